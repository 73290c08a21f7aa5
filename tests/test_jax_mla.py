"""Gated MLA in JAX: absorbed decode over the latent cache == naive form (fp32), with and without q-LoRA; interleaved
RoPE against an independent formula (GPT-J pairwise rotation + the fixed de-interleave permutation, facts §4.3)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.model.config import PRESETS, Ling3Config
from parity.jax_ling3.mla import init_mla_cache, mla_attention
from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin, inv_freq
from parity.jax_ling3.spec import layer_spec
from parity.jax_ling3.testing import assert_rel_close
from bounds import FP32_ONE_ROUNDING, JAX_FP32_BLOCK_REL, JAX_FP32_OP_REL, JAX_ROPE_DOT_REL

TOL = JAX_FP32_BLOCK_REL
layer = jax.jit(mla_attention, static_argnames=("spec",))


def _params(cfg: Ling3Config, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    c, r, n, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    f = lambda i, o: jnp.asarray(rng.standard_normal((i, o)) * i ** -0.5, jnp.float32)  # noqa: E731
    p = {"kv_a_proj_with_mqa": f(D, c + r), "kv_a_layernorm": jnp.asarray(1 + 0.05 * rng.standard_normal(c), jnp.float32),
         "kv_b_proj": f(c, H * (n + v)), "g_proj": f(D, H), "dense": f(H * v, D)}
    if cfg.q_lora:
        p.update(q_a_proj=f(D, cfg.q_lora_rank), q_b_proj=f(cfg.q_lora_rank, H * (n + r)),
                 q_a_layernorm=jnp.asarray(1 + 0.05 * rng.standard_normal(cfg.q_lora_rank), jnp.float32))
    else:
        p["q_proj"] = f(D, H * (n + r))
    return p


@pytest.fixture(scope="module", params=["tiny", "tiny-flash"], ids=["q_lora", "no_q_lora"])
def setup(request):
    cfg = Ling3Config.from_dict(PRESETS[request.param])
    i = cfg.mla_layers[0]
    spec = layer_spec(cfg, i, "float32")
    p = _params(cfg, 11)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((2, 12, cfg.hidden_size)), jnp.float32)
    # positions offset from 0 so RoPE really rotates (and differs per token)
    pos = jnp.arange(12) + 1000
    ref, ref_pts, _ = layer(p, x, pos, spec)  # naive causal form over the 12 tokens, no cache
    return cfg, spec, p, x, pos, ref, ref_pts


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_cached_decode_equals_naive_prefill(setup, absorbed):
    cfg, spec, p, x, pos, ref, ref_pts = setup
    spec = dataclasses.replace(spec, mla_absorbed=absorbed)
    cache = init_mla_cache(2, 16, spec)
    out, pts, cache = layer(p, x[:, :6], pos[:6], spec, cache)  # naive prefill of 6 into the latent cache
    outs, cores = [out], [pts["attention.core"]]
    out, pts, cache = layer(p, x[:, 6:8], pos[6:8], spec, cache)  # a 2-token chunk through the cache
    outs.append(out)
    cores.append(pts["attention.core"])
    for t in range(8, 12):  # then 4 single-token decode steps
        out, pts, cache = layer(p, x[:, t:t + 1], pos[t:t + 1], spec, cache)
        outs.append(out)
        cores.append(pts["attention.core"])
    assert int(cache.length) == 12
    assert_rel_close(jnp.concatenate(cores, 1), ref_pts["attention.core"], TOL, f"core, absorbed={absorbed}")
    assert_rel_close(jnp.concatenate(outs, 1), ref, TOL, f"dense output, absorbed={absorbed}")


def test_perturbed_absorbed_form_is_detected(setup):
    """A wrong softmax scale (v_head_dim^-½ instead of qk_head_dim^-½, facts §4.4) makes the comparison fail."""
    cfg, spec, p, x, pos, ref, ref_pts = setup
    wrong = dataclasses.replace(spec, model=dataclasses.replace(spec.model, attn_scale=cfg.v_head_dim ** -0.5))
    _, _, cache = layer(p, x[:, :1], pos[:1], spec, init_mla_cache(2, 16, spec))  # token 0: right, naive
    out, pts, _ = layer(p, x[:, 1:], pos[1:], wrong, cache)  # tokens 1..11 through the absorbed form
    with pytest.raises(AssertionError):
        assert_rel_close(pts["attention.core"], ref_pts["attention.core"][:, 1:], TOL, "wrong scale")
    out, pts, _ = layer(p, x[:, 1:], pos[1:], spec, cache)  # ... which, right, passes
    assert_rel_close(pts["attention.core"], ref_pts["attention.core"][:, 1:], TOL, "right scale")


def test_causality_and_gate(setup):
    cfg, spec, p, x, pos, ref, ref_pts = setup
    out, pts, _ = layer(p, x[:, :5], pos[:5], spec)  # a prefix sees nothing of the later tokens
    assert_rel_close(out, ref[:, :5], JAX_FP32_OP_REL, "prefix of a causal prefill")
    H = cfg.num_attention_heads
    gate = 1 / (1 + np.exp(-np.asarray(ref_pts["attention.g_proj"], np.float64)))
    assert_rel_close(ref_pts["attention.gate"], gate, JAX_FP32_OP_REL, "head gate = σ(g_proj x)")
    gated = np.asarray(ref_pts["attention.core"]).reshape(2, 12, H, -1) * gate[..., None]
    assert_rel_close(ref_pts["attention.dense:in"], gated.reshape(2, 12, -1), JAX_FP32_OP_REL, "gate before dense")


def test_rope_interleave_equals_gptj_then_permutation():
    r, theta = 64, 6e6
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, r))  # [B,T,h,r]
    pos = np.array([[0, 1, 7, 1000, 131071]] * 2)
    # independent formula: GPT-J rotates stored pairs (x_2j, x_2j+1) by angle pos·θ^(-2j/r) ...
    # (angles formed in fp32 as the reference does, facts §8: one rounding of pos·inv_freq; cos/sin in float64)
    inv = (theta ** (-np.arange(0, r, 2) / r)).astype(np.float32)
    f = (pos.astype(np.float32)[..., None, None] * inv).astype(np.float64)  # [B,T,1,r/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = x0 * np.cos(f) - x1 * np.sin(f)
    y[..., 1::2] = x1 * np.cos(f) + x0 * np.sin(f)
    # ... then the fixed permutation [0,2,4,…,1,3,5,…] (de-interleave), the same for q and k
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    ref = y[..., perm]
    cos, sin = cos_sin(jnp.asarray(pos), r, theta, jnp.float32)
    got = apply_rope_interleaved(jnp.asarray(x, jnp.float32), cos, sin)
    assert_rel_close(got, ref, JAX_FP32_BLOCK_REL, "interleaved RoPE vs GPT-J + permutation")
    FP32_ONE_ROUNDING.check(inv_freq(r, theta), theta ** (-np.arange(0, r, 2) / r), "inv_freq")
    # scores are permutation invariant: q·k equals the GPT-J (unpermuted) dot product
    s_got = np.einsum("btha,btha->bth", np.asarray(got, np.float64), np.asarray(got, np.float64)[:, :, ::-1])
    s_ref = np.einsum("btha,btha->bth", ref, ref[:, :, ::-1])
    assert_rel_close(s_got, s_ref, JAX_ROPE_DOT_REL, "rotated dot products")
    with pytest.raises(AssertionError):  # a rotate-half (NeoX) RoPE without de-interleave is a different map
        neox = np.concatenate([x[..., :r // 2] * np.cos(f) - x[..., r // 2:] * np.sin(f),
                               x[..., r // 2:] * np.cos(f) + x[..., :r // 2] * np.sin(f)], -1)
        assert_rel_close(got, neox, JAX_FP32_BLOCK_REL, "NeoX")
