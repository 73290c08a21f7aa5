"""Ling3's names in one place (issue 34 §1: a model family as data): the site graph and the module maps.

- **The site graph** (`SITE_GRAPH`, DESIGN §3): every per-layer site in execution order, where it exists (layer kind,
  MLP kind, q-LoRA), what it is computed from, its numerics class; the model-level sites. `parity.model.points`
  derives the per-layer site lists, the point spellings and the backward sites from it.
- **The dump's shapes** (`canonical_shape`): the sites whose tensor a dump holds in another shape than the module's
  natural [B, T, ...] output (per-head, flattened router outputs, the MLA core's heads merged).
- **The module maps** (`RUNTIME_MAPS`): per PyTorch runtime (the official file, the twin, transformers' built-in
  `bailing_hybrid`) which module (output, input, tuple element, method or module-level function) holds each site, and
  why a runtime does not expose one (`UNEXPOSED`). `parity.torch_ref.capture` hooks what they name.

A site is added here: its graph entry and the module of each runtime that computes it (tests/test_ling3_family.py:
one added here is captured, dumped, ordered and listed by the replay). Kimi Linear's description is
`parity.model.kimi_family`; `parity.model.families` tells a dump's or a checkpoint's family. The JAX reference names
its points by these sites (`parity.jax_ling3`, as any target does: DESIGN §7).
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILY = "ling3"

MODEL_SITES_BEFORE = ("embed",)
MODEL_SITES_AFTER = ("final_norm", "logits")

# ------------------------------------------------------------------------------------------ the site graph
@dataclass(frozen=True)
class Site:
    """One per-layer site of the graph (DESIGN §3): what it is computed from, how it is measured, where it exists.

    name:    canonical site name (relative to `model.layers.{i}`); `<module>:in` is a module's recorded input.
    kind:    where the site exists: "layer" (every layer), "kda", "mla" (with "mla/q_lora" and "mla/no_q_lora" for the
             q-path variants), "dense" or "moe" (the MLP kind).
    inputs:  sites of the same layer and step it is computed from — the data the site's computation reads, not the
             module that happens to compute it (divergence sources, isolated feeding).
    cls:     numerics class (calibration and noise tables group by it).
    carry:   dumped sites of the *previous* step this site continues from at a decode step (KDA recurrent state).
    history: dumped sites of *every earlier* step it attends over at a decode step (MLA expanded K/V cache).
    positions: the computation takes the tokens' absolute positions (RoPE).
    alias:   why the site has no computation of its own (it is another site's tensor, or the layer's input); such a
             site is compared in layer/free replay but not recomputed in isolated replay.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    cls: str
    carry: tuple[str, ...] = ()
    history: tuple[str, ...] = ()
    positions: bool = False
    alias: str | None = None


def _s(name, kind, inputs, cls, **kw) -> Site:
    return Site(name, kind, tuple(inputs), cls, **kw)


_QKV_PROJ = [_s(f"attention.{p}_proj", "kda", ["input_layernorm"], "projection") for p in "qkv"]
_CONV = [_s(f"attention.{p}_conv1d", "kda", [f"attention.{p}_proj"], "conv", carry=["attention.conv_state"])
         for p in "qkv"]  # after conv + SiLU
# MLA keys/values: expanded (kv_b_proj; naive form), their RoPE part (kv_a_proj_with_mqa[..., c:]) and the normalised
# latent (kv_a_layernorm) the absorbed decode form attends over (facts §4.5)
_MLA_KV = ["attention.kv_b_proj", "attention.kv_a_proj_with_mqa", "attention.kv_a_layernorm"]

