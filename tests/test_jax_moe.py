"""Grouped sigmoid router and MoE in JAX vs an independent numpy implementation of facts §5 written here, and vs the
twin's `BailingMoeV3Gate` (torch), on random inputs and on crafted exact ties and group boundaries."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.model.config import PRESETS, Ling3Config
from parity.jax_ling3 import moe
from parity.jax_ling3.spec import layer_spec
from parity.jax_ling3.testing import assert_rel_close
from bounds import JAX_FP32_BLOCK_REL, JAX_FP32_OP_REL

CFG = Ling3Config.from_dict(PRESETS["tiny"])  # E=16, n_group=4 (4 experts each), topk_group=2, k=4
SPEC = layer_spec(CFG, 1, "float32")
M = SPEC.model
E, G, KG, K = CFG.num_experts, CFG.n_group, CFG.topk_group, CFG.num_experts_per_tok
select = jax.jit(moe.select_experts, static_argnames=("m",))
weights = jax.jit(moe.routing_weights, static_argnames=("m",))


# ------------------------------------------------------------------------- independent numpy reference (facts §5)
def np_router(logits: np.ndarray, bias: np.ndarray):
    """facts §5.2–5.4 in float64: p = σ(z); selection on p + b: group score = sum of the two largest in each of G
    contiguous groups, keep the KG best groups, then the K best experts inside them; weights = p at the chosen ids /
    (Σ + 1e-20) × routed_scaling_factor. Ties are broken towards the lower index (a choice; see `valid_choice`)."""
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    c = p + bias
    n = E // G
    idx = np.empty(logits.shape[:-1] + (K,), np.int64)
    for t in np.ndindex(logits.shape[:-1]):
        gs = np.array([np.sort(c[t][g * n:(g + 1) * n])[-2:].sum() for g in range(G)])
        keep = sorted(range(G), key=lambda g: (-gs[g], g))[:KG]
        cand = [e for e in range(E) if e // n in keep]
        idx[t] = sorted(sorted(cand, key=lambda e: (-c[t][e], e))[:K])
    w = np.take_along_axis(p, idx, -1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * CFG.routed_scaling_factor
    return idx, w


def valid_choice(logits: np.ndarray, bias: np.ndarray, idx: np.ndarray) -> bool:
    """True when `idx` is *a* correct grouped top-k under ties: its groups are a top-KG set of group scores and its
    experts a top-K set inside the kept groups (what any implementation may return when scores tie)."""
    c = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    n = E // G
    for t in np.ndindex(logits.shape[:-1]):
        gs = np.array([np.sort(c[t][g * n:(g + 1) * n])[-2:].sum() for g in range(G)])
        chosen = set(int(e) for e in idx[t])
        groups = {e // n for e in chosen}
        if len(chosen) != K or len(groups) > KG:
            return False
        kth_group = np.sort(gs)[-KG]
        if any(gs[g] < kth_group for g in groups):
            return False
        # the kept groups may include tied groups without a chosen expert; candidates = groups at or above kth
        cand = [e for e in range(E) if gs[e // n] >= kth_group]
        kth = min(c[t][e] for e in chosen)
        if any(c[t][e] > kth for e in cand if e not in chosen and (e // n in groups or len(groups) < KG)):
            return False
    return True


def _jax_route(logits, bias):
    idx = np.asarray(select(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), M))
    return np.sort(idx, -1)


def _crafted():
    """Rows of logits (E=16, groups of 4) with exact ties and group-boundary cases; bias 0."""
    lo, rows = -3.0, []
    r = np.full(E, lo)
    r[[0]] = 4.0  # best expert alone in group 0 (its 2nd is low) ...
    r[[4, 5, 8, 9]] = 1.0  # ... groups 1 and 2 have two good experts each -> group 0 must NOT be kept
    rows.append(r)
    r = np.full(E, lo)
    r[[4, 5, 6, 7]] = 2.0  # exact 4-way tie inside one group: all four chosen (k = 4)
    r[[8, 9]] = 1.0
    rows.append(r)
    r = np.full(E, lo)
    r[[1, 2, 5, 6, 9, 10]] = 1.5  # three groups tie on group score: which two are kept is a tie
    rows.append(r)
    r = np.full(E, lo)
    r[[0, 1]] = 2.0
    r[[4, 5, 6]] = 1.0  # k-boundary tie: 2 + three equal experts for 2 remaining slots
    rows.append(r)
    r = np.full(E, lo)
    r[12:16] = [0.5, 0.5, 0.5, 0.5]
    r[3] = 0.5  # a tie straddling a group boundary (experts 3 and 12..15)
    r[2] = 0.5
    rows.append(r)
    return np.stack(rows).astype(np.float32)


def _ambiguous(logits, bias):
    """Rows whose choice is not unique (a tie at the group or the k boundary)."""
    c = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    n = E // G
    out = []
    for t in range(logits.shape[0]):
        gs = np.array([np.sort(c[t][g * n:(g + 1) * n])[-2:].sum() for g in range(G)])
        sg = np.sort(gs)
        amb = sg[-KG] == sg[-KG - 1]
        keep = sorted(range(G), key=lambda g: (-gs[g], g))[:KG]
        cs = np.sort([c[t][e] for e in range(E) if e // n in keep])
        out.append(bool(amb or cs[-K] == cs[-K - 1]))
    return np.array(out)


# ------------------------------------------------------------------------- tests
def test_router_matches_numpy_on_random_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50, CFG.hidden_size)).astype(np.float32)
    w = (rng.standard_normal((CFG.hidden_size, E)) * CFG.hidden_size ** -0.5).astype(np.float32)
    bias = rng.uniform(-0.1, 0.1, E).astype(np.float32)
    logits = np.asarray(moe.router_logits(jnp.asarray(x), jnp.asarray(w)))
    assert logits.dtype == np.float32
    assert_rel_close(logits, x.astype(np.float64) @ w.astype(np.float64), JAX_FP32_OP_REL, "fp32 router logits")
    idx_ref, w_ref = np_router(logits, bias.astype(np.float64))
    _, idx, wt = moe.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), M)
    idx, wt = np.asarray(idx), np.asarray(wt)
    order = np.argsort(idx, -1)
    idx, wt = np.take_along_axis(idx, order, -1), np.take_along_axis(wt, order, -1)
    np.testing.assert_array_equal(idx, idx_ref)
    assert_rel_close(wt, w_ref, JAX_FP32_OP_REL, "routing weights (unbiased, renormalised, ×2.5)")
    assert_rel_close(wt.sum(-1), np.full(wt.shape[:-1], CFG.routed_scaling_factor), JAX_FP32_OP_REL, "weight sums")
    # the bias only selects: weights do not depend on it once the ids are fixed
    assert_rel_close(weights(jnp.asarray(logits), jnp.asarray(idx), M), w_ref, JAX_FP32_OP_REL, "weights at given ids")


def test_router_perturbation_is_detected():
    """Dropping the group limit, or weighting with the biased scores, changes the result (the checks can fail)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((200, E)).astype(np.float32)
    bias = rng.uniform(-0.3, 0.3, E)
    idx_ref, w_ref = np_router(logits, bias)
    flat = dataclasses.replace(M, n_group=1, topk_group=1)  # no group limit
    assert not np.array_equal(np.sort(np.asarray(select(jnp.asarray(logits), jnp.asarray(bias, jnp.float32), flat)),
                                      -1), idx_ref)
    biased = np.take_along_axis(1 / (1 + np.exp(-logits.astype(np.float64))) + bias, idx_ref, -1)
    biased = biased / biased.sum(-1, keepdims=True) * CFG.routed_scaling_factor
    with pytest.raises(AssertionError):
        assert_rel_close(biased, w_ref, JAX_FP32_OP_REL, "biased weights")


