"""Per-point noise statistic of the calibration corpus (`point_noise`): how far a correct implementation's tensor is
from the reference's, on the grid the tensor was computed in (method: parity.calibration.rules' docstring).
numpy + ml_dtypes only; used by the corpus walk (parity.calibration.corpus) and the rule proposal."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parity.numerics.compare import percentile_rank
from parity.numerics.ulp import FINITE, ordered_int, to_dtype, ulp_of, value_class

FLOORS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fp32 grid: a bf16-compute run's fp32 tensors carry bf16-sized noise = up to 2^16 fp32 ULPs per bf16 ULP
FLOORS_FP32 = FLOORS + tuple(2**k for k in range(15, 25))
KS = (1, 2, 4, 8, 16, 32, 64)
RTOL_FP32 = 1e-5  # DESIGN §5: the fp32 tier is ~1e-5 relative


def _ranks(m: int) -> tuple[int, int]:
    """0-based ranks of p99 and p99.9 among m sorted values ('inverted_cdf', as parity.numerics.compare)."""
    return percentile_rank("99", m), percentile_rank("99.9", m)


def _quantiles(e: np.ndarray) -> tuple[int, int, int]:
    """(max, p99, p99.9) of a flat int array (attained values)."""
    m = e.size
    if m == 0:
        return 0, 0, 0
    r99, r999 = _ranks(m)
    part = np.partition(e, (r99, r999, m - 1))
    return int(part[m - 1]), int(part[r99]), int(part[r999])


def _fquantiles(x: np.ndarray) -> tuple[float, float, float]:
    """(max, p99, p99.9) of a flat float array (attained values)."""
    m = x.size
    if m == 0:
        return 0.0, 0.0, 0.0
    r99, r999 = _ranks(m)
    part = np.partition(x, (r99, r999, m - 1))
    return float(part[m - 1]), float(part[r99]), float(part[r999])


# ------------------------------------------------------------------------------------------------ one point
def floors_of(grid: str) -> tuple[int, ...]:
    """Candidate floors (ULPs of the row RMS) measured on `grid`."""
    return FLOORS_FP32 if grid == "float32" else FLOORS


def point_noise(ref: Any, test: Any, grid: str) -> dict:
    """Noise statistics of one point compared on `grid` ('bfloat16' or 'float32'); see the module docstring."""
    r, t = to_dtype(np.asarray(ref), grid), to_dtype(np.asarray(test), grid)
    if r.shape != t.shape:
        raise ValueError(f"point_noise: reference shape {r.shape} != test shape {t.shape}")
    last = r.shape[-1] if r.ndim else 1
    r, t = r.reshape(-1, last), t.reshape(-1, last)
    cr, ct = value_class(r), value_class(t)
    fin = (cr == FINITE) & (ct == FINITE)
    n_nonfinite_mismatch = int((cr != ct).sum())
    rv, tv = np.where(fin, r.astype(np.float64), 0.0), np.where(fin, t.astype(np.float64), 0.0)
    raw = np.where(fin, np.abs(ordered_int(r) - ordered_int(t)), 0)
    diff = np.abs(rv - tv)
    rms = np.sqrt((rv * rv).sum(-1, keepdims=True) / np.maximum(fin.sum(-1, keepdims=True), 1))
    need = diff / ulp_of(rms, grid)  # floor (in ULPs of the row RMS) this element needs to pass by the floor
    raw_f, need_f = raw.ravel(), need.ravel()
    by_floor = {}
    for F in floors_of(grid):
        eff = np.where(need_f > F, raw_f, 0)
        mx, p99, p999 = _quantiles(eff)
        by_floor[str(F)] = {"max": mx, "p99": p99, "p999": p999,
                            "frac_over": {str(k): float((eff > k).mean()) if eff.size else 0.0 for k in KS}}
    outside = diff > RTOL_FP32 * np.abs(rv)
    need_rtol = np.where(outside, need, 0.0).ravel()
    need_q = _fquantiles(need_f)
    need_rtol_q = _fquantiles(need_rtol)
    mx, p99, p999 = _quantiles(raw_f)
    nref = float(np.sqrt((rv * rv).sum()))
    return {
        "n": int(r.size), "grid": grid, "max_ulp_raw": mx, "p99_ulp_raw": p99, "p999_ulp_raw": p999,
        "frac_exact": float((raw_f == 0).mean()) if raw_f.size else 1.0,
        "floor_needed": need_q[0], "floor_needed_p99": need_q[1], "floor_needed_p999": need_q[2],
        "rtol_floor_needed": need_rtol_q[0], "rtol_floor_needed_p999": need_rtol_q[2],
        "rel_l2": float(np.sqrt((diff * diff).sum()) / nref) if nref > 0 else (0.0 if not diff.any() else math.inf),
        "max_abs_diff": float(diff.max()) if diff.size else 0.0,
        "nonfinite_mismatches": n_nonfinite_mismatch,
        "by_floor": by_floor,
    }


# ------------------------------------------------------------------------------------------------ one gradient
def grad_noise(ref: Any, test: Any, grid: str) -> dict:
    """Noise statistics of one backward point compared on `grid`, as the backward judge compares it
    (parity.replay.judge.compare_gradient): the whole tensor is one row, so `need` = |Δ| / ulp(RMS of the tensor)
    is the floor (in ULPs of the tensor's RMS) an element needs to pass by the floor. Records the worst and p99.9
    `need`, the floor the fp32 tier needs (every element outside it within rtol 1e-5), and the *tail*: (need, raw
    ULP distance) of every element whose need is above the tensor's p99.9 — exactly the elements a floor at or above
    that p99.9 can leave outside, so the count above any max_ulps outside any such floor is known from the tail
    (parity.calibration.gradients)."""
    r, t = to_dtype(np.asarray(ref), grid).reshape(-1), to_dtype(np.asarray(test), grid).reshape(-1)
    if r.shape != t.shape:
        raise ValueError(f"grad_noise: reference size {r.size} != test size {t.size}")
    cr, ct = value_class(r), value_class(t)
    fin = (cr == FINITE) & (ct == FINITE)
    rv, tv = np.where(fin, r.astype(np.float64), 0.0), np.where(fin, t.astype(np.float64), 0.0)
    raw = np.where(fin, np.abs(ordered_int(r) - ordered_int(t)), 0)
    diff = np.abs(rv - tv)
    rms = math.sqrt(float((rv * rv).sum()) / max(int(fin.sum()), 1))
    need = diff / float(ulp_of(np.float64(rms), grid))
    mx, _, p999 = _fquantiles(need)
    tail = need > p999
    outside = diff > RTOL_FP32 * np.abs(rv)
    nref = math.sqrt(float((rv * rv).sum()))
    return {
        "n": int(r.size), "grid": grid, "rms": rms, "max_ulp_raw": int(raw.max()) if raw.size else 0,
        "floor_needed": mx, "floor_needed_p999": p999,
        "rtol_floor_needed": float(need[outside].max()) if outside.any() else 0.0,
        "rel_l2": float(np.sqrt((diff * diff).sum()) / nref) if nref > 0 else (0.0 if not diff.any() else math.inf),
        "nonfinite_mismatches": int((cr != ct).sum()),
        "tail": [[float(f"{a:.6g}"), int(b)] for a, b in zip(need[tail].tolist(), raw[tail].tolist())],
    }
