"""Capture hooks: the declarative per-runtime maps (module path -> canonical point) and the hook machinery.

Each runtime names its modules differently (DESIGN §3): the official file and the twin use the checkpoint's names
(`model.layers.{i}.attention.q_proj`), transformers' built-in `bailing_hybrid` renames (`.self_attn.`, `o_proj` for
MLA `dense`, one merged `conv1d`, a `forget_gate` module, a flat `[B*T, ...]` router). A map is a list of `TapSpec`s;
`Capture` registers one forward hook per matching module and hands every captured tensor, reshaped to the canonical
shape (`parity.points.canonical_shape`), to a sink. Hooks only read: they never change a tensor (a test checks that
logits with and without capture are bit-identical).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
import torch

from parity.errors import ParityError
from parity.points import Point, canonical_shape, sites_for_config


@dataclass(frozen=True)
class TapSpec:
    """One canonical point read from one module.

    module: path relative to the model root, `{i}` = layer index (e.g. `model.layers.{i}.attention.q_proj`).
    io: "output" (forward hook) or "input" (forward pre-hook, positional argument `index`).
    index: element of a tuple output/input (None: the value itself).
    kind / mlp: only for layers of that kind ("kda"/"mla") / that MLP ("moe"/"dense").
    """

    module: str
    site: str
    io: str = "output"
    index: int | None = None
    kind: str | None = None
    mlp: str | None = None


def _layer(site: str, rel: str, **kw) -> TapSpec:
    return TapSpec(f"model.layers.{{i}}.{rel}", site, **kw)


# Sites common to every runtime whose module tree follows the official checkpoint names (twin and official file).
_OFFICIAL_NAMES: list[TapSpec] = [
    TapSpec("model.word_embeddings", "embed"),
    TapSpec("model.norm", "final_norm"),
    TapSpec("lm_head", "logits"),
    _layer("input", "", io="input", index=0),
    _layer("output", "", index=0),
    _layer("input_layernorm", "input_layernorm"),
    _layer("attention", "attention", index=0),
    _layer("post_attention_layernorm", "post_attention_layernorm"),
    # KDA (facts §3); ShortConvolution returns (y, cache) in fla's convention (the twin's own conv too)
    *[_layer(f"attention.{p}", f"attention.{p}", kind="kda") for p in ("q_proj", "k_proj", "v_proj", "f_proj",
                                                                         "b_proj", "g_proj", "o_norm", "o_proj")],
    *[_layer(f"attention.{c}", f"attention.{c}", kind="kda", index=0) for c in ("q_conv1d", "k_conv1d", "v_conv1d")],
    # MLA (facts §4)
    *[_layer(f"attention.{p}", f"attention.{p}", kind="mla") for p in ("q_a_proj", "q_a_layernorm", "q_b_proj",
                                                                         "q_proj", "kv_a_proj_with_mqa",
                                                                         "kv_a_layernorm", "kv_b_proj", "g_proj",
                                                                         "dense")],
    _layer("attention.dense:in", "attention.dense", io="input", index=0, kind="mla"),
    # MLP (facts §5)
    *[_layer(f"mlp.{p}", f"mlp.{p}", mlp="dense") for p in ("gate_proj", "up_proj", "down_proj")],
    _layer("mlp.shared_experts", "mlp.shared_experts", mlp="moe"),
    _layer("mlp", "mlp"),
]

# The twin's parameter-free observation taps (parity/torch_ref/twin): points the official code computes inside kernels.
_TWIN_TAPS: list[TapSpec] = [
    *[_layer(f"attention.{s}", f"attention.tap_{s}", kind="kda") for s in ("gate", "beta", "core", "state",
                                                                             "conv_state")],
    _layer("attention.core", "attention.tap_core", kind="mla"),
    _layer("attention.gate", "attention.tap_gate", kind="mla"),
    _layer("mlp.gate.logits", "mlp.gate.tap_logits", mlp="moe"),
    _layer("mlp.gate.topk_idx", "mlp.gate.tap_topk_idx", mlp="moe"),
    _layer("mlp.gate.topk_weight", "mlp.gate.tap_topk_weight", mlp="moe"),
    _layer("mlp.routed", "mlp.tap_routed", mlp="moe"),
]

# transformers 5.23 built-in bailing_hybrid (modeling_bailing_hybrid.py): renamed modules, merged conv (not a module
# call: no conv points), gate/beta/core computed inline.
_NATIVE: list[TapSpec] = [
    TapSpec("model.embed_tokens", "embed"),
    TapSpec("model.norm", "final_norm"),
    TapSpec("lm_head", "logits"),
    _layer("input", "", io="input", index=0),
    _layer("output", "", index=0),
    _layer("input_layernorm", "input_layernorm"),
    _layer("attention", "self_attn", index=0),
    _layer("post_attention_layernorm", "post_attention_layernorm"),
    *[_layer(f"attention.{p}", f"self_attn.{p}", kind="kda") for p in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                                         "g_proj", "o_norm", "o_proj")],
    _layer("attention.f_proj", "self_attn.forget_gate.f_proj", kind="kda"),
    _layer("attention.gate", "self_attn.forget_gate", kind="kda"),
    _layer("attention.core", "self_attn.o_norm", io="input", index=0, kind="kda"),
    *[_layer(f"attention.{p}", f"self_attn.{p}", kind="mla") for p in ("q_proj", "kv_a_proj_with_mqa",
                                                                         "kv_a_layernorm", "kv_b_proj", "g_proj")],
    _layer("attention.dense", "self_attn.o_proj", kind="mla"),
    _layer("attention.dense:in", "self_attn.o_proj", io="input", index=0, kind="mla"),
    *[_layer(f"mlp.{p}", f"mlp.{p}", mlp="dense") for p in ("gate_proj", "up_proj", "down_proj")],
    _layer("mlp.gate.logits", "mlp.gate", index=0, mlp="moe"),
    _layer("mlp.gate.topk_weight", "mlp.gate", index=1, mlp="moe"),
    _layer("mlp.gate.topk_idx", "mlp.gate", index=2, mlp="moe"),
    _layer("mlp.routed", "mlp.experts", mlp="moe"),
    _layer("mlp.shared_experts", "mlp.shared_experts", mlp="moe"),
    _layer("mlp", "mlp"),
]

RUNTIME_MAPS: dict[str, list[TapSpec]] = {
    "twin": _OFFICIAL_NAMES + _TWIN_TAPS,
    "official": _OFFICIAL_NAMES,  # + KDA gate/beta/core/state from the fla CPU stand-ins' observer, when installed
    "native": _NATIVE,
}

# Sites read from fla_cpu's KDA observer (official file on CPU): observer key -> site.
OBSERVER_SITES = {"gate": "attention.gate", "beta": "attention.beta", "core": "attention.core",
                  "state": "attention.state"}


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


Sink = Callable[[Point, np.ndarray, dict], None]


class Capture:
    """Registers hooks for a runtime map on a model and streams canonical points to `sink` as they fire.

    Use as a context manager; call `begin(phase, step, batch, seq)` before each forward. `layers` / `sites` filter
    (site glob patterns). `fired` records which points were seen, for the coverage check (`missing()`).
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
    ) -> None:
        self.model, self.cfg, self.map_name, self.sink = model, cfg, map_name, sink
        self.layers = set(range(cfg.num_hidden_layers)) if layers is None else set(layers)
        self.site_patterns = list(sites) if sites else None
        self.handles: list = []
        self.phase, self.step, self.batch, self.seq = "prefill", 0, 0, 0
        self.fired: set[Point] = set()
        self.expected: set[Point] = set()
        self._pending_topk: dict[Point, dict[str, np.ndarray]] = {}
        self._current_kda_layer: int | None = None

    # ---------------------------------------------------------------- selection
    def wants(self, layer: int | None, site: str) -> bool:
        if layer is not None and layer not in self.layers:
            return False
        if self.site_patterns is None:
            return True
        return any(fnmatch.fnmatchcase(site, p) for p in self.site_patterns)

    def provided_sites(self, layer: int) -> set[str]:
        """Sites this runtime map provides for layer i (observer sites included when the stand-ins observe)."""
        out = set()
        for spec in RUNTIME_MAPS[self.map_name]:
            if "{i}" in spec.module and self._applies(spec, layer):
                out.add(spec.site)
        if self.map_name == "official" and self.cfg.layer_kind(layer) == "kda" and _observer_available():
            out |= set(OBSERVER_SITES.values())
        return out

    def unavailable_sites(self, layer: int) -> list[str]:
        """Canonical sites of layer i this runtime cannot provide (recorded as unavailable, never as zeros)."""
        return [s for s in sites_for_config(self.cfg, layer) if s not in self.provided_sites(layer)]

    def _applies(self, spec: TapSpec, i: int) -> bool:
        if spec.kind and spec.kind != self.cfg.layer_kind(i):
            return False
        if spec.mlp and spec.mlp != ("moe" if self.cfg.is_moe(i) else "dense"):
            return False
        return True

    # ---------------------------------------------------------------- hooks
    def __enter__(self) -> "Capture":
        modules = dict(self.model.named_modules())
        prefix = "" if "lm_head" in modules or "model" in modules else "model."  # specs are CausalLM-rooted
        for spec in RUNTIME_MAPS[self.map_name]:
            targets: list[tuple[int | None, str]]
            if "{i}" in spec.module:
                targets = [(i, spec.module.format(i=i)) for i in sorted(self.layers) if self._applies(spec, i)]
            else:
                targets = [(None, spec.module)]
            for layer, path in targets:
                if not self.wants(layer, spec.site):
                    continue
                path = path.rstrip(".")
                mod = modules.get(path if prefix == "" else path.removeprefix("model."))
                if mod is None:
                    continue  # e.g. q_a_proj on a no-q-LoRA model: the coverage check reports what is missing
                self.expected.add(Point("prefill", 0, layer, spec.site))
                self.handles.append(self._hook(mod, spec, layer))
        if self.map_name == "official" and _observer_available():
            self._install_observer(modules, prefix)
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.map_name == "official" and _observer_available():
            from parity.torch_ref import fla_cpu

            fla_cpu.set_kda_observer(None)

    def _hook(self, mod: torch.nn.Module, spec: TapSpec, layer: int | None):
        def pick(value):
            if spec.index is not None and isinstance(value, (tuple, list)):
                return value[spec.index]
            return value

        if spec.io == "input":
            def pre_hook(_m, args, kwargs):
                i = spec.index or 0
                value = args[i] if len(args) > i else kwargs.get("hidden_states")
                if isinstance(value, torch.Tensor):
                    self.emit(layer, spec.site, value, module=spec.module, io="input")

            return mod.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(_m, _args, output):
            value = pick(output)
            if isinstance(value, torch.Tensor):
                self.emit(layer, spec.site, value, module=spec.module, io="output")

        return mod.register_forward_hook(hook)

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
            for key, site in OBSERVER_SITES.items():
                if key in d and d[key] is not None and self.wants(i, site):
                    self.emit(i, site, d[key], module=f"fla_cpu:{key}", io="output")

        fla_cpu.set_kda_observer(observe)

    # ---------------------------------------------------------------- emission
    def begin(self, phase: str, step: int, batch: int, seq: int) -> None:
        self.phase, self.step, self.batch, self.seq = phase, step, batch, seq

    def emit(self, layer: int | None, site: str, t: torch.Tensor, *, module: str, io: str) -> None:
        point = Point(self.phase, self.step, layer, site)
        arr = to_numpy(t)
        shape_names = ""
        canon = canonical_shape(self.cfg, layer, site, self.batch, self.seq)
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
            arr = arr.reshape(self.batch, self.seq, arr.shape[1])  # flat [B*T, D] (built-in MoE experts)
        if site in ("mlp.gate.topk_idx", "mlp.gate.topk_weight"):
            self._pair_topk(point, site, arr, module)
            return
        self._deliver(point, arr, module=module, io=io, shape_names=shape_names)

    def _pair_topk(self, point: Point, site: str, arr: np.ndarray, module: str) -> None:
        """Write top-k ids and weights in canonical order (ascending expert id per token), once both arrived."""
        key = Point(point.phase, point.step, point.layer, "mlp.gate.topk")
        slot = self._pending_topk.setdefault(key, {})
        slot[site] = arr
        if len(slot) < 2:
            return
        idx, w = slot["mlp.gate.topk_idx"], slot["mlp.gate.topk_weight"]
        order = np.argsort(idx, axis=-1, kind="stable")
        del self._pending_topk[key]
        for s, a in (("mlp.gate.topk_idx", np.take_along_axis(idx, order, -1).astype(np.int32)),
                     ("mlp.gate.topk_weight", np.take_along_axis(w, order, -1))):
            self._deliver(Point(point.phase, point.step, point.layer, s), a, module=module, io="output",
                          shape_names="B,T,K")

    def _deliver(self, point: Point, arr: np.ndarray, **attrs) -> None:
        if point in self.fired:
            # A module called twice in one forward (e.g. a shared sub-module) must not overwrite silently.
            raise ParityError(f"{self.map_name} runtime: point {point.key()} fired twice in one forward")
        self.fired.add(point)
        self.sink(point, arr, attrs)

    def missing(self, phase: str, step: int) -> list[Point]:
        """Points whose hook was registered but did not fire in the given (phase, step)."""
        seen = {(p.layer, p.site) for p in self.fired if p.phase == phase and p.step == step}
        return sorted(
            (Point(phase, step, p.layer, p.site) for p in self.expected if (p.layer, p.site) not in seen),
            key=lambda p: (p.layer if p.layer is not None else -1, p.site),
        )


def _observer_available() -> bool:
    """True when the fla CPU stand-ins are installed (their KDA observer then reports gate/beta/core/state)."""
    try:
        from parity.torch_ref import fla_cpu
    except ImportError:
        return False
    return bool(getattr(fla_cpu, "is_installed", lambda: False)())
