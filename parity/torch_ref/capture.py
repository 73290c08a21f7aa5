"""Capture hooks: the hook machinery over the declarative per-runtime maps (module path -> canonical point), which are
Ling3's description (`parity.model.ling3_family.RUNTIME_MAPS`).

Each runtime names its modules differently (DESIGN §3): the official file and the twin use the checkpoint's names
(`model.layers.{i}.attention.q_proj`), transformers' built-in `bailing_hybrid` renames (`.self_attn.`, `o_proj` for
MLA `dense`, one merged `conv1d`, a `forget_gate` module, a flat `[B*T, ...]` router). A map is a list of `TapSpec`s;
`Capture` registers one forward hook per matching module and hands every captured tensor, reshaped to the canonical
shape (`parity.model.points.canonical_shape`), to a sink. Hooks only read: they never change a tensor (a test checks that
logits with and without capture are bit-identical).

Three ways to read a tensor, all declared in the maps:
- a module's output / input (forward hook / pre-hook), `index` picking an element of a tuple by its declared position
  (the official MoE block returns `(y, (router_logits, topk_idx))`, its gate `(topk_idx, topk_weight, logits)`);
- `method`: the return value of a method the module's forward calls on itself (the official MoE's `moe_infer` = the
  routed experts' weighted sum), read by a wrapper bound on that module instance for the duration of the capture;
- `function`: the return value of a module-level function of the module's own Python module (the official MLA calls
  the global `eager_attention_forward`), read by a wrapper installed in that module's globals while the capture is
  active and attributed to the layer whose module is running.
A spec may name a declared `transform` (`TRANSFORMS`): a point the runtime computes inside a kernel from a tensor it
does expose, recomputed from that tensor as the runtime's own code does (the official KDA's beta and gate under fla's
real kernels); the dataset's `module` attr names the transform.

MTP layers (`model.layers.{N+j}`, run by the official forward after the main stack) are captured into their own
points (`parity.model.mtp_points.MtpPoint`, group `MTP{j}`): per-layer specs apply to them unless `scope="main"`, specs with
`scope="mtp"` exist only there, and model-level specs with `mtp_calls` (the embedding and the LM head, which the
official forward calls again for each MTP layer) attribute their (1+j)-th call in a forward to MTP layer j.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
import torch

from parity.errors import ParityError
from parity.model.mtp_points import MtpPoint, mtp_sites
from parity.model.points import Point, canonical_shape, sites_for_config


# The module maps are Ling3's description (`parity.model.ling3_family`): this module hooks what they name, reading
# them there at each capture, so a site added there is captured
from parity.model import ling3_family as _ling3  # noqa: E402
from parity.model.ling3_family import (OFFICIAL_KDA_DERIVED, OBSERVER_SITES, RUNTIME_MAPS,  # noqa: E402,F401
                                       UNEXPOSED, TapSpec)


# Declared transforms: (captured tensor, the layer's attention module) -> the canonical point, computed as the
# official code (or the kernel it calls) computes it. Read-only: new tensors, the module is not touched.
def _beta_sigmoid_fp32(b: torch.Tensor, _attn: torch.nn.Module) -> torch.Tensor:
    """attention.beta from b_proj's output: the official `self.b_proj(x).float().sigmoid()` (facts §3.4, fp32)."""
    return b.float().sigmoid()


