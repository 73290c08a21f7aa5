"""Pure-PyTorch CPU stand-ins for the fla names the official Ling3 remote code imports, plus the transformers-5 shims
it needs (official_remote_code.md §1 — cited ORC; facts sheet `reference/ling3_facts.md` — cited §n).

The official `modeling_bailing_moe_v3.py` imports, at module top level:
  fla.ops.simple_gla.fused_recurrent.fused_recurrent_simple_gla, fla.ops.simple_gla.chunk.chunk_simple_gla (unused),
  fla.modules.{FusedRMSNormGated, ShortConvolution}, fla.ops.kda.{chunk_kda, fused_recurrent_kda},
  fla.ops.utils.index.{prepare_cu_seqlens_from_mask, prepare_lens_from_mask}, fla.utils.tensor_cache,
  transformers.utils.import_utils.is_torch_fx_available (gone in 5.x) and uses ROPE_INIT_FUNCTIONS["default"] (gone).
fla-core without Triton cannot import any of them, so `install()` puts a fake `fla` package built from this module
into `sys.modules` and patches the two transformers names; `uninstall()` restores exactly the previous state.

Written from the public signatures/docstrings of fla-core 0.6.0 and the formulas of the facts sheet; no fla code is
copied. Everything numeric is computed in fp32 (§8: gate, beta, l2norm, decay and state are fp32 inside the kernels);
KDA returns o in q's dtype and the state in fp32. Two independent KDA forms are provided: `fused_recurrent_kda`
(token by token, §3.6) and `chunk_kda` (chunks of 64 in WY/UT form, §3.6 "chunked ... mathematically identical").
Note (ORC §1.1): the real Triton kernels keep some intermediates in the input dtype; by default these fp32 stand-ins
match the official *maths*. `set_chunk_precision("kernel")` makes `chunk_kda` round at fla's chunked rounding points
(listed below `kda_chunk_core`; measured against the real kernels in tests/test_kda_chunk_precision_kernels.py).

Observer: `set_kda_observer(fn)` makes every KDA call report the tensors computed inside the kernel, so a capture layer
can record sites the official code never exposes (`attention.gate`, `.beta`, `.core`, `.state`):
  fn({"kernel": "chunk"|"recurrent", "gate": g [B,T,HV,K] fp32 (after the gate function), "beta": [B,T,HV] fp32
      (after the sigmoid if done in the kernel), "core": o [B,T,HV,V] (as returned), "state": final state fp32,
      "q": q̂ [B,T,H,K] fp32 (after the in-kernel l2norm, before the scale), "k": k̂ [B,T,H,K] fp32})
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from parity.errors import ParityError

L2NORM_EPS = 1e-6  # §3.3: q / sqrt(Σq² + 1e-6), eps inside the sqrt on the sum
CHUNK_SIZE = 64  # §3.6 / §3.10: fla's chunk size for KDA (allowed 32 or 64)

# ----------------------------------------------------------------------------------------------- observer
_observer: Callable[[dict], None] | None = None


def set_kda_observer(fn: Callable[[dict], None] | None) -> None:
    """Install (or with None remove) the callback every KDA stand-in call reports its internals to."""
    global _observer
    if fn is not None and not callable(fn):
        raise ParityError(f"set_kda_observer: expected a callable or None, got {type(fn).__name__}")
    _observer = fn


def get_kda_observer() -> Callable[[dict], None] | None:
    return _observer


# ----------------------------------------------------------------------------------------------- KDA pieces
def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last axis, in fp32 (§3.3)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """Log-space decay [B,T,HV,K] (fp32) from the raw gate input g [B,T,HV,K] (§3.5).

    lower_bound given: `lb · σ(exp(A_log_h) · (g + dt_bias))` (Ling3; with A_log None the rate is 1, as fla documents);
    lower_bound None:  `−exp(A_log_h) · softplus(g + dt_bias)` (Kimi form; A_log required).
    dt_bias is `[HV*K]` (viewed [HV,K]) or `[HV]` (one bias per head).
    """
    HV, K = g.shape[-2], g.shape[-1]
    x = g.float()
    if dt_bias is not None:
        b = dt_bias.float()
        if b.numel() == HV * K:
            x = x + b.view(HV, K)
        elif b.numel() == HV:
            x = x + b.view(HV, 1)
        else:
            raise ParityError(f"kda gate: dt_bias has {b.numel()} elements, expected HV*K = {HV * K} or HV = {HV}")
    if A_log is None:
        if lower_bound is None:
            raise ParityError("kda gate: A_log is required when use_gate_in_kernel=True and lower_bound is None")
        rate = torch.ones(HV, 1, dtype=torch.float32, device=g.device)
    else:
        if A_log.numel() != HV:
            raise ParityError(f"kda gate: A_log has {A_log.numel()} elements, expected one per value head (HV = {HV})")
        rate = A_log.float().reshape(HV, 1).exp()
    if lower_bound is not None:
        return float(lower_bound) * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def kda_beta(beta: torch.Tensor, use_sigmoid: bool, allow_neg_eigval: bool = False) -> torch.Tensor:
    """Beta in fp32 (§3.4, §8): σ(beta) when the kernel applies the sigmoid (2σ with allow_neg_eigval), else as given."""
    b = beta.float()
    if use_sigmoid:
        b = torch.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)
    return b


def kda_recurrent_core(q, k, v, g, beta, scale: float, S0: torch.Tensor | None):
    """Token-by-token KDA (§3.6), fp32. q,k [B,T,HV,K] (already normalised / GVA-expanded), v [B,T,HV,V],
    g [B,T,HV,K] log decay, beta [B,T,HV], S0 [B,HV,K,V] or None. Returns (o [B,T,HV,V] fp32, S [B,HV,K,V] fp32).

    Per step: S ← diag(e^{g_t}) S;  u = β_t (v_t − Sᵀ k_t);  S ← S + k_t u_tᵀ;  o_t = Sᵀ (scale · q_t).
    """
    B, T, HV, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, HV, K, V) if S0 is None else S0.float().clone()
    o = q.new_zeros(B, T, HV, V)
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        pred = (S * k[:, t].unsqueeze(-1)).sum(-2)  # Sᵀ k_t  [B,HV,V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = (S * (scale * q[:, t]).unsqueeze(-1)).sum(-2)
    return o, S


def _chunker(T: int, C: int):
    """(n, chunks): the number of chunks of C tokens covering T, and the map [B,T,HV,*] -> [B,HV,n,C,*] that pads a
    ragged tail with zeros (no-op steps). Shared by the fp32 and the kernel-faithful chunked paths."""
    n = max(1, math.ceil(T / C))
    pad = n * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        return x.reshape(x.shape[0], n, C, x.shape[2], *x.shape[3:]).movedim(3, 1)

    return n, chunks


def kda_chunk_core(q, k, v, g, beta, scale: float, S0: torch.Tensor | None, chunk_size: int = CHUNK_SIZE):
    """Chunked KDA in WY/UT form (§3.6), fp32; same inputs/outputs as `kda_recurrent_core`.

    Inside a chunk, with cumulative log decay Γ_t = Σ_{s≤t} g_s (per key channel) and start state S0, unrolling the
    delta rule gives for the written values u_t:
        u_t + Σ_{s<t} A_ts u_s = β_t (v_t − S0ᵀ(e^{Γ_t} ⊙ k_t)),   A_ts = β_t Σ_c k_t[c] k_s[c] e^{Γ_t[c] − Γ_s[c]}.
    With the UT transform T = (I + A)^{-1} (unit lower triangular): W = T·diag(β)·(e^{Γ} ⊙ K), Ũ = T·diag(β)·V and
    U = Ũ − W S0. Then o_t = S0ᵀ(e^{Γ_t} ⊙ s q_t) + Σ_{s≤t} (s q_t · (e^{Γ_t−Γ_s} ⊙ k_s)) u_s and the state leaving the
    chunk is S = e^{Γ_C} ⊙ S0 + Σ_s (e^{Γ_C−Γ_s} ⊙ k_s) u_sᵀ. Decay ratios are formed pairwise (Γ_t − Γ_s ≤ 0 for s ≤ t)
    so nothing overflows. A ragged tail is padded with no-op steps (g = 0, k = v = q = β = 0).
    """
    B, T, HV, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n, chunks = _chunker(T, C)

    qc, kc, vc, gc = chunks(q * scale), chunks(k), chunks(v), chunks(g)
    bc = chunks(beta.unsqueeze(-1)).squeeze(-1)  # [B,HV,n,C]
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))  # s <= t
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)  # s < t
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    S = q.new_zeros(B, HV, K, V) if S0 is None else S0.float().clone()
    out = []
    for i in range(n):
        qi, ki, vi, bi = qc[:, :, i], kc[:, :, i], vc[:, :, i], bc[:, :, i]  # [B,HV,C,*]
        G = torch.cumsum(gc[:, :, i], dim=-2)  # Γ [B,HV,C,K]
        rel = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~incl[:, :, None], float("-inf"))
        decay = torch.exp(rel)  # [B,HV,t,s,K] = e^{Γ_t − Γ_s} for s ≤ t, else 0
        kk = torch.einsum("bhtc,bhsc,bhtsc->bhts", ki, ki, decay)
        A = bi.unsqueeze(-1) * kk * strict
        Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        W = Tm @ (bi.unsqueeze(-1) * (torch.exp(G) * ki))
        U = Tm @ (bi.unsqueeze(-1) * vi) - W @ S
        qk = torch.einsum("bhtc,bhsc,bhtsc->bhts", qi, ki, decay)  # already 0 above the diagonal
        out.append((torch.exp(G) * qi) @ S + qk @ U)
        G_end = G[:, :, -1:]  # [B,HV,1,K]
        S = torch.exp(G_end).transpose(-1, -2) * S + (torch.exp(G_end - G) * ki).transpose(-1, -2) @ U
    o = torch.stack(out, dim=2).reshape(B, HV, n * C, V)[:, :, :T].transpose(1, 2)
    return o, S


# ----------------------------------------------------------------------------------------------- chunk precision
# fla 0.6.0's chunked KDA (`chunk_kda`) stores its intermediates between (and inside) its Triton kernels in the input
# dtype; in a bf16 run these are bf16 roundings the fp32 stand-in does not make (rel-L2 ~5e-3 on o / the state). The
# stand-ins follow either the maths ("fp32", the default) or the kernel's rounding points ("kernel"). The rounding
# points (fla-core 0.6.0, site-packages/fla/ops/..., x = the input dtype):
#   1 q̂, k̂ after the in-kernel l2norm -> x           modules/norm/l2norm.py:83 (l2norm_fwd: y = empty_like(x))
#   2 Aqk = scale·q̂·(k̂ ⊙ e^{Γt−Γs}), s ≤ t -> x       kda/chunk_intra.py:233-254, :786,
#                                                      chunk_intra_token_parallel.py:126 (Aqk in k.dtype: chunk_intra.py:863)
#   3 Akk = (I + A)^-1 (A_ts = β_t k̂_t·k̂_s e^{Γt−Γs}) solved in fp32, stored -> x   kda/chunk_intra.py:369-387 (:865)
#   4 u = Akk @ (β v)->x, then -> x                   kda/wy_fast.py:102-104
#   5 w = Akk @ (β k̂ e^{Γ})->x, then -> x             kda/wy_fast.py:115-132
#   6 kg = k̂ e^{Γ_last − Γ} -> x                      kda/wy_fast.py:127-129
#   7 h (state entering each chunk) -> x; the carried state stays fp32   common/chunk_delta_h.py:185, :216, :719-723
#   8 v_new = u − w @ h_x -> x                        common/chunk_delta_h.py:234-243, :288 (b_v.to(k.dtype))
#     S ← e^{Γ_last} S + kgᵀ v_new  (fp32 accumulate; the final state is stored fp32)   chunk_delta_h.py:295, :720
#   9 o = scale·((q̂ e^{Γ})->x @ h_x) + Aqk @ v_new -> x   gla/chunk.py:438-455 (o = zeros_like(v_new), :1011)
# The gate cumsum (kda/gate.py:475, fp32 buffer) and β (fp32 from the official file) stay fp32.
CHUNK_PRECISIONS = ("fp32", "kernel")
_chunk_precision = "fp32"


def set_chunk_precision(mode: str) -> str:
    """Select how the `chunk_kda` stand-in rounds its intermediates ("fp32" | "kernel"); returns the previous mode."""
    global _chunk_precision
    if mode not in CHUNK_PRECISIONS:
        raise ParityError(f"chunk precision {mode!r}: expected one of {', '.join(CHUNK_PRECISIONS)}")
    old, _chunk_precision = _chunk_precision, mode
    return old


def get_chunk_precision() -> str:
    return _chunk_precision


@contextmanager
def chunk_precision(mode: str) -> Iterator[None]:
    """`set_chunk_precision(mode)` for the duration of a block (a dump), restoring the previous mode after."""
    old = set_chunk_precision(mode)
    try:
        yield
    finally:
        set_chunk_precision(old)


def kda_chunk_core_kernel(q, k, v, g, beta, scale: float, S0: torch.Tensor | None, dtype: torch.dtype,
                          chunk_size: int = CHUNK_SIZE):
    """`kda_chunk_core` rounded like fla's chunked kernels: the intermediates 2-9 of the list above are rounded to
    `dtype` (the kernel's input dtype), everything else is fp32. q, k are the fp32 l2-normalised q̂, k̂ (rounded to
    `dtype` here, point 1). Returns (o fp32 [B,T,HV,V] holding `dtype` values, final state fp32)."""
    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).float()

    B, T, HV, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n, chunks = _chunker(T, C)

    qc, kc, vc, gc = chunks(rnd(q)), chunks(rnd(k)), chunks(v.float()), chunks(g)
    bc = chunks(beta.unsqueeze(-1)).squeeze(-1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    S = q.new_zeros(B, HV, K, V) if S0 is None else S0.float().clone()
    out = []
    for i in range(n):
        qi, ki, vi, bi = qc[:, :, i], kc[:, :, i], vc[:, :, i], bc[:, :, i]
        G = torch.cumsum(gc[:, :, i], dim=-2)
        rel = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~incl[:, :, None], float("-inf"))
        decay = torch.exp(rel)
        A = bi.unsqueeze(-1) * torch.einsum("bhtc,bhsc,bhtsc->bhts", ki, ki, decay) * strict
        Akk = rnd(torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True))  # 3
        Aqk = rnd(scale * torch.einsum("bhtc,bhsc,bhtsc->bhts", qi, ki, decay))  # 2 (0 above the diagonal)
        u = rnd(Akk @ rnd(bi.unsqueeze(-1) * vi))  # 4
        w = rnd(Akk @ rnd(bi.unsqueeze(-1) * ki * torch.exp(G)))  # 5
        G_end = G[:, :, -1:]
        kg = rnd(ki * torch.exp(G_end - G))  # 6
        h = rnd(S)  # 7
        v_new = rnd(u - w @ h)  # 8
        out.append(scale * (rnd(qi * torch.exp(G)) @ h) + Aqk @ v_new)  # 9 (rounded by the caller)
        S = torch.exp(G_end).transpose(-1, -2) * S + kg.transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(B, HV, n * C, V)[:, :, :T].transpose(1, 2)
    return o, S


def _kda_call(kernel: str, q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
              cu_seqlens, A_log, dt_bias, chunk_size=CHUNK_SIZE):
    """Shared front end of both KDA stand-ins: validation, gate / beta / l2norm in fp32, GVA, varlen, observer."""
    name = "chunk_kda" if kernel == "chunk" else "fused_recurrent_kda"
    if q.dim() != 4 or k.shape != q.shape:
        raise ParityError(f"{name}: q and k must both be [B,T,H,K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ParityError(f"{name}: v must be [B,T,HV,V] with B,T = {B},{T}; got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H:
        raise ParityError(f"{name}: value heads HV = {HV} must be a multiple of q/k heads H = {H} (GVA)")
    if tuple(g.shape) != (B, T, HV, K):
        raise ParityError(f"{name}: g must be [B,T,HV,K] = {[B, T, HV, K]}; got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ParityError(f"{name}: beta must be [B,T,HV] = {[B, T, HV]}; got {list(beta.shape)}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ParityError(f"{name}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in fla)")
    scale = K ** -0.5 if scale is None else float(scale)  # fla default K^-½ (§3.3)

    gate = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.float()
    b = kda_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    qn = l2_normalize(q) if use_qk_l2norm_in_kernel else q.float()
    kn = l2_normalize(k) if use_qk_l2norm_in_kernel else k.float()
    rep = HV // H
    qe, ke = (qn.repeat_interleave(rep, dim=2), kn.repeat_interleave(rep, dim=2)) if rep > 1 else (qn, kn)
    vf = v.float()

    S0 = initial_state
    if S0 is not None:
        S0 = S0.float()
        if state_v_first:
            S0 = S0.transpose(-1, -2)
    core = kda_chunk_core if kernel == "chunk" else kda_recurrent_core
    extra = {"chunk_size": chunk_size} if kernel == "chunk" else {}
    if kernel == "chunk" and _chunk_precision == "kernel" and q.dtype != torch.float32:
        core = functools.partial(kda_chunk_core_kernel, dtype=q.dtype)  # fla's bf16 rounding points (see above)

    if cu_seqlens is None:
        N = B
        if S0 is not None and tuple(S0.shape) != (N, HV, K, v.shape[-1]):
            raise ParityError(f"{name}: initial_state must be [N,HV,K,V] = {[N, HV, K, v.shape[-1]]}; "
                              f"got {list(initial_state.shape)}")
        o, S = core(qe, ke, vf, gate, b, scale, S0, **extra)
    else:
        # varlen: B == 1, sequences packed along T; each segment runs from its own initial state.
        bounds = [int(x) for x in torch.as_tensor(cu_seqlens).tolist()]
        if B != 1:
            raise ParityError(f"{name}: with cu_seqlens the batch size must be 1 (packed sequences); got B = {B}")
        if bounds[0] != 0 or bounds[-1] != T or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ParityError(f"{name}: cu_seqlens {bounds} must rise from 0 to T = {T}")
        N = len(bounds) - 1
        if S0 is not None and S0.shape[0] != N:
            raise ParityError(f"{name}: {N} sequences in cu_seqlens but initial_state has {S0.shape[0]}")
        outs, states = [], []
        for j, (a, e) in enumerate(zip(bounds, bounds[1:])):
            s0 = None if S0 is None else S0[j:j + 1]
            if e == a:
                states.append(s0[0] if s0 is not None else qe.new_zeros(HV, K, v.shape[-1]))
                continue
            o_j, S_j = core(qe[:, a:e], ke[:, a:e], vf[:, a:e], gate[:, a:e], b[:, a:e], scale, s0, **extra)
            outs.append(o_j)
            states.append(S_j[0])
        o = torch.cat(outs, dim=1) if outs else vf.new_zeros(1, 0, HV, v.shape[-1])
        S = torch.stack(states)
    o = o.to(q.dtype)  # the kernels return o in the input dtype (§8 "KDA output")
    if state_v_first:
        S = S.transpose(-1, -2).contiguous()
    if _observer is not None:
        _observer({"kernel": kernel, "gate": gate, "beta": b, "core": o, "state": S, "q": qn, "k": kn})
    return o, (S if output_final_state else None)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla `chunk_kda` signature (fla-core 0.6.0), chunked WY/UT computation in fp32. `A_log` [HV] and `dt_bias`
    [HV*K] come through **kwargs as in fla. Returns (o [B,T,HV,V] in q's dtype, final state [N,HV,K,V] fp32 | None).
    `safe_gate` only selects a Tensor-Core path in fla (§3.5); here it is validated like fla and otherwise no-op."""
    if return_intermediate_states:
        raise NotImplementedError("fla_cpu.chunk_kda: return_intermediate_states (vLLM inference mode) is not provided")
    if cp_context is not None or use_graph:
        raise NotImplementedError("fla_cpu.chunk_kda: context parallelism / graph mode are not provided on CPU")
    chunk_size = kwargs.pop("chunk_size", CHUNK_SIZE)
    if chunk_size not in (32, 64):
        raise ParityError(f"chunk_kda: chunk_size must be 32 or 64 (as in fla), got {chunk_size}")
    if use_gate_in_kernel and safe_gate:
        if lower_bound is None:
            raise ParityError("chunk_kda: safe_gate=True with use_gate_in_kernel=True needs lower_bound (as in fla)")
        if not -5 <= lower_bound < 0:
            raise ParityError(f"chunk_kda: lower_bound must be in the safe range [-5, 0), got {lower_bound}")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    return _kda_call(
        "chunk", q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        chunk_size=chunk_size,
    )


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla `fused_recurrent_kda` signature (fla-core 0.6.0), token-by-token computation in fp32. The initial state
    is never modified (the public fla function is not in-place either)."""
    return _kda_call(
        "recurrent", q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
    )


def chunk_simple_gla(*args: Any, **kwargs: Any):
    """Imported by the official file but never called (ORC §1.1)."""
    raise NotImplementedError("fla_cpu: chunk_simple_gla is a placeholder; the Ling3 code path never calls it")


def fused_recurrent_simple_gla(*args: Any, **kwargs: Any):
    """Imported by the official file but never called (ORC §1.1)."""
    raise NotImplementedError("fla_cpu: fused_recurrent_simple_gla is a placeholder; the Ling3 code path never calls it")


# ----------------------------------------------------------------------------------------------- modules
class ShortConvolution(nn.Conv1d):
    """fla `ShortConvolution`: depthwise causal conv over time + optional SiLU (§3.2), weight [D,1,W].

    forward(x [B,T,D], residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None)
      -> (y [B,T,D] in x's dtype, final cache [N,D,W] | None).
    The cache holds the last W inputs (fla convention, §3.11); a given cache is the history before x (zeros when None).
    As in fla, a single-token call without autograd updates a given cache in place. Computed in fp32.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                 backend: str | None = "triton", device=None, dtype=None, **kwargs: Any) -> None:
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ParityError(f"ShortConvolution: activation {activation!r} not supported (None, 'silu', 'swish')")
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = backend

    def _conv(self, x: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence batch: x [B,T,D], cache [B,D,W] | None -> (y fp32 [B,T,D], last W inputs [B,D,W] fp32)."""
        B, T, D = x.shape
        W = self.kernel_size[0]
        hist = x.new_zeros(B, D, W, dtype=torch.float32) if cache is None else cache.float()
        seq = torch.cat([hist, x.float().transpose(1, 2)], dim=-1)  # [B,D,W+T]; output t sees inputs t−W+1..t
        bias = None if self.bias is None else self.bias.float()
        y = F.conv1d(seq[..., 1:], self.weight.float(), bias, groups=D)  # [B,D,T]
        if self.activation is not None:
            y = F.silu(y)
        return y.transpose(1, 2), seq[..., -W:]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs: Any):
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ParityError(f"ShortConvolution: x must be [B,T,{self.hidden_size}], got {tuple(x.shape)}")
        B, T, D = x.shape
        if mask is not None:
            if cu_seqlens is not None:
                raise ParityError("ShortConvolution: mask and cu_seqlens cannot be given together (as in fla)")
            x = x * mask.unsqueeze(-1).to(x.dtype)
        if cu_seqlens is None:
            if cache is not None and tuple(cache.shape) != (B, D, self.kernel_size[0]):
                raise ParityError(f"ShortConvolution: cache must be [B,D,W] = {[B, D, self.kernel_size[0]]}, "
                                  f"got {list(cache.shape)}")
            y, new = self._conv(x, cache)
        else:
            bounds = [int(b) for b in torch.as_tensor(cu_seqlens).tolist()]
            if B != 1 or bounds[0] != 0 or bounds[-1] != T:
                raise ParityError(f"ShortConvolution: cu_seqlens {bounds} needs B = 1 and must run from 0 to T = {T}")
            ys, news = [], []
            for j, (a, e) in enumerate(zip(bounds, bounds[1:])):
                y_j, c_j = self._conv(x[:, a:e], None if cache is None else cache[j:j + 1])
                ys.append(y_j)
                news.append(c_j)
            y, new = torch.cat(ys, dim=1), torch.cat(news, dim=0)
        if residual is not None:
            y = y + residual.float()
        y = y.to(x.dtype)
        new = new.to(cache.dtype if cache is not None else x.dtype)
        if cache is not None and T == 1 and cu_seqlens is None and not torch.is_grad_enabled():
            cache.copy_(new)  # fla's decode step updates the given cache in place
            new = cache
        return y, (new if output_final_state else None)

    def step(self, x: torch.Tensor, residual: torch.Tensor | None, cache: torch.Tensor | None,
             output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None):
        """Single-token decode step (x [B,1,D]); same semantics as forward."""
        return self.forward(x, residual=residual, cache=cache, output_final_state=output_final_state,
                            cu_seqlens=cu_seqlens)


class FusedRMSNormGated(nn.Module):
    """fla `FusedRMSNormGated(hidden_size, elementwise_affine=True, eps=1e-5, activation='swish')` (fla defaults).

    forward(x, g) = x·(mean(x²)+eps)^-½ · w · act(g), act = sigmoid (Ling3, §3.7) or swish/silu (g·σ(g)); computed in
    fp32 and cast to x's dtype. Optional `residual` is added to x first (returned too when `prenorm`).
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None) -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ParityError(f"FusedRMSNormGated: unsupported activation {activation!r} (swish, silu, sigmoid)")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
        y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        gf = g.float()
        y = y * (torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf))
        y = y.to(x.dtype)
        if prenorm:
            return y, (xf if residual_in_fp32 else xf.to(x.dtype))
        return y