def test_router_ties_and_group_boundaries_numpy():
    logits = _crafted()
    bias = np.zeros(E)
    idx = _jax_route(logits, bias)
    idx_ref, _ = np_router(logits, bias)
    amb = _ambiguous(logits, bias)
    assert amb.tolist() == [False, False, True, True, True]
    assert 0 not in idx[0]  # best expert sits in a dropped group (group score = top-2 sum)
    np.testing.assert_array_equal(idx[~amb], idx_ref[~amb])
    assert valid_choice(logits, bias, idx), f"invalid tie resolution: {idx}"
    assert not valid_choice(logits, bias, np.array([[0, 4, 5, 8]] * 5))  # row 0 with expert 0 would be wrong


@pytest.fixture(scope="module")
def twin_gate():
    sys.modules.setdefault("fla", None)  # the twin must not bind to fla kernels here (env_notes)
    import torch

    from parity.torch_ref.twin.configuration_bailing_moe_v3 import BailingMoeV3Config
    from parity.torch_ref.twin.modeling_bailing_moe_v3 import BailingMoeV3Gate

    return torch, BailingMoeV3Gate(BailingMoeV3Config(**{k: v for k, v in PRESETS["tiny"].items()}))


def test_router_matches_twin_gate(twin_gate):
    torch, gate = twin_gate
    rng = np.random.default_rng(2)
    D = CFG.hidden_size
    w = (rng.standard_normal((E, D)) * D ** -0.5).astype(np.float32)
    bias = rng.uniform(-0.1, 0.1, E).astype(np.float32)
    with torch.no_grad():
        gate.weight.copy_(torch.from_numpy(w))
        gate.expert_bias.copy_(torch.from_numpy(bias))
    x = rng.standard_normal((2, 64, D)).astype(np.float32)
    crafted = _crafted()
    with torch.no_grad():
        t_idx, t_w, t_logits = gate(torch.from_numpy(x))
    logits, idx, wt = moe.route(jnp.asarray(x), jnp.asarray(w.T), jnp.asarray(bias), M)
    assert_rel_close(logits, t_logits.numpy(), JAX_FP32_OP_REL, "router logits vs twin")
    ti, tw = t_idx.numpy(), t_w.numpy()
    o1, o2 = np.argsort(ti, -1), np.argsort(np.asarray(idx), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), o2, -1), np.take_along_axis(ti, o1, -1))
    assert_rel_close(np.take_along_axis(np.asarray(wt), o2, -1), np.take_along_axis(tw, o1, -1), JAX_FP32_OP_REL,
                     "weights vs twin")
    # exact ties: feed identical logits to both selections (the twin's gate with identity-like weights)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(E, D))
        gate.expert_bias.zero_()
    xt = np.zeros((1, crafted.shape[0], D), np.float32)
    xt[0, :, :E] = crafted
    with torch.no_grad():
        t_idx, t_w, t_logits = gate(torch.from_numpy(xt))
    np.testing.assert_array_equal(t_logits.numpy()[0], crafted)
    amb = _ambiguous(crafted, np.zeros(E))
    j_idx = _jax_route(crafted, np.zeros(E))
    t_sorted = np.sort(t_idx.numpy()[0], -1)
    np.testing.assert_array_equal(j_idx[~amb], t_sorted[~amb])
    assert valid_choice(crafted, np.zeros(E), t_sorted) and valid_choice(crafted, np.zeros(E), j_idx)
    # forced routing: on the twin's choice, our weights equal the twin's exactly (same maths on given experts)
    fw = weights(jnp.asarray(crafted), jnp.asarray(t_idx.numpy()[0].astype(np.int32)), M)
    assert_rel_close(fw, t_w.numpy()[0], JAX_FP32_OP_REL, "weights on the twin's experts (forced routing)")


