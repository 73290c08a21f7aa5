"""compare(): the hybrid rule of DESIGN §5 on hand-built tensors whose expected outcome is derived in the test
(bit patterns, numpy formulas), and each criterion shown to fail when its subject is perturbed."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
from bounds import FP64_STAT_REL
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from parity.errors import ParityError
from parity.numerics import ComparisonError, ToleranceRule, allowed_over_count, compare

BF16 = ml_dtypes.bfloat16


def rule(floor=1, max_ulps=2, frac=0.001, hard=64, **kw):
    return ToleranceRule(floor_ulps=floor, max_ulps=max_ulps, allowed_fraction=frac, hard_ulps=hard, **kw)


def bf16_steps(x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Move positive bf16 values `steps` grid points up (bit arithmetic; valid within the positive finite range)."""
    return (x.astype(BF16).view(np.uint16).astype(np.int64) + steps).astype(np.uint16).view(BF16)


def positive_bf16(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (1 + rng.random(shape)).astype(BF16)  # in [1, 2]: one binade, ULP 2**-7


def test_identical_inputs_pass_with_exact_statistics():
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(BF16)
    v = compare(x, x.copy(), rule(), name="p")
    assert v.passed and v.n == 240 and v.dtype == "bfloat16"
    assert (v.max_ulp, v.p50_ulp, v.p99_ulp, v.p999_ulp, v.frac_exact, v.frac_le1_ulp) == (0, 0, 0, 0, 1.0, 1.0)
    assert v.rel_l2 == 0.0 and v.cosine == pytest.approx(1.0) and v.max_abs_diff == 0.0 and v.worst_index is None
    assert v.min_passing_max_ulps == 0 and v.min_passing_hard_ulps == 0
    json.dumps(v.to_dict(), allow_nan=False)
    assert "Tensor-likes are close [p]" in v.message()


def test_plus_and_minus_zero_are_equal():
    v = compare(np.array([0.0, -0.0], BF16), np.array([-0.0, 0.0], BF16), rule(floor=0, max_ulps=0, frac=0, hard=0))
    assert v.passed and v.frac_exact == 1.0


# ------------------------------------------------------------------------------------------- the absolute floor
def floor_case(test_small: float):
    """Row of 63 × 1.5 and one 0 → RMS = 1.5·sqrt(63/64) ≈ 1.488 ∈ [1, 2): 1 bf16 ULP of the RMS is 2**-7."""
    ref = np.full((2, 64), 1.5, BF16)
    ref[:, -1] = 0
    test = ref.copy()
    test[1, -1] = test_small
    return ref, test


def test_floor_passes_errors_below_the_row_resolution():
    assert math.isclose(1.5 * math.sqrt(63 / 64), 1.488, rel_tol=1e-3)  # not-a-bound: the docs' 3-digit number
    ref, test = floor_case(2.0**-7)  # |Δ| = 1 ULP of the row RMS; billions of ULPs of the zero reference
    v = compare(ref, test, rule(floor=1))
    assert v.passed and v.n_floored == 1 and v.max_ulp == 0 and v.max_ulp_raw > 10_000
    assert v.floor_abs_max == 2.0**-7
    assert v.worst_index == (1, 63)  # fallback to the greatest |Δ| when every ULP distance is floored
    # perturbed: no floor, or a floor of 0.5 ULP, or |Δ| one grid step above the floor → fails on the hard limit
    assert not compare(ref, test, rule(floor=0)).passed
    assert not compare(ref, test, rule(floor=0.5)).passed
    ref2, test2 = floor_case(float(np.nextafter(np.array(2.0**-7, BF16), np.array(1, BF16))))
    v2 = compare(ref2, test2, rule(floor=1))
    assert not v2.passed and v2.n_hard == 1 and v2.worst_index == (1, 63)


def test_floor_uses_each_rows_own_rms():
    ref = np.zeros((2, 64), BF16)
    ref[0] = 1.5  # row 0 RMS 1.5 → floor 2**-7; row 1 all zero → floor = the smallest subnormal
    test = ref.copy()
    test[0, 0] = 1.5 + 2**-7  # 1 ULP, also within floor
    assert compare(ref, test, rule(floor=1, max_ulps=0, frac=0, hard=0)).passed
    test[1, 0] = 2.0**-9  # far below row 0's floor but row 1 has no scale
    assert not compare(ref, test, rule(floor=1, max_ulps=0, frac=0, hard=0)).passed


# ------------------------------------------------------------------------------------------- fraction / hard limit
def test_allowed_fraction_and_min_passing():
    ref = positive_bf16((1000,))
    steps = np.zeros(1000, np.int64)
    steps[[10, 500]] = 3
    test = bf16_steps(ref, steps)
    v = compare(ref, test, rule(floor=1, max_ulps=2, frac=0.001))  # 0.001·1000 = 1 element may be above 2 ULP
    assert not v.passed and v.n_over == 2 and v.allowed_over == 1 and v.max_ulp == 3
    assert v.frac_over == 0.002
    steps[500] = 0
    assert compare(ref, bf16_steps(ref, steps), rule(floor=1, max_ulps=2, frac=0.001)).passed
    assert "Mismatched elements: 2 / 1000 (0.2%) above 2 ULP" in v.message()
    assert "Would pass only with all of:\n  - max_ulps ≥ 3 (with any allowed_fraction" in v.message()


def test_would_pass_hint_names_the_fraction_and_the_outliers_it_hides():
    """Issue 15: "Would pass with max_ulps ≥ 94" next to a 32,364-ULP maximum hid the outliers. The hint must give
    the ULP limit together with the allowed fraction, and the limit with no element above it."""
    ref = positive_bf16((1000,))
    steps = np.zeros(1000, np.int64)
    steps[:5] = 4  # five elements 4 ULP off ...
    steps[5] = 90  # ... and one outlier 90 ULP off; 0.1 % of 1000 = 1 element may be above max_ulps
    v = compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=2, frac=0.001, hard=None))
    assert not v.passed and v.min_passing_max_ulps == 4 and v.max_ulp == 90
    msg = v.message()
    assert ("max_ulps ≥ 4 with allowed_fraction 0.1% (which lets ≤ 1 element stay above 4 ULP: the largest is 90 ULP); "
            "with every element within the limit: max_ulps ≥ 90") in msg
    # both statements are true: 4 at 0.1 % passes, 3 does not; 90 at 0 % passes, 89 does not
    assert compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=4, frac=0.001, hard=None)).passed
    assert not compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=3, frac=0.001, hard=None)).passed
    assert compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=90, frac=0.0, hard=None)).passed
    assert not compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=89, frac=0.0, hard=None)).passed


