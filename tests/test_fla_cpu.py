"""fla CPU stand-ins (`parity.torch_ref.fla_cpu`) against independent references: fla-core's own pure-PyTorch
`naive_recurrent_kda` / `naive_chunk_kda` (loaded by file path; fla's Triton modules do not import here), the gate /
l2norm / conv / norm formulas written out below in float64 numpy or plain torch ops, and each other (chunk vs
recurrent). Every comparison has a twin test showing it fails on a broken subject.

Measured (2-core CPU, torch 2.13, `python -m pytest tests/test_fla_cpu.py -q -p no:cacheprovider`, fp32, B=2, H=3,
K=16, V=12, non-zero initial state):
  fused_recurrent_kda vs naive_recurrent_kda: rel-L2 ≤ 1.1e-7 (o), ≤ 6.2e-8 (state), T ∈ {1, 63, 64, 65, 200}
  chunk_kda           vs naive_recurrent_kda: rel-L2 ≤ 1.9e-6 (o), ≤ 2.6e-6 (state)
  vs naive_chunk_kda (T=128): chunk_kda 5.9e-8 (o) / 4.5e-8 (state); fused_recurrent_kda 1.1e-6 / 2.9e-6
  full in-kernel path (raw gate + A_log/dt_bias, l2norm, beta sigmoid) vs naive on test-computed inputs, T=70:
    recurrent ≤ 1.5e-7, chunk ≤ 1.6e-6 (both gate forms)
  chunk_kda vs fused_recurrent_kda (raw inputs, T ∈ {1, 63, 64, 65, 200}): ≤ 2.3e-6
Tolerance: rel-L2 ≤ 1e-5 — the fp32 tier (~1e-5 relative, DESIGN §5).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parity.errors import ParityError
from parity.torch_ref import fla_cpu as fc
from bounds import (BF16_ONE_ROUNDING, FLA_CPU_REL_L2, FP32_FORMULA_VS_FP64, FP32_GATE_VS_FP64, FP32_OP_VS_FP64,
                    FP32_REORDERED, ROPE_INV_FREQ_FP32)

REL_TOL = FLA_CPU_REL_L2
B, H, K, V = 2, 3, 16, 12


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def naive():
    spec = None if fc.is_installed() else importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed (its naive KDA reference is needed)")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    s = importlib.util.spec_from_file_location("_fla_kda_naive_ref", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_rel(a, b, what: str, tol: float = REL_TOL) -> None:
    r = rel(a, b)
    assert r <= tol, f"{what}: rel-L2 {r:.3g} > {tol:g}"


def gate_lower_bound_np(a, A_log, dt_bias, lb):
    """fla's documented lower-bound gate (env_notes): g = lb · sigmoid(exp(A_log[h]) · (a + dt_bias)), float64."""
    Hh, Kk = a.shape[-2], a.shape[-1]
    x = a.double().numpy() + dt_bias.double().numpy().reshape(Hh, Kk)
    z = np.exp(A_log.double().numpy())[:, None] * x
    return torch.from_numpy(lb / (1.0 + np.exp(-z)))


def gate_softplus_np(a, A_log, dt_bias):
    """fla's documented default gate (env_notes): g = −exp(A_log[h]) · softplus(a + dt_bias), float64."""
    Hh, Kk = a.shape[-2], a.shape[-1]
    x = a.double().numpy() + dt_bias.double().numpy().reshape(Hh, Kk)
    return torch.from_numpy(-np.exp(A_log.double().numpy())[:, None] * np.logaddexp(0.0, x))


def l2norm_np(x):
    """facts §3.3: x / sqrt(Σx² + 1e-6), float64."""
    xn = x.double().numpy()
    return torch.from_numpy(xn / np.sqrt((xn**2).sum(-1, keepdims=True) + 1e-6))


def raw_inputs(T: int, seed: int = 0, Hq: int = H, HV: int = H):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        q=r(B, T, Hq, K), k=r(B, T, Hq, K), v=r(B, T, HV, V), a=r(B, T, HV, K),
        A_log=torch.rand(HV, generator=g) * 2.7, dt_bias=0.1 * r(HV * K), b_logit=r(B, T, HV),
        S0=0.5 * r(B, HV, K, V),
    )


