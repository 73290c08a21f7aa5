"""Canonical point names (DESIGN §3): what is compared, in execution order.

A point is `(phase, step, layer, site)`; `layer is None` for the model-level sites `embed`, `final_norm`, `logits`.
Sites use the official checkpoint's module names relative to `model.layers.{i}`. A module's *input* is written
`<site>:in` where it is not already another site's output (isolated replay feeds these).

Per-runtime module maps (module path -> point) live with each runtime in `parity/torch_ref/`; this module only
holds the names, their order and the HDF5 / report spellings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

Phase = Literal["prefill", "decode"]

MODEL_SITES_BEFORE = ("embed",)
MODEL_SITES_AFTER = ("final_norm", "logits")

KDA_SITES = (
    "attention.q_proj",
    "attention.k_proj",
    "attention.v_proj",
    "attention.q_conv1d",  # after conv + SiLU
    "attention.k_conv1d",
    "attention.v_conv1d",
    "attention.f_proj",
    "attention.gate",  # log-space decay after the gate function [B,T,H,d] fp32
    "attention.b_proj",
    "attention.beta",  # sigmoid(b_proj) fp32 [B,T,H]
    "attention.core",  # recurrence output before o_norm [B,T,H,d]
    "attention.g_proj",
    "attention.o_norm",  # normalised and gated [B,T,H,d]
    "attention.o_proj",
    "attention.state",  # recurrent state after the step [B,H,K,V] fp32
    "attention.conv_state",  # [3,B,P,W]: q,k,v conv histories (last W inputs, fla convention)
)

MLA_SITES = (
    "attention.q_a_proj",  # q-LoRA only
    "attention.q_a_layernorm",  # q-LoRA only
    "attention.q_b_proj",  # q-LoRA only
    "attention.q_proj",  # no q-LoRA only
    "attention.kv_a_proj_with_mqa",
    "attention.kv_a_layernorm",
    "attention.kv_b_proj",
    "attention.core",  # attention output before the head gate [B,T,H*v]
    "attention.g_proj",
    "attention.gate",  # sigmoid per head [B,T,H]
    "attention.dense",
)

DENSE_MLP_SITES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp")

MOE_SITES = (
    "mlp.gate.logits",  # fp32 router logits [B,T,E]
    "mlp.gate.topk_idx",  # int [B,T,k]
    "mlp.gate.topk_weight",  # fp32 [B,T,k], renormalised and scaled
    "mlp.routed",  # weighted sum of routed experts
    "mlp.shared_experts",
    "mlp",
)

# Inputs recorded for isolated replay where they are not another site's output (DESIGN §3).
# (KDA `attention.core` is what o_norm is fed, and `attention.o_norm` what o_proj is fed, so they need no `:in`.)
INPUT_SITES = ("attention.dense:in",)  # MLA gated attention output [B,T,H*v] fed to dense


def layer_sites(kind: str, moe: bool, q_lora: bool) -> tuple[str, ...]:
    """All per-layer sites of a layer, in execution order."""
    if kind == "kda":
        attn = KDA_SITES
    elif kind == "mla":
        skip = {"attention.q_proj"} if q_lora else {"attention.q_a_proj", "attention.q_a_layernorm", "attention.q_b_proj"}
        attn = tuple(s for s in MLA_SITES if s not in skip)
    else:
        raise ValueError(f"layer kind {kind!r}, expected 'kda' or 'mla'")
    mlp = MOE_SITES if moe else DENSE_MLP_SITES
    return ("input", "input_layernorm", *attn, "attention", "post_attention_layernorm", *mlp, "output")


def sites_for_config(cfg, i: int) -> tuple[str, ...]:
    """Sites of layer i of a Ling3Config."""
    return layer_sites(cfg.layer_kind(i), cfg.is_moe(i), cfg.q_lora)


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
        lay = "model" if self.layer is None else layer_group(self.layer)
        if self.phase == "prefill":
            return ("prefill", lay, self.site)
        return ("decode", step_group(self.step), lay, self.site)

    def h5_path(self) -> str:
        """HDF5 dataset path of DESIGN §4, e.g. `/prefill/L03/attention.o_proj`, `/decode/S001/L03/attention.core`."""
        return "/" + "/".join(self.h5_parts())


def layer_group(i: int) -> str:
    return f"L{i:02d}"


def step_group(k: int) -> str:
    return f"S{k:03d}"


def execution_order(cfg, phases: Iterable[tuple[str, int]]) -> list[Point]:
    """Every point of the model in execution order for the given (phase, step) pairs."""
    out: list[Point] = []
    for phase, step in phases:
        out += [Point(phase, step, None, s) for s in MODEL_SITES_BEFORE]
        for i in range(cfg.num_hidden_layers):
            out += [Point(phase, step, i, s) for s in sites_for_config(cfg, i)]
        out += [Point(phase, step, None, s) for s in MODEL_SITES_AFTER]
    return out


# ------------------------------------------------------------------------------------------ canonical shapes
# Every runtime's tensor is reshaped to these before it is written or compared, so that e.g. the built-in model's
# flattened [B*T, E] router logits and the twin's [B, T, E] land on the same dataset shape. Order of top-k ids is
# canonicalised separately (ascending expert id per token, weights permuted alike): implementations may return
# top-k unsorted (torch.topk(sorted=False)), and only the *set* and its weights carry meaning (DESIGN §6 routing).
def canonical_shape(cfg, layer: int | None, site: str, batch: int, seq: int) -> tuple[tuple[int, ...], str] | None:
    """(shape, shape_names) a site's tensor has in a dump, or None when the site keeps its natural [B,T,...] shape."""
    B, T = batch, seq
    H = cfg.num_attention_heads
    if layer is None:
        return None
    kind = cfg.layer_kind(layer)
    if kind == "kda":
        d, P, W = cfg.head_dim, cfg.kda_proj_size, cfg.short_conv_kernel_size
        table = {
            "attention.gate": ((B, T, H, d), "B,T,H,K"),
            "attention.beta": ((B, T, H), "B,T,H"),
            "attention.core": ((B, T, H, d), "B,T,H,V"),
            "attention.o_norm": ((B, T, H, d), "B,T,H,V"),
            "attention.state": ((B, H, d, d), "B,H,K,V"),
            "attention.conv_state": ((3, B, P, W), "QKV,B,P,W"),
        }
    else:
        table = {
            "attention.core": ((B, T, H * cfg.v_head_dim), "B,T,HV"),
            "attention.dense:in": ((B, T, H * cfg.v_head_dim), "B,T,HV"),
            "attention.gate": ((B, T, H), "B,T,H"),
            # the built-in applies kv_b_proj on a [B,1,T,c] view; the twin on [B,T,c]
            "attention.kv_b_proj": ((B, T, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), "B,T,HNV"),
        }
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    table.update(
        {
            "mlp.gate.logits": ((B, T, E), "B,T,E"),
            "mlp.gate.topk_idx": ((B, T, k), "B,T,K"),
            "mlp.gate.topk_weight": ((B, T, k), "B,T,K"),
        }
    )
    return table.get(site)


