"""Hashable statics of the JAX Kimi Linear, read from a transformers `KimiLinearConfig` and validated.

Anything the reference does not model raises `ConfigError` with one line naming the field and what was expected
(DESIGN §10), never a shape error deep inside jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity.errors import ConfigError
from parity.jax_ling3.spec import dtype_name, dtype_of

# `KimiLinearAttention` builds q_a_layernorm / kv_a_layernorm as `KimiLinearRMSNorm(dim)`, i.e. with the class
# default eps 1e-6 — not `rms_norm_eps` (1e-5 in the published config), which the decoder norms and o_norm use.
MLA_NORM_EPS = 1e-6
LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MLP_KINDS = ("dense", "sparse")


@dataclass(frozen=True)
class KimiModelSpec:
    """Model-wide dimensions and constants. The MoE field names match `parity.jax_ling3.spec.ModelSpec`'s, so
    `parity.jax_ling3.moe.select_experts` reads this spec unchanged."""

    dtype: str  # "bfloat16" | "float32": the activation dtype
    hidden_size: int
    intermediate_size: int  # the dense MLP's (KimiLinearMLP with the default width)
    eps: float  # rms_norm_eps: input/post-attention norms and the KDA o_norm
    # KDA (KimiLinearDeltaAttention)
    num_heads: int  # linear_num_heads
    kda_head_dim: int  # linear_head_dim
    conv_size: int  # linear_conv_kernel_dim
    # MLA (KimiLinearAttention)
    mla_heads: int  # num_attention_heads
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    # MoE (KimiLinearTopkRouter / KimiLinearMoE)
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling: float
    moe_intermediate: int
    n_shared_experts: int
    # which short-conv kernel the built-in ran (`CONV_KERNELS`): its rounding points differ in bf16
    conv_kernel: str = "torch"

    @property
    def jdtype(self):
        return dtype_of(self.dtype)

    @property
    def kda_proj(self) -> int:
        return self.num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def attn_scale(self) -> float:
        """`KimiLinearAttention.scaling` = qk_head_dim^-1/2 (nope + rope dims, not v_head_dim)."""
        return self.qk_head_dim ** -0.5


@dataclass(frozen=True)
class KimiLayerSpec:
    """What differs between layers: attention kind ("kda" | "mla") and MLP kind (MoE or dense)."""

    model: KimiModelSpec
    kind: str
    moe: bool


def _need(ok: bool, field: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"KimiLinearConfig.{field} = {got!r}: expected {expected} (parity.jax_kimi)")


# The built-in's short conv: "torch" — its torch fallbacks (`causal_conv1d_fn` / `causal_conv1d_update`, what it runs
# on CPU without kernels): the conv rounded to the activation dtype, then SiLU, rounded again; "fused" — a fused
# kernel (fla's / causal-conv1d's), fp32 inside and rounded once, as Ling3's runtimes (facts §3.2). Equal in fp32; in
# bf16 the tiny preset's KDA layers are bit-exact against the CPU built-in only with "torch" (docs/kimi_linear.md).
CONV_KERNELS = ("torch", "fused")


def model_spec(cfg: Any, dtype: str, conv_kernel: str = "torch") -> KimiModelSpec:
    """Validated statics from a `KimiLinearConfig` (or anything with its attributes); `conv_kernel` names the short-conv
    kernel of the run to mirror (`CONV_KERNELS`)."""
    if conv_kernel not in CONV_KERNELS:
        raise ConfigError(f"conv_kernel = {conv_kernel!r}: expected one of {CONV_KERNELS} (parity.jax_kimi)")
    mt = getattr(cfg, "model_type", None)
    _need(mt == "kimi_linear", "model_type", "'kimi_linear'", mt)
    _need(cfg.hidden_act == "silu", "hidden_act", "'silu' (the only activation modelled)", cfg.hidden_act)
    _need(not cfg.attention_bias, "attention_bias", "False (MLA projections without bias)", cfg.attention_bias)
    _need(cfg.num_key_value_heads == cfg.num_attention_heads, "num_key_value_heads",
          f"num_attention_heads = {cfg.num_attention_heads} (kv_b_proj makes one K/V head per query head)",
          cfg.num_key_value_heads)
    _need(cfg.q_lora_rank is None or cfg.q_lora_rank > 0, "q_lora_rank", "None or a positive int", cfg.q_lora_rank)
    E, G, tg, k = cfg.num_local_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    _need(isinstance(G, int) and G >= 1 and E % G == 0, "n_group", f"a divisor of num_local_experts = {E}", G)
    _need(E // G >= 2, "n_group", f"at most num_local_experts / 2 = {E // 2} (group score = sum of a group's top 2)",
          G)
    _need(isinstance(tg, int) and 1 <= tg <= G, "topk_group", f"an int in [1, n_group = {G}]", tg)
    _need(isinstance(k, int) and 1 <= k <= tg * (E // G), "num_experts_per_tok",
          f"an int in [1, topk_group * experts per group = {tg * (E // G)}]", k)
    _need(cfg.n_shared_experts >= 1, "n_shared_experts", ">= 1 (KimiLinearMoE always has shared experts)",
          cfg.n_shared_experts)
    return KimiModelSpec(
        dtype=dtype_name(dtype_of(dtype)), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        eps=float(cfg.rms_norm_eps),
        num_heads=cfg.linear_num_heads, kda_head_dim=cfg.linear_head_dim, conv_size=cfg.linear_conv_kernel_dim,
        mla_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope=cfg.qk_nope_head_dim, qk_rope=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        num_experts=E, top_k=k, n_group=G, topk_group=tg, norm_topk_prob=bool(cfg.norm_topk_prob),
        routed_scaling=float(cfg.routed_scaling_factor), moe_intermediate=cfg.moe_intermediate_size,
        n_shared_experts=cfg.n_shared_experts, conv_kernel=conv_kernel)


def layer_spec(cfg: Any, i: int, dtype: str, conv_kernel: str = "torch") -> KimiLayerSpec:
    """Statics of decoder layer i: `layer_types[i]` picks KDA or MLA, `mlp_layer_types[i]` MoE or dense
    (`KimiLinearDecoderLayer.__init__`)."""
    n = cfg.num_hidden_layers
    if not 0 <= i < n:
        raise ConfigError(f"layer {i}: expected 0 <= layer < num_hidden_layers = {n} (parity.jax_kimi)")
    for field, allowed in (("layer_types", tuple(LAYER_KINDS)), ("mlp_layer_types", MLP_KINDS)):
        types = getattr(cfg, field)
        _need(types is not None and len(types) == n, field, f"a list of num_hidden_layers = {n} entries", types)
        _need(types[i] in allowed, f"{field}[{i}]", f"one of {allowed}", types[i])
    return KimiLayerSpec(model=model_spec(cfg, dtype, conv_kernel), kind=LAYER_KINDS[cfg.layer_types[i]],
                         moe=cfg.mlp_layer_types[i] == "sparse")


def checkpoint_config(ckpt_dir: Any) -> Any:
    """A Kimi Linear checkpoint directory's `KimiLinearConfig` (transformers' own reader of its config.json), every
    field the reference relies on validated for every layer (`layer_spec`) before any weight loads: the family's config
    check (`parity.model.families.KIMI_LINEAR`, `tools/dump_hf.py`). One line (`ConfigError`) names what is wrong."""
    from pathlib import Path

    from transformers import KimiLinearConfig

    root = Path(ckpt_dir)
    try:
        cfg = KimiLinearConfig.from_pretrained(root)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{root / 'config.json'}: transformers could not read it as a KimiLinearConfig ({e})") \
            from None
    for i in range(cfg.num_hidden_layers):
        layer_spec(cfg, i, "float32")
    return cfg