def gated_inputs(T: int, seed: int = 0):
    """Inputs as the naive references want them (normalised q/k, gated g, sigmoided beta), computed in the test."""
    x = raw_inputs(T, seed)
    q, k = l2norm_np(x["q"]).float(), l2norm_np(x["k"]).float()
    gate = gate_lower_bound_np(x["a"], x["A_log"], x["dt_bias"], -5.0).float()
    beta = torch.sigmoid(x["b_logit"].double()).float()
    return q, k, x["v"], gate, beta, x["S0"]


# ----------------------------------------------------------------------------------------------- KDA vs fla naive
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
def test_kda_matches_fla_naive_recurrent(naive, fn, T):
    q, k, v, gate, beta, S0 = gated_inputs(T)
    ref_o, ref_S = naive.naive_recurrent_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    o, S = getattr(fc, fn)(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    assert o.dtype == q.dtype and S.dtype == torch.float32
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    assert_rel(o, ref_o, f"{fn} o, T={T}")
    assert_rel(S, ref_S, f"{fn} final state, T={T}")


@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
def test_kda_matches_fla_naive_chunk(naive, fn):
    """naive_chunk_kda needs T % 64 == 0: T = 128 (two chunks, the state crosses a chunk boundary)."""
    q, k, v, gate, beta, S0 = gated_inputs(128, seed=3)
    ref_o, ref_S = naive.naive_chunk_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    o, S = getattr(fc, fn)(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    assert_rel(o, ref_o, f"{fn} o vs naive_chunk_kda")
    assert_rel(S, ref_S, f"{fn} state vs naive_chunk_kda")


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
def test_in_kernel_gate_l2norm_beta_match_documented_formulas(naive, fn, lower_bound):
    """The official call (ORC §1.1): raw g + A_log + dt_bias, use_gate_in_kernel, use_qk_l2norm_in_kernel, and
    beta logits with use_beta_sigmoid_in_kernel — vs naive fed with the same quantities computed by the test."""
    T = 70
    x = raw_inputs(T, seed=5)
    gate = (gate_lower_bound_np(x["a"], x["A_log"], x["dt_bias"], lower_bound) if lower_bound is not None
            else gate_softplus_np(x["a"], x["A_log"], x["dt_bias"])).float()
    q, k = l2norm_np(x["q"]).float(), l2norm_np(x["k"]).float()
    beta = torch.sigmoid(x["b_logit"].double()).float()
    ref_o, ref_S = naive.naive_recurrent_kda(q, k, x["v"], gate, beta, initial_state=x["S0"], output_final_state=True)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["S0"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=lower_bound)
    o, S = getattr(fc, fn)(x["q"], x["k"], x["v"], x["a"], x["b_logit"], **kw)
    assert_rel(o, ref_o, f"{fn} o ({lower_bound=})")
    assert_rel(S, ref_S, f"{fn} state ({lower_bound=})")


def test_gate_and_l2norm_functions_match_formulas():
    x = raw_inputs(9, seed=7)
    FP32_GATE_VS_FP64.check(fc.kda_gate(x["a"], x["A_log"], x["dt_bias"], -5.0).double(),
                            gate_lower_bound_np(x["a"], x["A_log"], x["dt_bias"], -5.0))
    FP32_GATE_VS_FP64.check(fc.kda_gate(x["a"], x["A_log"], x["dt_bias"], None).double(),
                            gate_softplus_np(x["a"], x["A_log"], x["dt_bias"]))
    FP32_FORMULA_VS_FP64.check(fc.l2_normalize(x["q"]).double(), l2norm_np(x["q"]))
    g = fc.kda_gate(x["a"], x["A_log"], x["dt_bias"], -5.0)
    assert bool(((g >= -5.0) & (g <= 0)).all())  # lower-bound form: (lb, 0), closed once σ saturates in fp32


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_equals_recurrent(T):
    """Two independent forms of the same recurrence (§3.6), raw official-style inputs."""
    x = raw_inputs(T, seed=11)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["S0"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)
    beta = torch.sigmoid(x["b_logit"])
    o1, S1 = fc.fused_recurrent_kda(x["q"], x["k"], x["v"], x["a"], beta, **kw)
    o2, S2 = fc.chunk_kda(x["q"], x["k"], x["v"], x["a"], beta, safe_gate=True, **kw)
    assert_rel(o2, o1, f"chunk vs recurrent o, T={T}")
    assert_rel(S2, S1, f"chunk vs recurrent state, T={T}")


def test_prefill_then_decode_equals_full(naive):
    """chunk prefill of P tokens + recurrent steps from its state == one call over all tokens (DESIGN §6)."""
    q, k, v, gate, beta, S0 = gated_inputs(90, seed=13)
    o_full, S_full = naive.naive_recurrent_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    P = 70
    o_p, S = fc.chunk_kda(q[:, :P], k[:, :P], v[:, :P], gate[:, :P], beta[:, :P], initial_state=S0,
                          output_final_state=True)
    outs = [o_p]
    for t in range(P, 90):
        o_t, S = fc.fused_recurrent_kda(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate[:, t:t + 1],
                                        beta[:, t:t + 1], initial_state=S, output_final_state=True)
        outs.append(o_t)
    assert_rel(torch.cat(outs, 1), o_full, "prefill(70)+decode(20) o")
    assert_rel(S, S_full, "prefill(70)+decode(20) state")


# ---------------------------------------------------------------- the KDA comparisons fail on a broken stand-in
def _broken_gate(monkeypatch):
    real = fc.kda_gate
    monkeypatch.setattr(fc, "kda_gate", lambda g, A, dt, lb: real(g, A, dt, None if lb is None else lb * 0.99))


def _broken_beta_sigmoid(monkeypatch):
    real = fc.kda_beta
    monkeypatch.setattr(fc, "kda_beta", lambda b, use, neg=False: real(b, use, neg) * 1.01)


def _broken_l2norm(monkeypatch):
    monkeypatch.setattr(fc.l2_normalize, "__defaults__", (1e-1,))  # eps 0.1 instead of 1e-6 (§3.3)


def _broken_recurrence_order(monkeypatch):
    """Read-out before the state update instead of after it (§3.6)."""

    def wrong(q, k, v, g, beta, scale, S0):
        Bb, T, HV, Kk = q.shape
        S = q.new_zeros(Bb, HV, Kk, v.shape[-1]) if S0 is None else S0.float().clone()
        o = q.new_zeros(Bb, T, HV, v.shape[-1])
        for t in range(T):
            S = S * torch.exp(g[:, t]).unsqueeze(-1)
            o[:, t] = (S * (scale * q[:, t]).unsqueeze(-1)).sum(-2)
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - (S * k[:, t].unsqueeze(-1)).sum(-2))
            S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        return o, S

    monkeypatch.setattr(fc, "kda_recurrent_core", wrong)


@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
@pytest.mark.parametrize("breaker", [_broken_gate, _broken_beta_sigmoid, _broken_l2norm])
def test_in_kernel_comparison_detects_broken_stand_in(naive, monkeypatch, fn, breaker):
    breaker(monkeypatch)
    with pytest.raises(AssertionError, match="rel-L2"):
        test_in_kernel_gate_l2norm_beta_match_documented_formulas(naive, fn, -5.0)


def test_naive_comparison_detects_broken_recurrence(naive, monkeypatch):
    _broken_recurrence_order(monkeypatch)
    with pytest.raises(AssertionError, match="rel-L2"):
        test_kda_matches_fla_naive_recurrent(naive, "fused_recurrent_kda", 65)


def test_chunk_vs_recurrent_detects_broken_chunking(monkeypatch):
    real = fc.kda_chunk_core

    def drop_state(q, k, v, g, beta, scale, S0, chunk_size=64):
        return real(q, k, v, g, beta, scale, None, chunk_size=chunk_size)  # forgets the initial state

    monkeypatch.setattr(fc, "kda_chunk_core", drop_state)
    with pytest.raises(AssertionError, match="rel-L2"):
        test_chunk_equals_recurrent(65)


def test_chunk_size_does_not_change_the_maths():
    """Sanity of the chunked form itself: chunk 32 == chunk 64 (fla allows both)."""
    q, k, v, gate, beta, S0 = gated_inputs(100, seed=17)
    o1, S1 = fc.chunk_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True, chunk_size=32)
    o2, S2 = fc.chunk_kda(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
    assert_rel(o1, o2, "chunk 32 vs 64 o")
    assert_rel(S1, S2, "chunk 32 vs 64 state")


# ----------------------------------------------------------------------------------------------- KDA API details
def test_gva_varlen_state_v_first_and_dtypes(naive):
    # GVA: 2 q/k heads, 4 value heads -> naive repeats q/k per value head group.
    x = raw_inputs(40, seed=19, Hq=2, HV=4)
    gate = gate_lower_bound_np(x["a"], x["A_log"], x["dt_bias"], -5.0).float()
    q, k = l2norm_np(x["q"]).float(), l2norm_np(x["k"]).float()
    beta = torch.sigmoid(x["b_logit"])
    ref_o, ref_S = naive.naive_recurrent_kda(q, k, x["v"], gate, beta, initial_state=x["S0"], output_final_state=True)
    for fn in (fc.fused_recurrent_kda, fc.chunk_kda):
        o, S = fn(q, k, x["v"], gate, beta, initial_state=x["S0"], output_final_state=True)
        assert_rel(o, ref_o, f"{fn.__name__} GVA o")
        assert_rel(S, ref_S, f"{fn.__name__} GVA state")
        # state_v_first: [N,HV,V,K] in and out
        o_t, S_t = fn(q, k, x["v"], gate, beta, initial_state=x["S0"].transpose(-1, -2).contiguous(),
                      output_final_state=True, state_v_first=True)
        FP32_REORDERED.check(o_t, o)  # only the memory layout (summation order) differs
        FP32_REORDERED.check(S_t, S.transpose(-1, -2))
    # varlen: two sequences packed into B=1 == two separate calls
    q, k, v, gate, beta, S0 = gated_inputs(50, seed=23)
    packed = [t.reshape(1, 100, *t.shape[2:]) for t in (q, k, v, gate, beta)]
    cu = torch.tensor([0, 50, 100])
    for fn in (fc.fused_recurrent_kda, fc.chunk_kda):
        o_p, S_p = fn(*packed, initial_state=S0, output_final_state=True, cu_seqlens=cu)
        o_s, S_s = fn(q, k, v, gate, beta, initial_state=S0, output_final_state=True)
        FP32_REORDERED.check(o_p.reshape(2, 50, H, V), o_s)
        FP32_REORDERED.check(S_p, S_s)
    # bf16 in -> o in bf16, state fp32; output_final_state=False -> None
    o, S = fc.chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, beta, initial_state=S0)
    assert o.dtype == torch.bfloat16 and S is None