# ------------------------------------------------------------------------------------------ dataflow graph
# Which sites a site is computed from, inside one layer (facts §3–§5). The report uses it to find the *source* of a
# divergence: the first failing point whose own inputs pass (DESIGN §6, graph-aware as coremltools does).
_KDA_INPUTS = {
    "input_layernorm": ("input",),
    **{f"attention.{p}": ("input_layernorm",) for p in ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj")},
    "attention.q_conv1d": ("attention.q_proj",),
    "attention.k_conv1d": ("attention.k_proj",),
    "attention.v_conv1d": ("attention.v_proj",),
    "attention.gate": ("attention.f_proj",),
    "attention.beta": ("attention.b_proj",),
    "attention.core": ("attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.gate",
                       "attention.beta"),
    "attention.state": ("attention.k_conv1d", "attention.v_conv1d", "attention.gate", "attention.beta"),
    "attention.conv_state": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "attention.o_norm": ("attention.core", "attention.g_proj"),
    "attention.o_proj": ("attention.o_norm",),
    "attention": ("attention.o_proj",),
}
_MLA_INPUTS = {
    "input_layernorm": ("input",),
    "attention.q_a_proj": ("input_layernorm",),
    "attention.q_a_layernorm": ("attention.q_a_proj",),
    "attention.q_b_proj": ("attention.q_a_layernorm",),
    "attention.q_proj": ("input_layernorm",),
    "attention.kv_a_proj_with_mqa": ("input_layernorm",),
    "attention.kv_a_layernorm": ("attention.kv_a_proj_with_mqa",),
    "attention.kv_b_proj": ("attention.kv_a_layernorm",),
    "attention.core": ("attention.q_b_proj", "attention.q_proj", "attention.kv_a_proj_with_mqa",
                       "attention.kv_b_proj"),
    "attention.g_proj": ("input_layernorm",),
    "attention.gate": ("attention.g_proj",),
    "attention.dense:in": ("attention.core", "attention.gate"),
    "attention.dense": ("attention.dense:in", "attention.core", "attention.gate"),
    "attention": ("attention.dense",),
}
MLP_INPUTS = {  # also the isolated-mode feeds of the MLP sites (parity/isolated.py)
    "post_attention_layernorm": ("input", "attention"),
    "mlp.gate_proj": ("post_attention_layernorm",),
    "mlp.up_proj": ("post_attention_layernorm",),
    "mlp.down_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.gate.logits": ("post_attention_layernorm",),
    "mlp.gate.topk_idx": ("mlp.gate.logits",),
    "mlp.gate.topk_weight": ("mlp.gate.logits", "mlp.gate.topk_idx"),
    "mlp.routed": ("post_attention_layernorm", "mlp.gate.topk_idx", "mlp.gate.topk_weight"),
    "mlp.shared_experts": ("post_attention_layernorm",),
    "output": ("input", "attention", "mlp"),
}


def site_inputs(kind: str, moe: bool, site: str) -> tuple[str, ...]:
    """Sites of the same layer that `site` is computed from (empty for `input`)."""
    if site == "mlp":
        return ("mlp.routed", "mlp.shared_experts") if moe else ("mlp.down_proj",)
    table = _KDA_INPUTS if kind == "kda" else _MLA_INPUTS
    return table.get(site) or MLP_INPUTS.get(site, ())


def point_inputs(cfg, point: Point) -> list[Point]:
    """Points a point is computed from, across layers and model-level sites (same phase/step)."""
    ph, st = point.phase, point.step
    if point.layer is None:
        if point.site == "final_norm":
            return [Point(ph, st, cfg.num_hidden_layers - 1, "output")]
        if point.site == "logits":
            return [Point(ph, st, None, "final_norm")]
        return []
    i = point.layer
    if point.site == "input":
        return [Point(ph, st, None, "embed")] if i == 0 else [Point(ph, st, i - 1, "output")]
    return [Point(ph, st, i, s) for s in site_inputs(cfg.layer_kind(i), cfg.is_moe(i), point.site)]
