"""Taps: read intermediate values out of a JAX port's own jitted layer call, without editing its source (DESIGN §7).

The JAX mirror of `parity.torch_ref.capture`: a **declarative map** from the port's module paths (flax nnx modules,
relative to the layer object) or functions (``package.module:name`` / ``package.module:Class.method``) to
canonical sites (`parity.model.points`), each with the value it takes (``out``, ``out[0]``, ``in[b]``, …), which call it
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
- Limits: call the tapped layer under `jax.jit` (on jax 0.10 an *eager* debug callback inside a `shard_map` over
  explicitly sharded arrays raises NotImplementedError); on a multi-device mesh a callback inside `shard_map` sees
  one shard (taps are meant for single-device CPU replay); a function must be patched where it is *looked up* (the module that calls it), and a jitted port
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
    # Structural forms (issue 32): `compare_test` maps the target's value at comparison (an exact layout mapping of a
    # value the target returns as is, e.g. one part of a fused tensor); `structural` is set where no exact mapping
    # exists (a reduction: the target computes a coarser quantity) — the point is then reported as a semantic
    # difference with this line as its reason, and never compared (`coarser`).
    compare_test: Callable[[np.ndarray], np.ndarray] | None = None
    structural: str | None = None

    def apply(self, ref: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ref, test) as compared: the reference side mapped by `ref`, the test side by `compare_test` (a tap's `test`
        map runs at capture)."""
        return (ref if self.ref is None else self.ref(ref)), (test if self.compare_test is None
                                                              else self.compare_test(test))


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


def _select_take(name: str, take: str, fn: Callable | None, args: tuple, kwargs: dict, out: Any):
    kind, idx = _TAKE.match(take).groups()
    if kind == "out":
        return out if idx is None else out[int(idx)]
    if idx is None:
        raise ValueError(f"tap on {name}: take='in' needs an index or a name")
    if idx.isdigit():
        return args[int(idx)]
    if idx in kwargs:
        return kwargs[idx]
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    try:
        return args[params.index(idx)]
    except (ValueError, IndexError):
        raise ValueError(f"tap on {name}: no argument {idx!r} in this call") from None


class _Recorder:
    """Run-time sink of the callbacks: values per stable key (see `_key`), in arrival (= execution) order."""

    def __init__(self) -> None:
        self.values: dict[str, list[np.ndarray]] = {}

    def add(self, key: str, value) -> None:
        import jax

        self.values.setdefault(key, []).append(jax.tree.map(lambda a: np.asarray(a).copy(), value))


# Keys name *what* is read, not which tap set asked: "fn:<spec>|<take>" or "mod:<path>|<take>". A port's inner jit
# (sglang-jax's `chunk_kda_fwd`) is traced once per process and its cached trace keeps the callbacks it was traced
# with, so they must mean the same thing to every tap set (one per layer kind) that later records a run.
_ACTIVE: list[_Recorder] = []  # the `TapSet.record()` blocks in progress; a callback goes to the innermost one
_BOUND: list[dict] = []  # {"paths": id(module) -> path, "tapset": TapSet} for the trace in progress
_FN_TAKES: dict[str, set[str]] = {}  # patched function spec -> the takes any installed tap set reads from it
_FN_ORIG: dict[str, tuple[Any, str, Any]] = {}  # patched function spec -> (owner, attr, original)


def _key(tap: "Tap") -> str:
    return f"fn:{tap.function}|{tap.take}" if tap.function is not None else f"mod:{tap.module}|{tap.take}"


def _emit(key: str, value) -> None:
    if _ACTIVE:
        _ACTIVE[-1].add(key, value)


def _callback(key: str, value) -> None:
    import jax

    jax.debug.callback(functools.partial(_emit, key), value, ordered=True)


@dataclass
class Captured:
    """What one recorded layer run produced: `points` {site: value after the tap's test transform}, the transforms
    whose reference side must be applied at comparison (`transforms`), and `missing` {site: why} for taps that
    did not fire (a port code path not taken, e.g. the decode kernel during a prefill)."""

    points: dict[str, np.ndarray] = field(default_factory=dict)
    transforms: dict[str, Transform] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


