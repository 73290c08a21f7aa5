"""KDA linear attention (facts §3): short conv, gate, L2 norm, and the delta-rule recurrence in three forms.

Layouts follow fla: q, k `[B,T,H,K]`, v `[B,T,H,V]`, g (log-space decay, already gated) `[B,T,H,K]`, beta `[B,T,H]`,
state `[B,H,K,V]` (fp32). The recurrence (facts §3.6), per head, for t = 1..T:
    S ← diag(exp g_t) S ;  u = β_t (v_t − Sᵀ k_t) ;  S ← S + k_t u_tᵀ ;  o_t = Sᵀ (s·q_t)

- `kda_naive`     : the recurrence written out in a Python loop (readable reference, small T only).
- `kda_recurrent` : the same with `lax.scan` — the decode path (one token or many).
- `kda_chunked`   : chunk-parallel WY/UT form (chunk 64, any T, initial state in, final state out) — the prefill path.

All three run in fp32 (facts §8: q/k l2norm, decay and state fp32 inside the kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from parity.jax_ling3.norms import gated_rms_norm, l2_normalize
from parity.jax_ling3.ops import linear
from parity.jax_ling3.probes import tap
from parity.jax_ling3.spec import LayerSpec

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST  # fp32 contractions must stay fp32 on TPU too
CHUNK = 64
# Heads are independent, so `kda_chunked` runs its chunk loop over groups of this many heads (lax.map): only that
# many heads' pairwise-decay tensors [C, C, K] (2 MiB fp32 per head at C=64, K=128) are live at once. Ling3-Tiny
# (16 heads) at T=128: XLA temporaries 71 -> 23 MB with 4 heads per step, outputs bit-identical
# (tests/test_jax_kda_memory.py); single-core time 0.73 -> 0.53 s at T=512 (better cache reuse). None = all heads.
HEADS_PER_STEP: int | None = 4


# ------------------------------------------------------------------------------------------------ gate, conv
def kda_gate(a: jnp.ndarray, A_log: jnp.ndarray, dt_bias: jnp.ndarray, lower_bound: float | None,
             softplus=jax.nn.softplus) -> jnp.ndarray:
    """Log-space decay g [B,T,H,d] in fp32 from the raw f_proj output a [B,T,H,d] (facts §3.5):
    lower-bound form  g = lb·σ(exp(A_log_h)·(a + dt_bias))  (Ling3), or, with lb None, the softplus form
    g = −exp(A_log_h)·softplus(a + dt_bias), `softplus` the formula the mirrored model uses (default: the stable
    one; Kimi Linear's built-in computes its own, `parity.jax_kimi.kda.builtin_softplus`)."""
    H, d = a.shape[-2], a.shape[-1]
    x = a.astype(F32) + dt_bias.astype(F32).reshape(H, d)
    rate = jnp.exp(A_log.astype(F32)).reshape(H, 1)
    if lower_bound is None:
        return -rate * softplus(x)
    return lower_bound * jax.nn.sigmoid(rate * x)


def short_conv(x: jnp.ndarray, w: jnp.ndarray, cache: jnp.ndarray | None = None,
               fused: bool = True) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Causal depthwise conv + SiLU (facts §3.2), fp32 inside, output cast to x.dtype (as the fused kernels).

    x [B,T,P]; w [P,W] (w[:, W-1] multiplies the current token); cache [B,P,W] = the last W inputs (fla convention,
    facts §3.11) or None for zero history. Returns (y [B,T,P], new cache [B,P,W] in x.dtype). `fused=False`: the conv
    output is rounded to x.dtype before the SiLU, which is rounded again — an unfused conv1d then activation, as
    transformers' torch fallbacks (`causal_conv1d_fn` / `causal_conv1d_update` of its Kimi Linear, CPU without
    kernels) compute it; the same values in fp32."""
    B, T, P = x.shape
    W = w.shape[-1]
    hist = jnp.zeros((B, P, W), x.dtype) if cache is None else cache.astype(x.dtype)
    full = jnp.concatenate([hist, jnp.swapaxes(x, 1, 2)], axis=-1)  # [B,P,W+T]
    ff = full.astype(F32)
    wf = w.astype(F32)
    # y_t = Σ_j w[:, j] · x_{t-W+1+j}; in `full` token t sits at index W+t, so tap j reads index t+1+j.
    y = sum(wf[None, :, j, None] * ff[:, :, 1 + j: 1 + j + T] for j in range(W))
    if not fused:
        y = y.astype(x.dtype).astype(F32)
    y = (y * jax.nn.sigmoid(y)).astype(x.dtype)
    return jnp.swapaxes(y, 1, 2), full[:, :, -W:]


# ------------------------------------------------------------------------------------------------ recurrence
def _init_state(q, v, initial_state):
    B, _, H, K = q.shape
    V = v.shape[-1]
    return jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)


def kda_naive(q, k, v, g, beta, scale: float, initial_state=None):
    """The recurrence of facts §3.6, one token at a time in a Python loop (readable reference; not for long T).
    Returns (o [B,T,H,V] fp32, final state [B,H,K,V] fp32)."""
    q, k, v, g, beta = (t.astype(F32) for t in (q, k, v, g, beta))
    S = _init_state(q, v, initial_state)
    outs = []
    for t in range(q.shape[1]):
        S = S * jnp.exp(g[:, t])[..., None]  # decay along K, per channel
        kv = jnp.einsum("bhkv,bhk->bhv", S, k[:, t], precision=HI)  # Sᵀ k
        u = beta[:, t][..., None] * (v[:, t] - kv)  # delta-rule write
        S = S + k[:, t][..., None] * u[..., None, :]  # S += k uᵀ
        outs.append(jnp.einsum("bhkv,bhk->bhv", S, q[:, t] * scale, precision=HI))  # read-out after the update
    return jnp.stack(outs, axis=1), S


def kda_recurrent(q, k, v, g, beta, scale: float, initial_state=None):
    """`kda_naive` as a `lax.scan` over time (decode: one token or many). Same signature and results."""
    q, k, v, g, beta = (t.astype(F32) for t in (q, k, v, g, beta))
    S0 = _init_state(q, v, initial_state)

    def step(S, inp):
        qt, kt, vt, gt, bt = inp
        S = S * jnp.exp(gt)[..., None]
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt, precision=HI))
        S = S + kt[..., None] * u[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt * scale, precision=HI)

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v, g, beta))
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


def kda_chunked(q, k, v, g, beta, scale: float, initial_state=None, chunk: int = CHUNK,
                heads_per_step: int | None = HEADS_PER_STEP, inter_dtype: str = "float32"):
    """Chunk-parallel form (WY/UT transform), exact in exact arithmetic. Any T (padded to a multiple of `chunk` with
    g = 0, β = 0, k = q = v = 0, which leaves outputs and the state untouched). Heads are computed
    `heads_per_step` at a time (memory only, see `HEADS_PER_STEP`; None or ≥ H: all at once).

    Within a chunk with cumulative log decay G_t = Σ_{s≤t} g_s and start state S0 (per head):
      A_ts  = β_t Σ_i k_t,i k_s,i e^{G_t,i − G_s,i}     (s < t)        M = I + A (unit lower triangular)
      u     = M⁻¹ diag(β) (v − (k ⊙ e^G) S0)             the delta-rule writes of the chunk
      o_t   = (s q_t ⊙ e^{G_t})ᵀ S0 + Σ_{s≤t} (s q_t · (k_s ⊙ e^{G_t − G_s})) u_s
      S_end = diag(e^{G_C}) S0 + Σ_s (k_s ⊙ e^{G_C − G_s}) u_sᵀ
    Pairwise decays are formed as exp(G_t − G_s) with s ≤ t (≤ 1), never as e^{G_t}·e^{−G_s}, which overflows fp32
    over a chunk (g ≥ −5 per step, 64 steps).

    `inter_dtype` "bfloat16" rounds the intermediates fla's chunked kernels store in the input dtype (a semantic fork,
    `parity.model.semantics` `kda_chunk_precision`; the list with file:line is in `parity.torch_ref.fla_cpu`): see
    `_chunk_step_rounded`. "float32" (default) keeps everything fp32."""
    if inter_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"kda_chunked: inter_dtype {inter_dtype!r}: expected 'float32' or 'bfloat16'")
    B, T, H, K = q.shape
    hs = heads_per_step
    if hs and hs < H and H % hs == 0:  # the same computation per group of hs heads, one group at a time
        G = H // hs
        S0 = _init_state(q, v, initial_state)

        def split(t):  # [B, T, H, ...] -> [G, B, T, hs, ...]
            return jnp.moveaxis(t.reshape(B, T, G, hs, *t.shape[3:]), 2, 0)

        o, S = jax.lax.map(lambda a: kda_chunked(*a[:5], scale, a[5], chunk, None, inter_dtype),
                           (*(split(t) for t in (q, k, v, g, beta)), S0.reshape(B, G, hs, K, -1).swapaxes(0, 1)))
        return jnp.moveaxis(o, 0, 2).reshape(B, T, H, -1), jnp.moveaxis(S, 0, 1).reshape(B, H, K, -1)
    q, k, v, g, beta = (t.astype(F32) for t in (q, k, v, g, beta))
    V = v.shape[-1]
    S0 = _init_state(q, v, initial_state)
    n = -(-T // chunk)
    pad = n * chunk - T

    def to_chunks(t):  # [B,T,H,...] -> [n, B, H, C, ...]
        t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        t = t.reshape(B, n, chunk, *t.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(t, 1, 0), 3, 2)

    C = chunk
    incl = jnp.tril(jnp.ones((C, C), bool))  # s <= t
    strict = jnp.tril(jnp.ones((C, C), bool), -1)  # s < t
    if inter_dtype == "bfloat16":
        qc, kc, vc, gc, bc = (to_chunks(t) for t in (_bf16(q), _bf16(k), v, g, beta))  # q̂, k̂ leave l2norm in bf16
        step_r = _chunk_step_rounded(scale, incl, strict)
        S, o = jax.lax.scan(step_r, S0, (qc, kc, vc, gc, bc))
        o = jnp.moveaxis(o, 0, 1)
        return jnp.swapaxes(o, 2, 3).reshape(B, n * C, H, V)[:, :T], S
    qc, kc, vc, gc, bc = (to_chunks(t) for t in (q * scale, k, v, g, beta))

    def step(S, inp):
        qi, ki, vi, gi, bi = inp  # [B,H,C,K], [B,H,C,K], [B,H,C,V], [B,H,C,K], [B,H,C]
        G = jnp.cumsum(gi, axis=-2)
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B,H,C(t),C(s),K]
        decay = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
        kk = jnp.einsum("bhtk,bhsk,bhtsk->bhts", ki, ki, decay, precision=HI)
        A = jnp.where(strict, bi[..., :, None] * kk, 0.0)
        M = A + jnp.eye(C, dtype=F32)
        eG = jnp.exp(G)
        rhs_w = bi[..., None] * (ki * eG)  # diag(β)(k ⊙ e^G)
        rhs_u = bi[..., None] * vi
        Wm = solve_unit_lower(M, rhs_w)
        Um = solve_unit_lower(M, rhs_u)
        u = Um - jnp.einsum("bhck,bhkv->bhcv", Wm, S, precision=HI)
        aqk = jnp.where(incl, jnp.einsum("bhtk,bhsk,bhtsk->bhts", qi, ki, decay, precision=HI), 0.0)
        o = jnp.einsum("bhtk,bhkv->bhtv", qi * eG, S, precision=HI) + jnp.einsum("bhts,bhsv->bhtv", aqk, u,
                                                                                 precision=HI)
        Gend = G[..., -1:, :]  # [B,H,1,K]
        S = jnp.exp(Gend[..., 0, :])[..., None] * S + jnp.einsum("bhsk,bhsv->bhkv", ki * jnp.exp(Gend - G), u,
                                                                   precision=HI)
        return S, o

    S, o = jax.lax.scan(step, S0, (qc, kc, vc, gc, bc))  # o [n,B,H,C,V]
    o = jnp.moveaxis(o, 0, 1)  # [B,n,H,C,V]
    o = jnp.swapaxes(o, 2, 3).reshape(B, n * C, H, V)[:, :T]
    return o, S


def solve_unit_lower(M: jnp.ndarray, R: jnp.ndarray) -> jnp.ndarray:
    """M⁻¹ R for unit lower triangular M [..., C, C] and R [..., C, N] (`solve_triangular`), on CPU as one LAPACK
    trsm call per matrix.

    Why: jaxlib 0.10's CPU trsm kernel splits a batch of matrices over XLA's intra-op thread pool and blocks until
    the pieces are done (`jax::ParallelBatchMap`, taken when batch·C²·N ≥ 200 000 — every KDA chunk solve at
    Ling3-Tiny shapes). When the thunk executor runs as many such solves at once as the pool has threads (the two
    independent solves of a chunk, and more in a VJP), every worker waits for pieces queued behind the waiters: a
    deadlock with zero CPU (the chunked KDA layer backward at Ling3-Tiny shapes, T ≥ 128, on 2 cores; gdb: both
    `tf_XLAEigen` workers in `BlockingCounter::Wait` under `lapack_strsm_ffi`). A one-matrix call runs inline, never
    waits, so the solve and its VJP (one transposed solve per matrix) cannot deadlock. Same bits: the batched kernel
    calls the same strsm on each matrix in turn (tests/test_jax_kda_memory.py compares). Other backends: one batched
    call."""
    if jax.default_backend() != "cpu" or M.ndim == 2:
        return solve_triangular(M, R, lower=True, unit_diagonal=True)
    batch = M.shape[:-2]
    Mf = M.reshape(-1, *M.shape[-2:])
    Rf = R.reshape(-1, *R.shape[-2:])
    X = jax.lax.map(lambda mr: solve_triangular(mr[0], mr[1], lower=True, unit_diagonal=True), (Mf, Rf))
    return X.reshape(*batch, *R.shape[-2:])


def _bf16(x: jnp.ndarray) -> jnp.ndarray:
    """x rounded to bf16 (round to nearest even), kept in fp32 for the fp32 arithmetic that follows."""
    return x.astype(jnp.bfloat16).astype(F32)


def _chunk_step_rounded(scale: float, incl, strict):
    """One chunk of `kda_chunked` with fla's bf16 rounding points (fla_cpu's list, numbered alike): Aqk (2),
    (I + A)⁻¹ (3), u (4), w (5), k ⊙ e^{G_C − G} (6), the state entering the chunk as the dots read it (7), the new
    values (8), q ⊙ e^G (9); the carried state and every accumulation stay fp32. q, k arrive rounded (1)."""
    def step(S, inp):
        qi, ki, vi, gi, bi = inp
        C = qi.shape[-2]
        G = jnp.cumsum(gi, axis=-2)
        diff = G[..., :, None, :] - G[..., None, :, :]
        decay = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
        A = jnp.where(strict, bi[..., :, None] * jnp.einsum("bhtk,bhsk,bhtsk->bhts", ki, ki, decay, precision=HI), 0.0)
        eye = jnp.broadcast_to(jnp.eye(C, dtype=F32), A.shape)
        Akk = _bf16(solve_unit_lower(A + jnp.eye(C, dtype=F32), eye))  # 3
        Aqk = _bf16(scale * jnp.where(incl, jnp.einsum("bhtk,bhsk,bhtsk->bhts", qi, ki, decay, precision=HI), 0.0))
        eG = jnp.exp(G)
        u = _bf16(jnp.einsum("bhts,bhsv->bhtv", Akk, _bf16(bi[..., None] * vi), precision=HI))  # 4
        w = _bf16(jnp.einsum("bhts,bhsk->bhtk", Akk, _bf16(bi[..., None] * ki * eG), precision=HI))  # 5
        Gend = G[..., -1:, :]
        kg = _bf16(ki * jnp.exp(Gend - G))  # 6
        h = _bf16(S)  # 7
        v_new = _bf16(u - jnp.einsum("bhtk,bhkv->bhtv", w, h, precision=HI))  # 8
        o = scale * jnp.einsum("bhtk,bhkv->bhtv", _bf16(qi * eG), h, precision=HI) \
            + jnp.einsum("bhts,bhsv->bhtv", Aqk, v_new, precision=HI)  # 9 (the caller rounds o)
        S = jnp.exp(Gend[..., 0, :])[..., None] * S + jnp.einsum("bhsk,bhsv->bhkv", kg, v_new, precision=HI)
        return S, o

    return step


KERNELS = {"naive": kda_naive, "recurrent": kda_recurrent, "chunked": kda_chunked}


def chunk_options(mode: str, spec: LayerSpec) -> dict:
    """Extra keyword arguments of `KERNELS[mode]`: the chunk kernel's intermediate precision where the spec departs
    from fp32 (a semantic fork, parity.model.semantics); none otherwise, so a kernel wrapped with the plain signature
    (the mutation catalogue's) keeps working on the default path."""
    if mode == "chunked" and spec.kda_chunk_dtype != "float32":
        return {"inter_dtype": spec.kda_chunk_dtype}
    return {}


# ------------------------------------------------------------------------------------------------ the layer
def _at_precision(x: jnp.ndarray, dtype: str) -> jnp.ndarray:
    """x (fp32) as the recurrence receives it: unchanged for "float32"; rounded to bf16 (and kept in that dtype, as
    the built-in hands it over) for "bfloat16"."""
    return x if dtype == "float32" else x.astype(jnp.bfloat16)


def kda_attention(p: dict, x: jnp.ndarray, spec: LayerSpec, state: tuple | None = None):
    """KDA attention block on the layer-normed input x [B,T,D] (facts §3.1–3.8).

    p: JAX-layout params (`weights.convert_layer`): q/k/v/f/g_proj [D,P], b_proj [D,H], q/k/v_conv1d [P,W],
    A_log [H] fp32, dt_bias [P] fp32, o_norm [d], o_proj [P,D].
    state: None (start of sequence) or (S [B,H,K,V] fp32, conv [3,B,P,W] = q,k,v histories).
    Returns (out [B,T,D], points, new_state). Kernel choice: `spec.kda_mode` ("auto" mirrors the official code:
    recurrent when T <= 64, chunked beyond, facts §3.10)."""
    m = spec.model
    B, T, _ = x.shape
    H, d = m.num_heads, m.kda_head_dim
    S0, conv0 = (None, (None, None, None)) if state is None else (state[0], tuple(state[1]))
    pts: dict[str, jnp.ndarray] = {}
    qkv, convs = [], []
    for name, c0 in zip("qkv", conv0):
        proj = tap(pts, f"attention.{name}_proj", linear(x, p[f"{name}_proj"]))
        y, c = short_conv(proj, p[f"{name}_conv1d"], c0)
        y = tap(pts, f"attention.{name}_conv1d", y)
        qkv.append(y.reshape(B, T, H, d))
        convs.append(c)
    a = linear(x, p["f_proj"])
    a = tap(pts, "attention.f_proj", a)
    g = kda_gate(a.reshape(B, T, H, d), p["A_log"], p["dt_bias"], m.lower_bound)  # fp32 (ORC §5)
    g = _at_precision(g, spec.kda_gate_dtype)  # the built-in's bf16 rounding, on request (parity.model.semantics)
    g = tap(pts, "attention.gate", g)
    b = linear(x, p["b_proj"])
    b = tap(pts, "attention.b_proj", b)
    beta = _at_precision(jax.nn.sigmoid(b.astype(F32)), spec.kda_beta_dtype)  # fp32 (facts §3.4, ORC §5)
    beta = tap(pts, "attention.beta", beta)
    q, k, v = qkv
    qn, kn = l2_normalize(q), l2_normalize(k)  # fp32, eps inside the sqrt of the sum (§3.3)
    mode = spec.kda_mode
    if mode == "auto":
        mode = "recurrent" if T <= CHUNK else "chunked"
    o, S = KERNELS[mode](qn, kn, v, g, beta, d ** -0.5, S0, **chunk_options(mode, spec))
    core = o.astype(x.dtype)  # kernel output cast back to the q dtype (facts §8)
    core = tap(pts, "attention.core", core)
    gp = linear(x, p["g_proj"])
    gp = tap(pts, "attention.g_proj", gp)
    on = gated_rms_norm(core, gp.reshape(B, T, H, d), p["o_norm"], m.eps)
    on = tap(pts, "attention.o_norm", on)
    out = linear(on.reshape(B, T, H * d), p["o_proj"])
    out = tap(pts, "attention.o_proj", out)
    conv = jnp.stack(convs)
    pts["attention.state"] = S
    pts["attention.conv_state"] = conv
    return out, pts, (S, conv)
