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
  Its backward is its own VJP (`jax.custom_vjp`, `_routed_blocked_bwd`): reverse-mode AD cannot go through the loop's
  routing-dependent trip counts, and plain AD of a static-length form (issue 26) scattered every block's weight
  gradient into the whole [E, ...] stacks (17.8x the twin's autograd at Ling3-Tiny MLA+MoE T=512). The VJP runs
  each used expert's rows in one chunk (no per-block fp32 gradient sums: its bits are not pinned, so it is not
  bound to the forward's <= 32-row blocks), recomputes the chunk's g, u and y there instead of keeping the forward
  loop's buffers as residuals (so a layer VJP, whose primal output is unused, runs no forward loop at all), and
  writes each expert's gradients once, in the HF layout; the primal output is the same loop (`_expert_rows`), so the
  forward bits do not depend on whether a backward follows. In a bf16 layer its products that contract the weights'
  own dims run as bf16 x bf16 -> fp32 dots on the bf16 weights (`BWD_BF16_DOTS`: on a CPU with native bf16 dots
  they are 2-3x the upcast ones). XLA:CPU traps the loops avoid (measured): a `lax.switch` carrying the row
  buffers, and a dynamic slice of a bf16 array (~0.75 GB/s: `_expert_weights` slices uint16 bits).

The readable pair: `routed_experts_dense` and its plain-AD VJP (tests/test_jax_moe_blocked.py, test_jax_moe_vjp.py).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from parity.jax_ling3 import ops
from parity.jax_ling3.ops import dot_f32, linear, matmul_f32, silu
from parity.jax_ling3.probes import tap
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


class _Rows(NamedTuple):
    """The blocked path's row layout (shared by its forward and its VJP): sorted row r holds assignment order[r] =
    (token r // k, slot r % k); expert e owns sorted rows [seg_start[e], seg_start[e] + counts[e]); used[:n_used]
    are the experts with rows, ascending."""
    order: jnp.ndarray  # [A] int
    tok: jnp.ndarray  # [A + Bs] token of each sorted row; Bs spare rows (token 0, discarded)
    counts: jnp.ndarray  # [E]
    seg_start: jnp.ndarray  # [E]
    used: jnp.ndarray  # [E] int32: the used experts first, ascending, then the unused ones
    n_used: jnp.ndarray  # int32


def _sort_rows(idx: jnp.ndarray, n_experts: int, Bs: int) -> _Rows:
    k = idx.shape[-1]
    e_flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(e_flat, stable=True)
    tok = jnp.concatenate([order // k, jnp.zeros((Bs,), order.dtype)])
    counts = jnp.bincount(e_flat, length=n_experts)
    used = jnp.argsort(counts == 0, stable=True).astype(jnp.int32)
    return _Rows(order, tok, counts, jnp.cumsum(counts) - counts, used, jnp.sum(counts > 0).astype(jnp.int32))


def _up():
    """The operand upcast of the expert GEMMs: none with native bf16 dots, else `_upcast_cpu` (bf16 -> fp32, exact)."""
    return (lambda a: a) if ops.NATIVE_BF16_MATMUL else _upcast_cpu


def _expert_weights(stack: jnp.ndarray, dt):
    """e -> stack[e] in dt, upcast as `_up()` does (the same values either way). A bf16 stack is sliced as uint16
    bits: XLA:CPU's dynamic slice of a bf16 array ran at ~0.75 GB/s (2 ms per [1536, 512] expert slab, 3 slabs per
    expert in the forward and 3 in the VJP, measured on the Xeon VM), the uint16 slice at memory speed."""
    up = _up()
    if stack.dtype != jnp.bfloat16 or dt != jnp.bfloat16:
        return lambda e: up(stack[e].astype(dt))
    if up is _upcast_cpu and jax.default_backend() == "cpu":  # `_upcast_cpu` on the bits directly
        bits = jax.lax.bitcast_convert_type(stack, jnp.uint16)
        return lambda e: jax.lax.bitcast_convert_type(bits[e].astype(jnp.uint32) << 16, F32)
    slab = _bf16_slab(stack)
    return lambda e: up(slab(e))


def _bf16_slab(stack: jnp.ndarray):
    """e -> stack[e] of a bf16 stack, sliced as uint16 bits (`_expert_weights`), not upcast."""
    bits = jax.lax.bitcast_convert_type(stack, jnp.uint16)
    return lambda e: jax.lax.bitcast_convert_type(bits[e], jnp.bfloat16)


def _row_slice(a: jnp.ndarray, r0, size: int) -> jnp.ndarray:
    """a[r0:r0+size] (rows), a bf16 array sliced as uint16 bits. XLA:CPU converted each bf16 row array the VJP's
    overflow loop slices to fp32 in full before the loop, whether the loop ran or not (three [16896, 1536] converts,
    0.11 s of the MLA+MoE layer VJP at T = 2048, jax.profiler trace); the bits' slice is taken as it is."""
    if a.dtype != jnp.bfloat16:
        return jax.lax.dynamic_slice_in_dim(a, r0, size)
    bits = jax.lax.bitcast_convert_type(a, jnp.uint16)
    return jax.lax.bitcast_convert_type(jax.lax.dynamic_slice_in_dim(bits, r0, size), jnp.bfloat16)


def _first_holding(sizes: tuple[int, ...], n):
    """Index of the first of the ascending static `sizes` that is >= n (traced n <= sizes[-1])."""
    return jnp.sum(jnp.asarray(sizes) < n).astype(jnp.int32)


def _expert_rows(p: dict, x: jnp.ndarray, rows: _Rows, limit: float | None, Bs: int, save: bool):
    """The blocked loop: every used expert's row blocks, [Bs, D] x [D, I] GEMMs with that expert's weights only.

    A loop over the experts (skipping unused ones) takes the expert's weights once (`_expert_weights`) and runs its
    ceil(count/Bs) blocks, written at their sorted rows. The last block of an expert spills onto the next expert's
    first rows; experts run in ascending order, so the next expert's own blocks overwrite them (the buffer has Bs
    spare rows for the last one). Returns ys [A+Bs, D], and with `save` also the rows' g and u [A+Bs, I] (the VJP's
    residuals). Tail blocks of the next multiple of 8 rows (a `lax.switch` over the sizes) were tried: the same bits
    and no measurable speed-up (GEMMs of <= 32 rows run XLA:CPU's small-matrix kernel either way), at ~12 % more cold
    compile time of a MoE layer's replay (tiny-flash-bf16 layers 0, 1, 3 with backward: 62.2 vs 55.6 s, one core,
    2026-11-28), so the blocks stay Bs rows.

    The buffers are fp32 and receive each block's outputs already rounded to the activation dtype (so they hold
    exactly the dt values): XLA:CPU has no bf16 dynamic-update-slice, so a bf16 buffer was converted to fp32 and
    back in full on every block (3.3 ms per block, a third of the loop at Ling3-Tiny T=512, jax.profiler trace).
    tests/test_jax_moe_fast.py checks the compiled loop for that."""
    dt = x.dtype
    D, I = x.shape[-1], p["experts_gate"].shape[-1]
    E = p["experts_gate"].shape[0]
    R = rows.tok.shape[0]
    up = _up()
    xs = up(x[rows.tok])  # once, not per block
    slabs = [_expert_weights(p[n], dt) for n in ("experts_gate", "experts_up", "experts_down")]

    def expert_body(e, bufs):  # one used expert: (its weights once, then) its ceil(count/Bs) row blocks
        wg, wu, wd = (slab(e) for slab in slabs)

        def block_body(j, bufs):
            r0 = rows.seg_start[e] + j * Bs
            xb = jax.lax.dynamic_slice_in_dim(xs, r0, Bs)
            g = matmul_f32(xb, wg).astype(dt)
            u = matmul_f32(xb, wu).astype(dt)
            y = matmul_f32(up(swiglu(g, u, limit)), wd).astype(dt)
            return tuple(jax.lax.dynamic_update_slice_in_dim(b, v.astype(F32), r0, axis=0)
                         for b, v in zip(bufs, (y, g, u) if save else (y,)))

        return jax.lax.fori_loop(0, (rows.counts[e] + Bs - 1) // Bs, block_body, bufs)

    bufs = (jnp.zeros((R, D), F32),) + ((jnp.zeros((R, I), F32), jnp.zeros((R, I), F32)) if save else ())
    bufs = jax.lax.fori_loop(0, E, lambda e, b: jax.lax.cond(rows.counts[e] > 0, expert_body, lambda e, b: b, e, b),
                             bufs)
    return bufs if save else bufs[0]


def _combine(ys: jnp.ndarray, rows: _Rows, w: jnp.ndarray, dt) -> jnp.ndarray:
    """Rows back in (token, slot) order, summed with the fp32 weights in fp32, cast once (facts §5.5)."""
    N, k = w.shape
    y = ys[jnp.argsort(rows.order)].reshape(N, k, -1)  # fp32 holding dt values
    return jnp.einsum("nkd,nk->nd", y, w.astype(F32), precision=HI).astype(dt)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _routed_blocked(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None, Bs: int,
                    Bb: int):
    rows = _sort_rows(idx, p["experts_gate"].shape[0], Bs)
    return _combine(_expert_rows(p, x, rows, limit, Bs, save=False), rows, w, x.dtype)


def _routed_blocked_fwd(p, x, idx, w, limit, Bs, Bb):
    rows = _sort_rows(idx, p["experts_gate"].shape[0], Bs)
    # the VJP recomputes the rows' g, u and y itself (`_routed_blocked_bwd`), so no residual holds the loop's buffers
    # and a VJP whose primal output is not used (the layer VJP) drops this loop altogether
    return _combine(_expert_rows(p, x, rows, limit, Bs, save=False), rows, w, x.dtype), (p, x, idx, w, rows)


# The VJP's input-side products (dh = dy Wd^T, dx = dg Wg^T + du Wu^T) of a bf16 layer as bf16 x bf16 -> fp32 dots on
# the bf16 weights, not on an fp32 copy of them. Their bits are not pinned (only the forward's are); the products are
# the same, summed in another order. Read at trace time.
BWD_BF16_DOTS = True

# the VJP's chunk sizes below its largest chunk (`bwd_chunk_sizes`): steps of 8 rows up to 32, then ~1.5x apart
_BWD_STEPS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384)


def bwd_chunk_sizes(n_tokens: int, n_assign: int, n_experts: int, cap: int | None = None) -> tuple[int, ...]:
    """Row counts of the VJP's per-expert GEMMs, ascending. The last, its largest chunk, is 4x the mean rows per
    expert (a power of two, >= 32), at most `cap` (default 512) and at most n_tokens rounded up to a multiple of 8 (an
    expert holds at most one row per token: top-k ids are distinct)."""
    mean = max(1.0, n_assign / n_experts)
    top = min(cap or 512, -(-n_tokens // 8) * 8, max(32, 1 << math.ceil(math.log2(4 * mean))))
    return tuple(s for s in _BWD_STEPS if s < top) + (top,)


def _routed_blocked_bwd(limit, Bs, Bb, res, dout):
    """The VJP of the blocked path, expert by expert: each used expert's rows in one GEMM per product (not in the
    forward's blocks), its three weight gradients in fp32, written once into the gradient stacks, rounded once.

    Per row it is the VJP plain AD takes through the forward's roundings: the chunk's g, u, h = swiglu(g, u) and
    y = dt(h · Wd) are recomputed (dw = dout · y per row, in fp32), the row's output cotangent is dt(dout · w) (the
    cotangent of the dt expert output), dh = dt(dy · Wd^T), (dg, du) = swiglu's own VJP, the row's input cotangent
    [dg du] · [Wg Wu]^T in fp32. The rows of a token are summed in fp32 and cast once. The gradients' bits are not
    pinned (the forward's are: `_expert_rows`), so an expert's rows go in one chunk of the smallest of
    `bwd_chunk_sizes` that holds them (a `lax.switch` over static sizes: < 8 rows of padding up to 32 rows, < a
    third above), i.e. one GEMM per product and no fp32 gradient accumulation per expert (a [1536, 1024] fp32 add
    per extra block cost as much as a block's GEMM at Ling3-Tiny). A chunk's rows past its
    expert's count (the spill onto the next experts) get a zero cotangent, and their dx rows are overwritten by the
    next experts' chunks, as in the forward. An expert with more rows than the largest chunk (`Bb`; rare: 4x the
    mean) is redone by a second loop over such experts: all its rows in chunks of Bb, the weight gradients summed in
    fp32, its dx rows written under a mask (the next experts' rows are final by then). The gradients' fp32 sums
    depend on the chunk sizes. As in the forward, no conditional carries a buffer. The weight gradients are computed
    and stacked in the HF layout ([out, in] per expert: dgu^T x, dy^T h) and returned swapped to p's layout, a swap
    the jitted layer VJP undoes for free (`backward.experts_to_hf`). Readable reference: plain AD of
    `routed_experts_dense` (tests/test_jax_moe_vjp.py)."""
    p, x, idx, w, rows = res
    dt = x.dtype
    N, D = x.shape
    k = idx.shape[-1]
    E, _, I = p["experts_gate"].shape
    A = N * k
    sizes = bwd_chunk_sizes(N, A, E, Bb)
    Bb = sizes[-1]
    R = A + Bb  # Bb spare rows for the last expert's spill
    up = _up()
    dout_f = dout.astype(F32)
    names = ("experts_gate", "experts_up", "experts_down")
    inv = jnp.argsort(rows.order)
    dy = (dout_f[:, None, :] * w.astype(F32)[:, :, None]).astype(dt).reshape(A, D)

    def padded(a, rows_in_order):
        return jnp.concatenate([rows_in_order, jnp.zeros((R - rows_in_order.shape[0],) + a.shape[1:], a.dtype)])

    bf16_dots = BWD_BF16_DOTS and dt == jnp.bfloat16 and all(p[n].dtype == jnp.bfloat16 for n in names)
    dys = padded(dy, dy[rows.order])
    dys = dys if bf16_dots else up(dys)
    douts = jnp.concatenate([dout[rows.tok[:A]], jnp.zeros((Bb, D), dout.dtype)])  # each row's unweighted cotangent
    xs = jnp.concatenate([x[rows.tok[:A]], jnp.zeros((Bb, D), dt)])
    xs = xs if bf16_dots else up(xs)
    # gradient stacks in the HF layout [E, out, in] (returned swapped to p's [E, in, out]: `experts_to_hf` in the
    # jitted layer VJP swaps them back, which XLA cancels, so the host gets the HF layout without a transpose), as
    # integer bits when 2-byte (XLA:CPU has no bf16 dynamic-update-slice: see `_expert_rows`)
    bits = {n: jnp.uint16 if p[n].dtype.itemsize == 2 else None for n in names}
    stack0 = tuple(jnp.zeros((E, p[n].shape[2], p[n].shape[1]), bits[n] or p[n].dtype) for n in names)

    def put(stacks, e, gut, gdt):  # gut [2I, D]: the gate and up gradients, gdt [D, I] the down one (HF layouts)
        def one(stack, g, n):
            g = g.astype(p[n].dtype)
            if bits[n] is not None:
                g = jax.lax.bitcast_convert_type(g, bits[n])
            return jax.lax.dynamic_update_index_in_dim(stack, g, e, axis=0)
        return tuple(one(s, g, n) for s, g, n in zip(stacks, (gut[:I], gut[I:], gdt), names))

    def swiglu_split(gu):
        return swiglu(gu[:, :I], gu[:, I:], limit)

    if bf16_dots:  # the expert's weights as they are, bf16 (`_bf16_slab`)
        slabs = [_bf16_slab(p[n]) for n in names]

        def weights(e):
            return tuple(slab(e) for slab in slabs)  # Wg [D, I], Wu [D, I], Wd [I, D]
    else:
        slabs = [_expert_weights(p[n], dt) for n in names]

        def weights(e):
            return jnp.concatenate([slabs[0](e), slabs[1](e)], axis=1), slabs[2](e)  # [D, 2I], [I, D]

    def chunk(e, ws, size, off):  # `size` rows from expert e's row `off`: (dgu^T x, dy^T h, dx rows [Bb, D], dw rows)
        r0 = rows.seg_start[e] + off
        valid = (off + jnp.arange(size)) < rows.counts[e]
        xb = _row_slice(xs, r0, size)
        dyb = jnp.where(valid[:, None], _row_slice(dys, r0, size), 0)
        if bf16_dots:  # bf16 x bf16 -> fp32 products on the bf16 weights
            wg, wu, wd = ws
            gu = jnp.concatenate([ops.bf16_dot("nd,di->ni", xb, wg), ops.bf16_dot("nd,di->ni", xb, wu)], 1).astype(dt)
            h, swiglu_vjp = jax.vjp(swiglu_split, gu)
            y = ops.bf16_dot("ni,id->nd", h, wd).astype(dt)  # the rows' outputs, for dw
            dgu = swiglu_vjp(ops.bf16_dot("nd,id->ni", dyb, wd).astype(dt))[0]  # [size, 2I] in dt
            dxr = ops.bf16_dot("ni,di->nd", dgu[:, :I], wg) + ops.bf16_dot("ni,di->nd", dgu[:, I:], wu)
            gut, gdt = ops.bf16_dot_wgrad(dgu, xb), ops.bf16_dot_wgrad(dyb.astype(dt), h)  # rows contracted
        else:
            wgu, wd = ws
            h, swiglu_vjp = jax.vjp(swiglu_split, matmul_f32(xb, wgu).astype(dt))
            y = matmul_f32(up(h), wd).astype(dt)
            dgu = up(swiglu_vjp(matmul_f32(dyb, wd.T).astype(dt))[0])  # [size, 2I]
            dxr = matmul_f32(dgu, wgu.T)
            gut, gdt = matmul_f32(dgu.T, xb), matmul_f32(dyb.T, up(h))
        dwr = jnp.sum(_row_slice(douts, r0, size).astype(F32) * y.astype(F32), axis=1)
        pad = Bb - size
        return gut, gdt, jnp.pad(dxr, ((0, pad), (0, 0))), jnp.pad(dwr, (0, pad))

    def expert_body(i, carry):  # every used expert, its first min(count, Bb) rows in one chunk
        dxs, dws, stacks = carry
        e = rows.used[i]
        ws = weights(e)
        which = _first_holding(sizes, jnp.minimum(rows.counts[e], Bb))
        gut, gdt, dxr, dwr = jax.lax.switch(which, [partial(chunk, e, ws, t) for t in sizes], 0)
        r0 = rows.seg_start[e]
        return (jax.lax.dynamic_update_slice_in_dim(dxs, dxr, r0, axis=0),
                jax.lax.dynamic_update_slice_in_dim(dws, dwr, r0, axis=0), put(stacks, e, gut, gdt))

    def overflow_body(i, carry):  # an expert with more than Bb rows: all of them, chunks of Bb, fp32 sums
        dxs, dws, stacks = carry
        e = over[i]
        ws = weights(e)

        def one(j, acc):
            gut, gdt, dxs, dws = acc
            g1, g2, dxr, dwr = chunk(e, ws, Bb, j * Bb)
            r0 = rows.seg_start[e] + j * Bb
            mine = (j * Bb + jnp.arange(Bb)) < rows.counts[e]
            # the next experts' rows kept
            dxr = jnp.where(mine[:, None], dxr, jax.lax.dynamic_slice_in_dim(dxs, r0, Bb))
            dwr = jnp.where(mine, dwr, jax.lax.dynamic_slice_in_dim(dws, r0, Bb))
            return (gut + g1, gdt + g2, jax.lax.dynamic_update_slice_in_dim(dxs, dxr, r0, axis=0),
                    jax.lax.dynamic_update_slice_in_dim(dws, dwr, r0, axis=0))

        acc0 = (jnp.zeros((2 * I, D), F32), jnp.zeros((D, I), F32), dxs, dws)
        gut, gdt, dxs, dws = jax.lax.fori_loop(0, (rows.counts[e] + Bb - 1) // Bb, one, acc0)
        return dxs, dws, put(stacks, e, gut, gdt)

    carry = jax.lax.fori_loop(0, rows.n_used, expert_body, (jnp.zeros((R, D), F32), jnp.zeros((R,), F32), stack0))
    over = jnp.argsort(rows.counts <= Bb, stable=True).astype(jnp.int32)  # experts with > Bb rows first
    dxs, dws, stacks = jax.lax.fori_loop(0, jnp.sum(rows.counts > Bb).astype(jnp.int32), overflow_body, carry)
    dx = jnp.sum(dxs[:A][inv].reshape(N, k, D), axis=1).astype(dt)
    dw = dws[:A][inv].reshape(N, k).astype(w.dtype)
    dp = {n: jnp.swapaxes(jax.lax.bitcast_convert_type(s, p[n].dtype) if bits[n] is not None else s, 1, 2)
          for n, s in zip(names, stacks)}
    return dp, dx, None, dw


_routed_blocked.defvjp(_routed_blocked_fwd, _routed_blocked_bwd)


# the VJP's largest chunk of rows (`bwd_chunk_sizes`' cap) when `routed_experts_blocked` is not given one; None: 512
BWD_BLOCK: int | None = None


def routed_experts_blocked(p: dict, x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, limit: float | None,
                           block: int | None = None, bwd_block: int | None = None) -> jnp.ndarray:
    """Fast path, same result as `routed_experts_dense` (facts §5.5): only the selected experts are computed.

    The A = N·k assignments are stably sorted by expert id and cut into row blocks of Bs rows (`block_rows`), one
    expert's rows per block (`_expert_rows`). Exact (no capacity, no dropping). Differentiable through its own VJP
    (`_routed_blocked_bwd`: reverse-mode AD cannot go through the loop's routing-dependent trip counts, and plain AD
    of a static-length form scattered every block's gradient into the whole expert stacks); `bwd_block` caps its
    largest chunk (`bwd_chunk_sizes`)."""
    E = p["experts_gate"].shape[0]
    Bs = block or block_rows(idx.size, E)
    Bb = bwd_chunk_sizes(x.shape[0], idx.size, E, bwd_block or BWD_BLOCK)[-1]
    return _routed_blocked({n: p[n] for n in ("experts_gate", "experts_up", "experts_down")}, x, idx, w, limit, Bs,
                           Bb)


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
