"""Twin MLA (q-LoRA path, Ling3-Tiny) vs transformers' `DeepseekV3Attention` (rope_interleave=True), the twin router
vs `DeepseekV3TopkRouter`, and the twin's SwiGLU clamp vs a numpy evaluation of facts §5.7 — same weights each time.

The built-in `bailing_hybrid` has no q-LoRA, so the Tiny-shaped MLA path is checked against DeepSeek-V3's MLA, which
has it. DeepSeek's MLA has no head gate: the twin's `tap_core` (attention output before the gate, [B,T,H*v]) is
compared with the input of DeepSeek's `o_proj`. Each side computes its own RoPE tables and causal mask.

Measured (`python -m pytest tests/test_twin_mla_router.py -q -p no:cacheprovider`):
  MLA core, T=48, fp32: bit-identical (max|Δ| 0, |core| ≤ 2.6) -> tolerance 2e-6 abs (fp32 summation-order room)
  router, 600 tokens, 91 of them near-ties (k-th/(k+1)-th margin < 1e-3): identical top-k sets, logits identical,
  weights max|Δ| 1.8e-7 -> tolerance 1e-6
  clamp (fp32 torch) vs numpy float64: within rtol 1e-5
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.torch_ref.twin import modeling_bailing_moe_v3 as tw
from parity.torch_ref.twin.configuration_bailing_moe_v3 import BailingMoeV3Config
from bounds import CLAMP_VS_FP64, MLA_CORE_VS_DEEPSEEK, ROUTER_VS_DEEPSEEK

D, H, QR, KVR, NOPE, ROPE, V = 64, 4, 32, 32, 16, 8, 16
E, K, G, TG = 16, 4, 4, 2


def _twin_cfg(**kw) -> BailingMoeV3Config:
    base = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=QR, kv_lora_rank=KVR,
                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rope_theta=6e6, num_experts=E,
                num_experts_per_tok=K, n_group=G, topk_group=TG, routed_scaling_factor=2.5, moe_intermediate_size=32)
    base.update(kw)
    return BailingMoeV3Config(**base)


def _ds_cfg():
    from transformers import DeepseekV3Config

    c = DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=QR,
                         kv_lora_rank=KVR, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                         rope_interleave=True, rope_theta=6e6, n_routed_experts=E, num_experts_per_tok=K, n_group=G,
                         topk_group=TG, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=False)
    c._attn_implementation = "eager"
    return c


# ----------------------------------------------------------------------------------------------- MLA
@pytest.fixture(scope="module")
def mla_pair():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    torch.manual_seed(0)
    twin = tw.BailingMoeV3MultiLatentAttention(_twin_cfg(), layer_idx=0).eval()
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 1 + 0.05 * torch.randn_like(p))
    ds = DeepseekV3Attention(_ds_cfg(), layer_idx=0).eval()
    sd = {k.replace("dense.", "o_proj."): v for k, v in twin.state_dict().items() if not k.startswith("g_proj")}
    ds.load_state_dict(sd, strict=True)
    return twin, ds


def _mla_run(twin, ds, T=48, seed=1):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, D, generator=g)
    pos = torch.arange(T).unsqueeze(0).expand(2, T)
    got = {}
    h1 = twin.tap_core.register_forward_hook(lambda m, i, o: got.__setitem__("twin", o))
    h2 = ds.o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("ds", a[0]))
    try:
        with torch.no_grad():
            rot = tw.BailingMoeV3RotaryEmbedding(twin.config)
            twin(x, attention_mask=None, position_embeddings=rot(x, pos))  # twin builds its own causal mask
            cos, sin = DeepseekV3RotaryEmbedding(ds.config)(x, pos)
            mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1).view(1, 1, T, T)
            ds(x, position_embeddings=(cos, sin), attention_mask=mask)
    finally:
        h1.remove()
        h2.remove()
    return got["twin"], got["ds"]


def test_mla_qlora_core_matches_deepseek_v3(mla_pair):
    a, b = _mla_run(*mla_pair)
    assert a.shape == b.shape == (2, 48, H * V)
    MLA_CORE_VS_DEEPSEEK.check(a, b)


def _rope_not_interleaved(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("breakage", ["scale_v_head_dim", "rope_not_interleaved", "q_a_layernorm_skipped"])
def test_mla_comparison_detects_breakage(mla_pair, monkeypatch, breakage):
    twin, ds = mla_pair
    if breakage == "scale_v_head_dim":
        monkeypatch.setattr(twin, "scaling", (NOPE + ROPE) ** -0.5 * 1.05)
    elif breakage == "rope_not_interleaved":
        monkeypatch.setattr(tw, "apply_rope_interleaved", _rope_not_interleaved)
    else:
        monkeypatch.setattr(twin.q_a_layernorm, "forward", lambda x: x)
    a, b = _mla_run(twin, ds)
    assert (a - b).abs().max() > 2e-6, f"{breakage} went unnoticed"


# ----------------------------------------------------------------------------------------------- router
@pytest.fixture(scope="module")
def router_pair():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(2)
    twin = tw.BailingMoeV3Gate(_twin_cfg()).eval()
    with torch.no_grad():
        twin.weight.copy_(torch.randn(E, D, generator=g) / D**0.5)
        # Near-tie construction: expert 5 ≈ expert 4 (same group) and expert 9 ≈ expert 1 (other group), biases equal,
        # so many tokens have a k-th / (k+1)-th margin far below the score spread.
        twin.weight[5] = twin.weight[4] + 1e-4 * torch.randn(D, generator=g)
        twin.weight[9] = twin.weight[1] + 1e-4 * torch.randn(D, generator=g)
        bias = 0.1 * (torch.rand(E, generator=g) * 2 - 1)
        bias[5], bias[9] = bias[4], bias[1]
        twin.expert_bias.copy_(bias)
    ref = DeepseekV3TopkRouter(_ds_cfg()).eval()
    with torch.no_grad():
        ref.weight.copy_(twin.weight)
        ref.e_score_correction_bias.copy_(twin.expert_bias)
    x = torch.randn(1, 600, D, generator=g)
    return twin, ref, x


def _sorted_sets(idx, w):
    order = idx.argsort(-1)
    return idx.gather(-1, order), w.gather(-1, order)


def _route(twin, ref, x):
    with torch.no_grad():
        ti, tw_, tl = twin(x)
        rl, rw, ri = ref(x)
    return (*_sorted_sets(ti.reshape(-1, K), tw_.reshape(-1, K)), tl.reshape(-1, E), *_sorted_sets(ri, rw), rl)


def test_router_matches_deepseek_v3(router_pair):
    twin, ref, x = router_pair
    ti, tw_, tl, ri, rw, rl = _route(twin, ref, x)
    # the near-ties are really there: margin between k-th and (k+1)-th biased score (among kept groups) < 1e-3
    biased = (torch.sigmoid(rl) + twin.expert_bias).sort(-1, descending=True).values
    near = int(((biased[:, K - 1] - biased[:, K]).abs() < 1e-3).sum())  # not-a-bound: counts constructed near-ties
    assert near >= 20, f"only {near} near-tie tokens constructed"
    assert torch.equal(ti, ri), f"top-k sets differ on {(ti != ri).any(-1).sum()} of {len(ti)} tokens"
    ROUTER_VS_DEEPSEEK.check(tw_, rw)
    ROUTER_VS_DEEPSEEK.check(tl, rl)
    assert len(torch.unique(ti)) == E  # routing is spread, not degenerate


@pytest.mark.parametrize("breakage", ["bias_in_weights", "group_top1", "no_bias_in_selection"])
def test_router_comparison_detects_breakage(router_pair, monkeypatch, breakage):
    twin, ref, x = router_pair
    if breakage == "bias_in_weights":  # weights from biased scores (a classic port bug, §5.4)
        orig = twin.forward

        def fwd(h):
            idx, w, logits = orig(h)
            s = (torch.sigmoid(logits) + twin.expert_bias).gather(-1, idx)
            return idx, s / s.sum(-1, keepdim=True) * twin.routed_scaling_factor, logits

        monkeypatch.setattr(twin, "forward", fwd)
    elif breakage == "group_top1":  # group score = max instead of top-2 sum (§5.3)
        orig_topk = torch.Tensor.topk

        def topk(self, k, *a, **kw):
            return orig_topk(self, 1 if k == 2 else k, *a, **kw)

        monkeypatch.setattr(torch.Tensor, "topk", topk)
    else:
        monkeypatch.setattr(twin, "expert_bias", torch.zeros(E))
    ti, tw_, tl, ri, rw, rl = _route(twin, ref, x)
    assert not (torch.equal(ti, ri) and ROUTER_VS_DEEPSEEK.usage(tw_, rw) <= 1), f"{breakage} went unnoticed"


# ----------------------------------------------------------------------------------------------- SwiGLU clamp
@pytest.mark.parametrize("limit", [None, 1.0, 4.0])
def test_swiglu_clamp_matches_numpy_formula(limit):
    """§5.7: h = min(silu(gate x), L) · clip(up x, −L, L), evaluated in float64 numpy; limit None = plain SwiGLU."""
    torch.manual_seed(3)
    mlp = tw.BailingMoeV3MLP(_twin_cfg(), 32, swiglu_limit=limit).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)  # large enough that L = 1 and 4 both bite
        x = torch.randn(5, 7, D)
        got = mlp(x).double().numpy()
    xn = x.double().numpy()
    g = xn @ mlp.gate_proj.weight.detach().double().numpy().T
    u = xn @ mlp.up_proj.weight.detach().double().numpy().T
    s = g / (1 + np.exp(-g))
    if limit is not None:
        assert (s > limit).any() and (np.abs(u) > limit).any(), "clamp must bite for this test to mean anything"
        s, u = np.minimum(s, limit), np.clip(u, -limit, limit)
    want = (s * u) @ mlp.down_proj.weight.detach().double().numpy().T
    CLAMP_VS_FP64.check(got / np.abs(want).max(), want / np.abs(want).max())
    if limit is not None:  # the check fails without the clamp
        mlp.swiglu_limit = None
        with torch.no_grad():
            assert np.abs(mlp(x).double().numpy() - want).max() > 1e-3
