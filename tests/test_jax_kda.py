"""KDA in JAX: chunked prefill == recurrent decode == prefill(P) + decode(T−P) (fp32), agreement with fla's own
`naive_recurrent_kda` (independent torch reference, loaded by file path), gate / conv / L2 norm against numpy float64
formulas of facts §3, and the layer's prefill-then-decode through its conv + recurrent state."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.jax_ling3 import kda
from parity.jax_ling3.norms import l2_normalize
from parity.jax_ling3.testing import assert_rel_close, rel_err
from bounds import JAX_FP32_OP_REL, JAX_KDA_CHUNK_VS_RECURRENT_REL

B, H, K, V = 1, 2, 16, 16
SCALE = K ** -0.5
TOL = JAX_KDA_CHUNK_VS_RECURRENT_REL  # fp32: chunked (WY form) vs recurrent differ by ~5e-6 relative (tests/bounds.py)

chunked = jax.jit(kda.kda_chunked, static_argnums=(5,))
recurrent = jax.jit(kda.kda_recurrent, static_argnums=(5,))


def _inputs(T: int, seed: int = 0, with_state: bool = True):
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32))
    k = l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((B, T, H, K)) * 2, jnp.float32)
    A_log = jnp.asarray(np.log(rng.uniform(1, 16, H)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(H * K) * 0.1, jnp.float32)
    g = kda.kda_gate(a, A_log, dt_bias, -5.0)
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32))
    S0 = jnp.asarray(rng.standard_normal((B, H, K, V)) * 0.3, jnp.float32) if with_state else None
    return q, k, v, g, beta, S0


@pytest.fixture(scope="module")
def fla_naive():
    # locate fla without importing it (its __init__ is slow and needs triton for most submodules, env_notes)
    found = importlib.util.find_spec("fla")
    if found is None:
        pytest.skip("fla-core is not installed")
    path = os.path.join(list(found.submodule_search_locations)[0], "ops", "kda", "naive.py")
    spec = importlib.util.spec_from_file_location("fla_kda_naive_for_jax_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_recurrent_split_agree(T):
    q, k, v, g, beta, S0 = _inputs(T, seed=T)
    o_c, s_c = chunked(q, k, v, g, beta, SCALE, S0)
    o_r, s_r = recurrent(q, k, v, g, beta, SCALE, S0)
    assert_rel_close(o_c, o_r, TOL, f"T={T} chunked vs recurrent output")
    assert_rel_close(s_c, s_r, TOL, f"T={T} chunked vs recurrent final state")
    # prefill(P) with the chunked form, then decode(T-P) with the recurrent form from its state
    # split points chosen so that most pieces reuse shapes compiled above (compile time dominates)
    P = {1: 0, 63: 1, 64: 63, 65: 64, 200: 137}[T]
    sl = lambda t, a, b: t[:, a:b]  # noqa: E731
    if P:
        o1, s1 = chunked(*(sl(t, 0, P) for t in (q, k, v, g, beta)), SCALE, S0)
    else:
        o1, s1 = jnp.zeros((B, 0, H, V)), S0
    o2, s2 = recurrent(*(sl(t, P, T) for t in (q, k, v, g, beta)), SCALE, s1)
    assert_rel_close(jnp.concatenate([o1, o2], axis=1), o_r, TOL, f"T={T} prefill({P})+decode({T - P}) output")
    assert_rel_close(s2, s_r, TOL, f"T={T} prefill({P})+decode({T - P}) state")


@pytest.mark.parametrize("T", [65, 200])
def test_against_fla_naive_recurrent(T, fla_naive):
    import torch

    q, k, v, g, beta, S0 = _inputs(T, seed=100 + T)
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    o_ref, s_ref = fla_naive.naive_recurrent_kda(t(q), t(k), t(v), t(g), t(beta), scale=SCALE,
                                                 initial_state=t(S0), output_final_state=True)
    for name, fn in (("chunked", chunked), ("recurrent", recurrent)):
        o, s = fn(q, k, v, g, beta, SCALE, S0)
        assert_rel_close(o, o_ref.numpy(), TOL, f"{name} vs fla naive_recurrent_kda output, T={T}")
        assert_rel_close(s, s_ref.numpy(), TOL, f"{name} vs fla naive_recurrent_kda state, T={T}")


def test_naive_loop_matches_scan():
    q, k, v, g, beta, S0 = _inputs(7, seed=3)
    o_n, s_n = kda.kda_naive(q, k, v, g, beta, SCALE, S0)
    o_r, s_r = recurrent(q, k, v, g, beta, SCALE, S0)
    assert_rel_close(o_n, o_r, JAX_FP32_OP_REL, "kda_naive vs kda_recurrent")
    assert_rel_close(s_n, s_r, JAX_FP32_OP_REL, "kda_naive vs kda_recurrent state")


def test_perturbation_is_detected(fla_naive):
    """The comparisons above fail when the subject is broken: a 1e-3 change of one gate channel at one token, or a
    beta off by 1e-3, or the decay applied after the write instead of before."""
    import torch

    T = 65
    q, k, v, g, beta, S0 = _inputs(T, seed=7)
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    o_ref, s_ref = fla_naive.naive_recurrent_kda(t(q), t(k), t(v), t(g), t(beta), scale=SCALE,
                                                 initial_state=t(S0), output_final_state=True)
    o, s = chunked(q, k, v, g.at[0, 10, 1, 3].add(1e-3), beta, SCALE, S0)
    with pytest.raises(AssertionError):
        assert_rel_close(o, o_ref.numpy(), TOL, "perturbed gate")
    o, s = chunked(q, k, v, g, beta + 1e-3, SCALE, S0)
    with pytest.raises(AssertionError):
        assert_rel_close(s, s_ref.numpy(), TOL, "perturbed beta")

    def wrong_order(S, qt, kt, vt, gt, bt):  # write, then decay: a plausible bug
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt))
        S = (S + kt[..., None] * u[..., None, :]) * jnp.exp(gt)[..., None]
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt * SCALE)

    S, outs = S0, []
    for i in range(T):
        S, o_i = wrong_order(S, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        outs.append(o_i)
    assert rel_err(jnp.stack(outs, 1), o_ref.numpy()) > 1e-2


def test_gate_forms_match_facts_formula():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 3, H, K)) * 3
    A_log = np.log(rng.uniform(1, 16, H))
    dt = rng.standard_normal(H * K) * 0.1
    x = a + dt.reshape(H, K)
    rate = np.exp(A_log).reshape(H, 1)
    lb_ref = -5.0 / (1 + np.exp(-rate * x))  # facts §3.5: lb·σ(exp(A_log)(a + dt_bias))
    sp_ref = -rate * np.log1p(np.exp(x))  # softplus form (not Ling3)
    j = lambda z: jnp.asarray(z, jnp.float32)  # noqa: E731
    assert_rel_close(kda.kda_gate(j(a), j(A_log), j(dt), -5.0), lb_ref, JAX_FP32_OP_REL, "lower-bound gate")
    assert_rel_close(kda.kda_gate(j(a), j(A_log), j(dt), None), sp_ref, JAX_FP32_OP_REL, "softplus gate")
    g = np.asarray(kda.kda_gate(j(a), j(A_log), j(dt), -5.0))
    assert (g < 0).all() and (g >= -5).all()  # (lb, 0); fp32 saturates to lb exactly


def test_short_conv_and_l2norm_match_numpy():
    rng = np.random.default_rng(2)
    Bc, T, P, W = 2, 6, 5, 4
    x = rng.standard_normal((Bc, T, P))
    w = rng.standard_normal((P, W))
    hist = rng.standard_normal((Bc, P, W))
    # facts §3.2: y_t[c] = silu(Σ_j w[c,j] · x_{t-W+1+j}[c]), history = the cache's last inputs (zeros if none)
    for cache in (None, hist):
        full = np.concatenate([np.zeros((Bc, P, W)) if cache is None else cache, x.transpose(0, 2, 1)], axis=-1)
        pre = np.stack([(w[None] * full[:, :, t + 1:t + 1 + W]).sum(-1) for t in range(T)], axis=1)
        ref = pre / (1 + np.exp(-pre))
        y, new = kda.short_conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                None if cache is None else jnp.asarray(cache, jnp.float32))
        assert_rel_close(y, ref, JAX_FP32_OP_REL, "short conv")
        assert_rel_close(new, full[:, :, -W:].astype(np.float32), 0, "conv cache = last W inputs")
    z = rng.standard_normal((3, 16))
    assert_rel_close(l2_normalize(jnp.asarray(z, jnp.float32)), z / np.sqrt((z * z).sum(-1, keepdims=True) + 1e-6),
                     JAX_FP32_OP_REL, "l2 norm, eps inside the sqrt of the sum")


def test_layer_prefill_then_decode_matches_full_prefill():
    """kda_attention over 70 tokens (chunked) == 64-token prefill (recurrent) + 6 one-token decode steps through the returned
    (recurrent state, conv state) — fp32, random layer params."""
    from parity.model.config import Ling3Config, PRESETS
    from parity.jax_ling3.spec import layer_spec

    cfg = Ling3Config.from_dict(PRESETS["tiny"])
    spec = layer_spec(cfg, 0, "float32")
    D, P_, Hh, W = cfg.hidden_size, cfg.kda_proj_size, cfg.num_attention_heads, cfg.short_conv_kernel_size
    rng = np.random.default_rng(5)
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    p = {n: f(D, P_, sc=D ** -0.5) for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")}
    p.update(b_proj=f(D, Hh, sc=D ** -0.5), q_conv1d=f(P_, W, sc=0.4), k_conv1d=f(P_, W, sc=0.4),
             v_conv1d=f(P_, W, sc=0.4), A_log=jnp.asarray(np.log(rng.uniform(1, 16, Hh)), jnp.float32),
             dt_bias=f(P_, sc=0.1), o_norm=1 + f(cfg.head_dim, sc=0.05), o_proj=f(P_, D, sc=P_ ** -0.5))
    x = f(1, 70, D)
    layer = jax.jit(kda.kda_attention, static_argnames=("spec",))
    full, pts_full, (S_full, conv_full) = layer(p, x, spec)
    out1, _, st = layer(p, x[:, :64], spec)
    outs = [out1]
    for t in range(64, 70):
        o, pts, st = layer(p, x[:, t:t + 1], spec, st)
        outs.append(o)
    assert_rel_close(jnp.concatenate(outs, 1), full, TOL, "layer: prefill(64) + 6 decode steps vs prefill(70)")
    assert_rel_close(st[0], S_full, TOL, "layer: recurrent state")
    assert_rel_close(st[1], conv_full, 0, "layer: conv state")
    assert pts_full["attention.state"].shape == (1, Hh, cfg.head_dim, cfg.head_dim)
    assert pts_full["attention.conv_state"].shape == (3, 1, P_, W)
    assert pts_full["attention.gate"].dtype == jnp.float32 and pts_full["attention.beta"].dtype == jnp.float32