# ----------------------------------------------------------------------------------------------- small utilities
def tensor_cache(fn: Callable) -> Callable:
    """fla's `tensor_cache` memoises by argument identity; recomputing every call has the same results, so the
    stand-in is a plain pass-through (no risk of a stale cached tensor)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        return fn(*args, **kwargs)

    return wrapper


@tensor_cache
def prepare_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths (int32) of a [B,T] 0/1 attention mask."""
    return mask.sum(dim=-1, dtype=torch.int32)


@tensor_cache
def prepare_cu_seqlens_from_mask(mask: torch.Tensor, dtype: torch.dtype | None = torch.int32) -> torch.Tensor:
    """Cumulative sequence lengths [B+1] (starting at 0) of a [B,T] 0/1 attention mask."""
    lens = prepare_lens_from_mask(mask)
    return F.pad(lens.cumsum(dim=0, dtype=dtype), (1, 0))


# ----------------------------------------------------------------------------------------------- transformers shims
def default_rope_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    """Classic RoPE inverse frequencies θ^{-2j/d}, j = 0..d/2−1 (§4.3), computed in fp32 as transformers 4.x's
    default rope did (so a correct official load reproduces these bits)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
    return 1.0 / (float(base) ** exponent)


def _compute_default_rope_parameters(config=None, device=None, seq_len: int | None = None,
                                     layer_type: str | None = None, **rope_kwargs: Any) -> tuple[torch.Tensor, float]:
    """`ROPE_INIT_FUNCTIONS['default']` as in transformers 4.x: (inv_freq, attention_scaling = 1.0).

    base = config.rope_theta (or rope_parameters['rope_theta'] / rope_kwargs['base']); dim = head_dim ·
    partial_rotary_factor (or rope_kwargs['dim']). The official rotary module sets head_dim = qk_rope_head_dim and
    factor 1.0 on the config it passes (§1 'rotary_dim ... ignored')."""
    if config is None:
        if "base" not in rope_kwargs or "dim" not in rope_kwargs:
            raise ParityError("default rope (fla_cpu shim): without a config, rope_kwargs 'base' and 'dim' are needed")
        base, dim = rope_kwargs["base"], int(rope_kwargs["dim"])
    else:
        base = getattr(config, "rope_theta", None)
        if base is None:
            params = getattr(config, "rope_parameters", None) or {}
            base = params.get("rope_theta") if isinstance(params, dict) else None
        if base is None:
            raise ParityError("default rope (fla_cpu shim): the config has no rope_theta")
        partial = getattr(config, "partial_rotary_factor", None) or 1.0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * partial)
    return default_rope_inv_freq(base, dim, device=device), 1.0


def is_torch_fx_available() -> bool:
    """Shim for the helper transformers 5 removed: torch.fx ships with every torch ≥ 1.10."""
    return importlib.util.find_spec("torch.fx") is not None


_MISSING = object()


class _ShimHandle:
    """Undo record for the transformers shims: (object, attribute or key, previous value or _MISSING)."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any, bool]] = []
        self.active = False

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        self.undo.append((obj, name, getattr(obj, name, _MISSING), False))
        setattr(obj, name, value)

    def set_item(self, mapping: Any, key: str, value: Any) -> None:
        self.undo.append((mapping, key, mapping[key] if key in mapping else _MISSING, True))
        mapping[key] = value

    def restore(self) -> None:
        for obj, name, old, is_item in reversed(self.undo):
            if is_item:
                if old is _MISSING:
                    obj.pop(name, None)
                else:
                    obj[name] = old
            elif old is _MISSING:
                if hasattr(obj, name):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.undo.clear()
        self.active = False


