"""Detection resolution (parity.calibration.resolution): plants checked against numpy's own grid stepping, and the
resolution of simple rules against what the rule's definition implies."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from parity.numerics import ToleranceRule
from parity.calibration.resolution import detection_rate, plant, resolution

BF16 = ml_dtypes.bfloat16


def test_ulp_plant_matches_nextafter_fp32():
    ref = np.float32(np.random.default_rng(0).standard_normal((3, 50)))
    ref[0, 0] = 0.0
    out = plant(ref, "ulps", 3, np.random.default_rng(1), "float32")
    # independent: walk each element 3 times with np.nextafter towards the side it moved to
    for x, y in zip(ref.ravel(), out.ravel()):
        side = np.float32(np.inf) if y > x else np.float32(-np.inf)
        z = x
        for _ in range(3):
            z = np.nextafter(z, side)
        assert z == y, (x, y, z)


def test_ulp_plant_bf16_and_relative_plant():
    ref = np.random.default_rng(2).standard_normal((4, 64)).astype(BF16)
    out = plant(ref, "ulps", 1, np.random.default_rng(3), "bfloat16")
    f = ml_dtypes.finfo(BF16)
    # 1 ULP of a normal bf16 x in [2^e, 2^(e+1)) is 2^(e-7) (going down from a power of two: half of it)
    x, y = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    step = np.exp2(np.floor(np.log2(np.abs(x))) - (f.nmant))
    d = np.abs(y - x)
    assert np.all((d == step) | (d == step / 2))
    rel = plant(ref.astype(np.float32), "relative", 1e-3, np.random.default_rng(4), "float32")
    r = np.abs(rel.astype(np.float64) / ref.astype(np.float64) - 1)
    assert np.allclose(r, 1e-3, rtol=1e-3)  # not-a-bound: a planted 1e-3 offset up to fp32 rounding of the data (elementwise)
    with pytest.raises(ValueError, match="kind"):
        plant(ref, "absolute", 1, np.random.default_rng(0), "bfloat16")


def test_resolution_of_simple_rules():
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((8, 64)).astype(BF16)
    ulp_rule = ToleranceRule(floor_ulps=0, max_ulps=2, allowed_fraction=0.001, hard_ulps=None)
    # every element moved k ULPs: fails exactly when k > max_ulps (0.1 % of 512 = 0 elements may be above)
    res = resolution([(ref, ref.copy(), ulp_rule)], "ulps")
    assert res.magnitude == 3 and res.rate_at == 1.0 and res.rates[0] == (1, 0.0)
    fp32 = np.float32(rng.standard_normal((8, 64))) + np.float32(3)  # |x| ≥ ~0.5: no cancellation
    tier = ToleranceRule(floor_ulps=0, max_ulps=None, allowed_fraction=0, hard_ulps=None, rtol=1e-5)  # not-a-bound: a rule under test
    res = resolution([(fp32, fp32.copy(), tier)], "relative", scan=(5e-6, 2e-5))
    assert res.magnitude == 2e-5 and res.rates[0][1] == 0.0
    assert detection_rate([(fp32, fp32.copy(), tier)], "relative", 5e-6, range(3)) == 0.0


def test_resolution_refuses_a_failing_pair():
    ref = np.ones((2, 8), BF16)
    bad = ref * 2
    with pytest.raises(ValueError, match="fails without a plant"):
        resolution([(ref, bad, ToleranceRule(0, 2, 0.0, None))], "ulps")


@pytest.mark.parametrize("mode", ["layer", "isolated"])
def test_a_detected_plant_is_pinned_to_its_site(mode, tmp_path):
    """The premise of `tools/calibrate.py resolution`: a perturbation planted in one dumped site that its comparison detects is
    the report's first divergence *and* its source — here a 64-ULP plant into attention.o_norm of layer 1 of a copy of
    the bundled tiny-bf16 dump, replayed end to end."""
    import shutil

    import h5py

    from parity.dumpfile import seal_dump
    from parity.numerics import default_rules
    from parity.replay import run_replay

    src = Path(__file__).resolve().parents[1] / "dumps" / "tiny-bf16.h5"
    dump = tmp_path / "planted.h5"
    shutil.copy(src, dump)
    key = "/prefill/L01/attention.o_norm"
    with h5py.File(dump, "r+") as f:
        ds = f[key]
        val = ds[()].view(BF16)
        ds[...] = plant(val, "ulps", 64, np.random.default_rng(0), "bfloat16").view(np.uint16)
    seal_dump(dump)
    rep = run_replay(dump, mode=mode, layers=[0, 1])
    fd = rep["first_divergence"]
    assert fd is not None and (fd["phase"], fd["layer"], fd["site"]) == ("prefill", 1, "attention.o_norm"), fd
    assert (fd["source"]["layer"], fd["source"]["site"]) == (1, "attention.o_norm")
