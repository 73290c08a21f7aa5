"""PyTorch Ling3 (BailingMoeV3, HF `bailing_hybrid`) — the ling3-parity *twin* of the official remote code.

Written from the facts sheet (`reference/ling3_facts.md`, cited as §n) and the measured behaviour of the official file
(`reference/official_remote_code.md`, cited as ORC §n); no code of the official file or of fla/transformers is copied.
Self-contained: imports only torch, transformers and the configuration file next to it, because it is copied into
checkpoint directories and loaded through `auto_map` with `trust_remote_code=True`.

Same module tree and parameter names as the official checkpoint (§7). MTP layers `model.layers.{N+j}` (§2) are built
(at least one, so a checkpoint's MTP keys always load) and, as in the official forward, run after the main stack
when `num_nextn_predict_layers > 0`, in prefill and decode: their logits come back as `mtp_logits`.

KDA dispatch: if `fla.ops.kda.{chunk_kda, fused_recurrent_kda}` and `fla.modules.{ShortConvolution, FusedRMSNormGated}`
import (real fla on CUDA, or the suite's CPU stand-ins installed in
`sys.modules`) and the env var `LING3_TWIN_KERNELS` is not `torch`, the KDA layer calls them exactly as the official
file does (ORC §1.1); otherwise it uses the pure-PyTorch functions below, with the same module / parameter names.

Observation taps: parameter-free `nn.Identity` modules (`tap_*`) are fed tensors the official code computes inside
kernels, so forward hooks can read them; they add nothing to the state dict.

Choices where the sources leave room (documented here once):
- KDA gate form: lower-bound form `lb·σ(exp(A_log)·(a+dt_bias))` iff `kda_lower_bound is not None`, else the softplus
  form `−exp(A_log)·softplus(a+dt_bias)` — the selection rule of fla ≥ 0.4.2 kernels that the official file calls
  (§3.5, §10.11). `kda_safe_gate` only changes the chunk kernel's internal precision path, not the maths, so the
  pure-PyTorch path ignores it (it is passed through to `chunk_kda` when fla kernels are used).
- KDA short conv in fp32 (weights and inputs upcast, SiLU in fp32), output cast to the model dtype, as the fused
  causal-conv kernels accumulate in fp32 (§3.2, §8).
- SwiGLU clamp (§5.7): on by default (`twin_apply_swiglu_clamp`) for routed experts (`expert_swiglu_limit_list[i]`)
  and the shared expert (`share_expert_swiglu_limit_list[i]`); never for the dense MLP layers nor the MTP layer.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation import GenerationMixin
from transformers.modeling_attn_mask_utils import (
    _prepare_4d_causal_attention_mask,
    _prepare_4d_causal_attention_mask_for_sdpa,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_bailing_moe_v3 import BailingMoeV3Config

# ----------------------------------------------------------------------------------------------- kernel dispatch
# Same imports as the official file (ORC §1.1). Tried at import time and again when a KDA layer is built, so fla
# stand-ins installed into sys.modules after this module was first imported are still picked up.
chunk_kda = fused_recurrent_kda = ShortConvolution = FusedRMSNormGated = None


def _try_import_fla() -> bool:
    global chunk_kda, fused_recurrent_kda, ShortConvolution, FusedRMSNormGated
    if chunk_kda is not None:
        return True
    try:
        from fla.modules import FusedRMSNormGated as _norm
        from fla.modules import ShortConvolution as _conv
        from fla.ops.kda import chunk_kda as _chunk
        from fla.ops.kda import fused_recurrent_kda as _rec
    except Exception:  # no fla, or fla without triton (ModuleNotFoundError / RuntimeError on CPU)
        return False
    chunk_kda, fused_recurrent_kda, ShortConvolution, FusedRMSNormGated = _chunk, _rec, _conv, _norm
    return True


_try_import_fla()


def use_fla_kernels() -> bool:
    """True when the KDA layers built now will call fla's kernels (importable and not vetoed by the env var)."""
    return os.environ.get("LING3_TWIN_KERNELS", "").strip().lower() != "torch" and _try_import_fla()