_shims: _ShimHandle | None = None


def install_transformers_shims() -> _ShimHandle:
    """Add `is_torch_fx_available` to transformers.utils(.import_utils) and `ROPE_INIT_FUNCTIONS['default']` where
    they are missing (ORC §1.2, §1.3). Idempotent; returns the handle whose `restore()` undoes exactly these edits."""
    global _shims
    if _shims is not None and _shims.active:
        return _shims
    import transformers.utils as tu
    import transformers.utils.import_utils as iu
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    h = _ShimHandle()
    for mod in (iu, tu):
        if not hasattr(mod, "is_torch_fx_available"):
            h.set_attr(mod, "is_torch_fx_available", is_torch_fx_available)
    if "default" not in ROPE_INIT_FUNCTIONS:
        h.set_item(ROPE_INIT_FUNCTIONS, "default", _compute_default_rope_parameters)
    h.active = True
    _shims = h
    return h


def uninstall_transformers_shims() -> None:
    global _shims
    if _shims is not None:
        _shims.restore()
        _shims = None


# ----------------------------------------------------------------------------------------------- fake fla package
# module name -> attributes (names in this module) it exposes
FAKE_MODULES: dict[str, tuple[str, ...]] = {
    "fla": (),
    "fla.ops": (),
    "fla.ops.kda": ("chunk_kda", "fused_recurrent_kda"),
    "fla.ops.simple_gla": ("chunk_simple_gla", "fused_recurrent_simple_gla"),
    "fla.ops.simple_gla.chunk": ("chunk_simple_gla",),
    "fla.ops.simple_gla.fused_recurrent": ("fused_recurrent_simple_gla",),
    "fla.ops.utils": ("prepare_cu_seqlens_from_mask", "prepare_lens_from_mask"),
    "fla.ops.utils.index": ("prepare_cu_seqlens_from_mask", "prepare_lens_from_mask"),
    "fla.modules": ("FusedRMSNormGated", "ShortConvolution"),
    "fla.utils": ("tensor_cache",),
}
FAKE_VERSION = "0.0.0+parity-cpu-stand-ins"