class TapSet:
    """A tap map installed into a port. `install()` patches the port's functions (once per process per function,
    shared by all tap sets; `uninstall_all()` undoes it); `bind(root)` names the module instances of the layer
    being traced; `record(phase, ctx)` collects one run's values. Typical use inside a target:

        taps.install()                                   # before the port's first call
        with taps.record("prefill", {"slots": ...}) as cap:
            out = jitted_layer(...)                      # the jitted function calls `taps.bind(layer)` inside
        cap.points  # {site: np.ndarray}
    """

    def __init__(self, taps: Sequence[Tap]) -> None:
        self.taps = tuple(taps)
        sites = [(t.site, p) for t in self.taps for p in t.phases]
        dup = {s for s in sites if sites.count(s) > 1}
        if dup:
            raise ValueError(f"tap map names a site twice for one phase: {sorted(dup)}")
        self._module_taps = [t for t in self.taps if t.module is not None]

    # ------------------------------------------------------------------ install
    def install(self) -> "TapSet":
        for t in self.taps:
            if t.function is None:
                continue
            _FN_TAKES.setdefault(t.function, set()).add(t.take)
            if t.function not in _FN_ORIG:
                owner, attr = _resolve(t.function)
                orig = inspect.getattr_static(owner, attr)
                _FN_ORIG[t.function] = (owner, attr, orig)
                setattr(owner, attr, _wrap_function(orig, t.function))
        return self

    def uninstall(self) -> None:
        """Undo every function patch of the process (tap sets share them)."""
        uninstall_all()

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
        unknown = sorted({t.module for t in self._module_taps} - found)
        if unknown:
            raise ValueError(f"tap map names module path(s) {unknown} that {type(root).__name__} does not have "
                             f"(it has: {sorted(found)})")
        for path, node in nnx.iter_graph(root):
            p = ".".join(str(x) for x in path)
            if isinstance(node, nnx.Module) and any(t.module == p for t in self._module_taps):
                _patch_class(type(node), _wrap_module_call)
        _BOUND.append({"paths": paths, "tapset": self})
        try:
            yield
        finally:
            _BOUND.pop()

    # ------------------------------------------------------------------ run
    @contextlib.contextmanager
    def record(self, phase: str, ctx: dict | None = None) -> Iterator[Captured]:
        """Collect the callbacks of the jitted call(s) made inside the block; on exit (after `jax.effects_barrier`)
        fill the yielded `Captured` for `phase` with each tap's `call`-th value, test-transformed with `ctx`."""
        import jax

        rec = _Recorder()
        cap = Captured()
        _ACTIVE.append(rec)
        try:
            yield cap
            jax.effects_barrier()
        finally:
            _ACTIVE.remove(rec)
        ctx = dict(ctx or {})
        for t in self.taps:
            if phase not in t.phases:
                continue
            vals = rec.values.get(_key(t), [])
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


def _wrap_function(orig, spec: str):
    """The patched function: calls the original, then reports every take any tap set registered for it (read at
    trace time, so a take added later reaches every trace made after it)."""
    fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig
    method = _is_method(spec)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        sel_args = args[1:] if method else args
        for take in sorted(_FN_TAKES.get(spec, ())):
            _callback(f"fn:{spec}|{take}", _select_take(spec, take, fn, sel_args, kwargs, out))
        return out

    if isinstance(orig, staticmethod):
        return staticmethod(wrapper)
    if isinstance(orig, classmethod):
        return classmethod(wrapper)
    return wrapper


def _wrap_module_call(orig):
    @functools.wraps(orig)
    def wrapper(mod, *args, **kwargs):
        out = orig(mod, *args, **kwargs)
        bound = _BOUND[-1] if _BOUND else None
        path = bound["paths"].get(id(mod)) if bound else None
        if path is not None:
            for take in sorted({t.take for t in bound["tapset"]._module_taps if t.module == path}):
                _callback(f"mod:{path}|{take}", _select_take(path, take, orig, args, kwargs, out))
        return out

    return wrapper


