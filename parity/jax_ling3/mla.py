"""Head-gated multi-head latent attention (facts §4).

Two forms of the same maths:
- naive (prefill, §4.4): expand per-head K = [k_nope | k_rope], V from the latent through kv_b_proj; causal softmax.
- absorbed (decode, §4.5): keep a latent cache (normalised c_kv + rotated k_rope, 576 values per token in Ling3) and
  fold kv_b_proj into the query (q̃ = W_UKᵀ q_nope) and the output (o = W_UV z).
Precision follows the reference's eager path (facts §8): bf16 GEMMs with fp32 accumulation, scores scaled in fp32 from
the rounded product, softmax in fp32 cast back, head gate σ in fp32 cast back.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from parity.model.config import MLA_NORM_EPS as CONFIG_MLA_NORM_EPS
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.ops import bf16_dot, dot_f32, linear, native_bf16_backward, row_major
from parity.jax_ling3.probes import tap
from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin
from parity.jax_ling3.spec import LayerSpec

F32 = jnp.float32
MLA_NORM_EPS = CONFIG_MLA_NORM_EPS  # q_a/kv_a_layernorm eps (facts §4.2); a module global so mutants can patch it


class MLACache(NamedTuple):
    """Latent cache of one MLA layer: c_kv [B,S,c] (after kv_a_layernorm), k_rope [B,S,r] (rotated), length (int32
    scalar: tokens written; None for a fresh cache — a static pytree leaf, so the prefill that fills it is traced as a
    prefill). S is a fixed capacity so decode steps keep static shapes (one compile)."""

    c_kv: jnp.ndarray
    k_rope: jnp.ndarray
    length: jnp.ndarray


def init_mla_cache(batch: int, capacity: int, spec: LayerSpec) -> MLACache:
    m = spec.model
    return MLACache(jnp.zeros((batch, capacity, m.kv_lora_rank), m.jdtype),
                    jnp.zeros((batch, capacity, m.qk_rope), m.jdtype), None)


def _mm(eq: str, a, b, dtype):
    """einsum in the activation dtype with fp32 accumulation, rounded once (a bf16 torch matmul)."""
    return dot_f32(eq, a.astype(dtype), b.astype(dtype)).astype(dtype)


def _softmax_probs(scores_raw, scale: float, allowed, dtype):
    """scores (rounded product) × scale in fp32 → dtype; masked; softmax in fp32, cast to dtype (facts §4.4, §8)."""
    s = (scores_raw.astype(F32) * scale).astype(dtype)
    s = jnp.where(allowed, s.astype(F32), -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def mla_attention(p: dict, x: jnp.ndarray, positions: jnp.ndarray, spec: LayerSpec,
                  cache: MLACache | None = None):
    """MLA block on the layer-normed x [B,T,D] at RoPE `positions` [T] or [B,T].

    cache None: naive causal form over these T tokens (returns new_cache None).
    fresh cache (`init_mla_cache`, length None): the same naive prefill (the reference's eager path, facts §4.4 — and
    T×T scores instead of T×capacity), its latents written at 0.
    filled cache: the T new tokens are written at cache.length and attend to everything before them and causally to
    each other, in the absorbed form (`spec.mla_absorbed`) or by expanding K/V from the cached latents.
    Returns (out [B,T,D], points, new_cache)."""
    m = spec.model
    dt = x.dtype
    B, T, _ = x.shape
    H, n, r, vd, c = m.num_heads, m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank
    pts: dict[str, jnp.ndarray] = {}
    if m.q_lora_rank is None:
        q = tap(pts, "attention.q_proj", linear(x, p["q_proj"]))
    else:
        qa = tap(pts, "attention.q_a_proj", linear(x, p["q_a_proj"]))
        qa = rms_norm(qa, p["q_a_layernorm"], MLA_NORM_EPS)
        qa = tap(pts, "attention.q_a_layernorm", qa)
        q = linear(qa, p["q_b_proj"])
        q = tap(pts, "attention.q_b_proj", q)
    q = q.reshape(B, T, H, n + r)
    q_nope, q_rope = q[..., :n], q[..., n:]
    kv_a = linear(x, p["kv_a_proj_with_mqa"])
    kv_a = tap(pts, "attention.kv_a_proj_with_mqa", kv_a)
    c_kv = rms_norm(kv_a[..., :c], p["kv_a_layernorm"], MLA_NORM_EPS)
    c_kv = tap(pts, "attention.kv_a_layernorm", c_kv)
    kv = linear(c_kv, p["kv_b_proj"])
    kv = tap(pts, "attention.kv_b_proj", kv)
    pos = jnp.broadcast_to(positions, (B, T))
    cos, sin = cos_sin(pos, r, m.rope_theta, dt)
    q_rope = apply_rope_interleaved(q_rope, cos, sin)  # [B,T,H,r]
    k_rope = apply_rope_interleaved(kv_a[..., None, c:], cos, sin)[..., 0, :]  # [B,T,r], one shared head

    w_kv = p["kv_b_proj"].reshape(c, H, n + vd)
    if cache is None or cache.length is None:
        kvh = kv.reshape(B, T, H, n + vd)
        core = _naive(q_nope, q_rope, kvh[..., :n], kvh[..., n:], k_rope, jnp.tril(jnp.ones((T, T), bool)),
                      m.attn_scale, dt, causal=True)
        new_cache = None if cache is None else MLACache(
            jax.lax.dynamic_update_slice(cache.c_kv, c_kv.astype(cache.c_kv.dtype), (0, 0, 0)),
            jax.lax.dynamic_update_slice(cache.k_rope, k_rope.astype(cache.k_rope.dtype), (0, 0, 0)),
            jnp.asarray(T, jnp.int32))
    else:
        start = cache.length
        new_cache = MLACache(jax.lax.dynamic_update_slice(cache.c_kv, c_kv.astype(cache.c_kv.dtype), (0, start, 0)),
                             jax.lax.dynamic_update_slice(cache.k_rope, k_rope.astype(cache.k_rope.dtype),
                                                          (0, start, 0)),
                             start + T)
        Sk = cache.c_kv.shape[1]
        allowed = jnp.arange(Sk)[None, :] <= (start + jnp.arange(T))[:, None]  # [T,S] causal over cache + new
        if spec.mla_absorbed:
            core = _absorbed(q_nope, q_rope, new_cache.c_kv, new_cache.k_rope, w_kv[..., :n], w_kv[..., n:],
                             allowed, m.attn_scale, dt)
        else:
            kvh = linear(new_cache.c_kv, p["kv_b_proj"]).reshape(B, Sk, H, n + vd)
            core = _naive(q_nope, q_rope, kvh[..., :n], kvh[..., n:], new_cache.k_rope, allowed, m.attn_scale, dt)
    core = core.reshape(B, T, H * vd)
    core = tap(pts, "attention.core", core)
    gp = linear(x, p["g_proj"])
    gp = tap(pts, "attention.g_proj", gp)
    gate = jax.nn.sigmoid(gp.astype(F32)).astype(dt)  # head-wise gate, fp32 then cast (facts §4.6)
    gate = tap(pts, "attention.gate", gate)
    gated = (core.reshape(B, T, H, vd) * gate[..., None]).reshape(B, T, H * vd)
    gated = tap(pts, "attention.dense:in", gated)
    out = linear(gated, p["dense"])
    out = tap(pts, "attention.dense", out)
    return out, pts, new_cache


def _naive(q_nope, q_rope, k_nope, v, k_rope, allowed, scale, dt, causal: bool = False):
    """softmax(s·(q_nope·k_nope + q_rope·k_rope)) v per head; q [B,T,H,·], k_nope/v [B,S,H,·], k_rope [B,S,r].
    causal: `allowed` is the square lower triangle (a prefill), which lets the native VJP skip masked key blocks."""
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    H = q.shape[2]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], H, k_rope.shape[-1]))],
                        axis=-1)
    if native_bf16_backward(q, k, v):
        T, S = q.shape[1], k.shape[1]
        return _core_bf16(q, k, v, allowed, scale, causal_blocks(T, S, CAUSAL_BLOCK if causal else None))
    return _core(q, k, v, allowed, scale, dt)


def _core(q, k, v, allowed, scale, dt):
    """The attention core of the naive form (q [B,T,H,d], k [B,S,H,d], v [B,S,H,v]): its plain-AD VJP is the
    readable reference of `_core_bf16`'s."""
    probs = _softmax_probs(dot_f32("bthd,bshd->bhts", q, k).astype(dt), scale, allowed, dt)
    return _mm("bhts,bshv->bthv", probs, v, dt)


