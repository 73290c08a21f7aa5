"""The ULP convention of the suite (DESIGN §5), for bfloat16, float16 and float32. numpy + ml_dtypes only.

- A value is compared on the grid of one explicit dtype (`"bfloat16" | "float16" | "float32"`); values from a wider
  dtype are first rounded to it with round-to-nearest-even (`to_dtype`).
- ULP distance = distance on the monotone integer line of the bit patterns: the sign-magnitude pattern maps to
  `+magnitude` / `-magnitude` (`ordered_int`), so +0 and -0 are the same point (distance 0), the line crosses zero
  without a gap (smallest positive subnormal vs smallest negative subnormal = 2) and the largest finite value is
  1 ULP below +Inf.
- NaN and ±Inf are classes of their own (`value_class`): they get no ULP distance (`ulp_distance` returns the
  sentinel `NO_ULP` = -1 there); a class mismatch is reported separately by the comparison.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from parity.errors import ParityError

DTYPE_NAMES = ("bfloat16", "float16", "float32")
_BF16 = np.dtype(ml_dtypes.bfloat16)
NO_ULP = -1  # ulp_distance() where either side is NaN or ±Inf: those are classes, not points on the ULP line

# Value classes (value_class): finite, +Inf, -Inf, NaN (any payload, any sign).
FINITE, POS_INF, NEG_INF, NAN = 0, 1, 2, 3
CLASS_NAMES = {FINITE: "finite", POS_INF: "+inf", NEG_INF: "-inf", NAN: "nan"}


class _Spec:
    """Format facts of one dtype: numpy dtype, the same-width unsigned int, precision p (incl. implicit bit),
    minimum normal exponent."""

    def __init__(self, np_dtype: Any, uint: Any, bits: int, precision: int, emin: int):
        self.np_dtype = np.dtype(np_dtype)
        self.uint = np.dtype(uint)
        self.sint = np.dtype(f"int{bits}")
        self.bits = bits
        self.precision = precision
        self.emin = emin
        self.max = float(ml_dtypes.finfo(np_dtype).max)


_SPECS = {
    "bfloat16": _Spec(ml_dtypes.bfloat16, np.uint16, 16, 8, -126),
    "float16": _Spec(np.float16, np.uint16, 16, 11, -14),
    "float32": _Spec(np.float32, np.uint32, 32, 24, -126),
}


def dtype_name(dtype: Any) -> str:
    """Canonical name (`bfloat16|float16|float32`) of a dtype given as a name, numpy dtype, or array dtype."""
    if isinstance(dtype, str) and dtype in _SPECS:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _SPECS:
        raise ParityError(f"dtype {dtype!r}: no ULP convention for it; expected one of {', '.join(DTYPE_NAMES)}")
    return name


def _spec(dtype: Any) -> _Spec:
    return _SPECS[dtype_name(dtype)]


def _f64_to_f32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: truncate toward zero, and set the last bit if the result is inexact.
    Rounding that to bf16 with RNE then equals rounding float64 directly to bf16 (24 ≥ 8 + 2 bits), which a plain
    f64 -> f32 -> bf16 chain (ml_dtypes' astype from float64 does this) gets wrong at near-halfway values."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        y = x.astype(np.float32)
    bits = y.view(np.uint32).copy()
    finite = np.isfinite(x)
    # RNE rounded away from zero: step the magnitude one down (sign bit untouched). Also turns an overflow to Inf
    # of a finite x into float32 max, as truncation should.
    away = finite & (np.abs(y.astype(np.float64)) > np.abs(x))
    bits[away] -= np.uint32(1)
    inexact = finite & (bits.view(np.float32).astype(np.float64) != x)
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32)


def to_dtype(x: Any, dtype: Any) -> np.ndarray:
    """Round `x` (any float/int array) to `dtype` with round-to-nearest-even (overflow → ±Inf, NaN kept)."""
    spec = _spec(dtype)
    a = np.asarray(x)
    if a.dtype == spec.np_dtype:
        return a
    if spec.np_dtype == _BF16 and a.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        # float64, ints, bool: ml_dtypes would round via float32 twice; round to odd first instead.
        return _f64_to_f32_round_to_odd(a.astype(np.float64)).astype(_BF16)
    # numpy's float64 -> float16/float32 and ml_dtypes' float32/float16 -> bfloat16 are single, correct RNE casts.
    with np.errstate(over="ignore"):
        return a.astype(spec.np_dtype)


def ordered_int(a: np.ndarray) -> np.ndarray:
    """Bit pattern → position on the monotone integer line (int64): +magnitude for sign 0, -magnitude for sign 1.
    +0 and -0 both map to 0. NaN/Inf get the position of their bit pattern; exclude them with `value_class`."""
    spec = _spec(a.dtype)
    # As a signed integer, a pattern with the sign bit set is INT_MIN + magnitude, so INT_MIN - it = -magnitude.
    o = np.ascontiguousarray(a).view(spec.sint).astype(np.int64)
    np.subtract(np.int64(np.iinfo(spec.sint).min), o, out=o, where=o < 0)
    return o


def value_class(a: np.ndarray) -> np.ndarray:
    """Per element: FINITE, POS_INF, NEG_INF or NAN (int8)."""
    f = np.asarray(a).astype(np.float32)  # exact for all three dtypes
    nonfinite = ~np.isfinite(f)
    cls = np.zeros(f.shape, np.int8)  # FINITE == 0
    if nonfinite.any():  # rare: classify only those
        v = f[nonfinite]
        cls[nonfinite] = np.where(np.isnan(v), NAN, np.where(v > 0, POS_INF, NEG_INF))
    return cls


def ulp_distance(a: Any, b: Any, dtype: Any = None) -> np.ndarray:
    """|ordered_int(a) - ordered_int(b)| as int64, elementwise; `NO_ULP` (-1) where either side is NaN or ±Inf.

    With `dtype=None`, `a` and `b` must already have the same dtype (one of DTYPE_NAMES). With a dtype, both are
    first rounded to it (RNE)."""
    a, b = np.asarray(a), np.asarray(b)
    if dtype is None:
        if a.dtype != b.dtype:
            raise ParityError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype}); pass dtype= to round both to one")
        dtype = a.dtype
    a, b = to_dtype(a, dtype), to_dtype(b, dtype)
    if a.shape != b.shape:
        raise ParityError(f"ulp_distance: shapes differ ({a.shape} vs {b.shape})")
    d = np.abs(ordered_int(a) - ordered_int(b))
    nonfinite = (value_class(a) != FINITE) | (value_class(b) != FINITE)
    return np.where(nonfinite, NO_ULP, d)


def ulp_of(x: Any, dtype: Any) -> np.ndarray:
    """Spacing of the `dtype` grid at |x| (float64 array): 2**(e - p + 1) for |x| in [2**e, 2**(e+1)), the same as
    `numpy.spacing` of a positive representable value. Zero and subnormal magnitudes get the subnormal spacing
    2**(emin - p + 1); magnitudes at or beyond the largest finite value (Inf included) get its spacing; NaN → NaN."""
    spec = _spec(dtype)
    m = np.abs(np.asarray(x, np.float64))
    nan = np.isnan(m)
    m = np.where(nan, 0.0, np.minimum(m, spec.max))
    _, k = np.frexp(m)  # m = f * 2**k with f in [0.5, 1): exponent e = k - 1 (exact, no log2 rounding)
    e = np.maximum(k.astype(np.int64) - 1, spec.emin)
    e = np.where(m == 0, spec.emin, e)
    out = np.ldexp(1.0, (e - spec.precision + 1).astype(np.int32))
    return np.where(nan, np.nan, out)
