"""Taps: read intermediate values out of a JAX port's own jitted layer call, without editing its source (DESIGN §7).

The JAX mirror of `parity.torch_ref.capture`: a **declarative map** from the port's module paths (flax nnx modules,
relative to the layer object) or functions (``package.module:name`` / ``package.module:Class.method``) to
canonical sites (`parity.points`), each with the value it takes (``out``, ``out[0]``, ``in[b]``, …), which call it
means when the same module / function runs several times in one layer (``call``), and an optional declared
`Transform` for a point the port computes in another form (router *scores* instead of logits, a chunk-local
cumulative gate instead of the per-token gate, a state pool instead of one sequence's state).

How values leave the jitted computation — a host callback (`jax.debug.callback(..., ordered=True)`):
- The port's layer call is compiled by jax.jit, and inside it the port calls further `jax.jit`-decorated kernels
  (sglang-jax's `chunk_kda_fwd`), `shard_map` bodies and `lax.scan` loops. Threading captured tracers out as extra
  outputs breaks at each of those boundaries (a tracer of an inner trace leaking into the outer one), and an inner
  jit's trace is cached across calls, so code patched into it runs only on its first trace.
- A debug callback is an effect: jit keeps it (no dead-code elimination), it lives inside whatever inner jaxpr it was
  traced into (so a cached inner trace still reports on every run), and it works inside shard_map, scan and nested
  jit (checked on jax 0.10.2). `ordered=True` makes the arrival order the execution order, so "the 2nd call of this
  function" is counted at run time, not at trace time.
- Cost: one device→host copy per tapped value (small next to interpret-mode kernels); the layer's own outputs and
  numerics are untouched (the callback only reads).
- Limits: on a multi-device mesh a callback inside `shard_map` sees one shard (taps are meant for single-device CPU
  replay); a function must be patched where it is *looked up* (the module that calls it), and a jitted port
  function first traced before the taps were installed keeps its untapped trace — install a `TapSet` before the
  first call of the port (the targets here do so in `build`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

_TAKE = re.compile(r"^(out|in)(?:\[(\w+)\])?$")


@dataclass(frozen=True)
class Transform:
    """How a tapped value meets the dump's point: `test(value, ctx)` maps the captured value into the point's form,
    `ref(dump_tensor)` maps the dump's tensor into the form the port computes (e.g. logits -> sigmoid scores). Either
    may be None. `note` says in one line what is compared; reports carry it."""

    name: str
    note: str
    test: Callable[[np.ndarray, dict], np.ndarray] | None = None
    ref: Callable[[np.ndarray], np.ndarray] | None = None

    def apply(self, ref: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ref, test) as compared: only the reference side is mapped here (the test side is mapped at capture)."""
        return (ref if self.ref is None else self.ref(ref)), test


@dataclass(frozen=True)
class Tap:
    """One canonical site read from the port: `module` (dotted nnx path below the tapped root, "" = the root) or
    `function` ("pkg.mod:name" / "pkg.mod:Class.method", patched in that namespace), `take` ("out", "out[i]",
    "in[i]" for the i-th positional argument after self, "in[name]" for an argument by name), `call` (which call of
    that module/function in one layer run, counted from 0), `phases` it applies to, and an optional transform."""

    site: str
    module: str | None = None
    function: str | None = None
    take: str = "out"
    call: int = 0
    transform: Transform | None = None
    phases: tuple[str, ...] = ("prefill", "decode")

    def __post_init__(self) -> None:
        if (self.module is None) == (self.function is None):
            raise ValueError(f"tap {self.site!r}: give exactly one of module= or function=")
        if not _TAKE.match(self.take):
            raise ValueError(f"tap {self.site!r}: take={self.take!r}, expected out, out[i], in[i] or in[name]")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"tap {self.site!r}: function={self.function!r}, expected 'package.module:name'")

    @property
    def target(self) -> str:
        return f"module {self.module or '<root>'}" if self.module is not None else f"function {self.function}"


def _select(tap: Tap, fn: Callable | None, args: tuple, kwargs: dict, out: Any):
    kind, idx = _TAKE.match(tap.take).groups()
    if kind == "out":
        if idx is None:
            return out
        return out[int(idx)]
    if idx is None:
        raise ValueError(f"tap {tap.site!r}: take='in' needs an index or a name")
    if idx.isdigit():
        return args[int(idx)]
    if idx in kwargs:
        return kwargs[idx]
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    try:
        return args[params.index(idx)]
    except (ValueError, IndexError):
        raise ValueError(f"tap {tap.site!r}: {tap.target} has no argument {idx!r} in this call") from None