# Query rows per block of the native attention VJP of a causal prefill (`_core_bf16`): the queries [t0, t1) attend
# keys [0, t1) only, so the T x T products and softmax passes over keys that no query of the block sees are skipped
# (~44 % of them at T = 2048, as flash attention's causal kernels skip them). The forward's bits are the readable
# path's whatever the blocks; under a VJP key blocks change only fp32 summation orders (dk and dv are summed over the
# query blocks in fp32 and rounded once, as one bf16 GEMM rounds them). None: one block.
CAUSAL_BLOCK: int | None = 256


def causal_blocks(T: int, S: int, block: int | None) -> tuple[tuple[int, int, int], ...]:
    """(t0, t1, s1) per query block: queries [t0, t1) over keys [0, s1). One block (all T queries over all S keys)
    unless `block` is set, the mask is the square causal one (S == T) and T > block."""
    if block is None or T != S or T <= block:
        return ((0, T, S),)
    return tuple((t0, min(t0 + block, T), min(t0 + block, T)) for t0 in range(0, T, block))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _core_bf16(q, k, v, allowed, scale, blocks):
    """`_core` of bf16 operands on CPU (`ops.BWD_NATIVE_BF16`): the same forward bits; under a VJP its products are
    native bf16 dots (as a bf16 torch matmul and its autograd: fp32 sums, each product rounded once to bf16), query
    block by query block (`causal_blocks`)."""
    return _core(q, k, v, allowed, scale, jnp.bfloat16)