def test_hard_limit():
    ref = positive_bf16((100,))
    steps = np.zeros(100, np.int64)
    steps[7] = 65
    test = bf16_steps(ref, steps)
    v = compare(ref, test, rule(floor=0, max_ulps=2, frac=0.5, hard=64))
    assert not v.passed and v.n_hard == 1 and v.n_over == 1 and v.min_passing_hard_ulps == 65
    assert "hard_ulps ≥ 65" in v.message()
    assert compare(ref, test, rule(floor=0, max_ulps=2, frac=0.5, hard=65)).passed


@pytest.mark.parametrize("seed", range(5))
def test_min_passing_max_ulps_is_exact(seed):
    rng = np.random.default_rng(seed)
    ref = positive_bf16((4, 250), seed)
    steps = rng.integers(-6, 7, ref.shape) * (rng.random(ref.shape) < 0.3)  # not-a-bound: constructs data
    test = bf16_steps(ref, steps)
    frac = float(rng.choice([0.0, 0.001, 0.01, 0.05]))
    # independent: the distance is |steps| (one binade, positive values); floor 0 keeps every nonzero distance
    dist = np.sort(np.abs(steps).ravel())[::-1]
    k = math.floor(round(frac * dist.size, 9))
    expected = int(dist[k]) if k < dist.size else 0
    v = compare(ref, test, rule(floor=0, max_ulps=0, frac=frac, hard=None))
    assert v.min_passing_max_ulps == expected and v.min_passing_hard_ulps == int(dist[0])
    assert compare(ref, test, rule(floor=0, max_ulps=expected, frac=frac, hard=None)).passed
    if expected > 0:
        assert not compare(ref, test, rule(floor=0, max_ulps=expected - 1, frac=frac, hard=None)).passed