# ----------------------------------------------------------------------------------------------- pure functions
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """§6: fp32 statistics, normalised value cast back to the input dtype *before* the weight multiply."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """§3.3: x / sqrt(sum(x²) + eps) over the last axis, eps inside the sqrt on the *sum*; fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space KDA decay [B,T,H,d] in fp32 from the raw f_proj output a [B,T,H,d] (§3.5).

    lower-bound form `lb·σ(exp(A_log_h)·(a+dt_bias))` when lower_bound is not None, else `−exp(A_log_h)·softplus(a+dt_bias)`.
    """
    H, d = a.shape[-2], a.shape[-1]
    x = a.float() + dt_bias.float().view(H, d)
    rate = A_log.float().exp().view(H, 1)
    if lower_bound is not None:
        return float(lower_bound) * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def kda_recurrent(q, k, v, g, beta, scale: float, initial_state=None):
    """Token-by-token KDA recurrence (§3.6), all fp32. q,k already L2-normalised.

    q,k,v,g: [B,T,H,d]; beta: [B,T,H]; state [B,H,K,V]. Per step: S ← diag(exp g_t)·S; u = β_t(v_t − Sᵀk_t);
    S ← S + k_t⊗u; o_t = Sᵀ(s·q_t) (read-out after the update). Returns (o [B,T,H,V] fp32, S).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device) if initial_state is None else initial_state.float()
    q, k, v, g, beta = q.float() * scale, k.float(), v.float(), g.float(), beta.float()
    out = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def kda_chunked(q, k, v, g, beta, scale: float, initial_state=None, chunk_size: int = 64):
    """Chunked KDA (§3.6, §3.10): same maths as `kda_recurrent`, one triangular solve per chunk of `chunk_size`.

    Inside a chunk with cumulative log-decay G_t = Σ_{s≤t} g_s and start state S0, the delta-rule "new values"
    u_t = β_t(v_t − (D_t S_{t−1})ᵀk_t) satisfy u_t + β_t Σ_{s<t} A_ts u_s = β_t(v_t − S0ᵀ(e^{G_t}⊙k_t)) with
    A_ts = Σ_c k_t[c] k_s[c] e^{G_t[c]−G_s[c]}; then o_t = S0ᵀ(e^{G_t}⊙s·q_t) + Σ_{s≤t} (s·q_t·(k_s⊙e^{G_t−G_s})) u_s and
    S_C = e^{G_C}⊙S0 + Σ_s (k_s⊙e^{G_C−G_s}) u_sᵀ. The tail is padded with g=0, k=v=β=0 (a no-op step).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device) if initial_state is None else initial_state.float()
    n = -(-T // C)
    pad = n * C - T

    def prep(x):  # [B,T,H,*] -> [B,H,n,C,*] fp32, zero-padded
        x = x.float()
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.transpose(1, 2).reshape(B, H, n, C, *x.shape[3:])

    qc, kc, vc, gc = prep(q) * scale, prep(k), prep(v), prep(g)
    bc = prep(beta.unsqueeze(-1)).squeeze(-1)  # [B,H,n,C]
    causal_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, n, C, V, dtype=torch.float32, device=q.device)
    for i in range(n):
        qi, ki, vi, bi = qc[:, :, i], kc[:, :, i], vc[:, :, i], bc[:, :, i]
        G = gc[:, :, i].cumsum(-2)  # [B,H,C,K]
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B,H,t,s,K] = G_t - G_s
        diff = diff.masked_fill(~causal_incl.view(C, C, 1), float("-inf"))  # s > t never used: avoid exp overflow
        decay = diff.exp()
        A = torch.einsum("btk,bsk,btsk->bts", ki.flatten(0, 1), ki.flatten(0, 1), decay.flatten(0, 1)).view(B, H, C, C)
        A = A * strict
        rhs = bi.unsqueeze(-1) * (vi - torch.einsum("bhtk,bhkv->bhtv", G.exp() * ki, S))
        L = eye + bi.unsqueeze(-1) * A
        U = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
        Bm = torch.einsum("btk,bsk,btsk->bts", qi.flatten(0, 1), ki.flatten(0, 1), decay.flatten(0, 1)).view(B, H, C, C)
        out[:, :, i] = torch.einsum("bhtk,bhkv->bhtv", G.exp() * qi, S) + (Bm * causal_incl) @ U
        GC = G[:, :, -1:]  # [B,H,1,K]
        S = GC.squeeze(-2).exp().unsqueeze(-1) * S + torch.einsum("bhsk,bhsv->bhkv", ki * (GC - G).exp(), U)
    o = out.reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2)
    return o, S


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None):
    """Depthwise causal conv + SiLU over time (§3.2), fp32 inside. x [B,T,P], weight [P,1,W], cache [B,P,W] = last W
    inputs (fla convention, §3.11) or None (zero history). Returns (y [B,T,P] in x.dtype, new cache [B,P,W] fp32→x.dtype).
    """
    B, T, P = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2).float()  # [B,P,T]
    hist = torch.zeros(B, P, W, dtype=torch.float32, device=x.device) if cache is None else cache.float()
    full = torch.cat([hist, xt], dim=-1)  # [B,P,W+T]
    y = F.conv1d(full[..., 1:], weight.float(), groups=P)  # output t uses inputs t-W+1..t
    y = F.silu(y).to(x.dtype).transpose(1, 2)
    return y, full[..., -W:].to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos/sin [B,T,r/2] of angles position·inv_freq, computed in fp32, cast to the model dtype (§8)."""
    ang = position_ids[..., None].float() * inv_freq.float()
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_interleave=true` (§4.3): de-interleave x' = [x_0,x_2,…, x_1,x_3,…], then rotate-half:
    out_j = x'_j cos f_j − x'_{j+r/2} sin f_j ; out_{j+r/2} = x'_{j+r/2} cos f_j + x'_j sin f_j.
    x [B,h,T,r]; cos/sin [B,T,r/2]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


# ----------------------------------------------------------------------------------------------- modules
class BailingMoeV3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class BailingMoeV3RotaryEmbedding(nn.Module):
    """Default RoPE over the MLA rope dims r = qk_rope_head_dim, inv_freq_j = θ^{-2j/r} (§4.3; rotary_dim and
    partial_rotary_factor are ignored as in the official file, §1)."""

    def __init__(self, config: BailingMoeV3Config):
        super().__init__()
        self.dim = config.qk_rope_head_dim
        self.base = float(config.rope_theta)
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)).float()

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return rope_cos_sin(self.inv_freq, position_ids, x.dtype)


class BailingMoeV3MLP(nn.Module):
    """SwiGLU `down(silu(gate x) ⊙ up x)` (§5.6) with the optional clamp `min(silu(g),L)·clip(u,−L,L)` (§5.7)."""

    def __init__(self, config: BailingMoeV3Config, intermediate_size: int, swiglu_limit: float | None = None):
        super().__init__()
        D = config.hidden_size
        self.gate_proj = nn.Linear(D, intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, D, bias=False)
        self.swiglu_limit = swiglu_limit  # None / 0 = off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.silu(self.gate_proj(x))
        u = self.up_proj(x)
        if self.swiglu_limit:
            L = float(self.swiglu_limit)
            g = g.clamp(max=L)
            u = u.clamp(min=-L, max=L)
        return self.down_proj(g * u)


class BailingMoeV3Gate(nn.Module):
    """Grouped sigmoid router (§5.1–5.4), all in fp32; `expert_bias` only selects, weights use unbiased scores."""

    def __init__(self, config: BailingMoeV3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        self.tap_logits = nn.Identity()
        self.tap_topk_idx = nn.Identity()
        self.tap_topk_weight = nn.Identity()

    def forward(self, x: torch.Tensor):
        """x [B,T,D] -> (topk_idx [B,T,k] int64, topk_weight [B,T,k] fp32, logits [B,T,E] fp32)."""
        logits = self.tap_logits(F.linear(x.float(), self.weight.float()))
        scores = logits.sigmoid()
        choice = scores + self.expert_bias.float()
        *lead, E = choice.shape
        grouped = choice.view(*lead, self.n_group, E // self.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # top-2 sum per group (§5.3)
        keep = group_score.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, keep, True)
        masked = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(*lead, E)
        idx = masked.topk(self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.top_k > 1:  # the official code always renormalises when k > 1 (§5.4, norm_topk_prob ignored)
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.routed_scaling_factor
        return self.tap_topk_idx(idx), self.tap_topk_weight(w), logits


class BailingMoeV3SparseMoeBlock(nn.Module):
    def __init__(self, config: BailingMoeV3Config, layer_idx: int):
        super().__init__()
        clamp = getattr(config, "twin_apply_swiglu_clamp", True)
        routed_limit = _limit(config.expert_swiglu_limit_list, layer_idx) if clamp else None
        shared_limit = _limit(config.share_expert_swiglu_limit_list, layer_idx) if clamp else None
        self.num_experts = config.num_experts
        self.gate = BailingMoeV3Gate(config)
        self.experts = nn.ModuleList(
            BailingMoeV3MLP(config, config.moe_intermediate_size, routed_limit) for _ in range(config.num_experts)
        )
        self.shared_experts = None
        if config.num_shared_experts:
            size = (config.moe_shared_expert_intermediate_size or config.moe_intermediate_size) * config.num_shared_experts
            self.shared_experts = BailingMoeV3MLP(config, size, shared_limit)
        self.tap_routed = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        idx, w, _ = self.gate(x)
        flat = x.reshape(-1, D)
        idx_f, w_f = idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])
        slots = flat.new_zeros(flat.shape[0], idx_f.shape[-1], D)  # expert output per (token, slot), model dtype
        for e in torch.unique(idx_f).tolist():
            tok, pos = torch.where(idx_f == e)
            slots[tok, pos] = self.experts[e](flat[tok])
        # §5.5: weighted sum over the k slots accumulated in fp32 (topk_weight dtype), then cast back
        routed = (slots.float() * w_f.unsqueeze(-1)).sum(1).to(x.dtype).view(B, T, D)
        routed = self.tap_routed(routed)
        if self.shared_experts is not None:
            return routed + self.shared_experts(x)
        return routed


class _TwinShortConvolution(nn.Conv1d):
    """Pure-PyTorch stand-in with fla ShortConvolution's shape and call signature: depthwise, weight [P,1,W], no bias,
    SiLU; forward(x [B,T,P], cache=None, output_final_state=False, cu_seqlens=None) -> (y, new_cache [B,P,W] | None)."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str = "silu"):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False, padding=kernel_size - 1)
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):
        if cu_seqlens is not None:
            raise NotImplementedError("twin ShortConvolution: varlen (cu_seqlens) is not supported")
        y, new_cache = causal_short_conv(x, self.weight, cache)
        return y, (new_cache if output_final_state else None)


class _TwinRMSNormGated(nn.Module):
    """fla FusedRMSNormGated(d, eps, activation='sigmoid') semantics (§3.7): x·rsqrt(mean(x²)+eps)·w·σ(g) in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(g.float())).to(x.dtype)


def _kda_cache_get(cache: Cache | None, layer_idx: int):
    """KDA state from the official cache layout (ORC §3): layers[i].keys = recurrent state [B,H,K,V] fp32,
    layers[i].values = (conv_q, conv_k, conv_v) each [B,P,W]. The layer stays `is_initialized=False`, so it reports
    sequence length 0 — as the official KDA layers do."""
    if cache is None or len(cache.layers) <= layer_idx:
        return None, (None, None, None)
    layer = cache.layers[layer_idx]
    state = layer.keys if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4 else None
    convs = layer.values if isinstance(layer.values, tuple) and len(layer.values) == 3 else (None, None, None)
    return state, convs


def _kda_cache_set(cache: Cache, layer_idx: int, state: torch.Tensor, convs: tuple) -> None:
    while len(cache.layers) <= layer_idx:
        cache.layers.append(DynamicLayer())
    cache.layers[layer_idx].keys = state
    cache.layers[layer_idx].values = tuple(convs)


class BailingMoeV3KimiDeltaAttention(nn.Module):
    """KDA layer (§3): projections, short conv + SiLU, L2-normed q/k, fp32 gate and beta, delta-rule recurrence,
    gated RMS output norm, o_proj. No positions (§3.9)."""

    def __init__(self, config: BailingMoeV3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.head_dim = d = config.head_dim
        P = H * d
        D = config.hidden_size
        W = config.short_conv_kernel_size
        self.lower_bound = config.kda_lower_bound
        self.safe_gate = config.kda_safe_gate
        self.use_fla = use_fla_kernels()
        for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
            setattr(self, name, nn.Linear(D, P, bias=False))
        self.b_proj = nn.Linear(D, H, bias=False)
        conv_cls = ShortConvolution if self.use_fla else _TwinShortConvolution
        norm_cls = FusedRMSNormGated if self.use_fla else _TwinRMSNormGated
        self.q_conv1d = conv_cls(hidden_size=P, kernel_size=W, bias=False, activation="silu")
        self.k_conv1d = conv_cls(hidden_size=P, kernel_size=W, bias=False, activation="silu")
        self.v_conv1d = conv_cls(hidden_size=P, kernel_size=W, bias=False, activation="silu")
        # fp32 parameters as in the official file (§8; ORC §6)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.o_norm = norm_cls(d, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(P, D, bias=False)
        for tap in ("tap_gate", "tap_beta", "tap_core", "tap_state", "tap_conv_state"):
            setattr(self, tap, nn.Identity())

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                use_cache=False, **kwargs):
        # The official KDA ignores the attention mask (padding not supported, §9 / ORC §2).
        x = hidden_states
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        state0, (cq0, ck0, cv0) = _kda_cache_get(past_key_values, self.layer_idx)
        keep = use_cache and past_key_values is not None
        q, cq = self.q_conv1d(self.q_proj(x), cache=cq0, output_final_state=keep)
        k, ck = self.k_conv1d(self.k_proj(x), cache=ck0, output_final_state=keep)
        v, cv = self.v_conv1d(self.v_proj(x), cache=cv0, output_final_state=keep)
        q, k, v = (t.reshape(B, T, H, d) for t in (q, k, v))
        a = self.f_proj(x).view(B, T, H, d)  # raw gate pre-activation, what the official passes to the kernel
        beta = self.tap_beta(torch.sigmoid(self.b_proj(x).float()))  # fp32 (§3.4, ORC §5)
        gate = self.tap_gate(kda_gate(a, self.A_log, self.dt_bias, self.lower_bound))
        if self.use_fla:
            common = dict(
                g=a, beta=beta, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=state0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                lower_bound=self.lower_bound,
            )
            if T <= 64:
                o, state = fused_recurrent_kda(q=q, k=k, v=v, **common)
            else:
                o, state = chunk_kda(q=q, k=k, v=v, safe_gate=self.safe_gate, **common)
        else:
            qn, kn = l2_normalize(q), l2_normalize(k)
            fn = kda_recurrent if T <= 64 else kda_chunked  # §3.10: recurrent up to 64 tokens, chunked beyond
            o, state = fn(qn, kn, v, gate, beta, d ** -0.5, initial_state=state0)
        o = self.tap_core(o.to(q.dtype))  # kernel output is cast back to the q dtype (§8)
        self.tap_state(state)
        if keep:
            self.tap_conv_state(torch.stack([cq, ck, cv]))
            _kda_cache_set(past_key_values, self.layer_idx, state, (cq, ck, cv))
        o = self.o_norm(o, self.g_proj(x).view(B, T, H, d))
        return self.o_proj(o.reshape(B, T, H * d)), None


class BailingMoeV3MultiLatentAttention(nn.Module):
    """Head-wise gated MLA (§4): q (q-LoRA or plain), compressed kv, interleaved RoPE, eager fp32 softmax with scale
    qk_head_dim^-½, sigmoid head gate in fp32 cast to the model dtype, `dense` output projection."""

    def __init__(self, config: BailingMoeV3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        D = config.hidden_size
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope + self.rope
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        bias = bool(config.use_qkv_bias)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = BailingMoeV3RMSNorm(self.q_lora_rank, eps=1e-6)  # class-default eps (§4.2)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = BailingMoeV3RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H, bias=False)  # head-wise gate [H, D] (§4.6)
        self.dense = nn.Linear(H * self.v_dim, D, bias=bias)
        self.scaling = self.qk_head_dim ** -0.5  # §4.4: qk_head_dim, not v_head_dim
        self.tap_core = nn.Identity()
        self.tap_gate = nn.Identity()

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                use_cache=False, **kwargs):
        x = hidden_states
        B, T, _ = x.shape
        H = self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cos, sin = position_embeddings
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(k_rope.view(B, 1, T, self.rope), cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, T, self.rope)], dim=-1)
        if past_key_values is not None and use_cache:
            k, v = past_key_values.update(k, v, self.layer_idx)  # expanded per-head K/V (ORC §3)
        S = k.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if attention_mask is not None:
            scores = scores + attention_mask[..., :S]
        elif not getattr(self.config, "twin_quirk_noncausal_sdpa", False):
            # The mask helper returns None for a plain prefill under sdpa (ORC §2); unlike the official file the twin
            # then applies the causal mask itself. Queries are the last T of the S keys.
            qpos = torch.arange(S - T, S, device=x.device).unsqueeze(-1)
            allowed = torch.arange(S, device=x.device).unsqueeze(0) <= qpos
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # fp32 softmax (§8)
        core = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, H * self.v_dim)
        core = self.tap_core(core)
        gate = self.tap_gate(torch.sigmoid(self.g_proj(x).float()).to(x.dtype))  # [B,T,H] (§4.6)
        out = (core.view(B, T, H, self.v_dim) * gate.unsqueeze(-1)).reshape(B, T, H * self.v_dim)
        return self.dense(out), None


def _limit(lst, i: int):
    if lst is None or not 0 <= i < len(lst):
        return None  # MTP layer (index >= list length) has no clamp (§5.7)
    v = lst[i]
    return float(v) if v else None


def is_mla_layer(config: BailingMoeV3Config, i: int) -> bool:
    """§2: MLA iff (i+1) % g == 0 or i >= floor(n/g)*g (ragged tail); the MTP layer (i >= n) is MLA."""
    n, g = config.num_hidden_layers, config.layer_group_size
    return i >= n or (i + 1) % g == 0 or i >= (n // g) * g


class BailingMoeV3DecoderLayer(nn.Module):
    def __init__(self, config: BailingMoeV3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_layer_type = "attention" if is_mla_layer(config, layer_idx) else "linear_attention"
        attn_cls = BailingMoeV3MultiLatentAttention if self.attention_layer_type == "attention" else BailingMoeV3KimiDeltaAttention
        self.attention = attn_cls(config, layer_idx)
        self.input_layernorm = BailingMoeV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = BailingMoeV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.num_experts is not None and layer_idx >= config.first_k_dense_replace:
            self.mlp = BailingMoeV3SparseMoeBlock(config, layer_idx)
        else:
            self.mlp = BailingMoeV3MLP(config, config.intermediate_size)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                use_cache=False, **kwargs):
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.attention(h, attention_mask=attention_mask, position_embeddings=position_embeddings,
                              past_key_values=past_key_values, use_cache=use_cache)
        hidden_states = residual + h
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states,)


class BailingMoeV3MTPLayer(nn.Module):
    """MTP layer `model.layers.{N+j}` (§2): `x = eh_proj([enorm(emb) ; hnorm(h)])` (embedding first), a pre-norm MLA
    block and a pre-norm MoE block (no SwiGLU clamp: the layer index lies beyond the limit lists, §5.7), then
    `final_layernorm`. `emb` is the embedding of the ids shifted left by one, `h` the previous hidden state (the main
    stack's after `model.norm`, or the previous MTP layer's output)."""

    def __init__(self, config: BailingMoeV3Config, layer_idx: int):
        super().__init__()
        D = config.hidden_size
        self.layer_idx = layer_idx
        self.input_layernorm = BailingMoeV3RMSNorm(D, eps=config.rms_norm_eps)
        self.enorm = BailingMoeV3RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = BailingMoeV3RMSNorm(D, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.attention = BailingMoeV3MultiLatentAttention(config, layer_idx)
        self.post_attention_layernorm = BailingMoeV3RMSNorm(D, eps=config.rms_norm_eps)
        self.mlp = BailingMoeV3SparseMoeBlock(config, layer_idx)
        self.final_layernorm = BailingMoeV3RMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, input_embeds, hidden_states, attention_mask=None, position_embeddings=None,
                past_key_values=None, use_cache=False, **kwargs):
        x = self.eh_proj(torch.cat([self.enorm(input_embeds), self.hnorm(hidden_states)], dim=-1))
        a, _ = self.attention(self.input_layernorm(x), attention_mask=attention_mask,
                              position_embeddings=position_embeddings, past_key_values=past_key_values,
                              use_cache=use_cache)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (self.final_layernorm(x),)


def shift_ids_left(ids: torch.Tensor) -> torch.Tensor:
    """MTP input ids (§2): position t gets token t+1, the last position the fill id 0 — also in a one-token decode
    step, whose MTP layer thus sees token 0."""
    out = torch.roll(ids, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


@dataclass
class TwinModelOutput(BaseModelOutputWithPast):
    mtp_hidden_states: tuple | None = None


@dataclass
class TwinCausalLMOutput(CausalLMOutputWithPast):
    mtp_logits: tuple | None = None


class BailingMoeV3PreTrainedModel(PreTrainedModel):
    config_class = BailingMoeV3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["BailingMoeV3DecoderLayer", "BailingMoeV3MTPLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True  # as the official file: 5.23 then picks sdpa by default (ORC §2)
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias"]  # fp32 params in the official file (ORC §6)

    @torch.no_grad()
    def _init_weights(self, module):
        """Random init for fresh models; after `from_pretrained` only modules that were not loaded get here — the
        rotary module, whose non-persistent `inv_freq` 5.x leaves as `empty_like` memory (ORC §1.4)."""
        std = getattr(self.config, "initializer_range", 0.006)
        if isinstance(module, BailingMoeV3RotaryEmbedding):
            if not getattr(self.config, "twin_quirk_uninit_inv_freq", False):
                module.inv_freq.copy_(module.compute_inv_freq())
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Conv1d):
            module.weight.normal_(0.0, 0.3)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, (BailingMoeV3RMSNorm, _TwinRMSNormGated)):
            module.weight.fill_(1.0)
        elif isinstance(module, BailingMoeV3KimiDeltaAttention):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            module.dt_bias.zero_()
        elif isinstance(module, BailingMoeV3Gate):
            module.weight.normal_(0.0, std)
            module.expert_bias.zero_()


class BailingMoeV3Model(BailingMoeV3PreTrainedModel):
    def __init__(self, config: BailingMoeV3Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        n = config.num_hidden_layers
        layers = [BailingMoeV3DecoderLayer(config, i) for i in range(n)]
        layers += [BailingMoeV3MTPLayer(config, n + j) for j in range(max(1, config.num_nextn_predict_layers or 0))]
        self.layers = nn.ModuleList(layers)
        self.norm = BailingMoeV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = BailingMoeV3RotaryEmbedding(config)
        self.first_mla_layer = next(i for i in range(n + 1) if is_mla_layer(config, i))
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None, **kwargs):
        cfg = self.config
        output_hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        use_cache = use_cache if use_cache is not None else cfg.use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BailingMoeV3Model: pass exactly one of input_ids / inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        B, T = inputs_embeds.shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()  # plain DynamicCache, official layout (ORC §3)
        # Mask length from the first MLA layer, as the official file does (§9); KDA layers report 0.
        past_seen = past_key_values.get_seq_length(self.first_mla_layer) if past_key_values is not None else 0
        if cache_position is None:
            start = past_seen
            if getattr(cfg, "twin_quirk_cache_len_from_layer0", False) and past_key_values is not None:
                start = past_key_values.get_seq_length(0)  # official trap: layer 0 is KDA and reports 0 (ORC §3)
            cache_position = torch.arange(start, start + T, device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0).expand(B, T)
        # Mask preparation as the official file does on 5.23 (ORC §2): the sdpa helper returns None for a plain
        # prefill; the MLA layers then build the causal mask themselves (unless twin_quirk_noncausal_sdpa).
        helper = (_prepare_4d_causal_attention_mask if cfg._attn_implementation == "eager" or output_attentions
                  else _prepare_4d_causal_attention_mask_for_sdpa)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # helper deprecation notice, still shipped in 5.23
            mask = helper(attention_mask, (B, T), inputs_embeds, past_seen)
        hidden = inputs_embeds
        pos_emb = self.rotary_emb(hidden, position_ids)
        all_hidden = () if output_hidden_states else None
        for layer in self.layers[: cfg.num_hidden_layers]:
            if output_hidden_states:
                all_hidden += (hidden,)
            hidden = layer(hidden, attention_mask=mask, position_embeddings=pos_emb,
                           past_key_values=past_key_values, use_cache=use_cache)[0]
        hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden += (hidden,)
        mtp_hidden = None
        n_mtp = cfg.num_nextn_predict_layers or 0
        if n_mtp > 0 and input_ids is not None:  # MTP layers after the main stack, chained (§2)
            mtp_hidden, ids, h = (), input_ids, hidden
            for layer in self.layers[cfg.num_hidden_layers: cfg.num_hidden_layers + n_mtp]:
                ids = shift_ids_left(ids)
                h = layer(self.word_embeddings(ids), h, attention_mask=mask, position_embeddings=pos_emb,
                          past_key_values=past_key_values, use_cache=use_cache)[0]
                mtp_hidden += (h,)
        return TwinModelOutput(last_hidden_state=hidden, past_key_values=past_key_values if use_cache else None,
                               hidden_states=all_hidden, mtp_hidden_states=mtp_hidden)


class BailingMoeV3ForCausalLM(BailingMoeV3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config: BailingMoeV3Config):
        super().__init__(config)
        self.model = BailingMoeV3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def set_input_embeddings(self, value):
        self.model.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None, logits_to_keep: int = 0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         cache_position=cache_position)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h).float()  # lm_head in the model dtype, then fp32 (§6, §8)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        mtp_logits = None
        if out.mtp_hidden_states is not None:  # lm_head on each MTP output, no model.norm in between (§2)
            mtp_logits = tuple(self.lm_head(m).float() for m in out.mtp_hidden_states)
        return TwinCausalLMOutput(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                  hidden_states=out.hidden_states, mtp_logits=mtp_logits)


__all__ = [
    "BailingMoeV3PreTrainedModel",
    "BailingMoeV3Model",
    "BailingMoeV3ForCausalLM",
]