def test_kda_bad_inputs_raise_clear_errors():
    q, k, v, gate, beta, S0 = gated_inputs(8)
    with pytest.raises(ParityError, match=r"g must be \[B,T,HV,K\]"):
        fc.chunk_kda(q, k, v, gate[..., :-1], beta)
    with pytest.raises(ParityError, match="beta must be"):
        fc.fused_recurrent_kda(q, k, v, gate, beta[..., :1])
    with pytest.raises(ParityError, match="safe range"):
        fc.chunk_kda(q, k, v, gate, beta, use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0,
                     A_log=torch.zeros(H))
    with pytest.raises(ParityError, match="A_log is required"):
        fc.fused_recurrent_kda(q, k, v, gate, beta, use_gate_in_kernel=True)
    with pytest.raises(ParityError, match="batch size must be 1"):
        fc.chunk_kda(q, k, v, gate, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(NotImplementedError, match="never calls it"):
        fc.chunk_simple_gla(q, k, v)


def test_observer_reports_kernel_internals():
    x = raw_inputs(20, seed=29)
    seen = []
    fc.set_kda_observer(seen.append)
    try:
        o, S = fc.fused_recurrent_kda(x["q"], x["k"], x["v"], x["a"], x["b_logit"], A_log=x["A_log"],
                                      dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, output_final_state=True)
    finally:
        fc.set_kda_observer(None)
    fc.chunk_kda(x["q"], x["k"], x["v"], x["a"].clamp(max=0), torch.sigmoid(x["b_logit"]))  # not observed any more
    assert len(seen) == 1
    d = seen[0]
    assert d["kernel"] == "recurrent"
    FP32_GATE_VS_FP64.check(d["gate"].double(), gate_lower_bound_np(x["a"], x["A_log"], x["dt_bias"], -5.0))
    FP32_FORMULA_VS_FP64.check(d["beta"].double(), torch.sigmoid(x["b_logit"].double()))
    FP32_FORMULA_VS_FP64.check(d["q"].double(), l2norm_np(x["q"]))
    FP32_FORMULA_VS_FP64.check(d["k"].double(), l2norm_np(x["k"]))
    assert d["core"] is o and torch.equal(d["state"], S)
    assert d["gate"].dtype == d["beta"].dtype == d["state"].dtype == torch.float32
    with pytest.raises(ParityError, match="callable"):
        fc.set_kda_observer(42)


# ----------------------------------------------------------------------------------------------- ShortConvolution
def conv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """facts §3.2 with torch.nn.functional.conv1d: left zero padding W−1, depthwise, then SiLU. x [B,T,D]."""
    D, W = w.shape[0], w.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2).double(), (W - 1, 0)), w.double(), groups=D)
    return F.silu(y).transpose(1, 2)


