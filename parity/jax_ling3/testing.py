"""Comparison helpers shared by the tests of the JAX Ling3 (tests/test_jax_*.py)."""

from __future__ import annotations

import numpy as np


def rel_err(actual, expected) -> float:
    """max |a − e| / max |e| (0 when both are all-zero): a scale-aware relative error that does not blow up at
    isolated near-zero elements."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: actual {a.shape} vs expected {e.shape}")
    scale = np.abs(e).max() if e.size else 0.0
    diff = np.abs(a - e).max() if e.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


def assert_rel_close(actual, expected, tol: float, what: str = "") -> None:
    """AssertionError with the worst element (index, both values) when rel_err > tol."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    err = rel_err(a, e)
    if not np.isfinite(a).all():
        raise AssertionError(f"{what}: actual has {int((~np.isfinite(a)).sum())} non-finite element(s)")
    if err > tol:
        idx = np.unravel_index(np.argmax(np.abs(a - e)), e.shape)
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e} (max|Δ| / max|expected|); worst at index "
            f"{tuple(int(i) for i in idx)}: actual {a[idx]!r} vs expected {e[idx]!r}; shape {e.shape}")