def test_moe_block_forced_routing_and_clamp():
    """Routed sum = Σ w_i·Expert_{e_i}(x) computed per token in numpy (facts §5.5–5.7), with forced ids, clamp on."""
    rng = np.random.default_rng(4)
    D, I = CFG.hidden_size, CFG.moe_intermediate_size
    Is = CFG.shared_intermediate_size
    f = lambda *s: (rng.standard_normal(s) * s[-2] ** -0.5).astype(np.float32)  # noqa: E731
    p = {"router": f(D, E), "expert_bias": np.zeros(E, np.float32), "experts_gate": f(E, D, I) * 3,
         "experts_up": f(E, D, I) * 3, "experts_down": f(E, I, D), "shared_gate_proj": f(D, Is) * 3,
         "shared_up_proj": f(D, Is) * 3, "shared_down_proj": f(Is, D)}
    x = rng.standard_normal((1, 6, D)).astype(np.float32)
    forced = np.stack([rng.choice(E, K, replace=False) for _ in range(6)])[None].astype(np.int32)
    spec = dataclasses.replace(SPEC, routed_limit=1.0, shared_limit=1.5)
    y, pts = jax.jit(moe.moe_block, static_argnames=("spec",))(jax.tree_util.tree_map(jnp.asarray, p),
                                                               jnp.asarray(x), spec, jnp.asarray(forced))

    def mlp(v, g, u, dn, L):
        a, b = v @ g, v @ u
        s = a / (1 + np.exp(-a))
        return (np.minimum(s, L) * np.clip(b, -L, L)) @ dn  # facts §5.7: min(silu(g), L) · clip(u, ±L)

    logits = x[0].astype(np.float64) @ p["router"]
    ref = np.zeros((6, D))
    for t in range(6):
        sc = 1 / (1 + np.exp(-logits[t, forced[0, t]]))
        wt = sc / (sc.sum() + 1e-20) * CFG.routed_scaling_factor
        for e, we in zip(forced[0, t], wt):
            ref[t] += we * mlp(x[0, t].astype(np.float64), p["experts_gate"][e], p["experts_up"][e],
                               p["experts_down"][e], 1.0)
    sh = mlp(x[0].astype(np.float64), p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"], 1.5)
    assert_rel_close(pts["mlp.routed"][0], ref, JAX_FP32_BLOCK_REL, "forced routed sum with clamp")
    assert_rel_close(pts["mlp.shared_experts"][0], sh, JAX_FP32_BLOCK_REL, "shared expert with clamp")
    assert_rel_close(y[0], ref + sh, JAX_FP32_BLOCK_REL, "moe output")
    np.testing.assert_array_equal(np.asarray(pts["mlp.gate.topk_idx"])[0], np.sort(forced[0], -1))
    # the clamp bites on these inputs: without it the result differs
    y2, _ = jax.jit(moe.moe_block, static_argnames=("spec",))(jax.tree_util.tree_map(jnp.asarray, p),
                                                              jnp.asarray(x), SPEC, jnp.asarray(forced))
    with pytest.raises(AssertionError):
        assert_rel_close(y2[0], ref + sh, JAX_FP32_BLOCK_REL, "no clamp")
