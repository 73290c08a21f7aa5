"""The isolated-mode exactness test (parity.numerics.exactness, issue 15): rows counted, binomial tail against an
independent sum, the criterion inside `compare`, the rate derivation, and the generated rates file against its corpus."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from bounds import FP64_SPECIAL_REL

from parity.numerics import exactness
from parity.numerics.compare import compare
from parity.numerics.tolerances import ToleranceRule, default_rules

ROOT = Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16


def _binom_tail(r: int, n: int, p: float) -> float:  # independent: the definition, summed exactly in Python floats
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(r, n + 1))


@pytest.mark.parametrize("r,n,p", [(1, 1, 0.02), (2, 24, 0.0015), (5, 100, 0.0015), (24, 24, 0.0054), (0, 10, 0.1),
                                   (3, 40, 0.3)])
def test_tail_is_the_binomial_tail(r, n, p):
    assert exactness.tail(r, n, p) == pytest.approx(_binom_tail(r, n, p), rel=FP64_SPECIAL_REL, abs=1e-300)  # not-a-bound: abs=1e-300 only lets exact zeros compare


def test_rate_that_passes_is_the_boundary():
    p = exactness.rate_that_passes(5, 100)
    assert exactness.tail(5, 100, p) >= exactness.ALPHA > exactness.tail(5, 100, p * 0.99)
    assert exactness.rate_that_passes(0, 100) == 0.0


def test_rows_count_once_however_many_elements_differ():
    ref = np.zeros((4, 8), np.float32)
    test = ref.copy()
    test[1, :] = 1.0  # a whole row
    test[3, 2] = 1.0  # one element
    test[2, 0] = -0.0  # ±0 are equal
    v = compare(ref, test, _rule(None))
    assert (v.rows, v.inexact_rows) == (4, 2)
    nan = np.full((2, 2), np.nan, np.float32)
    assert compare(nan, nan.copy(), _rule(None)).inexact_rows == 0  # matching NaN classes are equal


def _rule(rate):
    return ToleranceRule(floor_ulps=1, max_ulps=1, allowed_fraction=0.001, hard_ulps=None, inexact_row_rate=rate)


def _one_ulp_up(a: np.ndarray, rows, cols) -> np.ndarray:
    b = a.copy().view(np.uint16)
    b[rows, cols] += 1
    return b.view(BF16)


def test_compare_fails_on_many_inexact_rows_and_passes_on_few():
    """1 ULP flips everywhere pass the ULP criteria; the exactness test fails them when they spread over rows, and a
    rule without the rate cannot (the criterion is what catches them)."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((100, 64)).astype(BF16)
    spread = _one_ulp_up(ref, np.arange(0, 100, 4), 5)  # 25 rows, one element each
    clustered = _one_ulp_up(ref, 7, np.arange(64))  # one row, all elements
    rate = 0.005
    bad = compare(ref, spread, _rule(rate))
    assert not bad.passed and bad.inexact_rows == 25 and bad.rows == 100 and bad.exactness_p < exactness.ALPHA
    msg = bad.message()
    assert "Rows not bit-identical: 25 / 100" in msg and "inexact_row_rate ≥" in msg
    assert compare(ref, spread, _rule(None)).passed  # without the rate: 1 ULP everywhere is within max_ulps 1
    ok = compare(ref, clustered, _rule(rate))
    assert ok.passed and ok.inexact_rows == 1  # a correct implementation's row-wise flip: one row, however wide
    assert compare(ref, ref.copy(), _rule(rate)).exactness_p == 1.0


def test_derive_rate_pooled_bound_and_worst_point():
    quiet = [(f"p{i}", 100, 0) for i in range(50)]
    d = exactness.derive_rate(quiet)
    assert d.worst_point is None and d.rate == pytest.approx(1 - (1 - exactness.CONFIDENCE) ** (1 / 5000), rel=1e-3)  # not-a-bound: the derived rate is rounded up to 3 digits by design
    loud = quiet + [("odd", 10, 4)]
    d2 = exactness.derive_rate(loud)
    assert d2.worst_point == "odd" and exactness.tail(4, 10, d2.rate) >= exactness.CORPUS_TAIL * 0.999
    assert all(exactness.tail(k, n, d2.rate) >= exactness.CORPUS_TAIL * 0.999 for _, n, k in loud)
    assert exactness.nice_rate(0.001234) == pytest.approx(0.0013) and exactness.nice_rate(0.02) == pytest.approx(0.02)


def test_default_table_has_rates_only_for_isolated_bf16():
    t = default_rules()
    assert t.rule_for("mlp.routed", "isolated", "bfloat16", "bfloat16").inexact_row_rate is not None
    assert t.rule_for("mlp.routed", "layer", "bfloat16", "bfloat16").inexact_row_rate is None
    assert t.rule_for("mlp.routed", "isolated", "float32", "float32").inexact_row_rate is None
    assert t.rule_for("attention.state", "isolated", "float32", "bfloat16").inexact_row_rate is None


def test_rates_file_is_what_its_corpus_gives():
    """The committed rates and RMSNorm scale noises are re-derived from the committed corpus (generated, not edited by
    hand)."""
    from parity.calibration import exactness_rates as ec

    records = ec.load_corpus(ROOT / "parity" / "numerics" / "calibration" / "exactness_rows.json.gz")
    want = tomllib.loads(ec.rates_toml(ec.derive_rates(records), "# header", ec.derive_scale_noise(records)))["rule"]
    got = tomllib.loads((ROOT / "parity" / "numerics" / "calibration.toml").read_text())[ec.SECTION]
    assert got == want