def test_allowed_over_count_takes_the_decimal_fraction():
    assert [allowed_over_count(f, n) for f, n in [(0.001, 1000), (0.3, 10), (0.1, 9), (0.0, 10**6), (1.0, 7)]] == \
        [1, 3, 0, 0, 7]


def test_percentiles_are_attained_values():
    ref = positive_bf16((1000,))
    steps = np.repeat(np.arange(10), 100)  # 100 elements at each of 0..9 ULP
    v = compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=9, frac=0, hard=None))
    # sorted distances s; pXX = s[ceil(q·n) - 1]
    s = np.sort(steps)
    assert (v.p50_ulp, v.p99_ulp, v.p999_ulp, v.max_ulp) == (s[499], s[989], s[998], 9)
    assert v.frac_exact == 0.1 and v.frac_le1_ulp == 0.2
    # all distinct distances 0..999 (crossing binades: the integer line is continuous for positive values)
    steps = np.random.default_rng(4).permutation(1000)
    v = compare(ref, bf16_steps(ref, steps), rule(floor=0, max_ulps=9, frac=0, hard=None))
    assert (v.p50_ulp, v.p99_ulp, v.p999_ulp, v.max_ulp) == (499, 989, 998, 999)
    assert v.min_passing_max_ulps == 999 and v.frac_exact == 0.001


# ------------------------------------------------------------------------------------------- worst element, stats
def test_worst_index_values_and_message():
    ref = positive_bf16((2, 3, 4))
    steps = np.zeros(ref.shape, np.int64)
    steps[1, 2, 3] = 37
    steps[0, 1, 1] = 5
    test = bf16_steps(ref, steps)
    v = compare(ref, test, rule(), name="prefill/L03/attention.core")
    assert v.worst_index == (1, 2, 3) and v.worst_ulp == 37
    assert v.worst_ref == float(ref[1, 2, 3]) and v.worst_test == float(test[1, 2, 3])
    assert v.max_abs_index == (1, 2, 3) and v.max_abs_diff == 37 * 2.0**-7
    msg = v.message()
    assert "Tensor-likes are not close! [prefill/L03/attention.core]" in msg
    assert "Greatest ULP distance: 37 at index (1, 2, 3)" in msg
    d = v.to_dict()
    assert d["worst_index"] == [1, 2, 3] and d["rule"]["max_ulps"] == 2
    json.dumps(d, allow_nan=False)


def test_worst_is_by_ulp_not_by_absolute_difference():
    ref = np.array([[100.0, 100.0], [1.5, 1.5]], BF16)  # bf16 ULP 0.5 at 100, 2**-7 at 1.5
    test = bf16_steps(ref, np.array([[2, 0], [0, 10]]))  # |Δ| 1.0 (2 ULP) vs 0.078 (10 ULP)
    v = compare(ref, test, rule(floor=0, max_ulps=20, frac=0, hard=None))
    assert v.worst_index == (1, 1) and v.worst_ulp == 10
    assert v.max_abs_index == (0, 0) and v.max_abs_diff == 1.0


def test_rel_l2_and_cosine_against_numpy():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((8, 32)).astype(np.float32)
    test = (ref + 0.05 * rng.standard_normal(ref.shape)).astype(np.float32)
    v = compare(ref, test, rule(), dtype="float32")
    r, t = ref.astype(np.float64), test.astype(np.float64)
    assert v.rel_l2 == pytest.approx(np.linalg.norm(t - r) / np.linalg.norm(r), rel=FP64_STAT_REL)
    assert v.cosine == pytest.approx(r.ravel() @ t.ravel() / (np.linalg.norm(r) * np.linalg.norm(t)), rel=FP64_STAT_REL)
    assert v.max_abs_diff == np.abs(t - r).max()


