"""The chunk solve of `kda.kda_chunked` on CPU (`kda.solve_unit_lower`): one LAPACK trsm call per matrix, in the
forward and in its VJP, because jaxlib 0.10's batched CPU trsm waits on XLA's intra-op pool and deadlocks when as many
solves run at once as the pool has threads (the chunked KDA backward at Ling3-Tiny shapes hung; kda.py explains).

Checked: every `lapack_strsm_ffi` call of the lowered chunked forward + VJP (both chunk precisions) has a single
matrix (the condition under which the kernel runs inline), and the per-matrix solve gives the bits of the batched
`solve_triangular` (so the forward replay's numbers do not move)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from parity.jax_ling3 import kda
from bounds import JAX_SOLVE_RESIDUAL_ABS

B, T, H, K = 1, 128, 4, 16  # 2 chunks; shapes small, the structure is Ling3-Tiny's


def _trsm_operand_ranks(fn, *args) -> list[int]:
    """Rank of the right-hand side of every lapack_strsm_ffi custom call in fn's lowered module."""
    txt = jax.jit(fn).lower(*args).as_text()
    ranks = []
    for line in txt.splitlines():
        if "lapack_strsm_ffi" in line and "custom_call" in line:
            sig = re.search(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->", line)
            assert sig, f"unparsed trsm call: {line[:200]}"
            ranks.append(sig.group(2).count("x"))
    return ranks


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the per-matrix solve is the CPU path")
@pytest.mark.parametrize("inter_dtype", ["float32", "bfloat16"])
def test_chunked_forward_and_vjp_solve_one_matrix_per_call(inter_dtype):
    z = jnp.zeros((B, T, H, K), jnp.float32)
    b = jnp.zeros((B, T, H), jnp.float32)

    def loss(q, k, v, g, beta):
        o, S = kda.kda_chunked(q, k, v, g, beta, K ** -0.5, None, inter_dtype=inter_dtype)
        return jnp.sum(o * o) + jnp.sum(S)

    ranks = _trsm_operand_ranks(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), z, z, z, z, b)
    assert ranks, "no trsm call found in the chunked KDA VJP (the check would be empty)"
    assert all(r == 2 for r in ranks), f"batched trsm calls in the chunked KDA VJP: operand ranks {ranks} (expected 2)"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the per-matrix solve is the CPU path")
def test_batched_solve_is_caught(monkeypatch):
    """The check above fails for the batched solve it replaced (so it can fail)."""
    monkeypatch.setattr(kda, "solve_unit_lower",
                        lambda M, R: solve_triangular(M, R, lower=True, unit_diagonal=True))
    z = jnp.zeros((B, T, H, K), jnp.float32)
    b = jnp.zeros((B, T, H), jnp.float32)
    ranks = _trsm_operand_ranks(
        jax.grad(lambda *a: jnp.sum(kda.kda_chunked(*a, K ** -0.5, None)[0]), argnums=(0, 1, 2, 3, 4)),
        z, z, z, z, b)
    assert ranks and any(r > 2 for r in ranks)


def test_per_matrix_solve_bit_identical_to_batched():
    rng = np.random.default_rng(0)
    C, N = 64, 48
    A = np.tril(rng.standard_normal((2, 3, C, C)).astype(np.float32) * 0.3, -1) + np.eye(C, dtype=np.float32)
    R = rng.standard_normal((2, 3, C, N)).astype(np.float32)
    got = np.asarray(jax.jit(kda.solve_unit_lower)(A, R))
    want = np.asarray(jax.jit(lambda a, r: solve_triangular(a, r, lower=True, unit_diagonal=True))(A, R))
    assert got.shape == want.shape
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} elements differ, first at {np.argwhere(diff)[0]}"
    # and it is the solve: M X = R to fp32 accuracy (independent of LAPACK: a numpy product)
    assert float(np.abs(np.einsum("...ij,...jk->...ik", A.astype(np.float64), got) - R).max()) <= JAX_SOLVE_RESIDUAL_ABS
