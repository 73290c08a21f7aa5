"""`ops.matmul_f32`: bf16 operands, fp32 accumulation, fp32 result — checked against numpy's float64 product of the
same bf16 values with the fp32 accumulation error bound, on both paths (native bf16 dot and the upcast reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from parity.jax_ling3 import ops

SHAPES = [((1, 512, 1536), (1536, 2048)), ((32, 1536), (1536, 512)), ((7, 13), (13, 5)), ((3, 1, 64), (64, 1))]


def _case(sa, sb, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(sa).astype(ml_dtypes.bfloat16)
    b = (rng.standard_normal(sb) * 0.05).astype(ml_dtypes.bfloat16)
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))  # bf16 products are exact in fp32 and fp64
    # fp32 accumulation of K terms: |error| <= K * 2^-24 * sum |a_i b_i| (a loose, standard bound)
    bound = sa[-1] * 2.0 ** -24 * np.matmul(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
    return a, b, exact, bound


def _within(out: np.ndarray, exact: np.ndarray, bound: np.ndarray) -> bool:
    return bool(np.all(np.abs(out.astype(np.float64) - exact) <= bound + 1e-30))


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "upcast"])
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_matmul_f32_accumulates_in_fp32(monkeypatch, native, sa, sb):
    monkeypatch.setattr(ops, "NATIVE_BF16_MATMUL", native)
    a, b, exact, bound = _case(sa, sb)
    out = np.asarray(jax.jit(ops.matmul_f32)(jnp.asarray(a), jnp.asarray(b)))
    jax.clear_caches()  # the flag is read at trace time
    assert out.dtype == np.float32 and out.shape == exact.shape
    assert _within(out, exact, bound), f"max |err| {np.abs(out - exact).max():.3g} > fp32 accumulation bound"
    # the check can fail: a result rounded to bf16 once (what a bf16-accumulating or bf16-output dot gives) breaks it
    assert not _within(out.astype(ml_dtypes.bfloat16).astype(np.float32), exact, bound)


def test_linear_rounds_once_to_the_activation_dtype():
    a, b, exact, _ = _case((4, 256), (256, 64), seed=3)
    out = np.asarray(ops.linear(jnp.asarray(a), jnp.asarray(b)))
    assert out.dtype == ml_dtypes.bfloat16
    ref = exact.astype(np.float32).astype(ml_dtypes.bfloat16)  # RNE of the (nearly) exact sum
    # a different fp32 summation order can only move a value across a bf16 rounding boundary: at most 1 bf16 ULP
    d = np.abs(out.astype(np.float32) - ref.astype(np.float32))
    ulp = np.spacing(np.abs(ref.astype(np.float32)).astype(ml_dtypes.bfloat16)).astype(np.float32)
    assert np.all(d <= ulp) and np.mean(d == 0) > 0.99