# ------------------------------------------------------------------------------------------- dtype handling
def test_fp32_compared_in_bf16_is_rounded_first():
    ref = np.float32([1.0, 3.0])
    test = np.float32([1.001, 3.0])  # rounds to 1.0 in bf16 (RNE), 8389 fp32 ULPs away
    strict = rule(floor=0, max_ulps=0, frac=0, hard=0)
    assert compare(ref, test, strict, dtype="bfloat16").passed
    assert compare(ref, test, rule(floor=0, max_ulps=0, frac=0, hard=0, compare_dtype="bfloat16")).passed
    v = compare(ref, test, strict)  # in the reference's own dtype, float32
    assert not v.passed and v.dtype == "float32" and v.max_ulp == 8389


def test_fp32_tensor_of_a_bf16_run_compared_in_the_precision_it_was_computed_in():
    """Issue 15: a router GEMM run in bf16 (a precision-placement bug) moves fp32 logits by ≤ ½ bf16 ULP. Rounded to
    bf16 first (compare_dtype bfloat16) both sides are equal; compared in fp32 — the precision the reference computed
    them in, `comparison_grid` — the bug is plain, while fp32 accumulation-order noise stays far below the limit."""
    from parity.numerics import comparison_grid

    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 64)).astype(BF16).astype(np.float64)
    w = (rng.standard_normal((64, 16)) / 8).astype(BF16).astype(np.float64)
    ref = (x @ w).astype(np.float32)  # fp32 logits of bf16 inputs (exact up to fp32 rounding)
    bug = ref.astype(BF16).astype(np.float32)  # the GEMM's result rounded to bf16, then upcast
    perm = (x[:, ::-1] @ w[::-1]).astype(np.float32)  # a correct implementation: another accumulation order
    fine = rule(floor=16, max_ulps=8, frac=0.001, hard=None)  # an fp32-grid rule of the calibrated kind
    assert comparison_grid(np.float32, fine) == "float32" and comparison_grid("float32") == "float32"
    coarse = rule(floor=16, max_ulps=8, frac=0.001, hard=None, compare_dtype="bfloat16")
    assert comparison_grid(np.float32, coarse) == "bfloat16"
    assert compare(ref, bug, coarse).passed and compare(ref, bug, coarse).max_ulp_raw == 0  # erased by the rounding
    v = compare(ref, bug, fine)
    assert v.dtype == "float32" and not v.passed and v.max_ulp > 1000
    assert compare(ref, perm, fine).passed


def test_test_side_in_a_wider_dtype_is_rounded_to_the_reference_dtype():
    ref = np.array([1.0], BF16)
    assert compare(ref, np.float32([1 + 2**-9]), rule(floor=0, max_ulps=0, frac=0, hard=0)).passed
    assert not compare(ref, np.float32([1 + 2**-7]), rule(floor=0, max_ulps=0, frac=0, hard=0)).passed


def test_float64_reference_needs_a_grid():
    with pytest.raises(ComparisonError, match="float64"):
        compare(np.float64([1.0]), np.float64([1.0]), rule())
    assert compare(np.float64([1.0]), np.float64([1.0]), rule(), dtype="float32").passed


def test_shape_mismatch_is_a_parity_error():
    with pytest.raises(ParityError, match=r"L03/mlp.*reference \(2, 3\), test \(3, 2\)"):
        compare(np.zeros((2, 3), BF16), np.zeros((3, 2), BF16), rule(), name="L03/mlp")


