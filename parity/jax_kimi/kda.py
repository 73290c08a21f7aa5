"""Kimi Linear's KDA block (`KimiLinearDeltaAttention`), composed from `parity.jax_ling3`'s KDA pieces.

Same as Ling3's KDA (facts §3): short causal conv + SiLU on q, k, v; per-head, per-channel log decay; the delta rule
with L2-normalised q, k (eps 1e-6 inside the sqrt of the sum) and scale d^-1/2; sigmoid-gated RMSNorm per head; no
positions. What is Kimi's own:
- one depthwise conv over the concatenation [q | k | v] (`conv1d`, 3P channels) instead of three;
- the decay pre-activation is low rank, `f_b_proj(f_a_proj(x))`, with no activation in between
  (`KimiLinearForgetGate`), and the gate is the softplus form g = −exp(A_log_h)·softplus(a + dt_bias): A_log per
  head (stored [1, 1, H, 1]), dt_bias per channel [H·d] — `kda_gate(..., lower_bound=None)` with the built-in's own
  softplus formula, log(1 + exp(x)) below 20 (`builtin_softplus`);
- the output gate is low rank too, `g_b_proj(g_a_proj(x))`, into `KimiLinearRMSNormGated` (sigmoid, fp32);
- every prefill runs the chunked form (`chunk_kimi_delta_attention`, chunk 64); only a one-token step with a state
  runs the recurrence (`recurrent_kimi_delta_attention`), both in fp32;
- precision: the gate is fp32 (`forget_gate.float()`), beta = σ(b_proj x) in the activation dtype (the built-in
  applies `torch.sigmoid` to the model-dtype projection), the core output cast back to it; the short conv rounds
  where the kernel the built-in ran does (`spec.CONV_KERNELS`: its torch fallback rounds the conv before the SiLU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.jax_ling3.kda import kda_chunked, kda_gate, kda_recurrent, short_conv
from parity.jax_ling3.norms import gated_rms_norm, l2_normalize
from parity.jax_ling3.ops import linear
from parity.jax_kimi.spec import KimiLayerSpec

F32 = jnp.float32


def low_rank(x: jnp.ndarray, w_a: jnp.ndarray, w_b: jnp.ndarray) -> jnp.ndarray:
    """b(a(x)): two bias-free linears with nothing in between, each rounded to the activation dtype (the built-in's
    two `nn.Linear` calls) — `f_b_proj(f_a_proj(x))` and `g_b_proj(g_a_proj(x))`."""
    return linear(linear(x, w_a), w_b)


def builtin_softplus(x: jnp.ndarray) -> jnp.ndarray:
    """softplus as `KimiLinearForgetGate` computes it (fp32): x above 20, else log(1 + exp(x)) — not a stable
    softplus, whose fp32 values differ for negative x (where 1 + exp(x) rounds): up to 1,089 fp32 ULP at the tiny
    preset's gate, 466 of 4,480 elements beyond rtol 1e-5 (docs/kimi_linear.md)."""
    return jnp.where(x > 20.0, x, jnp.log(1.0 + jnp.exp(x)))


def forget_gate(p: dict, x: jnp.ndarray, spec: KimiLayerSpec) -> jnp.ndarray:
    """`KimiLinearForgetGate`: log-space decay g [B,T,H,d] in fp32 from the layer-normed x [B,T,D]."""
    m = spec.model
    B, T, _ = x.shape
    a = low_rank(x, p["f_a_proj"], p["f_b_proj"]).reshape(B, T, m.num_heads, m.kda_head_dim)
    # None: the softplus form; A_log [H] broadcast per head
    return kda_gate(a, p["A_log"], p["dt_bias"], None, softplus=builtin_softplus)


def kda_attention(p: dict, x: jnp.ndarray, spec: KimiLayerSpec, state: tuple | None = None):
    """KDA block on the layer-normed x [B,T,D]. state: None (start of sequence) or (S [B,H,d,d] fp32, conv [B,3P,W]
    = the last W inputs of the concatenated [q|k|v], fla's convention). Returns (out [B,T,D], points, new_state)."""
    m = spec.model
    B, T, _ = x.shape
    H, d, P = m.num_heads, m.kda_head_dim, m.kda_proj
    S0, conv0 = (None, None) if state is None else state
    pts: dict[str, jnp.ndarray] = {}
    for n in ("q", "k", "v"):
        pts[f"self_attn.{n}_proj"] = linear(x, p[f"{n}_proj"])
    mixed = jnp.concatenate([pts[f"self_attn.{n}_proj"] for n in ("q", "k", "v")], axis=-1)  # [B,T,3P]
    y, conv = short_conv(mixed, p["conv1d"], conv0, fused=m.conv_kernel == "fused")
    q, k, v = (y[..., j * P:(j + 1) * P].reshape(B, T, H, d) for j in range(3))
    g = pts["self_attn.forget_gate"] = forget_gate(p, x, spec)
    b = pts["self_attn.b_proj"] = linear(x, p["b_proj"])
    beta = jax.nn.sigmoid(b.astype(F32)).astype(x.dtype)
    pts["self_attn.beta"] = beta
    qn, kn = l2_normalize(q), l2_normalize(k)  # fp32, as the built-in's kernels after their fp32 casts
    kernel = kda_recurrent if (S0 is not None and T == 1) else kda_chunked
    o, S = kernel(qn, kn, v, g, beta, d ** -0.5, S0)
    core = pts["self_attn.core"] = o.astype(x.dtype)
    gate = pts["self_attn.g_b_proj"] = low_rank(x, p["g_a_proj"], p["g_b_proj"])
    on = pts["self_attn.o_norm"] = gated_rms_norm(core, gate.reshape(B, T, H, d), p["o_norm"], m.eps)
    out = pts["self_attn.o_proj"] = linear(on.reshape(B, T, P), p["o_proj"])
    return out, pts, (S, conv)
