"""`kda.kda_chunked` computes heads in groups (`HEADS_PER_STEP`, a memory measure): the grouped evaluation must give
the same bits as all heads at once, for outputs and final state, with and without an initial state, for a T that is
not a multiple of the chunk; a grouped evaluation that puts the groups back in the wrong order must be caught; and it
must lower the compiled temporaries (the reason it exists)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.jax_ling3 import kda
from parity.jax_ling3.norms import l2_normalize

B, H, K, V = 2, 8, 16, 16


def _inputs(T: int, with_state: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32))
    k = l2_normalize(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.bfloat16)  # the layer feeds the conv output's dtype
    g = jnp.asarray(-5.0 * rng.random((B, T, H, K)), jnp.float32)
    beta = jnp.asarray(rng.random((B, T, H)), jnp.float32)
    S0 = jnp.asarray(rng.standard_normal((B, H, K, V)) * 0.3, jnp.float32) if with_state else None
    return q, k, v, g, beta, S0


def _run(fn, args, heads_per_step):
    q, k, v, g, beta, S0 = args
    f = jax.jit(lambda q, k, v, g, beta, S0: fn(q, k, v, g, beta, K ** -0.5, S0, kda.CHUNK, heads_per_step))
    o, S = f(q, k, v, g, beta, S0)
    return np.asarray(o), np.asarray(S)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("T,with_state", [(100, True), (64, False), (200, True)])
@pytest.mark.parametrize("heads_per_step", [1, 2, 4])
def test_grouped_heads_bit_identical(T, with_state, heads_per_step):
    args = _inputs(T, with_state)
    o_all, S_all = _run(kda.kda_chunked, args, None)
    o_grp, S_grp = _run(kda.kda_chunked, args, heads_per_step)
    assert _bits_equal(o_grp, o_all), f"o: {(o_grp != o_all).sum()} of {o_all.size} differ"
    assert _bits_equal(S_grp, S_all), f"S: {(S_grp != S_all).sum()} of {S_all.size} differ"


def test_grouped_comparison_catches_misplaced_groups(monkeypatch):
    """Perturbation: if the groups came back reversed (group 0's heads written where the last group's belong), the
    bitwise check above fails."""
    args = _inputs(100, True)
    o_all, S_all = _run(kda.kda_chunked, args, None)
    real_map = jax.lax.map
    monkeypatch.setattr(jax.lax, "map", lambda f, xs: jax.tree_util.tree_map(lambda a: a[::-1], real_map(f, xs)))
    o_bad, S_bad = _run(kda.kda_chunked, args, 4)
    assert not _bits_equal(o_bad, o_all) and not _bits_equal(S_bad, S_all)


def test_grouped_heads_lower_temporaries():
    """The point of grouping: fewer heads' [C, C, K] decay tensors live at once (XLA's own buffer accounting)."""
    args = _inputs(128, True)
    q, k, v, g, beta, S0 = args

    def temp(hs):
        f = jax.jit(lambda q, k, v, g, beta, S0: kda.kda_chunked(q, k, v, g, beta, K ** -0.5, S0, kda.CHUNK, hs))
        return f.lower(q, k, v, g, beta, S0).compile().memory_analysis().temp_size_in_bytes

    assert temp(2) < 0.6 * temp(None), (temp(2), temp(None))  # not-a-bound: a memory ratio, not an fp tolerance