def _conv(D=10, W=4, seed=31):
    torch.manual_seed(seed)
    m = fc.ShortConvolution(hidden_size=D, kernel_size=W, bias=False, activation="silu")
    torch.nn.init.normal_(m.weight, std=0.4)
    return m


def test_short_conv_is_an_nn_conv1d_with_fla_shapes():
    m = _conv()
    assert isinstance(m, torch.nn.Conv1d) and tuple(m.weight.shape) == (10, 1, 4) and m.bias is None


def test_short_conv_matches_conv1d_silu_and_steps():
    m = _conv()
    x = torch.randn(2, 17, 10)
    with torch.no_grad():
        y, cache = m(x, output_final_state=True)
        FP32_OP_VS_FP64.check(y.double(), conv_reference(x, m.weight))
        torch.testing.assert_close(cache, x[:, -4:].transpose(1, 2))  # cache = last W inputs [B,D,W]
        # token-by-token decode from an empty (zero) cache, updating the cache in place as fla does
        c = torch.zeros(2, 10, 4)
        steps = []
        for t in range(17):
            y_t, c_out = m(x[:, t:t + 1], cache=c, output_final_state=True)
            assert c_out is c
            steps.append(y_t)
        FP32_REORDERED.check(torch.cat(steps, 1), y)
        # prefill(11) then continue with its cache == full
        y_a, c_a = m(x[:, :11], output_final_state=True)
        y_b, _ = m(x[:, 11:], cache=c_a, output_final_state=True)
        FP32_REORDERED.check(torch.cat([y_a, y_b], 1), y)
        assert m(x, output_final_state=False)[1] is None


