"""Kimi Linear's full attention (`KimiLinearAttention`): DeepSeek-V2 multi-head latent attention "with NoPE".

Read from the built-in: q = q_proj(x) (or q_b_proj(RMSNorm(q_a_proj(x))) with q_lora_rank), split per head into
[nope | rope]; kv_a_proj_with_mqa(x) = [c | k_rot] with c normalised by kv_a_layernorm (eps 1e-6, the class default)
and k_rot one shared head; kv_b_proj(c) = per-head [k_nope | v]. The "rope" dims get **no rotation at all**: the
module takes no position embeddings and `KimiLinearModel` builds no rotary module; K = [k_nope | k_rot] per head,
causal softmax at scale qk_head_dim^-1/2, then `o_proj`. Unlike Ling3's MLA (facts §4) there is no head gate
(no g_proj) and the output projection is `o_proj`, not `dense`. The attention maths itself (scores in fp32 from the
rounded product, softmax in fp32 cast back — the eager path) is Ling3's `mla._naive`, reused. Decode continues from
a cache of the past tokens' keys and values (`mla_attention(..., cache=...)`).
"""

from __future__ import annotations

import jax.numpy as jnp

from parity.jax_ling3.mla import _naive as causal_attention  # same maths as the built-in's eager attention
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.ops import linear
from parity.jax_kimi.spec import MLA_NORM_EPS, KimiLayerSpec


def mla_attention(p: dict, x: jnp.ndarray, spec: KimiLayerSpec, cache: tuple | None = None):
    """MLA block on the layer-normed x [B,T,D]. Returns (out [B,T,D], points, cache). Without `cache` the T tokens
    start the sequence (causal over them); with `cache` = (k_nope [B,S,H,n], k_rot [B,S,r], v [B,S,H,vd]) of the S
    tokens before, they continue it (decode): each new token attends to the S cached tokens and to the new ones up
    to itself, as the built-in's `DynamicCache` (it caches the per-head K = [k_nope | k_rot] and V; with no rotation
    the cached keys do not depend on positions). The returned cache holds all S + T tokens."""
    m = spec.model
    dt = x.dtype
    B, T, _ = x.shape
    H, n, r, vd, c = m.mla_heads, m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank
    pts: dict[str, jnp.ndarray] = {}  # the projections' outputs, named by the built-in's module paths
    if m.q_lora_rank is None:
        q = pts["self_attn.q_proj"] = linear(x, p["q_proj"])
    else:
        qa = pts["self_attn.q_a_proj"] = linear(x, p["q_a_proj"])
        qn = pts["self_attn.q_a_layernorm"] = rms_norm(qa, p["q_a_layernorm"], MLA_NORM_EPS)
        q = pts["self_attn.q_b_proj"] = linear(qn, p["q_b_proj"])
    q = q.reshape(B, T, H, n + r)
    kv_a = pts["self_attn.kv_a_proj_with_mqa"] = linear(x, p["kv_a_proj_with_mqa"])
    c_kv = pts["self_attn.kv_a_layernorm"] = rms_norm(kv_a[..., :c], p["kv_a_layernorm"], MLA_NORM_EPS)
    k_rot = kv_a[..., c:]  # [B,T,r]: shared by all heads, not rotated (NoPE)
    kv = pts["self_attn.kv_b_proj"] = linear(c_kv, p["kv_b_proj"])
    kv = kv.reshape(B, T, H, n + vd)
    k_nope, v = kv[..., :n], kv[..., n:]
    S = 0
    if cache is not None:
        S = cache[0].shape[1]
        k_nope, k_rot, v = (jnp.concatenate([old, new], axis=1) for old, new in zip(cache, (k_nope, k_rot, v)))
    allowed = jnp.arange(S + T)[None, :] <= S + jnp.arange(T)[:, None]  # [T, S+T]: the past and the causal new
    core = causal_attention(q[..., :n], q[..., n:], k_nope, v, k_rot, allowed, m.attn_scale, dt)
    core = core.reshape(B, T, H * vd)
    out = pts["self_attn.o_proj"] = linear(core, p["o_proj"])
    pts["self_attn.core"] = core
    return out, pts, (k_nope, k_rot, v)
