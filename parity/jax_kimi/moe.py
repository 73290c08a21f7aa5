"""Kimi Linear's MoE (`KimiLinearTopkRouter`, `KimiLinearMoE`, `KimiLinearExperts`) and dense MLP (`KimiLinearMLP`).

Router (fp32 throughout): logits = x·W in fp32, p = σ(logits), choice = p + e_score_correction_bias, group score =
sum of a group's top 2 choice scores, keep `topk_group` groups, top-k experts by choice — Ling3's
`select_experts`, reused (same rule, facts §5.3). Weights from the *unbiased* p; renormalised (+1e-20) only when
`norm_topk_prob` (Ling3's official code always renormalises for k > 1, facts §5.4: the one difference), then scaled
once by `routed_scaling_factor`.

Routed experts: SwiGLU per expert in the activation dtype (Ling3's routed-expert functions, reused). The combine
follows `KimiLinearExperts.forward` (eager): each (token, expert) output is multiplied by its fp32 weight, cast to
the activation dtype, and `index_add_`-ed into a zero buffer in that dtype, experts in ascending id order — so in
bf16 every partial sum is rounded (Ling3's `moe_infer` sums in fp32 and casts once). Shared experts: one SwiGLU of
width moe_intermediate_size · n_shared_experts on the same input, added in the activation dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.jax_ling3.moe import dense_mlp, router_logits, routed_experts, select_experts
from parity.jax_kimi.spec import KimiLayerSpec, KimiModelSpec

F32 = jnp.float32
ROUTER_EPS = 1e-20  # the built-in's renormalisation denominator term (`topk_weights.sum() + 1e-20`)


def routing_weights(logits: jnp.ndarray, idx: jnp.ndarray, m: KimiModelSpec) -> jnp.ndarray:
    """`KimiLinearTopkRouter`'s weights at the chosen ids [..., k]: σ(logits) gathered, renormalised iff
    norm_topk_prob, times routed_scaling_factor (fp32)."""
    w = jnp.take_along_axis(jax.nn.sigmoid(logits), idx, axis=-1)
    if m.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + ROUTER_EPS)
    return w * m.routed_scaling


def route(x: jnp.ndarray, p: dict, m: KimiModelSpec):
    """(logits fp32 [N,E], ids int32 [N,k] ascending per token, weights fp32 [N,k] permuted alike) for x [N,D]."""
    logits = router_logits(x, p["router"])
    # reads num_experts, n_group, topk_group, top_k (the same names as Ling3's ModelSpec); sorted: ascending expert
    # id is the built-in's accumulation order (and the dumps' canonical top-k order, DESIGN §4)
    idx = jnp.sort(select_experts(logits, p["expert_bias"], m), axis=-1)
    return logits, idx, routing_weights(logits, idx, m)


def routed_sum(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """Σ over a token's experts in ascending id order, accumulated in x.dtype as the built-in's `index_add_`:
    each slot's term dt(Expert_e(x) · w) is Ling3's routed-expert evaluation with that one slot (its fp32 combine of
    a single term is exactly that cast); idx [N,k] ascending per token."""
    acc = None
    for j in range(idx.shape[-1]):
        term = routed_experts(p, x, idx[:, j:j + 1], w[:, j:j + 1], None)
        acc = term if acc is None else (acc + term).astype(x.dtype)  # 0 + term is exact: start from the first term
    return acc


def moe_block(p: dict, x: jnp.ndarray, spec: KimiLayerSpec, forced_idx: jnp.ndarray | None = None):
    """`KimiLinearMoE` on the post-attention-normed x [B,T,D]. Returns (y, points). `forced_idx` [B,T,k]: route to
    these experts (another run's choice, e.g. the built-in's: a near-tie decided the other way then does not hide
    what follows it), weighted by this run's own router scores."""
    m = spec.model
    B, T, D = x.shape
    logits, idx, w = route(x.reshape(B * T, D), p, m)
    if forced_idx is not None:
        idx = jnp.sort(forced_idx.reshape(B * T, -1).astype(jnp.int32), axis=-1)
        w = routing_weights(logits, idx, m)
    routed = routed_sum(p, x.reshape(B * T, D), idx, w).reshape(B, T, D)
    shared, _ = dense_mlp({n: p[f"shared_{n}"] for n in ("gate_proj", "up_proj", "down_proj")}, x)
    pts = {"mlp.gate.logits": logits.reshape(B, T, -1), "mlp.gate.topk_idx": idx.reshape(B, T, -1),
           "mlp.gate.topk_weight": w.reshape(B, T, -1), "mlp.routed": routed, "mlp.shared_experts": shared}
    return routed + shared, pts


def mlp_block(p: dict, x: jnp.ndarray, spec: KimiLayerSpec, forced_idx: jnp.ndarray | None = None):
    """The layer's MLP: `KimiLinearMoE` (routing forced to `forced_idx` if given) or the dense `KimiLinearMLP`
    (SwiGLU, no clamp). Returns (y, points)."""
    if spec.moe:
        return moe_block(p, x, spec, forced_idx)
    y, _ = dense_mlp(p, x)
    return y, {}