def uninstall_all() -> None:
    """Restore every function the tap sets of this process patched."""
    for spec, (owner, attr, orig) in list(_FN_ORIG.items()):
        setattr(owner, attr, orig)
    _FN_ORIG.clear()
    _FN_TAKES.clear()


# Module classes get one class-level `__call__` wrapper for the process (shared by every tap set): it reports only
# for instances bound by the innermost `TapSet.bind`, so an untapped call costs one dict lookup.
_CLASS_PATCHED: set[type] = set()


def _patch_class(cls: type, make_wrapper) -> None:  # noqa: D103
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


# ------------------------------------------------------------------------------------------ structural forms (issue 32)
def _axes(names: str) -> list[str]:
    return [x.strip() for x in names.strip("[]").split(",")]


def transposed(site: str, dump_layout: str, target_layout: str) -> Transform:
    """The target returns `site` with its axes in another order, e.g. `transposed("attention.core", "B,T,H,d",
    "B,H,T,d")`: an exact mapping — the dump's tensor is permuted into the target's layout and compared there, every
    element against its own counterpart. Axis names must be the same set (docs/points.md names the dump's)."""
    src, dst = _axes(dump_layout), _axes(target_layout)
    if sorted(src) != sorted(dst) or len(set(src)) != len(src):
        raise ValueError(f"transposed({site!r}): target layout [{','.join(dst)}] is not a permutation of the dump's "
                         f"[{','.join(src)}]; expected the same axis names in another order")
    perm = tuple(src.index(a) for a in dst)
    return Transform(name="transposed", note=f"{site} compared in the target's layout [{','.join(dst)}] (the dump's "
                     f"[{','.join(src)}] permuted {perm}, an exact mapping)", ref=lambda r: np.transpose(r, perm))


def fused_part(site: str, axis: int, index: int, parts: int | Sequence[int], what: str = "") -> Transform:
    """The target returns `site` fused with other tensors along `axis` (e.g. q, k, v projections as one [B,T,3P]
    tensor): the part `index` of `parts` (a count of equal parts, or the sizes) is cut out and compared — exact.
    The same fused tensor may be returned for each of its sites with its own index."""
    sizes = None if isinstance(parts, int) else list(parts)

    def cut(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t)
        if sizes is None:
            return np.split(t, parts, axis=axis)[index]
        bounds = np.cumsum(sizes)[:-1]
        return np.split(t, bounds, axis=axis)[index]

    label = what or f"part {index} of {parts if sizes is None else sizes} along axis {axis}"
    return Transform(name="fused_part", note=f"{site} cut from the target's fused tensor ({label}, an exact mapping)",
                     compare_test=cut)


def coarser(what: str, target_form: str, dump_form: str) -> Transform:
    """The target computes a coarser quantity than the dump's point, with no exact mapping between them (e.g. a KDA
    decay per head [B,T,H] where the canonical gate is per channel [B,T,H,d]): the point is reported as a named
    structural difference (status `semantic`, this line as its reason), not compared — the adapter need not invent
    the finer values, nor return any."""
    line = f"target computes {what} {target_form}; the dump's is {dump_form}"
    return Transform(name="coarser", note=line, structural=line)


def reshape_to(shape_fn: Callable[[dict], tuple[int, ...]]) -> Callable[[np.ndarray, dict], np.ndarray]:
    def f(v: np.ndarray, ctx: dict) -> np.ndarray:
        return np.asarray(v).reshape(shape_fn(ctx))
    return f


__all__ = ["Tap", "TapSet", "Transform", "Captured", "ROUTER_SCORES", "scores_to_logits", "reshape_to",
           "transposed", "fused_part", "coarser",
           "uninstall_all"]
