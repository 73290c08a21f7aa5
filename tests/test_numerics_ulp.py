"""The ULP convention (DESIGN §5) against hand-computed bit patterns, numpy's nulp machinery, np.nextafter and an
integer-arithmetic round-to-nearest-even reference written here."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.errors import ParityError
from parity.numerics import ulp
from parity.numerics.ulp import NO_ULP, ordered_int, to_dtype, ulp_distance, ulp_of, value_class

BF16 = ml_dtypes.bfloat16
UINT = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
NPDT = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}


def from_bits(bits, dtype):
    return np.array(bits, UINT[dtype]).view(NPDT[dtype])


# ------------------------------------------------------------------------------------------- hand-computed patterns
# (a bits, b bits, distance): sign bit 0x8000 / 0x80000000; mantissa 7 / 10 / 23 bits.
HAND = {
    "bfloat16": [
        (0x0000, 0x8000, 0),          # +0 vs -0
        (0x0001, 0x0000, 1),          # smallest subnormal vs 0
        (0x0001, 0x8001, 2),          # smallest positive vs smallest negative subnormal
        (0x007F, 0x0080, 1),          # largest subnormal vs smallest normal
        (0x7F7F, 0x7F7E, 1),          # max finite vs its predecessor
        (0x7F7F, 0xFF7F, 2 * 0x7F7F),  # max vs -max
        (0x3F80, 0x4000, 128),        # 1.0 vs 2.0: 2**7 values per binade
        (0x3F80, 0xBF80, 2 * 0x3F80),  # 1.0 vs -1.0
    ],
    "float16": [
        (0x0000, 0x8000, 0),
        (0x0001, 0x8001, 2),
        (0x03FF, 0x0400, 1),
        (0x7BFF, 0x7BFE, 1),          # max finite 65504
        (0x3C00, 0x4000, 1024),       # 1.0 vs 2.0
        (0x7BFF, 0xFBFF, 2 * 0x7BFF),
    ],
    "float32": [
        (0x00000000, 0x80000000, 0),
        (0x00000001, 0x80000001, 2),
        (0x007FFFFF, 0x00800000, 1),
        (0x7F7FFFFF, 0x7F7FFFFE, 1),
        (0x3F800000, 0x40000000, 2**23),
        (0x3F800000, 0xBF800000, 2 * 0x3F800000),
    ],
}


@pytest.mark.parametrize("dtype", list(HAND))
def test_hand_computed_distances(dtype):
    a = from_bits([h[0] for h in HAND[dtype]], dtype)
    b = from_bits([h[1] for h in HAND[dtype]], dtype)
    expected = np.array([h[2] for h in HAND[dtype]])
    np.testing.assert_array_equal(ulp_distance(a, b), expected)
    np.testing.assert_array_equal(ulp_distance(b, a), expected)


@pytest.mark.parametrize("dtype", list(HAND))
def test_ordered_int_values(dtype):
    sign = 0x8000 if dtype != "float32" else 0x80000000
    bits = [0x0000, sign, 0x0001, sign | 0x0001, 0x0123]
    np.testing.assert_array_equal(ordered_int(from_bits(bits, dtype)), [0, 0, 1, -1, 0x0123])


@pytest.mark.parametrize("dtype", list(HAND))
def test_nan_inf_are_classes(dtype):
    x = np.array([np.nan, np.inf, -np.inf, 1.0, np.nan, np.inf], np.float32).astype(NPDT[dtype])
    y = np.array([np.nan, np.inf, np.inf, np.inf, 1.0, 3.0], np.float32).astype(NPDT[dtype])
    np.testing.assert_array_equal(value_class(x), [ulp.NAN, ulp.POS_INF, ulp.NEG_INF, ulp.FINITE, ulp.NAN, ulp.POS_INF])
    np.testing.assert_array_equal(ulp_distance(x, y), [NO_ULP] * 6)
    # -NaN (sign bit set) is still NaN
    neg_nan = from_bits([0xFFC0 if dtype == "bfloat16" else (0xFE00 if dtype == "float16" else 0xFFC00000)], dtype)
    assert value_class(neg_nan)[0] == ulp.NAN


def test_mixed_dtypes_need_explicit_grid():
    with pytest.raises(ParityError, match="dtypes differ"):
        ulp_distance(np.float32([1.0]), np.float16([1.0]))
    # with a grid, both are rounded first: 1 + 2**-10 is 1 ULP above 1 in fp16 but rounds to 1.0 in bf16
    assert ulp_distance(np.float32([1.0]), np.float32([1 + 2**-10]), dtype="float16")[0] == 1
    assert ulp_distance(np.float32([1.0]), np.float32([1 + 2**-10]), dtype="bfloat16")[0] == 0


def test_unknown_dtype_is_a_parity_error():
    with pytest.raises(ParityError, match="float64"):
        ulp_distance(np.float64([1.0]), np.float64([1.0]))


# ------------------------------------------------------------------------------------------- numpy's nulp machinery
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_numpy_assert_array_max_ulp(dtype, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(500) * 10.0 ** rng.integers(-3, 3, 500)).astype(dtype)
    # walk each element a random number of steps along the grid (crossing zero for small values)
    steps = rng.integers(-40, 41, 500)
    b = a.copy()
    for _ in range(40):
        move = steps != 0
        b[move] = np.nextafter(b[move], np.where(steps[move] > 0, np.inf, -np.inf).astype(dtype))
        steps = steps - np.sign(steps)
    d = int(ulp_distance(a, b).max())
    assert d >= 1
    np.testing.assert_array_max_ulp(a, b, maxulp=d, dtype=dtype)
    with pytest.raises(AssertionError):
        np.testing.assert_array_max_ulp(a, b, maxulp=d - 1, dtype=dtype)
    # elementwise as well: each element's distance is exactly numpy's (passes at d_i, raises at d_i - 1)
    for ai, bi, di in zip(a[:60], b[:60], ulp_distance(a[:60], b[:60])):
        np.testing.assert_array_max_ulp(ai, bi, maxulp=int(di), dtype=dtype)
        if di >= 1:
            with pytest.raises(AssertionError):
                np.testing.assert_array_max_ulp(ai, bi, maxulp=int(di) - 1, dtype=dtype)


def test_numpy_check_catches_an_off_by_one_distance():
    """The agreement check above is not vacuous: a distance off by one is rejected by numpy's assert."""
    a = np.float32([1.0, 2.0, -3.0])
    b = np.nextafter(np.nextafter(a, np.float32(np.inf)), np.float32(np.inf))
    wrong = int(ulp_distance(a, b).max()) - 1  # what a broken implementation would report
    with pytest.raises(AssertionError):
        np.testing.assert_array_max_ulp(a, b, maxulp=wrong)