# Declaration order is execution order within a layer (DESIGN §3).
SITE_GRAPH: tuple[Site, ...] = (
    _s("input", "layer", [], "residual", alias="the layer's input is what the layer is fed, not computed"),
    _s("input_layernorm", "layer", ["input"], "layernorm"),
    # KDA (facts §3)
    *_QKV_PROJ, *_CONV,
    _s("attention.f_proj", "kda", ["input_layernorm"], "projection"),
    _s("attention.gate", "kda", ["attention.f_proj"], "gate_beta"),  # log-space decay after the gate [B,T,H,d] fp32
    _s("attention.b_proj", "kda", ["input_layernorm"], "projection"),
    _s("attention.beta", "kda", ["attention.b_proj"], "gate_beta"),  # sigmoid(b_proj) fp32 [B,T,H]
    # recurrence output before o_norm [B,T,H,d] (facts §3.6: o_t = Sᵀ(s·q_t))
    _s("attention.core", "kda", ["attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.gate",
                                 "attention.beta"], "attn_core", carry=["attention.state"]),
    _s("attention.g_proj", "kda", ["input_layernorm"], "projection"),
    _s("attention.o_norm", "kda", ["attention.core", "attention.g_proj"], "o_norm"),  # normalised and gated
    _s("attention.o_proj", "kda", ["attention.o_norm"], "projection"),
    # recurrent state after the step [B,H,K,V] fp32. The update S ← diag(exp g) S + k uᵀ, u = β(v − Sᵀk) reads k, v,
    # gate, β and never q (facts §3.6; jax_ling3/kda.py), so q is not an input.
    _s("attention.state", "kda", ["attention.k_conv1d", "attention.v_conv1d", "attention.gate", "attention.beta"],
       "kda_state", carry=["attention.state"]),
    # [3,B,P,W]: q,k,v conv histories (last W inputs, fla convention)
    _s("attention.conv_state", "kda", ["attention.q_proj", "attention.k_proj", "attention.v_proj"], "conv",
       carry=["attention.conv_state"]),
    # MLA (facts §4)
    _s("attention.q_a_proj", "mla/q_lora", ["input_layernorm"], "projection"),
    _s("attention.q_a_layernorm", "mla/q_lora", ["attention.q_a_proj"], "layernorm"),
    _s("attention.q_b_proj", "mla/q_lora", ["attention.q_a_layernorm"], "projection"),
    _s("attention.q_proj", "mla/no_q_lora", ["input_layernorm"], "projection"),
    _s("attention.kv_a_proj_with_mqa", "mla", ["input_layernorm"], "projection"),
    _s("attention.kv_a_layernorm", "mla", ["attention.kv_a_proj_with_mqa"], "layernorm"),
    _s("attention.kv_b_proj", "mla", ["attention.kv_a_layernorm"], "projection"),
    # attention output before the head gate [B,T,H*v]: scores from q and the expanded keys (nope part from kv_b_proj,
    # RoPE part from kv_a_proj_with_mqa[..., c:]), values from kv_b_proj (facts §4.2-4.4). The q input is q_b_proj
    # or q_proj by the q-LoRA setting (`site_inputs` keeps the one that exists).
    _s("attention.core", "mla", ["attention.q_b_proj", "attention.q_proj", *_MLA_KV], "attn_core", history=_MLA_KV,
       positions=True),
    _s("attention.g_proj", "mla", ["input_layernorm"], "projection"),
    _s("attention.gate", "mla", ["attention.g_proj"], "gate_beta"),  # sigmoid per head [B,T,H]
    _s("attention.dense:in", "mla", ["attention.core", "attention.gate"], "attn_core"),  # gated output (facts §4.6)
    _s("attention.dense", "mla", ["attention.dense:in"], "projection"),
    _s("attention", "layer", ["attention.o_proj", "attention.dense"], "attention_out",
       alias="the attention block output is the `attention.o_proj` / `attention.dense` output itself"),
    _s("post_attention_layernorm", "layer", ["input", "attention"], "layernorm"),
    # dense MLP
    _s("mlp.gate_proj", "dense", ["post_attention_layernorm"], "projection"),
    _s("mlp.up_proj", "dense", ["post_attention_layernorm"], "projection"),
    _s("mlp.down_proj", "dense", ["mlp.gate_proj", "mlp.up_proj"], "mlp_out"),
    _s("mlp", "dense", ["mlp.down_proj"], "mlp_out", alias="a dense layer's `mlp` output is the `mlp.down_proj` output itself"),
    # MoE (facts §5)
    _s("mlp.gate.logits", "moe", ["post_attention_layernorm"], "router_logits"),  # fp32 [B,T,E]
    _s("mlp.gate.topk_idx", "moe", ["mlp.gate.logits"], "router_ids"),  # int [B,T,k], compared as sets (routing)
    _s("mlp.gate.topk_weight", "moe", ["mlp.gate.logits", "mlp.gate.topk_idx"], "topk_weight"),  # renormalised, scaled
    _s("mlp.routed", "moe", ["post_attention_layernorm", "mlp.gate.topk_idx", "mlp.gate.topk_weight"], "mlp_out"),
    _s("mlp.shared_experts", "moe", ["post_attention_layernorm"], "mlp_out"),
    _s("mlp", "moe", ["mlp.routed", "mlp.shared_experts"], "mlp_out"),
    _s("output", "layer", ["input", "attention", "mlp"], "residual"),
)

# Numerics classes of the model-level sites (no layer).
MODEL_SITE_CLASSES = {"embed": "embed", "final_norm": "head", "logits": "head"}




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


