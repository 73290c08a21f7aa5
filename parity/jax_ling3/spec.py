"""Hashable static arguments for the jitted layer functions, derived from a `Ling3Config`.

`Ling3Config` itself is not hashable (it may hold a `rope_scaling` dict), and jit needs hashable statics; these small
frozen dataclasses carry exactly what the maths reads, so one compiled function serves every layer of the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax.numpy as jnp

from parity.model.config import Ling3Config
from parity.errors import ConfigError

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


def dtype_of(name: str):
    """jnp dtype for "bfloat16"/"float32" (aliases bf16/fp32); ConfigError otherwise."""
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ConfigError(f"dtype {name!r}: expected one of 'bfloat16', 'float32'") from None


def dtype_name(dtype) -> str:
    return "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"


@dataclass(frozen=True)
class ModelSpec:
    """Model-wide dimensions and constants (facts §1)."""

    dtype: str  # "bfloat16" | "float32" — compute / activation dtype
    hidden_size: int
    vocab_size: int
    eps: float
    # KDA (§3)
    num_heads: int
    kda_head_dim: int
    conv_size: int
    lower_bound: float | None
    # MLA (§4)
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    rope_theta: float
    attn_scale: float
    # MoE (§5)
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling: float
    has_shared: bool

    @property
    def jdtype(self):
        return dtype_of(self.dtype)

    @property
    def kda_proj(self) -> int:
        return self.num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope + self.qk_rope


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: attention kind, MLP kind, SwiGLU clamp limits (None = off, facts §5.7)."""

    model: ModelSpec
    kind: str  # "kda" | "mla"
    moe: bool
    routed_limit: float | None = None
    shared_limit: float | None = None
    kda_mode: str = "auto"  # "auto" (official: recurrent if T <= 64 else chunked, §3.10) | "chunked" | "recurrent"
    mla_absorbed: bool = True  # MLA over a latent cache: absorbed form (§4.5) instead of expanding K/V
    # Precision of the KDA forget gate / beta as they enter the recurrence (a semantic fork, parity.model.semantics):
    # "float32" (official file, intended) or "bfloat16" (transformers' built-in rounds both to the model dtype, ORC §5)
    kda_gate_dtype: str = "float32"
    kda_beta_dtype: str = "float32"
    # Precision of the KDA chunk kernel's intermediates (a semantic fork, parity.model.semantics): "float32" (intended) or
    # "bfloat16" (fla's chunked Triton kernels in a bf16 run round them, parity.torch_ref.fla_cpu's list)
    kda_chunk_dtype: str = "float32"


def model_spec(cfg: Ling3Config, dtype: str) -> ModelSpec:
    if cfg.rope_scaling is not None:
        raise ConfigError("rope_scaling is set: only unscaled RoPE is modelled by the JAX Ling3 (facts §4.4)")
    return ModelSpec(
        dtype=dtype_name(dtype_of(dtype)),
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        eps=float(cfg.rms_norm_eps),
        num_heads=cfg.num_attention_heads,
        kda_head_dim=cfg.head_dim,
        conv_size=cfg.short_conv_kernel_size,
        lower_bound=None if cfg.kda_lower_bound is None else float(cfg.kda_lower_bound),
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope=cfg.qk_nope_head_dim,
        qk_rope=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_theta=float(cfg.rope_theta),
        attn_scale=float(cfg.attention_scale),
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling=float(cfg.routed_scaling_factor),
        has_shared=cfg.has_shared_expert,
    )


def layer_spec(cfg: Ling3Config, i: int, dtype: str, *, clamp: bool = True, kda_mode: str = "auto",
               mla_absorbed: bool = True, kda_gate_dtype: str = "float32",
               kda_beta_dtype: str = "float32", kda_chunk_dtype: str = "float32") -> LayerSpec:
    """Statics of layer i (i ≥ num_hidden_layers: an MTP layer, MLA + MoE without clamp, facts §2, §5.7).
    `clamp=False` drops the SwiGLU clamp (to follow runtimes that ignore it, facts §10.1); `kda_gate_dtype` /
    `kda_beta_dtype` "bfloat16" round the KDA gate / beta as transformers' built-in does, `kda_chunk_dtype`
    "bfloat16" the chunk kernel's intermediates as fla's chunked kernels do in bf16 (parity.model.semantics)."""
    if kda_mode not in ("auto", "chunked", "recurrent"):
        raise ConfigError(f"kda_mode {kda_mode!r}: expected 'auto', 'chunked' or 'recurrent'")
    for name, v in (("kda_gate_dtype", kda_gate_dtype), ("kda_beta_dtype", kda_beta_dtype),
                    ("kda_chunk_dtype", kda_chunk_dtype)):
        if v not in ("float32", "bfloat16"):
            raise ConfigError(f"{name} {v!r}: expected 'float32' or 'bfloat16'")
    return LayerSpec(
        model=model_spec(cfg, dtype),
        kind=cfg.layer_kind(i),
        moe=cfg.is_moe(i),
        routed_limit=cfg.expert_swiglu_limit(i) if clamp else None,
        shared_limit=cfg.shared_swiglu_limit(i) if clamp else None,
        kda_mode=kda_mode,
        mla_absorbed=mla_absorbed,
        kda_gate_dtype=kda_gate_dtype,
        kda_beta_dtype=kda_beta_dtype,
        kda_chunk_dtype=kda_chunk_dtype,
    )


__all__ = ["ModelSpec", "LayerSpec", "model_spec", "layer_spec", "dtype_of", "dtype_name", "replace"]