# ------------------------------------------------------------------------------------------- properties
def finite_bits(dtype):
    spec = {"bfloat16": (16, 0x7F80), "float16": (16, 0x7C00), "float32": (32, 0x7F800000)}[dtype]
    nbits, inf = spec
    mag = st.integers(0, inf - 1)
    return st.tuples(st.booleans(), mag).map(lambda s: (s[0] << (nbits - 1)) | s[1])


@pytest.mark.parametrize("dtype", list(HAND))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_properties(dtype, data):
    bits = data.draw(st.lists(finite_bits(dtype), min_size=3, max_size=3))
    a, b, c = (from_bits([x], dtype) for x in bits)
    dab, dba = ulp_distance(a, b)[0], ulp_distance(b, a)[0]
    assert dab == dba >= 0
    # distance 0 iff bit-equal up to ±0
    zero = lambda x: float(x[0]) == 0.0  # noqa: E731
    assert (dab == 0) == (bits[0] == bits[1] or (zero(a) and zero(b)))
    # on a line: sorted by value, distances add up (monotone, no gaps, triangle with equality)
    x, y, z = sorted((a, b, c), key=lambda v: float(v[0]))
    assert ulp_distance(x, z)[0] == ulp_distance(x, y)[0] + ulp_distance(y, z)[0]
    # the integer line has the order of the values
    oa, ob = ordered_int(a)[0], ordered_int(b)[0]
    assert np.sign(oa - ob) == np.sign(float(a[0]) - float(b[0]))
    # one step of nextafter is 1 ULP, toward both infinities (max finite stepping up reaches +Inf: excluded)
    for direction in (np.inf, -np.inf):
        with np.errstate(over="ignore"):
            nxt = np.nextafter(a, np.array([direction], np.float32).astype(NPDT[dtype]))
        if np.isfinite(nxt[0].astype(np.float32)):
            assert ulp_distance(a, nxt)[0] == 1