def _is_ours(name: str) -> bool:
    return bool(getattr(sys.modules.get(name), "__parity_fla_cpu__", False))


def is_installed() -> bool:
    """True while the stand-in `fla` package is what `import fla` returns."""
    return _is_ours("fla")


def real_fla_with_triton() -> bool:
    """True when a real fla *and* triton are importable. Checked without importing either package. Not enough for
    the real kernels to run: they also need a CUDA device or TRITON_INTERPRET=1 (`real_kernels_run_here`)."""
    if is_installed():
        return False
    try:
        has_fla = importlib.util.find_spec("fla") is not None
        has_triton = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False
    return has_fla and has_triton


def real_kernels_run_here() -> bool:
    """True when fla's Triton kernels can run in this process: a real fla with triton, and a CUDA device or Triton's
    interpreter (TRITON_INTERPRET=1). A CPU machine that merely has triton installed cannot run them."""
    return real_fla_with_triton() and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())


def _make_fake_modules() -> dict[str, types.ModuleType]:
    this = sys.modules[__name__]
    mods: dict[str, types.ModuleType] = {}
    for name, attrs in FAKE_MODULES.items():
        is_pkg = any(other.startswith(name + ".") for other in FAKE_MODULES)
        m = types.ModuleType(name, f"ling3-parity CPU stand-in for {name} (see {__name__})")
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_pkg)
        if is_pkg:
            m.__path__ = []  # a package with no search path: unknown submodules fail with ModuleNotFoundError
        m.__parity_fla_cpu__ = True
        for a in attrs:
            setattr(m, a, getattr(this, a))
        mods[name] = m
    mods["fla"].__version__ = FAKE_VERSION
    for name, m in mods.items():  # parent.child attributes, as a real import would set
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, m)
    return mods