def test_short_conv_comparison_detects_a_flipped_kernel():
    m = _conv()
    x = torch.randn(1, 9, 10)
    with torch.no_grad():
        m.weight.copy_(m.weight.flip(-1))  # w[c, W-1] must multiply the current token (§3.2)
        y, _ = m(x)
    ref = conv_reference(x, m.weight.flip(-1))
    assert FP32_OP_VS_FP64.usage(y.double(), ref) > 1


def test_short_conv_varlen_equals_separate():
    m = _conv()
    x = torch.randn(1, 12, 10)
    with torch.no_grad():
        y, c = m(x, cu_seqlens=torch.tensor([0, 5, 12]), output_final_state=True)
        y1, c1 = m(x[:, :5], output_final_state=True)
        y2, c2 = m(x[:, 5:], output_final_state=True)
    torch.testing.assert_close(y, torch.cat([y1, y2], 1))
    torch.testing.assert_close(c, torch.cat([c1, c2], 0))


# ----------------------------------------------------------------------------------------------- FusedRMSNormGated
def norm_gated_reference(x, g, w, eps):
    """§3.7 in float64: x / sqrt(mean(x²) + eps) · w · sigmoid(g)."""
    x, g, w = x.double(), g.double(), w.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w * torch.sigmoid(g)


def test_fused_rms_norm_gated_matches_formula():
    m = fc.FusedRMSNormGated(16, eps=1e-6, activation="sigmoid")
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(16))
    x, g = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16)
    y = m(x, g)
    FP32_OP_VS_FP64.check(y.double(), norm_gated_reference(x, g, m.weight, 1e-6))
    yb = m(x.bfloat16(), g)
    assert yb.dtype == torch.bfloat16
    # fp32 inside, one rounding at the end: within 1 bf16 ULP of the float64 reference
    BF16_ONE_ROUNDING.check(yb.double(), norm_gated_reference(x.bfloat16(), g, m.weight, 1e-6))
    # swish (fla default): g·sigmoid(g)
    s = fc.FusedRMSNormGated(16, eps=1e-6)
    FP32_OP_VS_FP64.check(s(x, g).double(), norm_gated_reference(x, g, s.weight, 1e-6) * g.double())


def test_fused_rms_norm_gated_comparison_detects_gate_before_norm():
    m = fc.FusedRMSNormGated(16, eps=1e-6, activation="sigmoid")
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    broken = m(x * torch.sigmoid(g), torch.full_like(g, 40.0))  # gating before normalising: a plausible bug
    with pytest.raises(AssertionError):
        FP32_OP_VS_FP64.check(broken.double(), norm_gated_reference(x, g, m.weight, 1e-6))


