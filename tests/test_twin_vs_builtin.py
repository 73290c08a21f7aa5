"""Twin remote code vs transformers 5.23's built-in `bailing_hybrid` (an independently written Ling 3 port), and the
twin's KDA maths vs fla's naive reference — both independent of this project's code.

Setup: one Flash-shaped random checkpoint (`tiny-flash` preset, fp32 weights, official layout, ragged MLA tail 5-7).
The built-in loads it with `trust_remote_code=False` and a `layer_types` override (the ragged tail, ORC §6); the twin
loads it as remote code with the SwiGLU clamp off (the built-in has none). Both eager, fp32.

Measured (2-core CPU, torch 2.13, `python -m pytest tests/test_twin_vs_builtin.py -q -p no:cacheprovider`):
  prefill 40 tokens (recurrent KDA path): per-layer rel-L2 ≤ 3.1e-6, logits max|Δ| 2.6e-5 (|logits| ≤ 3.8)
  prefill 100 tokens (chunked KDA path):  per-layer rel-L2 ≤ 5.6e-6, logits max|Δ| 6.0e-5 (|logits| ≤ 4.4)
  prefill 40 / 70 + 5 decode steps (explicit positions): logits max|Δ| ≤ 1.5e-5 at every step
  (official vs built-in in ORC §4: ≤ 3e-6 per layer, 5.6e-5 at 150 tokens.)
Tolerances: per-layer rel-L2 ≤ 2e-5 and logits max|Δ| ≤ 4e-4 (tests/bounds.py TWIN_REL_L2, TWIN_LOGIT_ABS: ≥ ×3
over the largest measured, with the AVX2 caps too, issue 35; they were 1e-5 and 1e-4, DESIGN §5's fp32 tier, and
the logits one failed under the AVX2 caps: 1.13e-4).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from bounds import (FP32_FORMULA_VS_FP64, FP32_GATE_VS_FP64, PREFIX_GAP, ROPE_INV_FREQ_FP32, TWIN_KDA_VS_FLA_NAIVE,
                    TWIN_LOGIT_ABS, TWIN_REL_L2)

REL_TOL = TWIN_REL_L2
LOGIT_ABS_TOL = TWIN_LOGIT_ABS
RAGGED_LAYER_TYPES = ["linear_attention"] * 5 + ["full_attention"] * 3  # tiny-flash: group 6, n 8 -> MLA 5, 6, 7


@contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update(kv)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_twin(path: Path, **overrides):
    from transformers import AutoModelForCausalLM

    with _env(LING3_TWIN_KERNELS="torch", HF_HUB_OFFLINE="1"):
        m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                 attn_implementation="eager", **overrides)
    return m.eval()


@pytest.fixture(scope="module")
def pair(tiny_flash_fp32_ckpt):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # the built-in reports the MTP layer's keys as unexpected: expected
    native = AutoModelForCausalLM.from_pretrained(tiny_flash_fp32_ckpt, trust_remote_code=False, dtype=torch.float32,
                                                  layer_types=RAGGED_LAYER_TYPES, attn_implementation="eager").eval()
    twin = load_twin(tiny_flash_fp32_ckpt, twin_apply_swiglu_clamp=False)
    return native, twin


def _ids(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (1, T), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def compare_prefill(native, twin, ids) -> tuple[list[float], float]:
    with torch.no_grad():
        a = native(ids, output_hidden_states=True)
        b = twin(ids, output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states) == twin.config.num_hidden_layers + 1
    rels = [_rel(y, x) for x, y in zip(a.hidden_states, b.hidden_states)]
    return rels, (a.logits - b.logits).abs().max().item()


def test_classes_come_from_where_they_should(pair):
    native, twin = pair
    assert type(native).__module__ == "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
    assert type(twin).__module__.startswith("transformers_modules."), type(twin).__module__
    assert type(twin).__module__.endswith(".modeling_bailing_moe_v3")
    assert type(twin).__name__ == "BailingMoeV3ForCausalLM"
    kinds = [type(l.attention).__name__ for l in twin.model.layers]
    assert kinds == ["BailingMoeV3KimiDeltaAttention"] * 5 + ["BailingMoeV3MultiLatentAttention"] * 3 + [
        "BailingMoeV3MultiLatentAttention"]  # + MTP layer 8, built and loaded, never run


@pytest.mark.parametrize("T", [40, 100], ids=["T40_recurrent", "T100_chunked"])
def test_prefill_matches_builtin(pair, T):
    native, twin = pair
    rels, dlogit = compare_prefill(native, twin, _ids(T))
    bad = {i: r for i, r in enumerate(rels) if r > REL_TOL}
    assert not bad, f"T={T}: hidden-state rel-L2 above {REL_TOL} at layers {bad} (all: {rels})"
    assert dlogit <= LOGIT_ABS_TOL, f"T={T}: logits max|Δ| = {dlogit:.3g} > {LOGIT_ABS_TOL}"


@pytest.mark.parametrize("T", [40, 70], ids=["prefill40", "prefill70"])
def test_decode_matches_builtin(pair, T):
    """Prefill then 5 greedy decode steps, each with explicit position_ids (+ cache_position for the twin).
    Measured: logits max|Δ| ≤ 1.5e-5 at every step (module docstring)."""
    native, twin = pair
    ids = _ids(T, seed=1)
    with torch.no_grad():
        a = native(ids, use_cache=True)
        b = twin(ids, use_cache=True)
        pa, pb = a.past_key_values, b.past_key_values
        tok = a.logits[:, -1:].argmax(-1)
        for step in range(5):
            pos = torch.tensor([[T + step]])
            a = native(tok, past_key_values=pa, position_ids=pos, use_cache=True)
            b = twin(tok, past_key_values=pb, position_ids=pos, cache_position=pos[0], use_cache=True)
            d = (a.logits - b.logits).abs().max().item()
            assert d <= LOGIT_ABS_TOL, f"decode step {step + 1} after a {T}-token prefill: logits max|Δ| = {d:.3g}"
            tok = a.logits[:, -1:].argmax(-1)


# ---------------------------------------------------------------- the comparison must fail when the twin is broken
def _break_kda_gate(twin):
    twin.model.layers[2].attention.lower_bound = -4.0  # wrong lower bound in one KDA layer (§3.5)


def _break_mla_scale(twin):
    a = twin.model.layers[5].attention
    a.scaling = a.v_dim ** -0.5  # v_head_dim instead of qk_head_dim (§4.4)


def _break_router_scaling(twin):
    twin.model.layers[3].mlp.gate.routed_scaling_factor = 2.0  # §5.4: 2.5 expected


def _break_beta(twin):
    lay = twin.model.layers[1].attention
    orig = lay.b_proj.forward
    lay.b_proj.forward = lambda x: 1.01 * orig(x)


@pytest.mark.parametrize("breaker", [_break_kda_gate, _break_mla_scale, _break_router_scaling, _break_beta])
def test_comparison_detects_a_broken_twin(tiny_flash_fp32_ckpt, pair, breaker):
    native, _ = pair
    twin = load_twin(tiny_flash_fp32_ckpt, twin_apply_swiglu_clamp=False)
    breaker(twin)
    rels, dlogit = compare_prefill(native, twin, _ids(100))
    assert max(rels) > REL_TOL and dlogit > LOGIT_ABS_TOL, f"{breaker.__name__} went unnoticed: {rels}, {dlogit}"


def test_swiglu_clamp_is_active_in_tiny_flash(tiny_flash_fp32_ckpt, pair):
    """With the clamp on (twin default) the routed/shared limits of layers 5-7 bite, so the twin departs from the
    clamp-less built-in exactly from layer 5 on (layers 0-4 stay within tolerance)."""
    native, _ = pair
    twin = load_twin(tiny_flash_fp32_ckpt)
    assert twin.config.twin_apply_swiglu_clamp is True
    rels, _ = compare_prefill(native, twin, _ids(40))
    assert max(rels[:6]) <= REL_TOL, rels  # hidden_states[i] is the input of layer i: 0..5 untouched
    assert min(rels[6:]) > 1e-3, rels


# ---------------------------------------------------------------- twin KDA maths vs fla's naive reference
def _fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed (needed only for its naive KDA reference)")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    s = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def _kda_inputs(T: int, seed: int = 0):
    from parity.torch_ref.twin import modeling_bailing_moe_v3 as tw

    g = torch.Generator().manual_seed(seed)
    B, H, K = 2, 3, 16
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, a = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    A_log, dt_bias = torch.rand(H, generator=g) * 2.7, 0.1 * r(H * K)
    gate = tw.kda_gate(a, A_log, dt_bias, -5.0)
    beta = torch.rand(B, T, H, generator=g)
    return tw.l2_normalize(q), tw.l2_normalize(k), v, gate, beta, r(B, H, K, K), (a, A_log, dt_bias)


@pytest.mark.parametrize("fn", ["kda_recurrent", "kda_chunked"])
def test_twin_kda_matches_fla_naive(fn):
    """Measured vs fla naive_recurrent_kda (T=150, initial state): recurrent ≤ 6e-8, chunked ≤ 1.3e-6 abs
    (|o| ≤ 0.4). Tolerance 5e-6 abs. A 1 % error in beta is caught (perturbation below)."""
    from parity.torch_ref.twin import modeling_bailing_moe_v3 as tw

    naive = _fla_naive()
    q, k, v, gate, beta, S0, _ = _kda_inputs(150)
    ref_o, ref_S = naive.naive_recurrent_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    o, S = getattr(tw, fn)(q, k, v, gate, beta, 16 ** -0.5, initial_state=S0)
    TWIN_KDA_VS_FLA_NAIVE.check(o, ref_o)
    TWIN_KDA_VS_FLA_NAIVE.check(S, ref_S)
    o_bad, _ = getattr(tw, fn)(q, k, v, gate, beta * 1.01, 16 ** -0.5, initial_state=S0)
    assert TWIN_KDA_VS_FLA_NAIVE.usage(o_bad, ref_o) > 1


def test_twin_kda_gate_and_l2norm_formulas():
    """Gate forms and L2 norm vs the formulas of env_notes/facts §3.3, §3.5 evaluated in float64 numpy."""
    import numpy as np

    from parity.torch_ref.twin import modeling_bailing_moe_v3 as tw

    *_, (a, A_log, dt_bias) = _kda_inputs(7)
    an, Al, dt = a.double().numpy(), A_log.double().numpy(), dt_bias.double().numpy().reshape(3, 16)
    x = an + dt
    rate = np.exp(Al)[:, None]
    lb = -5.0 * (1 / (1 + np.exp(-rate * x)))
    sp = -rate * np.log1p(np.exp(x))
    FP32_GATE_VS_FP64.check(tw.kda_gate(a, A_log, dt_bias, -5.0).numpy(), lb)
    FP32_GATE_VS_FP64.check(tw.kda_gate(a, A_log, dt_bias, None).numpy(), sp)
    qn = an / np.sqrt((an**2).sum(-1, keepdims=True) + 1e-6)
    FP32_FORMULA_VS_FP64.check(tw.l2_normalize(a).numpy(), qn)


# ---------------------------------------------------------------- official-quirk switches (default off)
def _prefix_gap(model, ids, n=10) -> float:
    """Causality probe: logits of the first n positions from the full prompt vs from the n-token prefix."""
    with torch.no_grad():
        return (model(ids).logits[:, :n] - model(ids[:, :n]).logits).abs().max().item()


def test_quirk_noncausal_sdpa(tiny_ckpt):
    """Default attn_implementation is sdpa (as for the official file); the sdpa mask helper then yields None for a
    plain prefill. Twin: still causal (gap ~5e-6); quirk on: MLA attends bidirectionally (measured gap ~2.1)."""
    from transformers import AutoModelForCausalLM

    ids = _ids(30)
    with _env(LING3_TWIN_KERNELS="torch"):
        ok = AutoModelForCausalLM.from_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32)
        bad = AutoModelForCausalLM.from_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32,
                                                   twin_quirk_noncausal_sdpa=True)
    assert ok.config._attn_implementation == "sdpa"
    assert _prefix_gap(ok, ids) < PREFIX_GAP
    assert _prefix_gap(bad, ids) > 0.1


def test_quirk_uninit_inv_freq(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    cfg = load_twin(tiny_ckpt).config
    r = cfg.qk_rope_head_dim
    want = torch.tensor([cfg.rope_theta ** (-2 * j / r) for j in range(r // 2)], dtype=torch.float64).float()
    ok = AutoModelForCausalLM.from_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32)
    bad = AutoModelForCausalLM.from_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32,
                                               twin_quirk_uninit_inv_freq=True)
    ROPE_INV_FREQ_FP32.check(ok.model.rotary_emb.inv_freq, want)
    assert not ROPE_INV_FREQ_FP32.usage(bad.model.rotary_emb.inv_freq, want) <= 1000  # off by > 1e-3 relative, or NaN (uninitialised memory)


@pytest.mark.parametrize("quirk", [False, True])
def test_manual_decode_without_positions(tiny_ckpt, quirk):
    """Manual decode with no position_ids / cache_position. Twin: positions from the first MLA layer's cache, equal
    to the full forward (≤ 1.2e-5 measured); quirk on: positions from layer 0 (KDA, reports 0) — logits off (~1-2)."""
    m = load_twin(tiny_ckpt, twin_quirk_cache_len_from_layer0=quirk)
    ids = _ids(24, seed=3)
    with torch.no_grad():
        full = m(ids).logits
        out = m(ids[:, :20], use_cache=True)
        pkv, gaps = out.past_key_values, []
        for t in range(20, 24):
            out = m(ids[:, t:t + 1], past_key_values=pkv, use_cache=True)
            gaps.append((out.logits[0, -1] - full[0, t]).abs().max().item())
    if quirk:
        assert min(gaps) > 0.05, gaps
    else:
        assert max(gaps) < PREFIX_GAP, gaps


# ---------------------------------------------------------------- fla kernel dispatch contract (ORC §1.1)
def test_fla_dispatch_calls_kernels_like_the_official_file(tiny_ckpt, monkeypatch):
    """With `fla.ops.kda` / `fla.modules` importable, the KDA layers call chunk_kda / fused_recurrent_kda with the
    official arguments (raw g = f_proj(x), fp32 sigmoided beta, A_log/dt_bias, gate + L2 norm in kernel, lower_bound,
    safe_gate for chunk only, initial_state, output_final_state) and use ShortConvolution / FusedRMSNormGated.
    The fake kernels here are adapters over fla's naive reference (gate and L2 norm applied as documented), so the
    fla-dispatched twin must reproduce the pure-PyTorch twin's logits. Measured logits max|Δ|: T=30 (recurrent on
    both sides) ~1e-6; T=70 (naive recurrent vs the twin's chunked form) 7.9e-5 -> LOGIT_ABS_TOL (×3 over it)."""
    import sys
    import types

    from safetensors.torch import load_file

    from parity.torch_ref.twin import modeling_bailing_moe_v3 as tw

    naive = _fla_naive()
    calls = []

    def make_kernel(name):
        def kernel(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, lower_bound=None, **kw):
            calls.append(dict(name=name, g_dtype=g.dtype, g_shape=tuple(g.shape), beta_dtype=beta.dtype,
                              beta_shape=tuple(beta.shape), gate=use_gate_in_kernel, l2=use_qk_l2norm_in_kernel,
                              lb=lower_bound, extra=sorted(kw), init=initial_state is not None, final=output_final_state))
            H, d = g.shape[-2:]
            x = g.float() + dt_bias.float().view(H, d)
            gate = lower_bound * torch.sigmoid(A_log.float().exp().view(H, 1) * x)
            l2 = lambda t: t.float() / torch.sqrt(t.float().pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
            return naive.naive_recurrent_kda(l2(q), l2(k), v.float(), gate, beta, initial_state=initial_state,
                                             output_final_state=True)
        return kernel

    fla = types.ModuleType("fla")
    ops, kda, modules = (types.ModuleType(n) for n in ("fla.ops", "fla.ops.kda", "fla.modules"))
    kda.chunk_kda, kda.fused_recurrent_kda = make_kernel("chunk"), make_kernel("recurrent")
    modules.ShortConvolution, modules.FusedRMSNormGated = tw._TwinShortConvolution, tw._TwinRMSNormGated
    fla.ops, ops.kda, fla.modules = ops, kda, modules
    for name, mod in {"fla": fla, "fla.ops": ops, "fla.ops.kda": kda, "fla.modules": modules}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("chunk_kda", "fused_recurrent_kda", "ShortConvolution", "FusedRMSNormGated"):
        monkeypatch.setattr(tw, name, None)  # restored after the test: later builds re-resolve
    monkeypatch.delenv("LING3_TWIN_KERNELS", raising=False)

    cfg = tw.BailingMoeV3Config.from_pretrained(tiny_ckpt)
    sd = {}
    for f in sorted(tiny_ckpt.glob("model-*.safetensors")):
        sd.update(load_file(f))
    with_fla = tw.BailingMoeV3ForCausalLM(cfg).float().eval()
    assert with_fla.model.layers[0].attention.use_fla
    with_fla.load_state_dict(sd, strict=True)
    monkeypatch.setenv("LING3_TWIN_KERNELS", "torch")
    plain = tw.BailingMoeV3ForCausalLM(cfg).float().eval()
    assert not plain.model.layers[0].attention.use_fla
    plain.load_state_dict(sd, strict=True)
    plain.model.rotary_emb.inv_freq.copy_(with_fla.model.rotary_emb.inv_freq)
    for T in (30, 70):
        ids = _ids(T)
        with torch.no_grad():
            torch.testing.assert_close(with_fla(ids).logits, plain(ids).logits, atol=LOGIT_ABS_TOL, rtol=0)
    n_kda = len(cfg_kda := [i for i in range(cfg.num_hidden_layers) if not tw.is_mla_layer(cfg, i)])
    assert [c["name"] for c in calls] == ["recurrent"] * n_kda + ["chunk"] * n_kda, cfg_kda
    for c in calls:
        assert c["g_dtype"] == torch.float32 and c["g_shape"][-2:] == (cfg.num_attention_heads, cfg.head_dim)
        assert c["beta_dtype"] == torch.float32 and len(c["beta_shape"]) == 3
        assert c["gate"] and c["l2"] and c["lb"] == cfg.kda_lower_bound and c["final"]
        assert c["extra"] == (["safe_gate"] if c["name"] == "chunk" else [])