def _heads_first(a):
    """[B, T, H, d] -> [B, H, T, d], materialised row-major once (each query block's dots then slice it in place;
    sliced in [B, T, H, d], XLA:CPU copied every block's key prefix transposed: 0.19 s at T = 2048)."""
    return row_major(jnp.einsum("bthd->bhtd", a))


def _minor_t(a):
    """[..., t, d] -> [..., d, t] materialised row-major: the small operand of dv = (dOᵀ P)ᵀ and dk = (qᵀ dS)ᵀ. Left to
    XLA, a dot contracting its lhs's rows took XLA:CPU's slow generic path (0.12 s at T = 2048), as `ops.contiguous_t`
    notes for the linears."""
    return row_major(jnp.swapaxes(a, -1, -2))


def _core_bf16_fwd(q, k, v, allowed, scale, blocks):
    bf = jnp.bfloat16
    qh, kh, vh = _heads_first(q), _heads_first(k), _heads_first(v)
    outs, p32s = [], []
    for t0, t1, s1 in blocks:
        s = (bf16_dot("bhtd,bhsd->bhts", qh[:, :, t0:t1], kh[:, :, :s1]).astype(bf).astype(F32) * scale).astype(bf)
        p32 = jax.nn.softmax(jnp.where(allowed[t0:t1, :s1], s.astype(F32), -jnp.inf), axis=-1)  # saved, as torch
        outs.append(row_major(bf16_dot("bhts,bhsv->bhtv", p32.astype(bf), vh[:, :, :s1]).astype(bf)))
        p32s.append(p32)
    out = jnp.einsum("bhtv->bthv", jnp.concatenate(outs, axis=2))
    return out, (qh, kh, vh, allowed, tuple(p32s))


def _core_bf16_bwd(scale, blocks, res, dout):
    """Plain AD of `_core` step by step, in torch autograd's roundings: d probs and dv rounded to bf16, the softmax's
    VJP p ⊙ (d − Σ d p) in fp32 on its fp32 output, rounded; × scale in fp32, rounded; dq and dk rounded. dk and dv
    sum their query blocks' fp32 products, then round once."""
    qh, kh, vh, allowed, p32s = res
    bf = jnp.bfloat16
    doh = _heads_first(dout.astype(bf))
    B, H, S, d = kh.shape
    dq_blocks = []
    dk = jnp.zeros((B, H, d, S), F32)
    dv = jnp.zeros((B, H, vh.shape[-1], S), F32)
    for (t0, t1, s1), p32 in zip(blocks, p32s):
        qb, dob, kb, vb = qh[:, :, t0:t1], doh[:, :, t0:t1], kh[:, :, :s1], vh[:, :, :s1]
        d32 = bf16_dot("bhtv,bhsv->bhts", dob, vb).astype(bf).astype(F32)
        # dv = Pᵀ dO and dk = dSᵀ q contract the T x T matrix's leading dim: as (dOᵀ P)ᵀ and (qᵀ dS)ᵀ the big operand
        # stays row-major and only the small one is transposed (written as "bhts,bthv->bshv", XLA:CPU copied each
        # [16, 2048, 2048] bf16 matrix transposed for its dot: 0.41 s apiece at T = 2048)
        dv = dv.at[..., :s1].add(row_major(bf16_dot("bhvt,bhts->bhvs", _minor_t(dob), p32.astype(bf))))
        ds = jnp.where(allowed[t0:t1, :s1], p32 * (d32 - jnp.sum(d32 * p32, axis=-1, keepdims=True)), 0).astype(bf)
        dsr = (ds.astype(F32) * scale).astype(bf)
        dq_blocks.append(row_major(bf16_dot("bhts,bhsd->bhtd", dsr, kb).astype(bf)))
        dk = dk.at[..., :s1].add(row_major(bf16_dot("bhdt,bhts->bhds", _minor_t(qb), dsr)))
    dq = jnp.einsum("bhtd->bthd", jnp.concatenate(dq_blocks, axis=2))
    return dq, jnp.einsum("bhds->bshd", dk.astype(bf)), jnp.einsum("bhvs->bshv", dv.astype(bf)), None


_core_bf16.defvjp(_core_bf16_fwd, _core_bf16_bwd)


def _absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, allowed, scale, dt):
    """Absorbed form (facts §4.5): q̃_h = W_UKᵀ q_nope_h ∈ R^c; score = s·(q̃·c_kv + q_rope·k_rope);
    z_h = Σ p c_kv; o_h = W_UV z_h. w_uk [c,H,n], w_uv [c,H,v]; c_kv [B,S,c]; k_rope [B,S,r]."""
    q_lat = _mm("bthn,chn->bthc", q_nope, w_uk, dt)
    raw = (dot_f32("bthc,bsc->bhts", q_lat, c_kv)
           + dot_f32("bthr,bsr->bhts", q_rope, k_rope)).astype(dt)
    probs = _softmax_probs(raw, scale, allowed, dt)
    z = _mm("bhts,bsc->bthc", probs, c_kv, dt)
    return _mm("bthc,chv->bthv", z, w_uv, dt)