def _kda_gate_in_kernel(f: torch.Tensor, attn: torch.nn.Module) -> torch.Tensor:
    """attention.gate from f_proj's output [B,T,P]: the gate fla computes inside the kernel (use_gate_in_kernel),
    `lb·σ(exp(A_log)·(f + dt_bias))` with lb = the module's lower_bound, else the softplus form (facts §3.5), fp32."""
    from parity.torch_ref.fla_cpu import kda_gate  # pure torch; importing it installs nothing

    heads = attn.A_log.numel()
    return kda_gate(f.unflatten(-1, (heads, f.shape[-1] // heads)), attn.A_log, attn.dt_bias, attn.lower_bound)


TRANSFORMS: dict[str, Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]] = {
    "beta_sigmoid_fp32": _beta_sigmoid_fp32,
    "kda_gate_in_kernel": _kda_gate_in_kernel,
}

def map_specs(map_name: str, observer: bool) -> list[TapSpec]:
    """The specs a capture uses: the runtime's map, plus the official KDA's derived points where the stand-ins'
    observer does not report them (fla's real kernels)."""
    specs = _ling3.RUNTIME_MAPS[map_name]
    return specs + _ling3.OFFICIAL_KDA_DERIVED if map_name == "official" and not observer else specs


def runtime_map_name(model: torch.nn.Module, runtime: str) -> str:
    """Which map fits a loaded model: `native`, `twin` (remote code with taps) or `official` (remote, no taps)."""
    if runtime == "native":
        return "native"
    has_taps = any(name.endswith(".tap_core") for name, _ in model.named_modules())
    return "twin" if has_taps else "official"


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact host copy; bf16 comes back as ml_dtypes.bfloat16 (bit-exact via an int16 view)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.contiguous().numpy().copy()


AnyPoint = Point | MtpPoint
Sink = Callable[[AnyPoint, np.ndarray, dict], None]


def _point_order(p: AnyPoint) -> tuple:
    """Sort key over main and MTP points of one (phase, step): model-level, layers, then MTP layers."""
    if isinstance(p, MtpPoint):
        return (2, p.mtp, p.site)
    return (0 if p.layer is None else 1, -1 if p.layer is None else p.layer, p.site)


class Capture:
    """Registers hooks for a runtime map on a model and streams canonical points to `sink` as they fire.

    Use as a context manager; call `begin(phase, step, batch, seq)` before each forward. `layers` / `sites` filter
    (site glob patterns); `mtp` captures the MTP layers the config declares (`num_nextn_predict_layers`) when the
    model has them. `fired` records which points were seen, for the coverage check (`missing()`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg,
        map_name: str,
        sink: Sink,
        *,
        layers: Iterable[int] | None = None,
        sites: Iterable[str] | None = None,
        mtp: bool = True,
    ) -> None:
        self.model, self.cfg, self.map_name, self.sink = model, cfg, map_name, sink
        self.layers = set(range(cfg.num_hidden_layers)) if layers is None else set(layers)
        self.site_patterns = list(sites) if sites else None
        self.want_mtp = bool(mtp)
        self.mtp_layers: list[int] = []  # checkpoint indices N+j of the MTP layers being captured
        self.handles: list = []
        self._restore: list[Callable[[], None]] = []
        self.phase, self.step, self.batch, self.seq = "prefill", 0, 0, 0
        self.fired: set[AnyPoint] = set()
        self.expected: set[AnyPoint] = set()
        self._pending_topk: dict[AnyPoint, dict[str, np.ndarray]] = {}
        self._current_kda_layer: int | None = None
        self._calls: dict[str, int] = {}  # model-level site -> calls in this forward (mtp_calls specs)
        self._running: dict[str, list[int]] = {}  # function name -> stack of layers whose module is running
        self._fn_specs: dict[str, list[tuple[int | None, TapSpec]]] = {}  # function name -> what it feeds
        self.specs = map_specs(map_name, _observer_available())
        # (phase/step/layer, "mlp.gate.topk") -> the canonical top-k order applied to that point (see _pair_topk)
        self.topk_order: dict[AnyPoint, np.ndarray] = {}
        # called with every tensor emitted in the prefill when set (the --grads recorder, parity/torch_ref/backward.py)
        self.grad_watch: Callable[..., None] | None = None

    # ---------------------------------------------------------------- selection
    def wants(self, layer: int | None, site: str) -> bool:
        if layer is not None and layer not in self.layers and layer not in self.mtp_layers:
            return False
        if self.site_patterns is None:
            return True
        return any(fnmatch.fnmatchcase(site, p) for p in self.site_patterns)

    def provided_sites(self, layer: int) -> set[str]:
        """Sites this runtime map provides for layer i (observer sites included when the stand-ins observe)."""
        out = set()
        for spec in self.specs:
            if "{i}" in spec.module and self._applies(spec, layer):
                out.add(spec.site)
        if self.map_name == "official" and self.cfg.layer_kind(layer) == "kda" and _observer_available():
            out |= set(_ling3.OBSERVER_SITES.values())
        return out

    def unavailable_sites(self, layer: int) -> list[str]:
        """Canonical sites of layer i this runtime cannot provide (recorded as unavailable, never as zeros)."""
        return [s for s in sites_for_config(self.cfg, layer) if s not in self.provided_sites(layer)]

    def unavailable_mtp_sites(self) -> list[str]:
        """Canonical MTP sites this runtime map cannot provide (embed/logits come from `mtp_calls` model specs)."""
        n = self.cfg.num_hidden_layers
        have = self.provided_sites(n) | {s.site for s in self.specs if s.mtp_calls}
        return [s for s in mtp_sites(self.cfg) if s not in have]

    def unexposed_reason(self, site: str, layer: int | None = None) -> str:
        """Why layer `layer`'s `site` is not provided (MTP layers, numbered from N on, are MLA layers: facts §2)."""
        n = self.cfg.num_hidden_layers
        kind = None if layer is None else ("mla" if layer >= n else self.cfg.layer_kind(layer))
        return _ling3.UNEXPOSED.get((self.map_name, kind, site), f"the {self.map_name} runtime does not expose {site}")

    def _applies(self, spec: TapSpec, i: int) -> bool:
        mtp = i >= self.cfg.num_hidden_layers
        if spec.scope == ("mtp" if not mtp else "main"):
            return False
        if spec.kind and spec.kind != self.cfg.layer_kind(i):
            return False
        if spec.mlp and spec.mlp != ("moe" if self.cfg.is_moe(i) else "dense"):
            return False
        return True

    def point(self, layer: int | None, site: str) -> AnyPoint:
        """The canonical point of (current phase/step, layer, site); layers from N on are MTP layers."""
        n = self.cfg.num_hidden_layers
        if layer is not None and layer >= n:
            return MtpPoint(self.phase, self.step, layer - n, site)
        return Point(self.phase, self.step, layer, site)

    # ---------------------------------------------------------------- hooks
    def __enter__(self) -> "Capture":
        modules = dict(self.model.named_modules())
        prefix = "" if "lm_head" in modules or "model" in modules else "model."  # specs are CausalLM-rooted

        def find(path: str):
            return modules.get(path if prefix == "" else path.removeprefix("model."))

        n = self.cfg.num_hidden_layers
        if self.want_mtp:  # MTP layers the config declares and the model holds (facts §2)
            self.mtp_layers = [n + j for j in range(self.cfg.num_nextn_predict_layers)
                               if find(f"model.layers.{n + j}.eh_proj") is not None]
        for spec in self.specs:
            targets: list[tuple[int | None, str]]
            if "{i}" in spec.module:
                targets = [(i, spec.module.format(i=i)) for i in sorted(self.layers) + self.mtp_layers
                           if self._applies(spec, i)]
            else:
                targets = [(None, spec.module)]
            for layer, path in targets:
                if not self.wants(layer, spec.site):
                    continue
                path = path.rstrip(".")
                mod = find(path)
                if mod is None:
                    continue  # e.g. q_a_proj on a no-q-LoRA model: the coverage check reports what is missing
                self.expected.add(Point("prefill", 0, layer, spec.site) if layer is None or layer < n
                                  else MtpPoint("prefill", 0, layer - n, spec.site))
                if layer is None and spec.mtp_calls:
                    self.expected |= {MtpPoint("prefill", 0, i - n, spec.site) for i in self.mtp_layers}
                if spec.function:
                    self._function_tap(mod, spec, layer)
                elif spec.method:
                    self._method_tap(mod, spec, layer)
                elif spec.transform:
                    self.handles.append(self._transform_hook(mod, find(path.rsplit(".", 1)[0]), spec, layer))
                else:
                    self.handles.append(self._hook(mod, spec, layer))
        if self.map_name == "official" and _observer_available():
            self._install_observer(modules, prefix)
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        if self.map_name == "official" and _observer_available():
            from parity.torch_ref import fla_cpu

            fla_cpu.set_kda_observer(None)

    @staticmethod
    def _pick(spec: TapSpec, value):
        if spec.index is not None and isinstance(value, (tuple, list)):
            return value[spec.index]
        return value

    def _hook(self, mod: torch.nn.Module, spec: TapSpec, layer: int | None):
        if spec.io == "input":
            def pre_hook(_m, args, kwargs):
                i = spec.index or 0
                value = args[i] if len(args) > i else kwargs.get("hidden_states")
                if isinstance(value, torch.Tensor):
                    self.emit(layer, spec.site, value, module=spec.module, io="input")

            return mod.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(_m, _args, output):
            value = self._pick(spec, output)
            if not isinstance(value, torch.Tensor):
                return
            if layer is None and spec.mtp_calls:
                k = self._calls.get(spec.site, 0)
                self._calls[spec.site] = k + 1
                if k > 0:  # the (1+j)-th call of a forward: MTP layer j (facts §2), never the main stack's point
                    j = k - 1
                    if j < len(self.mtp_layers) and self.wants(self.mtp_layers[j], spec.site):
                        self.emit(self.mtp_layers[j], spec.site, value, module=spec.module, io="output")
                    return  # MTP not captured (e.g. a --layers subset): its embedding/LM head call is not recorded
            self.emit(layer, spec.site, value, module=spec.module, io="output")

        return mod.register_forward_hook(hook)

    def _transform_hook(self, mod: torch.nn.Module, owner: torch.nn.Module, spec: TapSpec, layer: int | None):
        """Forward hook emitting TRANSFORMS[spec.transform](output, owner); owner = the module one level up."""
        fn = TRANSFORMS[spec.transform]

        def hook(_m, _args, output):
            value = self._pick(spec, output)
            if isinstance(value, torch.Tensor):
                with torch.no_grad():
                    derived = fn(value, owner)
                self.emit(layer, spec.site, derived, module=f"{spec.module} -> {spec.transform}", io="output")

        return mod.register_forward_hook(hook)

    def _method_tap(self, mod: torch.nn.Module, spec: TapSpec, layer: int | None) -> None:
        """Bind a reading wrapper of `mod.<method>` on the instance; removed at exit (the class method is untouched)."""
        if spec.method in vars(mod):
            raise ParityError(f"{self.map_name} runtime: {spec.module}.{spec.method} is already an instance attribute; "
                              "cannot observe it")
        orig = getattr(mod, spec.method)

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            value = self._pick(spec, out)
            if isinstance(value, torch.Tensor):
                self.emit(layer, spec.site, value, module=f"{spec.module}.{spec.method}", io="output")
            return out

        setattr(mod, spec.method, wrapper)
        self._restore.append(lambda: delattr(mod, spec.method))

    def _function_tap(self, mod: torch.nn.Module, spec: TapSpec, layer: int | None) -> None:
        """Observe the module-level function `spec.function` of `mod`'s Python module while `mod` runs."""
        pymod = sys.modules.get(type(mod).__module__)
        fn_name = spec.function
        if pymod is None or not callable(getattr(pymod, fn_name, None)):
            return  # not this runtime's structure: the coverage check reports the site as missing
        stack = self._running.setdefault(fn_name, [])

        def enter(_m, _args):
            stack.append(layer)

        def leave(_m, _args, _out):
            if stack:
                stack.pop()

        self.handles.append(mod.register_forward_pre_hook(enter))
        self.handles.append(mod.register_forward_hook(leave))
        specs = self._fn_specs.setdefault(fn_name, [])  # (layer, spec) pairs observed through this function
        specs.append((layer, spec))
        if len(specs) > 1:
            return  # the wrapper is installed once per function
        orig = getattr(pymod, fn_name)

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            if stack:
                cur = stack[-1]
                for lay, sp in specs:
                    if lay == cur:
                        value = self._pick(sp, out)
                        if isinstance(value, torch.Tensor):
                            self.emit(lay, sp.site, value, module=f"{sp.module}:{fn_name}", io="output")
            return out

        setattr(pymod, fn_name, wrapper)
        self._restore.append(lambda: setattr(pymod, fn_name, orig))

    def _install_observer(self, modules, prefix) -> None:
        from parity.torch_ref import fla_cpu

        for i in sorted(self.layers):
            if self.cfg.layer_kind(i) != "kda":
                continue
            attn = modules.get(f"{prefix}model.layers.{i}.attention")
            if attn is not None:
                def set_layer(_m, _a, i=i):
                    self._current_kda_layer = i
                self.handles.append(attn.register_forward_pre_hook(set_layer))

        def observe(d: dict) -> None:
            i = self._current_kda_layer
            if i is None:
                return
            for key, site in _ling3.OBSERVER_SITES.items():
                if key in d and d[key] is not None and self.wants(i, site):
                    self.emit(i, site, d[key], module=f"fla_cpu:{key}", io="output")

        fla_cpu.set_kda_observer(observe)

    # ---------------------------------------------------------------- emission
    def begin(self, phase: str, step: int, batch: int, seq: int) -> None:
        self.phase, self.step, self.batch, self.seq = phase, step, batch, seq
        self._calls.clear()

    def emit(self, layer: int | None, site: str, t: torch.Tensor, *, module: str, io: str) -> None:
        point = self.point(layer, site)
        if self.grad_watch is not None and self.phase == "prefill":
            # --grads: the backward recorder registers a tensor hook on a live tensor (parity/torch_ref/backward.py)
            self.grad_watch(layer, site, t, module=module, io=io)
        arr, shape_names = self.canonical(point, to_numpy(t), module=module)
        if site in ("mlp.gate.topk_idx", "mlp.gate.topk_weight"):
            self._pair_topk(point, site, arr, module)
            return
        self._deliver(point, arr, module=module, io=io, shape_names=shape_names)

    def canonical(self, point: AnyPoint, arr: np.ndarray, *, module: str) -> tuple[np.ndarray, str]:
        """A captured array (or its cotangent) reshaped to the point's canonical shape: (array, shape_names)."""
        layer = point.mtp + self.cfg.num_hidden_layers if isinstance(point, MtpPoint) else point.layer
        site = point.site
        shape_names = ""
        n = self.cfg.num_hidden_layers
        # MTP layers have the shapes of an MLA + MoE layer (facts §2); their model-level sites (embed, logits) those
        # of the model's.
        shape_layer = layer if layer is None or layer < n else (None if site in ("embed", "logits") else n)
        canon = canonical_shape(self.cfg, shape_layer, site, self.batch, self.seq)
        if site == "attention.kv_b_proj" and arr.ndim == 4 and arr.shape[2] > self.seq:
            # the built-in re-expands the whole latent cache at each decode step: keep this step's positions
            arr = arr[:, :, -self.seq:, :]
        if canon is not None:
            shape, shape_names = canon
            if arr.size != int(np.prod(shape)):
                raise ParityError(
                    f"{self.map_name} runtime: {point.key()} from module {module} has shape {arr.shape}, "
                    f"cannot be viewed as the canonical {shape} ({shape_names})"
                )
            arr = arr.reshape(shape)
        elif arr.ndim == 2 and arr.shape[0] == self.batch * self.seq:
            arr = arr.reshape(self.batch, self.seq, arr.shape[1])  # flat [B*T, D] (built-in / official MoE experts)
        return arr, shape_names

    def _pair_topk(self, point: AnyPoint, site: str, arr: np.ndarray, module: str) -> None:
        """Write top-k ids and weights in canonical order (ascending expert id per token), once both arrived."""
        key = _with_site(point, "mlp.gate.topk")
        slot = self._pending_topk.setdefault(key, {})
        slot[site] = arr
        if len(slot) < 2:
            return
        idx, w = slot["mlp.gate.topk_idx"], slot["mlp.gate.topk_weight"]
        order = np.argsort(idx, axis=-1, kind="stable")
        del self._pending_topk[key]
        self.topk_order[key] = order  # the backward recorder orders topk_weight's cotangent alike
        for s, a in (("mlp.gate.topk_idx", np.take_along_axis(idx, order, -1).astype(np.int32)),
                     ("mlp.gate.topk_weight", np.take_along_axis(w, order, -1))):
            self._deliver(_with_site(point, s), a, module=module, io="output", shape_names="B,T,K")

    def _deliver(self, point: AnyPoint, arr: np.ndarray, **attrs) -> None:
        if point in self.fired:
            # A module called twice in one forward (e.g. a shared sub-module) must not overwrite silently.
            raise ParityError(f"{self.map_name} runtime: point {point.key()} fired twice in one forward")
        self.fired.add(point)
        self.sink(point, arr, attrs)

    def mtp_ran(self, phase: str, step: int) -> bool:
        """Whether any MTP point fired in (phase, step) (a runtime that builds the MTP layer may never call it)."""
        return any(isinstance(p, MtpPoint) and p.phase == phase and p.step == step for p in self.fired)

    def missing(self, phase: str, step: int, *, mtp: bool = True) -> list[AnyPoint]:
        """Points whose hook was registered but did not fire in the given (phase, step) (MTP ones only with `mtp`)."""
        def rel(p: AnyPoint):  # (phase, step)-free identity
            return (p.mtp, p.site, "mtp") if isinstance(p, MtpPoint) else (p.layer, p.site, "main")

        seen = {rel(p) for p in self.fired if p.phase == phase and p.step == step}
        out = []
        for p in self.expected:
            if rel(p) in seen or (isinstance(p, MtpPoint) and not mtp):
                continue
            out.append(MtpPoint(phase, step, p.mtp, p.site) if isinstance(p, MtpPoint)
                       else Point(phase, step, p.layer, p.site))
        return sorted(out, key=_point_order)


def _with_site(p: AnyPoint, site: str) -> AnyPoint:
    if isinstance(p, MtpPoint):
        return MtpPoint(p.phase, p.step, p.mtp, site)
    return Point(p.phase, p.step, p.layer, site)


def _observer_available() -> bool:
    """True when the fla CPU stand-ins are installed (their KDA observer then reports gate/beta/core/state)."""
    try:
        from parity.torch_ref import fla_cpu
    except ImportError:
        return False
    return bool(getattr(fla_cpu, "is_installed", lambda: False)())
