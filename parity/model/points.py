"""Canonical point names (DESIGN §3): what is compared, in execution order.

A point is `(phase, step, layer, site)`; `layer is None` for the model-level sites `embed`, `final_norm`, `logits`.
Sites use the official checkpoint's module names relative to `model.layers.{i}`. A module's *input* is written
`<site>:in` where it is not already another site's output (isolated replay feeds these).

The site graph and the per-runtime module maps (module path -> point) are Ling3's description,
`parity.model.ling3_family`; this module derives the per-layer site lists, the point and HDF5 / report spellings and
the backward sites from it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode", "backward"]

# The site graph is Ling3's description (`parity.model.ling3_family`): this module derives from it, reading it there
# at each use, so a site added there is seen here (`layer_graph` caches per layer kind: `layer_graph.cache_clear()`).
from parity.model import ling3_family as _ling3  # noqa: E402
from parity.model.ling3_family import (MODEL_SITE_CLASSES, MODEL_SITES_AFTER, MODEL_SITES_BEFORE,  # noqa: E402,F401
                                       SITE_GRAPH, Site, canonical_shape)


def _layer_kinds(kind: str, moe: bool, q_lora: bool) -> set[str]:
    if kind not in ("kda", "mla"):
        raise ValueError(f"layer kind {kind!r}, expected 'kda' or 'mla'")
    kinds = {"layer", kind, "moe" if moe else "dense"}
    if kind == "mla":
        kinds.add("mla/q_lora" if q_lora else "mla/no_q_lora")
    return kinds


@functools.lru_cache(maxsize=None)  # a few (kind, moe, q_lora) combinations; Sites are frozen, the result a tuple
def layer_graph(kind: str, moe: bool, q_lora: bool) -> tuple[Site, ...]:
    """The graph of one layer: its sites in execution order, inputs restricted to sites the layer has."""
    kinds = _layer_kinds(kind, moe, q_lora)
    sites = [s for s in _ling3.SITE_GRAPH if s.kind in kinds]
    names = {s.name for s in sites}
    return tuple(dataclasses.replace(s, inputs=tuple(x for x in s.inputs if x in names)) for s in sites)


def layer_sites(kind: str, moe: bool, q_lora: bool, *, recorded_inputs: bool = False) -> tuple[str, ...]:
    """Per-layer sites in execution order: module outputs, and with `recorded_inputs` also the `<module>:in` sites
    (what a replay compares and a dump of the twin holds)."""
    return tuple(s.name for s in layer_graph(kind, moe, q_lora) if recorded_inputs or not s.name.endswith(":in"))


def sites_for_config(cfg, i: int, *, recorded_inputs: bool = False) -> tuple[str, ...]:
    """Sites of layer i of a Ling3Config (see `layer_sites`)."""
    return layer_sites(cfg.layer_kind(i), cfg.is_moe(i), cfg.q_lora, recorded_inputs=recorded_inputs)


def site_of(cfg, i: int, name: str) -> Site:
    """The graph entry of site `name` in layer i; KeyError naming the layer kind when the layer has no such site."""
    for s in layer_graph(cfg.layer_kind(i), cfg.is_moe(i), cfg.q_lora):
        if s.name == name:
            return s
    raise KeyError(f"site {name!r} does not exist in layer {i} ({cfg.layer_kind(i)}, "
                   f"{'moe' if cfg.is_moe(i) else 'dense'})")


def site_class(site: str) -> str:
    """Numerics class of a site ('other' for an unknown name). A name shared by KDA and MLA layers
    (`attention.core`, `.gate`, `.g_proj`) has one class in both; the tensor dtype separates them where it matters."""
    if site in _ling3.MODEL_SITE_CLASSES:
        return _ling3.MODEL_SITE_CLASSES[site]
    return next((s.cls for s in _ling3.SITE_GRAPH if s.name == site), "other")


# MTP layer j's sites travel through the replay as model-level points (layer None) named "MTP{j}/<site>"; their
# report/HDF5 spelling is the MTP group's own (`/prefill/MTP0/eh_proj`, parity.model.mtp_points, DESIGN §4 addition).
MTP_SITE_RE = re.compile(r"^MTP(\d+)/(.+)$")


def mtp_site(site: str) -> tuple[int, str] | None:
    """("MTP0/eh_proj") -> (0, "eh_proj"); None for any other site name."""
    m = MTP_SITE_RE.match(site)
    return None if m is None else (int(m.group(1)), m.group(2))


@dataclass(frozen=True, order=True)
class Point:
    phase: str
    step: int
    layer: int | None
    site: str

    def key(self) -> str:
        """Report spelling: `prefill/L03/attention.o_proj`, `decode/S002/L03/mlp`, `prefill/model/logits`."""
        return "/".join(self.h5_parts())

    def h5_parts(self) -> tuple[str, ...]:
        lay, site = ("model" if self.layer is None else layer_group(self.layer)), self.site
        if self.layer is None and (m := mtp_site(site)) is not None:
            lay, site = f"MTP{m[0]}", m[1]
        if self.phase in ("prefill", "backward"):  # one step each: no step group
            return (self.phase, lay, site)
        return ("decode", step_group(self.step), lay, site)

    def h5_path(self) -> str:
        """HDF5 dataset path of DESIGN §4, e.g. `/prefill/L03/attention.o_proj`, `/decode/S001/L03/attention.core`."""
        return "/" + "/".join(self.h5_parts())


def parse_layers(text: str | None, option: str = "--layers") -> list[int] | None:
    """Layer selection "0-3,7" -> [0, 1, 2, 3, 7] (None for no selection); an empty or reversed range is refused,
    `option` names the flag in the error."""
    import re

    from parity.errors import ParityError

    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ParityError(f"{option} {text!r}: {part.strip()!r} is not a layer number or a range; expected "
                              "comma-separated layer numbers or ranges like 0-3,7")
        a, b = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if b < a:
            raise ParityError(f"{option} {text!r}: range {a}-{b} is empty (start > end); expected a range like {b}-{a}")
        out += range(a, b + 1)
    return out


def layer_group(i: int) -> str:
    return f"L{i:02d}"


def step_group(k: int) -> str:
    return f"S{k:03d}"


# ------------------------------------------------------------------------------------------ canonical shapes
# Every runtime's tensor is reshaped to these before it is written or compared, so that e.g. the built-in model's
# flattened [B*T, E] router logits and the twin's [B, T, E] land on the same dataset shape. Order of top-k ids is
# canonicalised separately (ascending expert id per token, weights permuted alike): implementations may return
# top-k unsorted (torch.topk(sorted=False)), and only the *set* and its weights carry meaning (DESIGN §6 routing).
# ------------------------------------------------------------------------------------------ dataflow
def site_inputs(kind: str, moe: bool, site: str, q_lora: bool | None = None) -> tuple[str, ...]:
    """Sites of the same layer that `site` is computed from (empty for `input` and unknown names). With q_lora None
    both MLA q-paths count as present (a given dump holds one of them)."""
    kinds = _layer_kinds(kind, moe, bool(q_lora)) | ({"mla/q_lora", "mla/no_q_lora"} if q_lora is None else set())
    graph = [s for s in _ling3.SITE_GRAPH if s.kind in kinds]
    names = {s.name for s in graph}
    for s in graph:
        if s.name == site:
            return tuple(x for x in s.inputs if x in names)
    return ()


def point_inputs(cfg, point: Point) -> list[Point]:
    """Points a point is computed from, across layers and model-level sites (same phase/step)."""
    ph, st = point.phase, point.step
    if ph == "backward":
        return backward_inputs(cfg, point)
    if point.layer is None:
        if point.site == "final_norm":
            return [Point(ph, st, cfg.num_hidden_layers - 1, "output")]
        if point.site == "logits":
            return [Point(ph, st, None, "final_norm")]
        return []
    i = point.layer
    if point.site == "input":
        return [Point(ph, st, None, "embed")] if i == 0 else [Point(ph, st, i - 1, "output")]
    return [Point(ph, st, i, s) for s in site_inputs(cfg.layer_kind(i), cfg.is_moe(i), point.site, cfg.q_lora)]


# ------------------------------------------------------------------------------------------ backward phase (issue 26)
# `Point("backward", 0, layer, site)`: `site` a forward site = dL/d(that site's tensor), canonical shape; or
# `grad.<HF name relative to model.layers.{i}.>` = the gradient of that parameter (HF shape). Model level: the
# cotangents of `logits`, `final_norm`, `embed`, `final_norm:in` (dL/d the final norm's input, i.e. the last layer's
# `output` cotangent as the head's backward gives it) and the full-name grads of the embedding, final norm and head.
NO_COTANGENT = ("mlp.gate.topk_idx", "attention.state", "attention.conv_state")  # integer ids; states off the path
BACKWARD_MODEL_SITES = ("logits", "final_norm", "final_norm:in", "embed", "grad.lm_head.weight",
                        "grad.model.norm.weight", "grad.model.word_embeddings.weight")
# Fed, not computed, in a teacher-forced backward replay: a layer's `output` cotangent, the model's `embed` cotangent.
BACKWARD_FED = ("output", "embed")


def backward_param_sites(cfg, i: int) -> tuple[str, ...]:
    """`grad.<suffix>` for every trainable parameter of main layer i (official names, facts §7); the router's
    `expert_bias` is a buffer (selection only, facts §5.4) and has no gradient. tests/test_backward_replay.py checks
    this list against `jax_ling3.weights.expected_suffixes`."""
    s = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.layer_kind(i) == "kda":
        s += [f"attention.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj",
                                                 "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "o_proj")]
        s += ["attention.A_log", "attention.dt_bias"]
    else:
        q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.q_lora else ("q_proj",)
        s += [f"attention.{n}.weight" for n in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
                                                 "dense")]
    if cfg.is_moe(i):
        s += ["mlp.gate.weight"]
        s += [f"mlp.experts.{e}.{n}.weight" for e in range(cfg.num_experts) for n in ("gate_proj", "up_proj",
                                                                                   "down_proj")]
        if cfg.has_shared_expert:
            s += [f"mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    else:
        s += [f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return tuple(f"grad.{x}" for x in s)


def backward_sites(cfg, i: int) -> tuple[str, ...]:
    """The backward points of main layer i: the cotangents of its forward sites (but `NO_COTANGENT`), in forward
    order, then its weight gradients."""
    return tuple(x for x in sites_for_config(cfg, i, recorded_inputs=True) if x not in NO_COTANGENT) \
        + backward_param_sites(cfg, i)


# A weight gradient's incoming cotangent: the output of the module the parameter belongs to (facts §3-§5).
_PARAM_SITE = {"attention.A_log": "attention.gate", "attention.dt_bias": "attention.gate",
               "mlp.gate.weight": "mlp.gate.logits"}


def grad_param_site(cfg, i: int, param: str) -> str | None:
    """The site whose cotangent a parameter's gradient is computed from (`attention.q_proj.weight` ->
    `attention.q_proj`, experts -> `mlp.routed`), None if unknown."""
    if param in _PARAM_SITE:
        return _PARAM_SITE[param]
    if param.startswith("mlp.experts."):
        return "mlp.routed"
    if param.startswith("mlp.shared_experts."):
        return "mlp.shared_experts"
    site = param.removesuffix(".weight")
    return site if site in sites_for_config(cfg, i) else None


def backward_inputs(cfg, point: Point) -> list[Point]:
    """Points a backward point is computed from: the cotangents of the sites that consume its forward tensor (the
    reverse of the site graph), a weight gradient from its module's output cotangent; a layer's `output` from the next
    layer's `input` (the last layer's from the head, `final_norm:in`)."""
    ph, st, i, site = point.phase, point.step, point.layer, point.site
    n = cfg.num_hidden_layers
    if i is None:
        prev = {"logits": [], "final_norm": ["logits"], "final_norm:in": ["final_norm"],
                "grad.lm_head.weight": ["logits"], "grad.model.norm.weight": ["final_norm"],
                "grad.model.word_embeddings.weight": ["embed"]}.get(site)
        if prev is not None:
            return [Point(ph, st, None, s) for s in prev]
        return [Point(ph, st, 0, "input")] if site == "embed" else []
    if site.startswith("grad."):
        src = grad_param_site(cfg, i, site[len("grad."):])
        return [] if src is None else [Point(ph, st, i, src)]
    if site == "output":
        return [Point(ph, st, i + 1, "input")] if i + 1 < n else [Point(ph, st, None, "final_norm:in")]
    graph = layer_graph(cfg.layer_kind(i), cfg.is_moe(i), cfg.q_lora)
    return [Point(ph, st, i, s.name) for s in graph if site in s.inputs and s.name not in NO_COTANGENT]