class _Recorder:
    """Run-time sink of the callbacks: values per (tap index), in arrival (= execution) order."""

    def __init__(self) -> None:
        self.values: dict[int, list[np.ndarray]] = {}

    def add(self, key: int, value) -> None:
        import jax

        self.values.setdefault(key, []).append(jax.tree.map(lambda a: np.asarray(a).copy(), value))


# The `TapSet.record()` blocks in progress, as (tap-set id, recorder); a callback goes to the innermost recorder of
# its own tap set and is dropped outside one (several tap sets may patch the same function).
_ACTIVE: list[tuple[int, _Recorder]] = []
_BOUND: list[dict[int, str]] = []  # id(module) -> path below the root, for the trace in progress


def _emit(owner: int, key: int, value) -> None:
    for tid, rec in reversed(_ACTIVE):
        if tid == owner:
            rec.add(key, value)
            return


def _callback(owner: int, key: int, value) -> None:
    import jax

    jax.debug.callback(functools.partial(_emit, owner, key), value, ordered=True)


@dataclass
class Captured:
    """What one recorded layer run produced: `points` {site: value after the tap's test transform}, the transforms
    whose reference side must be applied at comparison (`transforms`), and `missing` {site: why} for taps that
    did not fire (a port code path not taken, e.g. the decode kernel during a prefill)."""

    points: dict[str, np.ndarray] = field(default_factory=dict)
    transforms: dict[str, Transform] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


class TapSet:
    """A tap map installed into a port. `install()` patches the port's classes / functions (idempotent, undone by
    `uninstall()`); `bind(root)` names the module instances of the layer being traced; `record(phase, ctx)` collects
    one run's values. Typical use inside a target:

        taps.install()                                   # once, before the port's first call
        with taps.record("prefill", {"slot": 1}) as cap:
            out = jitted_layer(...)                      # the jitted function calls `taps.bind(layer)` inside
        cap.points  # {site: np.ndarray}
    """

    def __init__(self, taps: Sequence[Tap]) -> None:
        self.taps = tuple(taps)
        sites = [(t.site, p) for t in self.taps for p in t.phases]
        dup = {s for s in sites if sites.count(s) > 1}
        if dup:
            raise ValueError(f"tap map names a site twice for one phase: {sorted(dup)}")
        self._patched: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ install
    def install(self) -> "TapSet":
        if self._patched:
            return self
        by_fn: dict[str, list[int]] = {}
        by_cls: dict[type, None] = {}
        for k, t in enumerate(self.taps):
            if t.function is not None:
                by_fn.setdefault(t.function, []).append(k)
        for spec, keys in by_fn.items():
            owner, attr = _resolve(spec)
            orig = inspect.getattr_static(owner, attr)
            self._patched.append((owner, attr, orig))
            setattr(owner, attr, self._wrap_function(orig, keys, spec))
        self._module_keys = [k for k, t in enumerate(self.taps) if t.module is not None]
        self._module_classes = by_cls
        return self

    def uninstall(self) -> None:
        for owner, attr, orig in reversed(self._patched):
            setattr(owner, attr, orig)
        self._patched.clear()

    def _wrap_function(self, orig, keys: list[int], spec: str):
        fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig
        taps, tid = self.taps, id(self)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            sel_args = args[1:] if _is_method(spec) else args
            for k in keys:
                _callback(tid, k, _select(taps[k], fn, sel_args, kwargs, out))
            return out

        if isinstance(orig, staticmethod):
            return staticmethod(wrapper)
        if isinstance(orig, classmethod):
            return classmethod(wrapper)
        return wrapper

    # ------------------------------------------------------------------ modules
    @contextlib.contextmanager
    def bind(self, root) -> Iterator[None]:
        """Inside a trace: tap the nnx modules of `root` named by the map (class-level `__call__` wrappers, active
        only for the instances found at the declared paths)."""
        from flax import nnx

        paths: dict[int, str] = {}
        found: set[str] = set()
        for path, node in nnx.iter_graph(root):
            if isinstance(node, nnx.Module):
                p = ".".join(str(x) for x in path)
                paths.setdefault(id(node), p)
                found.add(p)
        unknown = sorted({self.taps[k].module for k in self._module_keys} - found)
        if unknown:
            raise ValueError(f"tap map names module path(s) {unknown} that {type(root).__name__} does not have "
                             f"(it has: {sorted(found)})")
        for path, node in nnx.iter_graph(root):
            p = ".".join(str(x) for x in path)
            if isinstance(node, nnx.Module) and any(self.taps[k].module == p for k in self._module_keys):
                _patch_class(type(node), self._wrap_module_call)
        _BOUND.append({"paths": paths, "tapset": self})
        try:
            yield
        finally:
            _BOUND.pop()

    @staticmethod
    def _wrap_module_call(orig):
        @functools.wraps(orig)
        def wrapper(mod, *args, **kwargs):
            out = orig(mod, *args, **kwargs)
            bound = _BOUND[-1] if _BOUND else None
            path = bound["paths"].get(id(mod)) if bound else None
            if path is not None:
                ts = bound["tapset"]
                for k in ts._module_keys:
                    if ts.taps[k].module == path:
                        _callback(id(ts), k, _select(ts.taps[k], orig, args, kwargs, out))
            return out

        return wrapper

    # ------------------------------------------------------------------ run
    @contextlib.contextmanager
    def record(self, phase: str, ctx: dict | None = None) -> Iterator[Captured]:
        """Collect the callbacks of the jitted call(s) made inside the block; on exit (after `jax.effects_barrier`)
        fill the yielded `Captured` for `phase` with each tap's `call`-th value, test-transformed with `ctx`."""
        import jax

        rec = _Recorder()
        cap = Captured()
        entry = (id(self), rec)
        _ACTIVE.append(entry)
        try:
            yield cap
            jax.effects_barrier()
        finally:
            _ACTIVE.remove(entry)
        ctx = dict(ctx or {})
        for k, t in enumerate(self.taps):
            if phase not in t.phases:
                continue
            vals = rec.values.get(k, [])
            if len(vals) <= t.call:
                cap.missing[t.site] = (f"{t.target} ran {len(vals)} time(s) in this {phase} call, tap wants call "
                                       f"#{t.call}")
                continue
            v = vals[t.call]
            if t.transform is not None:
                if t.transform.test is not None:
                    v = t.transform.test(v, ctx)
                cap.transforms[t.site] = t.transform
            cap.points[t.site] = v
        return cap

    def describe(self) -> list[dict]:
        """The tap map as data (for a report header)."""
        return [{"site": t.site, "from": t.target, "take": t.take, "call": t.call, "phases": list(t.phases),
                 **({"transform": t.transform.note} if t.transform else {})} for t in self.taps]