def test_integer_tensors_compare_exactly():
    ids = np.array([[3, 7], [1, 2]], np.int32)
    v = compare(ids, ids.copy(), rule())
    assert v.passed and v.dtype == "int32" and v.frac_exact == 1.0
    bad = ids.copy()
    bad[1, 0] = 5
    v = compare(ids, bad, rule(max_ulps=100, frac=1.0, hard=None))  # ULP tolerances do not apply to ids
    assert not v.passed and v.n_over == 1 and v.worst_index == (1, 0) and (v.worst_ref, v.worst_test) == (1, 5)
    assert "Mismatched elements: 1 / 4" in v.message()
    assert not compare(ids, ids.astype(np.float32) + 0.5, rule()).passed
    with pytest.raises(ComparisonError):
        compare(ids, ids, rule(), dtype="bfloat16")


# ------------------------------------------------------------------------------------------- NaN / Inf
def test_nan_inf_classes():
    ref = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0], BF16)
    assert compare(ref, ref.copy(), rule(floor=0, max_ulps=0, frac=0, hard=0)).passed
    for i, bad in [(0, 1.0), (1, -np.inf), (0, np.inf), (3, np.nan), (4, np.inf), (2, 3.0)]:
        test = ref.copy()
        test[i] = bad
        v = compare(ref, test, rule(max_ulps=100, frac=1.0, hard=None))
        assert not v.passed and v.nan_inf_mismatches == 1 and v.first_nan_inf_index == (i,)
        # the mismatched element is left out of every statistic: the rest is equal
        assert v.max_abs_diff == 0.0 and v.worst_index is None and v.max_ulp == 0 and v.rel_l2 == 0.0
        assert "NaN/Inf mismatches: 1" in v.message()
        json.dumps(v.to_dict(), allow_nan=False)


def test_rtol_atol_tier():
    ref = np.float32([1.0, 100.0, -3.0, 1e-3] * 16).reshape(4, 16)
    fp32 = dict(floor=0, max_ulps=None, frac=0, hard=None, rtol=1e-5)  # not-a-bound: a rule under test
    test = ref.copy()
    test[2, 5] *= 1 + 5e-6
    assert compare(ref, test, rule(**fp32)).passed
    test[2, 5] = ref[2, 5] * (1 + 2e-5)
    v = compare(ref, test, rule(**fp32))
    assert not v.passed and v.n_tol_fail == 1
    assert "outside |Δ| ≤ atol + rtol·|ref|" in v.message()
    # the floor absorbs errors far below the row scale even where rtol alone would fail (the 1e-3 elements)
    test = ref.copy()
    test[0, 3] = 1.1e-3  # |Δ| 1e-4, 10 % relative, row RMS ≈ 50
    assert not compare(ref, test, rule(**fp32)).passed
    assert compare(ref, test, rule(**(fp32 | {"floor": 2048}))).passed  # 2048 fp32 ULP of 50 ≈ 7.8e-3


