"""Kimi Linear's sites in one place (issue 34 §1): canonical site name <- the built-in's module <- the JAX point.

transformers' built-in `KimiLinearForCausalLM` is read by forward hooks on its modules (`parity.torch_ref.kimi_dump`),
its dumps hold the sites under these canonical names, and the JAX reference (`parity.jax_kimi`, which names its points
by the built-in's module paths) is judged at them (`parity.jax_kimi.check`). All three read `SITES`: a site added
here is captured, dumped and judged, one taken out is none of these (tests/test_kimi_check.py). The canonical names
are Ling3's where the quantity is the same (DESIGN §3: `attention.gate` is the log-space decay, `attention.o_norm`
the gated norm's output, `mlp.routed` the weighted expert sum), so Ling3's calibrated rules for that site class judge
them. A site whose module a layer lacks (MLA's `kv_b_proj` in a KDA layer, a dense layer's router) is skipped there.

Each site also names the sites it is computed from (`KimiSite.inputs`): the site graph the report reads
(`KimiGraph`) for a Kimi dump's first divergence and its source; `MODEL_SITES` are the embedding, the final norm
and the head. Ling3's description is `parity.model.ling3_family`; `parity.model.families` tells the two apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

FAMILY = "kimi_linear"


@dataclass(frozen=True)
class KimiSite:
    """site: canonical name. module: the built-in's module path relative to a decoder layer ("" = the layer itself).
    io: which side of the module ("output", or "input" = its first argument). index: the element of a tuple output.
    sort: ids sorted ascending per token (a top-k *set*, DESIGN §4). point: the JAX reference's point name (default:
    the module path, or `site` for the layer itself); judged: compared against the JAX point (else only recorded, as
    the inputs a replay feeds)."""

    site: str
    module: str
    io: str = "output"
    index: int | None = None
    sort: bool = False
    point: str | None = None
    judged: bool = True
    inputs: tuple[str, ...] = ()  # the sites of the same layer it is computed from (the site graph, DESIGN §6)
    # read from the built-in's cache after each forward that has one (a prefill followed by decode steps, and each
    # decode step) instead of a hook: "recurrent" (`get_recurrent_state(i)`) or "conv" (`get_conv_state(i)`); a layer
    # whose cache has no such state (an MLA layer) has no such site
    cache: str | None = None

    @property
    def jax_point(self) -> str:
        return self.point or self.module or self.site


def _attn(site: str, module: str, inputs: tuple[str, ...] = ("input_layernorm",)) -> KimiSite:
    return KimiSite(f"attention.{site}", f"self_attn.{module}", inputs=inputs)


_KDA_IN = tuple(f"attention.{s}" for s in ("q_proj", "k_proj", "v_proj", "gate", "b_proj", "g_proj"))
# MLA's core (no site) reads the query (q_b_proj, or q_proj without q-LoRA), the expanded keys and values and k_rope
_MLA_IN = ("attention.q_proj", "attention.q_b_proj", "attention.kv_b_proj", "attention.kv_a_proj_with_mqa")


# execution order within a layer (DESIGN §3), each site with the sites it is computed from (a site a layer lacks is
# simply absent there: MLA's inputs in a KDA layer, the router in a dense one)
_POST = ("post_attention_layernorm",)
SITES: tuple[KimiSite, ...] = (
    KimiSite("input", "", io="input", judged=False),
    KimiSite("input_layernorm", "input_layernorm", inputs=("input",)),
    # KDA (KimiLinearDeltaAttention)
    _attn("q_proj", "q_proj"), _attn("k_proj", "k_proj"), _attn("v_proj", "v_proj"),
    _attn("gate", "forget_gate"),  # log-space decay g [B,T,H,d] fp32 (KimiLinearForgetGate)
    _attn("b_proj", "b_proj"),  # before its sigmoid (beta is computed inline, no module)
    _attn("g_proj", "g_b_proj"),  # the output gate, g_b_proj(g_a_proj(x)), before its reshape
    _attn("o_norm", "o_norm", _KDA_IN),  # KimiLinearRMSNormGated: normalised and gated
    # the KDA cache after the step (the built-in's `DynamicCache`, what its next decode step continues from): the
    # recurrent state [B,H,K,V] fp32 — its update reads k, v, the decay and beta, never q (Ling3's facts §3.6, the
    # same recurrence) — and the short conv's history of the last W inputs of [q|k|v], laid out [3,B,P,W] as Ling3's
    # canonical `attention.conv_state` (`conv_state_canonical`: the built-in holds [B,3P,W])
    KimiSite("attention.state", "self_attn", cache="recurrent", point="self_attn.recurrent_state",
             inputs=("attention.k_proj", "attention.v_proj", "attention.gate", "attention.b_proj")),
    KimiSite("attention.conv_state", "self_attn", cache="conv", point="self_attn.conv_state",
             inputs=("attention.q_proj", "attention.k_proj", "attention.v_proj")),
    # MLA (KimiLinearAttention)
    _attn("q_a_proj", "q_a_proj"), _attn("q_a_layernorm", "q_a_layernorm", ("attention.q_a_proj",)),
    _attn("q_b_proj", "q_b_proj", ("attention.q_a_layernorm",)),
    _attn("kv_a_proj_with_mqa", "kv_a_proj_with_mqa"),
    _attn("kv_a_layernorm", "kv_a_layernorm", ("attention.kv_a_proj_with_mqa",)),
    _attn("kv_b_proj", "kv_b_proj", ("attention.kv_a_layernorm",)),
    # both kinds
    _attn("o_proj", "o_proj", ("attention.o_norm",) + _MLA_IN),
    KimiSite("attention", "self_attn", inputs=("attention.o_proj",)),
    KimiSite("post_attention_layernorm", "post_attention_layernorm", inputs=("input", "attention")),
    KimiSite("mlp:in", "mlp", io="input", judged=False, inputs=_POST),
    # MoE (KimiLinearMoE): the router's (logits, weights, ids), the experts' weighted sum, the shared experts
    KimiSite("mlp.gate.logits", "mlp.gate", index=0, point="mlp.gate.logits", inputs=_POST),
    KimiSite("mlp.gate.topk_idx", "mlp.gate", index=2, sort=True, judged=False,  # routing: forced and counted
             inputs=("mlp.gate.logits",)),
    KimiSite("mlp.routed", "mlp.experts", point="mlp.routed", inputs=_POST + ("mlp.gate.logits",)),
    KimiSite("mlp.shared_experts", "mlp.shared_experts", inputs=_POST),
    KimiSite("mlp", "mlp", inputs=_POST + ("mlp.routed", "mlp.shared_experts")),
    KimiSite("output", "", inputs=("input", "attention", "mlp")),
)


def conv_state_canonical(x):
    """A short-conv history [B, 3P, W] (the built-in's cache, fla's convention; torch, numpy or jax) as Ling3's
    canonical `attention.conv_state` [3, B, P, W] (q, k, v first)."""
    B, C, W = x.shape
    y = x.reshape(B, 3, C // 3, W)
    return y.permute(1, 0, 2, 3).contiguous() if hasattr(y, "permute") else y.transpose(1, 0, 2, 3)


CANONICAL = {"attention.conv_state": conv_state_canonical}  # site -> layout of its dump, applied to both sides


def canonical(site: str, x):
    """`x` (the built-in's tensor or a JAX point of `site`) in the layout the dump holds the site in."""
    return CANONICAL[site](x) if site in CANONICAL else x


# Model-level sites (layer None; DESIGN §3's names): the embedding's output, the final norm's and the head's logits.
# `module` is relative to the model root (`KimiLinearForCausalLM`); `inputs` name the model-level sites or, as
# "last_layer/<site>", the last decoder layer's site they are computed from.
MODEL_SITES: tuple[KimiSite, ...] = (
    KimiSite("embed", "model.embed_tokens"),
    KimiSite("final_norm", "model.norm", inputs=("last_layer/output",)),
    KimiSite("logits", "lm_head", inputs=("final_norm",)),
)
MODEL_SITES_BEFORE = ("embed",)  # before layer 0; the others after the last layer


class KimiGraph:
    """The family's site graph as the report reads it (`parity.reporting.report`: execution order and each point's
    inputs, for the first divergence and its source), from `SITES` and `MODEL_SITES` alone. Forward: a layer's sites in `SITES` order,
    layer i's `input` from layer i-1's `output`. Backward (a `--grads` dump's phase, sites `input` = dL/d layer input
    and `grad.<param>`): the layers last to first, each layer's weight gradients before its input cotangent."""

    family = FAMILY

    def __init__(self, num_layers: int | None = None) -> None:
        self.num_layers = num_layers  # where `final_norm` reads its input (None: not known, no such input)

    def layer_rank(self, layer: int | None, site: str) -> int:
        """A record's place among the layers: the embedding before layer 0, the head after the last."""
        if layer is not None:
            return layer
        return -1 if site in MODEL_SITES_BEFORE else 10**6

    def site_rank(self, layer: int | None, site: str) -> int:
        names = [s.site for s in (SITES if layer is not None else MODEL_SITES)]
        return names.index(site) if site in names else len(names)

    def backward_rank(self, layer: int | None, site: str) -> tuple:
        return (-(layer or 0), 0 if site.startswith("grad.") else 1, site)

    def point_inputs(self, point):
        from parity.model.points import Point

        if point.phase == "backward":
            return []
        if point.layer is None:
            site = next((s for s in MODEL_SITES if s.site == point.site), None)
            out = []
            for n in (site.inputs if site else ()):
                if not n.startswith("last_layer/"):
                    out.append(Point(point.phase, point.step, None, n))
                elif self.num_layers:
                    out.append(Point(point.phase, point.step, self.num_layers - 1, n.split("/", 1)[1]))
            return out
        if point.site == "input":
            return [Point(point.phase, point.step, None, "embed")] if point.layer == 0 else \
                [Point(point.phase, point.step, point.layer - 1, "output")]
        by_name = {s.site: s for s in SITES}
        s = by_name.get(point.site)
        return [Point(point.phase, point.step, point.layer, n) for n in (s.inputs if s else ())]


# The family's tolerance overlay (issue 34 item 3): Ling3's calibrated rules judge a Kimi site of the same class;
# where the built-in computes a site another way, parity/numerics/kimi_linear.toml (calibrated on the correct pairs
# of `parity.jax_kimi.corpus`, tools/kimi_corpus.py) comes first. Only those sites are in it.
RULES_FILE = "kimi_linear.toml"


@functools.lru_cache(maxsize=1)
def rules():
    """Ling3's calibrated rules (`parity.numerics.tolerances.default_rules`) with the family's overlay first."""
    from importlib import resources

    from parity.numerics.tolerances import default_rules, load_rules

    return default_rules().merged(load_rules(Path(str(resources.files("parity.numerics") / RULES_FILE))))