# Module classes get one class-level `__call__` wrapper for the process (shared by every tap set): it reports only
# for instances bound by the innermost `TapSet.bind`, so an untapped call costs one dict lookup.
_CLASS_PATCHED: set[type] = set()


def _patch_class(cls: type, make_wrapper) -> None:
    if cls in _CLASS_PATCHED:
        return
    cls.__call__ = make_wrapper(cls.__call__)
    _CLASS_PATCHED.add(cls)


def _is_method(spec: str) -> bool:
    return "." in spec.split(":", 1)[1]


def _resolve(spec: str) -> tuple[Any, str]:
    mod_name, attr_path = spec.split(":", 1)
    try:
        owner: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"tap function {spec!r}: cannot import {mod_name} ({e})") from None
    parts = attr_path.split(".")
    for p in parts[:-1]:
        if not hasattr(owner, p):
            raise ValueError(f"tap function {spec!r}: {owner!r} has no attribute {p!r}")
        owner = getattr(owner, p)
    if not hasattr(owner, parts[-1]):
        raise ValueError(f"tap function {spec!r}: {mod_name} has no {attr_path}")
    return owner, parts[-1]


# ------------------------------------------------------------------------------------------ common transforms
def _sigmoid_ref(x: np.ndarray) -> np.ndarray:
    # In float64, then rounded once to the dump's dtype: the exact sigmoid of the reference logits.
    x64 = np.asarray(x, np.float64)
    return (1.0 / (1.0 + np.exp(-x64))).astype(x.dtype)


ROUTER_SCORES = Transform(
    name="router_scores",
    note="router compared as sigmoid scores: the port returns sigmoid(logits); the reference logits are mapped "
         "through an exact (float64) sigmoid, because logit(s) from fp32 scores loses ~30 fp32 ULPs near s = 0.5",
    ref=_sigmoid_ref,
)


def scores_to_logits(s: np.ndarray) -> np.ndarray:
    """log(s / (1 - s)) in float64 (for routing-margin estimates, not for comparison: inexact near s = 0.5)."""
    s64 = np.asarray(s, np.float64)
    return np.log(s64) - np.log1p(-s64)


def reshape_to(shape_fn: Callable[[dict], tuple[int, ...]]) -> Callable[[np.ndarray, dict], np.ndarray]:
    def f(v: np.ndarray, ctx: dict) -> np.ndarray:
        return np.asarray(v).reshape(shape_fn(ctx))
    return f


__all__ = ["Tap", "TapSet", "Transform", "Captured", "ROUTER_SCORES", "scores_to_logits", "reshape_to"]
