"""SwiGLU MLPs and the grouped-sigmoid MoE (facts §5).

Router in fp32 (§5.1–5.4): logits = x·W_g in fp32, p = σ(logits), selection on p + expert_bias with group-limited
top-k (group score = sum of the top-2 biased scores, keep `topk_group` groups), weights from the *unbiased* p,
renormalised (+1e-20) and scaled by routed_scaling_factor exactly once. Routed expert outputs are in the activation
dtype and combined with the fp32 weights in fp32, cast once (§5.5, HF `moe_infer`).

Two evaluations of the routed experts, same maths per (token, expert) row:
- `routed_experts_dense`: every token through every expert, then a one-hot combine. Readable, static shapes, shards
  over an expert mesh axis — but E/k times the needed compute (16x at Ling3-Tiny: E=128, k=8).
- `routed_experts_blocked` (default, `ROUTED_IMPL`): the N·k (token, expert) assignments are sorted by expert and cut
  into row blocks of one expert each; a loop over the used blocks does [block, D] x [D, I] GEMMs with that expert's
  weights only. Exact (no capacity, no dropping). `jax.lax.ragged_dot` would be the natural primitive, but on XLA:CPU
  (jax 0.10) it lowers to a dense masked product over all E groups (measured 26 s vs 0.12 s for one dense GEMM of the
  same rows at Ling3-Tiny T=512), so the blocks are done by hand.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from parity.jax_ling3 import ops
from parity.jax_ling3.ops import dot_f32, linear, matmul_f32, silu
from parity.jax_ling3.probes import differentiating, tap
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
    pts: dict = {}
    g = tap(pts, f"{prefix}gate_proj", linear(x, p["gate_proj"]))
    u = tap(pts, f"{prefix}up_proj", linear(x, p["up_proj"]))
    y = tap(pts, f"{prefix}down_proj", linear(swiglu(g, u, limit), p["down_proj"]))
    return y, pts


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
    logits = tap({}, "mlp.gate.logits", router_logits(x, w_router))  # probe: dL/dlogits (issue 26)
    idx = select_experts(logits, bias, m) if forced_idx is None else jnp.asarray(forced_idx).astype(jnp.int32)
    return logits, idx, routing_weights(logits, idx, m)


def routed_experts_dense(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray,
                         limit: float | None) -> jnp.ndarray:
    """Readable path: Σ_i w_i · Expert_{e_i}(x) with every expert evaluated on every token (facts §5.5).
    p: experts_gate/up [E,D,I], experts_down [E,I,D]; x [N,D]; idx/w [N,k]."""
    dt = x.dtype
    g = dot_f32("nd,edi->nei", x, p["experts_gate"].astype(dt)).astype(dt)
    u = dot_f32("nd,edi->nei", x, p["experts_up"].astype(dt)).astype(dt)
    y = dot_f32("nei,eid->ned", swiglu(g, u, limit), p["experts_down"].astype(dt)).astype(dt)
    E = p["experts_gate"].shape[0]
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32) * w[..., None].astype(F32), axis=-2)  # [N,E]
    return jnp.einsum("ned,ne->nd", y.astype(F32), combine, precision=HI).astype(dt)


def block_rows(n_assign: int, n_experts: int) -> int:
    """Static row-block size of the blocked path: the power of two nearest the mean rows per expert, in [8, 32].
    Each used expert wastes < 1 block of padding, so bigger blocks give bigger GEMMs but more wasted rows. The cap: for
    GEMMs of up to 32 rows XLA:CPU (its YNNPACK dot, jax 0.10) gives every row the same bits whatever the row count
    (measured at Ling3-Tiny shapes, T=512, for 8, 16, 24, 32 rows; 64 and 128 rows change 120 of 786k outputs),
    so a row's result does not depend on how many rows its expert got, i.e. on T; speed is the same within noise
    (T=2048: 128-row blocks waste ~50 % rows to padding, 32-row blocks ~12 %)."""
    mean = max(1.0, n_assign / n_experts)
    b = 1 << max(0, round(math.log2(mean)))
    return int(min(32, max(8, b)))


def routed_experts_blocked(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None,
                           block: int | None = None) -> jnp.ndarray:
    """Fast path, same result as `routed_experts_dense` (facts §5.5): only the selected experts are computed.

    The A = N·k assignments are stably sorted by expert id; expert e owns sorted rows [start_e, start_e + count_e),
    covered by ceil(count_e / Bs) blocks of Bs rows. A loop over the experts (skipping unused ones) upcasts the
    expert's weights once and runs its blocks, [Bs, D] x [D, I] GEMMs written at their sorted rows. The last block
    of an expert spills onto the next expert's first rows; experts run in ascending order, so the next expert's own
    blocks overwrite them (the buffer has Bs spare rows for the last one). Rows are then put back
    in (token, slot) order and summed with the fp32 weights in fp32, cast once.

    The row buffer is fp32 and receives each block's outputs already rounded to the activation dtype (so it holds
    exactly the dt values): XLA:CPU has no bf16 dynamic-update-slice, so a bf16 buffer was converted to fp32 and
    back in full on every block (3.3 ms per block, a third of the loop at Ling3-Tiny T=512, jax.profiler trace).
    tests/test_jax_moe_fast.py checks the compiled loop for that."""
    dt = x.dtype
    N, D = x.shape
    k = idx.shape[-1]
    E = p["experts_gate"].shape[0]
    A = N * k
    Bs = block or block_rows(A, E)

    e_flat = idx.reshape(A).astype(jnp.int32)
    order = jnp.argsort(e_flat, stable=True)  # sorted row r holds assignment order[r] = (token r//k, slot r%k)
    tok = jnp.concatenate([order // k, jnp.zeros((Bs,), order.dtype)])  # Bs spare rows (token 0, discarded)
    xs = x[tok]  # [A+Bs, D]
    counts = jnp.bincount(e_flat, length=E)
    seg_start = jnp.cumsum(counts) - counts  # first sorted row of each expert
    up = (lambda a: a) if ops.NATIVE_BF16_MATMUL else _upcast_cpu  # native bf16 dots need no fp32 copies
    xs = up(xs)  # once, not per block

    def expert_body(e, buf):  # one used expert: (upcast its weights once, then) its ceil(count/Bs) row blocks
        wg, wu, wd = (up(p[n][e].astype(dt)) for n in ("experts_gate", "experts_up", "experts_down"))

        def block_body(j, buf):
            r0 = seg_start[e] + j * Bs
            xb = jax.lax.dynamic_slice_in_dim(xs, r0, Bs)
            g = matmul_f32(xb, wg).astype(dt)
            u = matmul_f32(xb, wu).astype(dt)
            y = matmul_f32(up(swiglu(g, u, limit)), wd).astype(dt)
            return jax.lax.dynamic_update_slice_in_dim(buf, y.astype(F32), r0, axis=0)

        return jax.lax.fori_loop(0, (counts[e] + Bs - 1) // Bs, block_body, buf)

    def maybe_expert(e, buf):
        return jax.lax.cond(counts[e] > 0, expert_body, lambda e, buf: buf, e, buf)

    ys = jax.lax.fori_loop(0, E, maybe_expert, jnp.zeros((A + Bs, D), F32))
    inv = jnp.argsort(order)  # assignment -> sorted row
    y = ys[inv].reshape(N, k, D)  # fp32 holding dt values
    return jnp.einsum("nkd,nk->nd", y, w.astype(F32), precision=HI).astype(dt)


def routed_experts_blocked_static(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None,
                                  block: int | None = None) -> jnp.ndarray:
    """`routed_experts_blocked` with a static trip count, so reverse-mode AD can go through it (issue 26): the same
    row blocks, the same per-block GEMMs and the same write order (experts ascending, blocks ascending within an
    expert), run as one `lax.scan` over a static upper bound of blocks, A // Bs + E + 1 (each used expert wastes < 1
    block). Block j's expert and first row come from a block table built from the counts; blocks past the last used
    one write into the Bs spare rows (discarded). Same bits as the blocked loop (tests/test_backward_replay.py)."""
    dt = x.dtype
    N, D = x.shape
    k = idx.shape[-1]
    E = p["experts_gate"].shape[0]
    A = N * k
    Bs = block or block_rows(A, E)
    e_flat = idx.reshape(A).astype(jnp.int32)
    order = jnp.argsort(e_flat, stable=True)
    tok = jnp.concatenate([order // k, jnp.zeros((Bs,), order.dtype)])
    # the same values as `_upcast_cpu`'s bit shift (bf16 -> fp32 is exact), but a convert, which AD goes through
    up = (lambda a: a) if ops.NATIVE_BF16_MATMUL else (
        lambda a: a.astype(F32) if a.dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else a)
    xs = up(x[tok])
    counts = jnp.bincount(e_flat, length=E)
    seg_start = jnp.cumsum(counts) - counts
    nblk = (counts + Bs - 1) // Bs
    blk_end = jnp.cumsum(nblk)  # blocks of experts 0..e
    NB = A // Bs + E + 1
    j = jnp.arange(NB)
    e_j = jnp.minimum(jnp.searchsorted(blk_end, j, side="right"), E - 1).astype(jnp.int32)
    valid = j < blk_end[-1]
    r0 = jnp.where(valid, seg_start[e_j] + (j - (blk_end[e_j] - nblk[e_j])) * Bs, A)  # spare rows when past the end

    # each block's expert weights gathered once, outside the loop: the gather's VJP is one scatter-add into the expert
    # stacks, where indexing the stacks inside the loop made every step's VJP add into a full [E, ...] gradient
    # (Ling3-Tiny MLA+MoE at T=128: 32.5 s a backward)
    wblk = tuple(p[n][e_j] for n in ("experts_gate", "experts_up", "experts_down"))

    def body(buf, blk):
        r, w3 = blk
        wg, wu, wd = (up(a.astype(dt)) for a in w3)
        xb = jax.lax.dynamic_slice_in_dim(xs, r, Bs)
        g = matmul_f32(xb, wg).astype(dt)
        u = matmul_f32(xb, wu).astype(dt)
        y = matmul_f32(up(swiglu(g, u, limit)), wd).astype(dt)
        return jax.lax.dynamic_update_slice_in_dim(buf, y.astype(F32), r, axis=0), None

    ys, _ = jax.lax.scan(body, jnp.zeros((A + Bs, D), F32), (r0, wblk))
    inv = jnp.argsort(order)
    y = ys[inv].reshape(N, k, D)
    return jnp.einsum("nkd,nk->nd", y, w.astype(F32), precision=HI).astype(dt)


def _upcast_cpu(a: jnp.ndarray) -> jnp.ndarray:
    """bf16 -> fp32 on CPU by moving the 16 bits up (exact: a bf16 is the top half of its fp32), else unchanged.

    Used when `ops.NATIVE_BF16_MATMUL` is off: `dot_f32` upcasts bf16 operands on CPU anyway; doing it here lets the
    blocked loop convert each expert's weights once, and the bit shift measured ~1.7x faster than XLA:CPU's convert (600
    [1536,512] slabs: 0.96 s vs 1.64 s, 0.51 s with no conversion; load ~9.8 on 2 cores)."""
    if a.dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return a
    bits = jax.lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, F32)


# "blocked" (default) or "dense"; read at trace time (a change needs a fresh jit cache, e.g. jax.clear_caches()).
ROUTED_IMPL = "blocked"


def routed_experts(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None) -> jnp.ndarray:
    """Σ_i w_i · Expert_{e_i}(x), expert outputs in the activation dtype, weighted sum in fp32, cast once (facts §5.5).
    p: experts_gate/up [E,D,I], experts_down [E,I,D]; x [N,D]; idx/w [N,k]. Dispatches on `ROUTED_IMPL`."""
    if ROUTED_IMPL == "dense":
        return routed_experts_dense(p, x, idx, w, limit)
    if differentiating():
        # the blocked loop's trip counts depend on the routing (a while loop), which reverse-mode AD cannot go through
        # (issue 26): a backward trace runs the same blocks with a static trip count
        return routed_experts_blocked_static(p, x, idx, w, limit)
    return routed_experts_blocked(p, x, idx, w, limit)


def moe_block(p: dict, x: jnp.ndarray, spec: LayerSpec, forced_idx=None):
    """MoE block on the post-attention-normed x [B,T,D]. Returns (y, points). Points' top-k are in canonical order
    (ascending expert id per token, weights permuted alike — only the set carries meaning, parity.model.points)."""
    m = spec.model
    B, T, D = x.shape
    logits, idx, w = route(x, p["router"], p["expert_bias"], m, forced_idx)
    order = jnp.argsort(idx, axis=-1)
    idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
    pts: dict = {"mlp.gate.logits": logits, "mlp.gate.topk_idx": idx}
    w = tap(pts, "mlp.gate.topk_weight", w)
    routed = routed_experts(p, x.reshape(B * T, D), idx.reshape(B * T, -1), w.reshape(B * T, -1),
                            spec.routed_limit).reshape(B, T, D)
    routed = tap(pts, "mlp.routed", routed)
    y = routed
    if m.has_shared:
        sh, _ = dense_mlp({k: p[f"shared_{k}"] for k in ("gate_proj", "up_proj", "down_proj")}, x, spec.shared_limit,
                          prefix="mlp.shared_experts.")  # its own names: never tapped as a dense layer's sites
        sh = tap(pts, "mlp.shared_experts", sh)
        y = routed + sh
    return y, pts
