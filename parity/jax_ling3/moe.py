"""SwiGLU MLPs and the grouped-sigmoid MoE (facts §5).

Router in fp32 (§5.1–5.4): logits = x·W_g in fp32, p = σ(logits), selection on p + expert_bias with group-limited
top-k (group score = sum of the top-2 biased scores, keep `topk_group` groups), weights from the *unbiased* p,
renormalised (+1e-20) and scaled by routed_scaling_factor exactly once. Routed experts are evaluated for every expert
(dense over E: simple, static shapes, shards over an expert mesh axis) and combined with the fp32 weights in fp32,
cast once (§5.5, HF `moe_infer`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.jax_ling3.ops import dot_f32, linear, silu
from parity.jax_ling3.spec import LayerSpec, ModelSpec

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST


def swiglu(g: jnp.ndarray, u: jnp.ndarray, limit: float | None) -> jnp.ndarray:
    """silu(g) ⊙ u, with the clamp of facts §5.7 when `limit` is set: min(silu(g), L) ⊙ clip(u, −L, L)."""
    a = silu(g)
    if limit:
        a = jnp.minimum(a, jnp.asarray(limit, a.dtype))
        u = jnp.clip(u, -jnp.asarray(limit, u.dtype), jnp.asarray(limit, u.dtype))
    return a * u


def dense_mlp(p: dict, x: jnp.ndarray, limit: float | None = None, prefix: str = "mlp."):
    """down(swiglu(gate x, up x)) (facts §5.6); p: gate_proj/up_proj [D,I], down_proj [I,D]. Returns (y, points)."""
    g = linear(x, p["gate_proj"])
    u = linear(x, p["up_proj"])
    y = linear(swiglu(g, u, limit), p["down_proj"])
    return y, {f"{prefix}gate_proj": g, f"{prefix}up_proj": u, f"{prefix}down_proj": y}


def router_logits(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """fp32 router GEMM `x.float() @ W.float()` (facts §5.1); w [D,E]."""
    return jnp.matmul(x.astype(F32), w.astype(F32), precision=HI)


def select_experts(logits: jnp.ndarray, bias: jnp.ndarray, m: ModelSpec) -> jnp.ndarray:
    """Group-limited top-k on σ(logits) + bias (facts §5.2–5.3). logits [..., E] fp32 -> ids [..., k] int32."""
    E, G = m.num_experts, m.n_group
    choice = jax.nn.sigmoid(logits) + bias.astype(F32)
    grouped = choice.reshape(*choice.shape[:-1], G, E // G)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # sum of the top-2 biased scores per group
    _, keep = jax.lax.top_k(group_score, m.topk_group)
    kept = jnp.any(jax.nn.one_hot(keep, G, dtype=bool), axis=-2)  # [..., G]
    masked = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    return jax.lax.top_k(masked, m.top_k)[1].astype(jnp.int32)


def routing_weights(logits: jnp.ndarray, idx: jnp.ndarray, m: ModelSpec) -> jnp.ndarray:
    """Unbiased σ(logits) at the chosen ids, renormalised when k > 1 (the official code ignores norm_topk_prob),
    scaled once by routed_scaling_factor (facts §5.4). fp32 [..., k]."""
    w = jnp.take_along_axis(jax.nn.sigmoid(logits), idx, axis=-1)
    if m.top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * m.routed_scaling


def route(x: jnp.ndarray, w_router: jnp.ndarray, bias: jnp.ndarray, m: ModelSpec, forced_idx=None):
    """(logits fp32 [...,E], ids int32 [...,k], weights fp32 [...,k]); `forced_idx` replaces the selection
    (forced routing: same weight maths on the given experts, DESIGN §6)."""
    logits = router_logits(x, w_router)
    idx = select_experts(logits, bias, m) if forced_idx is None else jnp.asarray(forced_idx).astype(jnp.int32)
    return logits, idx, routing_weights(logits, idx, m)


def routed_experts(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None) -> jnp.ndarray:
    """Σ_i w_i · Expert_{e_i}(x), expert outputs in the activation dtype, weighted sum in fp32, cast once (facts §5.5).
    p: experts_gate/up [E,D,I], experts_down [E,I,D]; x [N,D]; idx/w [N,k]."""
    dt = x.dtype
    g = dot_f32("nd,edi->nei", x, p["experts_gate"].astype(dt)).astype(dt)
    u = dot_f32("nd,edi->nei", x, p["experts_up"].astype(dt)).astype(dt)
    y = dot_f32("nei,eid->ned", swiglu(g, u, limit), p["experts_down"].astype(dt)).astype(dt)
    E = p["experts_gate"].shape[0]
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32) * w[..., None].astype(F32), axis=-2)  # [N,E]
    return jnp.einsum("ned,ne->nd", y.astype(F32), combine, precision=HI).astype(dt)


def moe_block(p: dict, x: jnp.ndarray, spec: LayerSpec, forced_idx=None):
    """MoE block on the post-attention-normed x [B,T,D]. Returns (y, points). Points' top-k are in canonical order
    (ascending expert id per token, weights permuted alike — only the set carries meaning, parity.points)."""
    m = spec.model
    B, T, D = x.shape
    logits, idx, w = route(x, p["router"], p["expert_bias"], m, forced_idx)
    order = jnp.argsort(idx, axis=-1)
    idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
    routed = routed_experts(p, x.reshape(B * T, D), idx.reshape(B * T, -1), w.reshape(B * T, -1),
                            spec.routed_limit).reshape(B, T, D)
    pts = {"mlp.gate.logits": logits, "mlp.gate.topk_idx": idx, "mlp.gate.topk_weight": w, "mlp.routed": routed}
    y = routed
    if m.has_shared:
        sh, _ = dense_mlp({k: p[f"shared_{k}"] for k in ("gate_proj", "up_proj", "down_proj")}, x, spec.shared_limit)
        pts["mlp.shared_experts"] = sh
        y = routed + sh
    return y, pts