def rne_bf16_reference(x32: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits by integer arithmetic: keep the top 16 bits, round up if the dropped half is above 0x8000,
    or exactly 0x8000 and the kept part is odd (ties to even). Carries into the exponent (and to Inf) are correct."""
    bits = x32.view(np.uint32).astype(np.uint64)
    hi, lo = bits >> 16, bits & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & ((hi & 1) == 1))
    return (hi + up).astype(np.uint16)


def test_rounding_hand_made_halfway_cases():
    e = 2.0**-8  # half a bf16 ULP at 1.0
    x = np.array([1 + e, 1 + 3 * e, 1 + 5 * e, -(1 + e), -(1 + 3 * e), 1 + e + 2**-23, 1 + e - 2**-23,
                  2 - e, 3.3895314e38 * 0 + float(np.float32(3.3895314e38))], np.float32)
    y = to_dtype(x, "bfloat16").astype(np.float64)
    # ties go to the even mantissa; just above / below a tie go up / down; near max finite stays finite
    expected = [1.0, 1 + 4 * e, 1 + 4 * e, -1.0, -(1 + 4 * e), 1 + 2 * e, 1.0, 2.0, float(ml_dtypes.finfo(BF16).max)]
    np.testing.assert_array_equal(y, expected)
    # halfway between max finite and the next binade rounds to Inf (IEEE overflow under RNE)
    assert np.isinf(to_dtype(from_bits([0x7F7F8000], "float32"), "bfloat16")[0])


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 2**32 - 1))
def test_fp32_to_bf16_is_rne(bits):
    x = np.array([bits], np.uint32).view(np.float32)
    if not np.isfinite(x[0]):
        return
    y = to_dtype(x, "bfloat16")
    assert y.view(np.uint16)[0] == rne_bf16_reference(x)[0]
    yv = float(y[0])
    if np.isfinite(yv):  # within half a ULP of the bf16 grid around x
        lo_bits = (x.view(np.uint32) >> 16 << 16).view(np.float32)
        lo = float(lo_bits[0])
        hi = float(np.nextafter(lo_bits.astype(BF16), np.array([np.copysign(np.inf, lo if lo else 1.0)], BF16))[0])
        assert abs(float(x[0]) - yv) <= abs(hi - lo) / 2


def rne_reference_exact(x: float, dtype: str) -> float:
    """Exact RNE of a float64 to bf16 using Fractions and the two grid neighbours."""
    y0 = np.array([x]).astype(np.float32).astype(BF16)  # within one bf16 step of the answer
    cands = [y0, np.nextafter(y0, np.array([np.inf], BF16)), np.nextafter(y0, np.array([-np.inf], BF16))]
    fx = Fraction(x)
    best = min(cands, key=lambda c: (abs(Fraction(float(c[0])) - fx), int(c.view(np.uint16)[0]) & 1))
    return float(best[0])


@settings(max_examples=300, deadline=None)
@given(x=st.floats(min_value=2.0**-120, max_value=2.0**120) | st.floats(min_value=-(2.0**120), max_value=-(2.0**-120)))
def test_fp64_to_bf16_without_double_rounding(x):
    assert float(to_dtype(np.array([x]), "bfloat16")[0]) == rne_reference_exact(x, "bfloat16")


def test_fp64_double_rounding_case():
    x = np.array([1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40)])  # just above a bf16 tie, exactly a tie in fp32
    np.testing.assert_array_equal(to_dtype(x, "bfloat16").astype(np.float64), [1 + 2**-7, -(1 + 2**-7)])
    # fp16 from fp64 is numpy's single correct rounding
    assert float(to_dtype(np.array([1 + 2**-11 + 2**-40]), "float16")[0]) == 1 + 2**-10


# ------------------------------------------------------------------------------------------- ulp_of
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ulp_of_matches_numpy_spacing(dtype):
    name = np.dtype(dtype).name
    fi = np.finfo(dtype)
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (rng.random(300) * 2.0 ** rng.integers(-20, 15, 300)).astype(dtype),
        np.array([0, fi.smallest_subnormal, fi.smallest_normal, 1, 2, 0.75], dtype),
    ])
    x = x[np.isfinite(x) & (x < fi.max)]
    np.testing.assert_array_equal(ulp_of(x, name), np.spacing(x).astype(np.float64))
    np.testing.assert_array_equal(ulp_of(-x, name), np.spacing(x).astype(np.float64))
    # at max finite: the gap below it
    assert ulp_of(fi.max, name) == float(fi.max) - float(np.nextafter(fi.max, dtype(0)))


def test_ulp_of_bfloat16_against_next_bit_pattern():
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 0x7F7F, 500).astype(np.uint16)  # positive finite, below max
    x = bits.view(BF16)
    nxt = (bits + 1).view(BF16)
    np.testing.assert_array_equal(ulp_of(x, "bfloat16"), nxt.astype(np.float64) - x.astype(np.float64))
    mx = float(ml_dtypes.finfo(BF16).max)
    assert ulp_of(mx, "bfloat16") == 2.0 ** (127 - 7)
    assert ulp_of(np.inf, "bfloat16") == 2.0 ** (127 - 7)
    assert ulp_of(0.0, "bfloat16") == 2.0**-133  # smallest bf16 subnormal
    assert np.isnan(ulp_of(np.nan, "bfloat16"))
    assert ulp_of(1.0, "bfloat16") == 2.0**-7 and ulp_of(0.999, "bfloat16") == 2.0**-8