# ------------------------------------------------------------------------------------------ the module maps
@dataclass(frozen=True)
class TapSpec:
    """One canonical point read from one module.

    module: path relative to the model root, `{i}` = layer index (e.g. `model.layers.{i}.attention.q_proj`).
    io: "output" (forward hook) or "input" (forward pre-hook, positional argument `index`).
    index: element of a tuple output/input (None: the value itself).
    kind / mlp: only for layers of that kind ("kda"/"mla") / that MLP ("moe"/"dense").
    scope: per-layer specs only — "any" (main and MTP layers), "main" or "mtp".
    method: read the return value of this method of the module instead of the module's output.
    function: read the return value of this module-level function of the module's Python module, while the module runs.
    mtp_calls: model-level only — the (1+j)-th call in one forward is MTP layer j's point (embedding, LM head).
    transform: name in `parity.torch_ref.capture.TRANSFORMS` applied to the captured tensor (with the layer's
               attention module) before emission.
    """

    module: str
    site: str
    io: str = "output"
    index: int | None = None
    kind: str | None = None
    mlp: str | None = None
    scope: str = "any"
    method: str | None = None
    function: str | None = None
    mtp_calls: bool = False
    transform: str | None = None


def _layer(site: str, rel: str, **kw) -> TapSpec:
    return TapSpec(f"model.layers.{{i}}.{rel}", site, **kw)


# Sites common to every runtime whose module tree follows the official checkpoint names (twin and official file).
_OFFICIAL_NAMES: list[TapSpec] = [
    TapSpec("model.word_embeddings", "embed", mtp_calls=True),
    TapSpec("model.norm", "final_norm"),
    TapSpec("lm_head", "logits", mtp_calls=True),
    _layer("input", "", io="input", index=0, scope="main"),
    _layer("output", "", index=0, scope="main"),
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
    # MLP (facts §5). The MoE block may return a tuple (the official one: `(y, (router_logits, topk_idx))`): `mlp` is
    # element 0 (a plain tensor output is taken as is).
    *[_layer(f"mlp.{p}", f"mlp.{p}", mlp="dense") for p in ("gate_proj", "up_proj", "down_proj")],
    _layer("mlp.shared_experts", "mlp.shared_experts", mlp="moe"),
    _layer("mlp", "mlp", index=0),
    # MTP layer only (facts §2): enorm(embedding), hnorm(main hidden), eh_proj on their concatenation, final norm
    *[_layer(s, s, scope="mtp") for s in ("enorm", "hnorm", "eh_proj", "final_layernorm")],
    _layer("final_layernorm:in", "final_layernorm", io="input", index=0, scope="mtp"),
]

# The official file's own structure where it exposes points without taps: the gate returns (topk_idx, topk_weight,
# logits) with flat [B*T, ...] shapes; `moe_infer` returns the routed experts' weighted sum [B*T, D]; the MLA calls
# the module-global `eager_attention_forward`, whose output 0 is the attention output before the head gate
# [B, T, H, v] (`attention.core`). The MLA head gate (an inline sigmoid) is not exposed.
_OFFICIAL_STRUCTURE: list[TapSpec] = [
    _layer("mlp.gate.topk_idx", "mlp.gate", index=0, mlp="moe"),
    _layer("mlp.gate.topk_weight", "mlp.gate", index=1, mlp="moe"),
    _layer("mlp.gate.logits", "mlp.gate", index=2, mlp="moe"),
    _layer("mlp.routed", "mlp", method="moe_infer", mlp="moe"),
    _layer("attention.core", "attention", function="eager_attention_forward", index=0, kind="mla"),
]

# The official KDA under fla's real kernels: what the kernel computes inside and the code does not return, recovered
# from what it does expose without changing its numerics (hooks only read). `attention.state` comes from the cache
# (dump.py's snapshot). With the CPU stand-ins their observer reports these instead (OBSERVER_SITES).
OFFICIAL_KDA_DERIVED: list[TapSpec] = [
    _layer("attention.core", "attention.o_norm", io="input", index=0, kind="kda"),  # o, before o_norm (facts §3.7)
    _layer("attention.beta", "attention.b_proj", kind="kda", transform="beta_sigmoid_fp32"),
    _layer("attention.gate", "attention.f_proj", kind="kda", transform="kda_gate_in_kernel"),
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
    # + KDA gate/beta/core/state from the fla CPU stand-ins' observer, when installed
    "official": _OFFICIAL_NAMES + _OFFICIAL_STRUCTURE,
    "native": _NATIVE,
}

# Why a map lacks a site (recorded with the site in the dump's unavailable table).
UNEXPOSED = {  # (map, layer kind, site) -> reason
    ("official", "mla", "attention.gate"): "the official MLA computes its head gate as an inline sigmoid of g_proj (no "
                                           "module, method or function call to read it from)",
}

# Sites read from fla_cpu's KDA observer (official file on CPU): observer key -> site.
OBSERVER_SITES = {"gate": "attention.gate", "beta": "attention.beta", "core": "attention.core",
                  "state": "attention.state"}