# ------------------------------------------------------------------------------------------- per-element safety bound
def _activation(seed=0, shape=(4, 64)):
    """bf16 rows with RMS ≈ 1 (normal samples)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16)


@pytest.mark.parametrize("garbage", [3e38, -3e38, 7.0])
def test_safety_bound_fails_finite_garbage_the_fraction_would_let_through(garbage):
    """Issue 14: up to allowed_fraction of the elements could be *anything finite* (3e38 in 2 elements passed; one
    element 0.625 -> 7.0 passed). With bound_rms the fraction no longer covers elements beyond bound_rms·row RMS."""
    ref = _activation(shape=(8, 256))
    test = ref.copy()
    n_bad = 1 if garbage == 7.0 else 2
    test[3, 17] = 0.625 if garbage == 7.0 else ref[3, 17]
    ref[3, 17] = test[3, 17]
    test[3, 17] = garbage
    if n_bad == 2:
        test[6, 200] = garbage
    loose = dict(floor=16, max_ulps=2, frac=0.01, hard=None)  # 1 % of 2048 = 20 elements may be above 2 ULP
    assert compare(ref, test, rule(**loose)).passed  # the gap: without the bound this passes
    rms3 = float(np.sqrt(np.mean(ref[3].astype(np.float64) ** 2)))
    v = compare(ref, test, rule(**loose, bound_rms=0.5))
    assert not v.passed and v.n_bound == n_bad and v.bound_index == (3, 17)
    assert v.bound_ref == float(ref[3, 17]) and v.bound_test == float(np.float32(garbage).astype(BF16))
    assert v.max_diff_rms == pytest.approx(abs(float(test[3, 17]) - float(ref[3, 17])) / rms3, rel=1e-6)  # not-a-bound: one fp32 rounding of the RMS (elementwise IEEE maths: the same on every CPU)
    msg = v.message()
    assert f"beyond the per-element safety bound |Δ| ≤ 0.5×row RMS: {n_bad} / 2048" in msg
    assert "bound_rms ≥" in msg and "no correct implementation" in msg
    json.dumps(v.to_dict(), allow_nan=False)


def test_safety_bound_limit_is_exact_and_the_floor_always_passes():
    ref = np.full((1, 64), 1.0, BF16)  # RMS exactly 1
    test = ref.copy()
    test[0, 5] = 1.5  # |Δ| = 0.5 row RMS
    r = dict(floor=1, max_ulps=2, frac=0.1, hard=None)
    assert compare(ref, test, rule(**r, bound_rms=0.5)).passed
    v = compare(ref, test, rule(**r, bound_rms=0.4921875))
    assert not v.passed and v.n_bound == 1 and v.max_diff_rms == 0.5
    # within the absolute floor passes even where bound_rms·RMS is smaller (floor 64 ULP of 1 = 0.5)
    assert compare(ref, test, rule(**(r | {"floor": 64}), bound_rms=0.01)).passed


def test_safety_bound_on_a_zero_row_and_off():
    ref = np.zeros((2, 8), BF16)
    ref[0] = 1.0
    test = ref.copy()
    test[1, 3] = 1e-3  # a row whose reference is all zero has no scale: any difference is beyond every bound
    v = compare(ref, test, rule(floor=1, max_ulps=2, frac=0.1, hard=None, bound_rms=1e6))
    assert not v.passed and v.n_bound == 1 and v.max_diff_rms == math.inf and v.bound_index == (1, 3)
    json.dumps(v.to_dict(), allow_nan=False)
    v = compare(ref, test, rule(floor=1, max_ulps=2, frac=0.1, hard=None))  # bound off: the fraction allows it
    assert v.passed and v.n_bound == 0 and v.max_diff_rms == math.inf


def test_safety_bound_with_the_fp32_tier():
    ref = np.float32(np.random.default_rng(1).standard_normal((4, 32)))
    ref[2, 2] = 0.75
    test = ref.copy()
    test[2, 2] += 1e-3  # allowed by rtol 1e-2, beyond a 1e-4 row-RMS bound
    fp32 = dict(floor=16, max_ulps=None, frac=0, hard=None, rtol=1e-2)  # not-a-bound: a rule under test
    assert compare(ref, test, rule(**fp32)).passed
    v = compare(ref, test, rule(**fp32, bound_rms=1e-4))
    assert not v.passed and v.n_bound == 1 and v.bound_index == (2, 2)


# ------------------------------------------------------------------------------------------- never raises on values
float_arrays = st.sampled_from([np.float32, np.float16]).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
                          elements=hnp.from_dtype(np.dtype(dt), allow_nan=True, allow_infinity=True)))


@settings(max_examples=150, deadline=None)
@given(a=float_arrays, data=st.data(), to_bf16=st.booleans())
def test_compare_never_raises_and_identical_passes(a, data, to_bf16):
    if to_bf16:
        a = a.astype(BF16)
    b = data.draw(hnp.arrays(np.float32, a.shape, elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
    r = rule()
    v = compare(a, b, r)
    json.dumps(v.to_dict(), allow_nan=False)
    assert isinstance(v.message(), str)
    assert compare(a, a.copy(), r).passed


# ------------------------------------------------------------------------------------------ block by block
# `_compare_float_blocked` (used above BLOCKED_ABOVE elements: a real vocabulary's gradients) against the reference
# `_compare_float` on the same inputs, with blocks small enough to split these tensors every way: whole rows per
# block, and rows longer than a block (a gradient's single row). Integers, indices and percentiles must be equal;
# the float64 norms behind rel-L2 / cosine are sums of per-block sums (last bits), and a row split across blocks has
# its RMS summed in pieces (the floor's last bits).
def _blocked_vs_reference(r, t, rl, block, dtype="float32"):
    import dataclasses

    from parity.numerics.compare import _compare_float, _compare_float_blocked

    a = _compare_float(r, t, rl, "x", dtype)
    b = _compare_float_blocked(r, t, rl, "x", dtype, block=block)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x):
            assert math.isnan(y), (f.name, x, y, block)
        elif isinstance(x, float) and isinstance(y, float) and not math.isinf(x):
            assert y == pytest.approx(x, rel=FP64_STAT_REL, abs=0), (f.name, x, y, block)  # relative only
        else:
            assert x == y, (f.name, x, y, block)
    return a


def _noisy(shape, seed, dtype=np.float32, garbage=0):
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(shape).astype(dtype)
    t = (r.astype(np.float64) * (1 + 3e-7 * rng.standard_normal(shape))).astype(dtype)
    flat = t.reshape(-1)
    idx = rng.choice(flat.size, size=garbage, replace=False) if garbage else []
    flat[idx] = flat[idx] * 1.5 + 0.25  # a few elements far off: outliers, bound breaches, worst indices
    return r, t


@pytest.mark.parametrize("shape", [(7, 33), (1, 1000), (3, 5, 64), (2001,)])
@pytest.mark.parametrize("block", [1, 17, 64, 10**6])
def test_blocked_comparison_gives_the_reference_verdict(shape, block):
    for seed, garbage in ((0, 0), (1, 3)):
        r, t = _noisy(shape, seed, garbage=garbage)
        # a rule exercising every criterion of both paths (not a tolerance of the suite)
        rl = ToleranceRule(floor_ulps=64, max_ulps=2, hard_ulps=4096,
                           allowed_fraction=0.01, rtol=1e-5,  # not-a-bound: exercises the criteria
                           bound_rms=0.5, inexact_row_rate=0.999)  # not-a-bound: exercises the criteria
        v = _blocked_vs_reference(r, t, rl, block)
        assert v.passed == (garbage == 0), v.message()
        # bf16 tensors, NaN/Inf classes, a zero row
        r16, t16 = r.astype(BF16), t.astype(BF16)
        t16.reshape(-1)[:3] = np.array([np.nan, np.inf, -np.inf], BF16)[: min(3, t16.size)]
        if r16.ndim > 1:
            r16[..., 0, :] = 0
        _blocked_vs_reference(r16, t16, rule(floor=2, max_ulps=2, frac=0.001, hard=64, bound_rms=0.25), block,
                              "bfloat16")


def test_a_large_gradient_is_compared_block_by_block(monkeypatch):
    """compare() takes the blocked path above BLOCKED_ABOVE and gives the reference's verdict there."""
    import importlib

    C = importlib.import_module("parity.numerics.compare")  # the module (the package re-exports the function)
    r, t = _noisy((1, 5000), 2, garbage=2)
    rl = rule(floor=8, max_ulps=2, frac=0.001, hard=64)
    want = C._compare_float(r, t, rl, "g", "float32")
    seen = []
    real = C._compare_float_blocked
    monkeypatch.setattr(C, "BLOCKED_ABOVE", 1000)
    monkeypatch.setattr(C, "_compare_float_blocked", lambda *a, **k: seen.append(1) or real(*a, block=700))
    got = C.compare(r, t, rl, name="g")
    assert seen and got.passed == want.passed and got.worst_index == want.worst_index and got.n_hard == want.n_hard