class StandIns:
    """Handle returned by `install()`; a context manager. `uninstall()` restores every `fla` / `fla.*` entry of
    `sys.modules` and the transformers shims to what they were before `install()`. A nested `install()` while the
    stand-ins are already in place returns a handle that restores nothing (the outer one owns the state)."""

    def __init__(self, saved: dict[str, types.ModuleType] | None, shims: _ShimHandle | None, forced: bool) -> None:
        self._saved = saved
        self._shims = shims
        self.forced = forced
        self.owner = saved is not None
        self.active = True

    def uninstall(self) -> None:
        if not self.active:
            return
        self.active = False
        if not self.owner:
            return
        for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[name]
        sys.modules.update(self._saved)
        if self._shims is not None:
            self._shims.restore()
            global _shims
            if _shims is self._shims:
                _shims = None

    def __enter__(self) -> "StandIns":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


def install(force: bool = False, *, shims: bool = True) -> StandIns:
    """Put the fake `fla` package into `sys.modules` (replacing any `fla*` entries, which are saved) and, with
    `shims`, the transformers-5 shims. Refuses with ParityError when the real kernels can run here
    (`real_kernels_run_here`; replacing them would silently change the reference) unless `force=True`."""
    if is_installed():
        return StandIns(None, None, force)
    if real_kernels_run_here() and not force:
        raise ParityError(
            "fla_cpu.install: a real fla with triton is importable and a CUDA device or TRITON_INTERPRET=1 is present, "
            "so the real kernels can run; refusing to shadow them with the CPU stand-ins (pass force=True, or "
            "--cpu-kernels, to override)"
        )
    saved = {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")}
    shim_handle = None
    if shims and (_shims is None or not _shims.active):
        shim_handle = install_transformers_shims()
    for name in saved:
        del sys.modules[name]
    sys.modules.update(_make_fake_modules())
    return StandIns(saved, shim_handle, force)


__all__ = [
    "chunk_kda", "fused_recurrent_kda", "chunk_simple_gla", "fused_recurrent_simple_gla", "ShortConvolution",
    "FusedRMSNormGated", "tensor_cache", "prepare_cu_seqlens_from_mask", "prepare_lens_from_mask",
    "set_kda_observer", "get_kda_observer", "install", "is_installed", "real_fla_with_triton", "real_kernels_run_here",
    "StandIns",
    "install_transformers_shims", "uninstall_transformers_shims", "default_rope_inv_freq", "is_torch_fx_available",
    "kda_gate", "kda_beta", "l2_normalize", "kda_recurrent_core", "kda_chunk_core", "kda_chunk_core_kernel",
    "CHUNK_PRECISIONS", "set_chunk_precision", "get_chunk_precision", "chunk_precision",
]