def test_index_utils():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert fc.prepare_lens_from_mask(mask).tolist() == [3, 2]
    cu = fc.prepare_cu_seqlens_from_mask(mask)
    assert cu.tolist() == [0, 3, 5] and cu.dtype == torch.int32
    calls = []
    f = fc.tensor_cache(lambda t: calls.append(1) or t + 1)
    t = torch.zeros(1)
    f(t), f(t)
    assert len(calls) == 2  # pass-through: never serves a stale result


# ----------------------------------------------------------------------------------------------- install / shims
def _fla_entries():
    return {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")}


def _shim_state():
    import transformers.utils as tu
    import transformers.utils.import_utils as iu
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return (getattr(iu, "is_torch_fx_available", None), getattr(tu, "is_torch_fx_available", None),
            ROPE_INIT_FUNCTIONS.get("default"))


@pytest.fixture
def clean_install():
    assert not fc.is_installed(), "stand-ins left installed by an earlier test"
    handles = []
    yield handles
    for h in reversed(handles):
        h.uninstall()
    assert not fc.is_installed()


def test_install_provides_every_official_import_and_uninstall_restores(clean_install):
    import fla  # the real fla-core package (importable without triton); its entries must come back untouched

    before, shims_before = _fla_entries(), _shim_state()
    assert before.get("fla") is fla
    h = fc.install()
    clean_install.append(h)
    assert fc.is_installed()
    from fla.modules import FusedRMSNormGated, ShortConvolution
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.simple_gla.chunk import chunk_simple_gla
    from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
    from fla.ops.utils.index import prepare_cu_seqlens_from_mask, prepare_lens_from_mask
    from fla.utils import tensor_cache
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.utils.import_utils import is_torch_fx_available

    assert chunk_kda is fc.chunk_kda and fused_recurrent_kda is fc.fused_recurrent_kda
    assert ShortConvolution is fc.ShortConvolution and FusedRMSNormGated is fc.FusedRMSNormGated
    assert chunk_simple_gla is fc.chunk_simple_gla and fused_recurrent_simple_gla is fc.fused_recurrent_simple_gla
    assert prepare_lens_from_mask is fc.prepare_lens_from_mask and tensor_cache is fc.tensor_cache
    assert prepare_cu_seqlens_from_mask is fc.prepare_cu_seqlens_from_mask
    assert is_torch_fx_available() is True
    assert importlib.util.find_spec("fla") is not None  # a proper spec: find_spec does not crash on the fake
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fla.layers")  # not provided -> a clear import error, not the real Triton one
    # default RoPE: θ^{-2j/d} (facts §4.3) vs float64 numpy, attention_scaling 1.0
    cfg = types.SimpleNamespace(rope_theta=6e6, head_dim=64, partial_rotary_factor=1.0, hidden_size=8,
                                num_attention_heads=1)
    inv, scaling = ROPE_INIT_FUNCTIONS["default"](cfg, "cpu")
    want = 6e6 ** (-np.arange(0, 64, 2) / 64.0)
    ROPE_INV_FREQ_FP32.check(inv.double().numpy(), want)
    assert scaling == 1.0 and inv.dtype == torch.float32

    h.uninstall()
    assert not fc.is_installed()
    after = _fla_entries()
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert _shim_state() == shims_before
    h.uninstall()  # idempotent


def test_install_as_context_manager_and_nested(clean_install):
    before = _fla_entries()
    with fc.install() as outer:
        assert fc.is_installed()
        inner = fc.install()
        inner.uninstall()  # nested handle owns nothing
        assert fc.is_installed()
        assert outer.owner and not inner.owner
    assert not fc.is_installed() and _fla_entries().keys() == before.keys()


def test_install_refuses_only_where_the_real_kernels_can_run(clean_install, monkeypatch):
    fake_triton = types.ModuleType("triton")
    fake_triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    monkeypatch.setitem(sys.modules, "triton", fake_triton)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fc.torch.cuda, "is_available", lambda: False)
    assert fc.real_fla_with_triton() and not fc.real_kernels_run_here()
    h = fc.install()  # a CPU machine with triton installed: the kernels cannot run, the stand-ins go in (issue 24)
    h.uninstall()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs them on CPU tensors: refuse to shadow them
    with pytest.raises(ParityError, match="real kernels can run"):
        fc.install()
    assert not fc.is_installed()
    h = fc.install(force=True)
    clean_install.append(h)
    assert fc.is_installed() and h.forced


def test_real_fla_with_triton_is_false_on_this_cpu_machine():
    assert importlib.util.find_spec("triton") is None, "triton must not be installed on CPU machines (env_notes)"
    assert not fc.real_fla_with_triton()
