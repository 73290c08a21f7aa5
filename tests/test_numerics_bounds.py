"""Per-element safety bound (issue 14): derivation from the calibration corpus, the safety_bounds section of the shipped calibration.toml, and
planted finite garbage failing under the default table in every mode."""

import math

import ml_dtypes
import numpy as np
import pytest

from parity.numerics import compare, default_rules
from parity.calibration import bounds as B

BF16 = ml_dtypes.bfloat16
MODES = ("layer", "forced", "isolated", "free")
TIERS = (("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32"))


def test_nice_up():
    assert [B.nice_up(x) for x in (0.3, 0.5, 0.51, 0.75, 0.76, 1.0, 1.2, 3.0, 5.0)] == \
        [0.375, 0.5, 0.75, 0.75, 1.0, 1.0, 1.5, 3.0, 6.0]
    assert B.nice_up(2.0**-20 * 1.1) == 1.5 * 2.0**-20 and B.nice_up(0) == 0


def test_derive_bounds_is_safety_times_worst_in_rms_units():
    pts = [{"mode": "layer", "class": "c", "site": "s", "dtype": "bfloat16", "compute": "bfloat16", "grid": "bfloat16",
            "floor_needed": need, "corpus": f"tiny/s{i}/T40/bf16", "phase": "prefill", "step": 0, "layer": 0}
           for i, need in enumerate([3.0, 12.0, 5.0])]
    pts.append(dict(pts[0], mode="twin_fp32_vs_bf16", floor_needed=1e6))  # not a pair of correct implementations
    (b,) = B.derive_bounds(pts, safety=8)
    assert b.worst_rms == 12 * 2.0**-7 and b.bound_rms == B.nice_up(8 * 12 * 2.0**-7) == 0.75
    assert (b.mode, b.sites, b.n_points) == ("layer", ("s",), 3)
    (b0,) = B.derive_bounds([dict(p, floor_needed=0.0) for p in pts[:3]])  # no difference: the minimum
    assert b0.bound_rms == B.MIN_ULPS * 2.0**-7


def test_every_mode_and_tier_has_a_bound():
    t = default_rules()
    for mode in MODES + ("mtp",):
        for dtype, compute in TIERS + (("float16", "float16"),):
            for site in ("attention.core", "mlp.down_proj", "no.such.site"):
                r = t.rule_for(site, mode, dtype, compute)
                assert r.bound_rms is not None and 0 < r.bound_rms < math.inf, (site, mode, dtype, compute)
        assert t.rule_for("x", mode, "bfloat16").bound_rms is not None  # no compute dtype given


def _site_tensor(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 40, 64)).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, compute", TIERS)
def test_planted_garbage_fails_in_every_mode(mode, dtype, compute):
    """The issue's cases under the default table: 3e38 in 2 elements of attention.core, and one element 0.625 -> 7.0
    (rows of RMS ~1). Before the bound, the bf16 rules' allowed_fraction let both pass."""
    t = default_rules()
    r = t.rule_for("attention.core", mode, dtype, compute)
    ref = _site_tensor()
    ref[0, 5, 9] = 0.625
    ref = ref.astype(BF16).astype(np.float32) if dtype == "bfloat16" or compute == "bfloat16" else ref
    cast = (lambda a: a.astype(BF16)) if dtype == "bfloat16" else (lambda a: a)
    for plant in ({(0, 5, 9): 7.0}, {(0, 3, 1): 3e38, (0, 30, 60): 3e38}):
        test = ref.copy()
        for k, v in plant.items():
            test[k] = v
        v = compare(cast(ref), cast(test), r)
        rms = float(np.sqrt(np.mean(ref[0, 5].astype(np.float64) ** 2)))
        if len(plant) == 1 and 6.375 <= r.bound_rms * rms:  # the bound is loose in free mode: say so, do not hide it
            assert mode == "free", (mode, r.bound_rms)
            continue
        assert not v.passed and v.n_bound == len(plant), (mode, dtype, compute, plant, r.describe())
    # and the same tensors unperturbed pass
    assert compare(cast(ref), cast(ref.copy()), r).passed


def test_without_the_bound_the_fraction_lets_garbage_through():
    """The gap the bound closes (issue 14), shown on today's ULP criteria of the default table alone."""
    r = default_rules().rule_for("attention.core", "layer", "bfloat16", "bfloat16")
    assert r.allowed_fraction > 0 and r.hard_ulps is None
    ref = _site_tensor().astype(BF16)
    test = ref.copy()
    test[0, 3, 1] = test[0, 30, 60] = 3e38
    no_bound = type(r)(**{**r.to_dict(), "bound_rms": None})
    assert compare(ref, test, no_bound).passed
    assert not compare(ref, test, r).passed
