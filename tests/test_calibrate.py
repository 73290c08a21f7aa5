"""parity.calibration.rules: per-point noise statistic, aggregation and rule proposal on hand-made numbers with known answers;
the committed default table loads and names the command that calibrated it."""

import math
from importlib import resources

import ml_dtypes
import numpy as np
import pytest

from parity.calibration import noise as N
from parity.calibration import rules as C
from parity.model.points import site_class
from parity.numerics.compare import compare
from parity.numerics.tolerances import _parse_text, default_rules

BF16 = ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------------------ point_noise
def test_point_noise_known_values():
    # Row RMS 1 → bf16 ulp(1) = 2^-7. Element 0 is 1 ULP off (need 1); element 3 (ref 2^-8 near zero) is off by
    # 3·2^-7: 3 ULP of the row RMS, but 3·2^-7 / ulp(2^-8)=2^-16 → 384 of its own ULPs.
    ref = np.array([[1.0, -1.0, 1.0, 2.0 ** -8]], np.float32)
    rms = math.sqrt((3 + 2.0 ** -16) / 4)
    assert 2 ** -1 <= rms < 1  # ulp(rms) = 2^-8 in bf16
    test = ref.copy()
    test[0, 0] += 2.0 ** -7  # 1.0078125: 1 ULP of 1.0 (ulp(1)=2^-7), 2 ULP of the row RMS
    test[0, 3] += 3 * 2.0 ** -7
    s = N.point_noise(ref.astype(BF16), test.astype(BF16), "bfloat16")
    assert s["n"] == 4
    assert s["floor_needed"] == pytest.approx(3 * 2.0 ** -7 / 2.0 ** -8)  # = 6 ULP of the row RMS
    raw3 = int(np.abs(np.int64(test[0, 3].astype(BF16).view(np.uint16)) - np.int64(ref[0, 3].astype(BF16).view(np.uint16))))
    assert s["max_ulp_raw"] == raw3 > 100
    # Floor 4 keeps element 0 (need 2) out and leaves element 3 (need 6) judged in its own ULPs.
    assert s["by_floor"]["4"]["max"] == raw3
    assert s["by_floor"]["8"]["max"] == 0
    assert s["by_floor"]["1"]["frac_over"]["2"] == 0.25  # element 0 has 1 raw ULP, element 3 is above 2
    assert s["frac_exact"] == 0.5
    # The statistic agrees with compare(): with the floor it needs, the same rule passes; just below, it fails.
    from parity.numerics.tolerances import ToleranceRule

    assert compare(ref.astype(BF16), test.astype(BF16), ToleranceRule(6, 0, 0.0, None)).passed
    assert not compare(ref.astype(BF16), test.astype(BF16), ToleranceRule(5.9, 0, 0.0, None)).passed


def test_point_noise_rtol_floor_fp32():
    ref = np.array([[1.0, 1.0, 1.0, 1e-6]], np.float32)
    test = ref.copy()
    test[0, 1] = np.float32(1.0 + 5e-6)  # within rtol 1e-5: needs no floor
    test[0, 3] = np.float32(1e-6 + 64 * 2.0 ** -24)  # near zero: outside rtol, 64 fp32-ULP of row RMS (ulp = 2^-24)
    s = N.point_noise(ref, test, "float32")
    rms_ulp = 2.0 ** -24  # rms ≈ 0.866 ∈ [0.5, 1)
    assert s["rtol_floor_needed"] == pytest.approx(abs(float(test[0, 3]) - 1e-6) / rms_ulp, rel=1e-6)  # not-a-bound: elementwise IEEE maths on constructed data (CPU-independent)
    assert s["rtol_floor_needed"] == pytest.approx(64, rel=1e-3)  # not-a-bound: 64 ULP by construction, up to the fp32 rounding of 1e-6
    assert s["floor_needed"] > s["rtol_floor_needed"]  # element 1 (5e-6 ≈ 84 ULP of the RMS) needs more floor alone


def test_nice_and_floor_for():
    assert [C.nice(x) for x in (0, 0.3, 1, 1.2, 1.5, 1.6, 2, 2.5, 3, 3.1, 46, 80, 100)] == \
        [0, 1, 1, 1.5, 1.5, 2, 2, 3, 3, 4, 48, 96, 128]
    assert C.floor_for(0) == 0 and C.floor_for(3) == 4 and C.floor_for(20) == 32 and C.floor_for(1e9) == N.FLOORS[-1]


# ------------------------------------------------------------------------------------------------ aggregation
def _pt(site="attention.core", mode="layer", dtype="bfloat16", compute="bfloat16", need_p999=1.0, need_p99=1.0,
        frac_over2=0.0, max_eff=0, rtol_need=0.0, corpus="c", layer=0):
    by_floor = {str(F): {"max": max_eff, "p99": 0, "p999": 0, "frac_over": {str(k): frac_over2 if k == 2 else 0.0
                                                                       for k in C.KS}} for F in N.FLOORS_FP32}
    return {"corpus": corpus, "mode": mode, "phase": "prefill", "step": 0, "layer": layer, "site": site,
            "class": site_class(site), "dtype": dtype, "compute": compute, "n": 1000, "max_ulp_raw": max_eff,
            "floor_needed": need_p999, "floor_needed_p99": need_p99, "floor_needed_p999": need_p999,
            "rtol_floor_needed": rtol_need, "rel_l2": 1e-3, "nonfinite_mismatches": 0, "by_floor": by_floor}


def test_propose_layer_rule_from_worst_point():
    pts = [_pt(need_p999=3, frac_over2=0.0001, max_eff=10, corpus="a"),
           _pt(need_p999=10, frac_over2=0.0004, max_eff=40, corpus="b", site="attention.dense:in")]
    rule, F = C.propose_rule(pts)
    # floor: worst p99.9 need 10 × safety 2 = 20 → candidate 32; fraction 0.0004·2 = 0.0008 → minimum 0.001;
    # hard: off in the propagating modes (a corpus maximum is a tail statistic; see propose_rule).
    assert F == 32
    assert rule.fields["floor_ulps"] == 32 and rule.fields["max_ulps"] == 2
    assert rule.fields["allowed_fraction"] == 0.001 and rule.fields["hard_ulps"] == "off"
    assert rule.sites == ("attention.core", "attention.dense:in") and rule.cls == "attn_core"
    assert "b:prefill/L00/attention.dense:in" in rule.basis  # names the worst point
    # Perturb the worst point: the rule follows the measurement (it is not a constant).
    pts[1] = _pt(need_p999=40, frac_over2=0.003, max_eff=1000, corpus="b")
    rule2, F2 = C.propose_rule(pts)
    assert F2 == 128 and rule2.fields["allowed_fraction"] == 0.006 and rule2.fields["hard_ulps"] == "off"



def test_hard_limit_method_when_enabled(monkeypatch):
    """The per-element hard limit (off by default in the propagating modes) still follows the measurement when
    switched on: S x worst max, rounded up; above HARD_OFF_ABOVE only sign flips of near-zero elements: off."""
    monkeypatch.setattr(C, "HARD_PER_ELEMENT_OFF", False)
    pts = [_pt(need_p999=3, frac_over2=0.0001, max_eff=10, corpus="a"),
           _pt(need_p999=10, frac_over2=0.0004, max_eff=40, corpus="b")]
    assert C.propose_rule(pts)[0].fields["hard_ulps"] == 96  # 40 x 2 = 80 -> nice 96
    pts[1] = _pt(max_eff=20000)
    assert C.propose_rule(pts)[0].fields["hard_ulps"] == "off"


def test_propose_free_and_fp32_and_mixed_rules():
    # p99 need 7 × 2 = 14 → floor 16; fraction 0.02 × 2 = 0.04 → nice(40)/1000 = 0.048
    free, F = C.propose_rule([_pt(mode="free", need_p99=7, need_p999=1000, max_eff=30000, frac_over2=0.02)])
    assert F == 16 and free.fields["allowed_fraction"] == 0.048 and free.fields["hard_ulps"] == "off"
    fp32, _ = C.propose_rule([_pt(dtype="float32", compute="float32", rtol_need=100)])
    assert fp32.fields["floor_ulps"] == 256 and fp32.fields["rtol"] == 1e-5 and fp32.fields["max_ulps"] == "off"
    fp32_small, _ = C.propose_rule([_pt(dtype="float32", compute="float32", rtol_need=0.5)])
    assert fp32_small.fields["floor_ulps"] == C.MINIMUMS["fp32_floor_ulps"]
    # an fp32 tensor of a bf16 run: a ULP rule on its own (fp32) grid, never rounded to bf16 first (issue 15)
    mixed, _ = C.propose_rule([dict(_pt(site="mlp.gate.logits", dtype="float32", need_p999=3000), grid="float32")])
    assert mixed.fields["compare_dtype"] == "off" and mixed.fields["floor_ulps"] == 8192
    assert mixed.fields["max_ulps"] == 2 and mixed.fields["rtol"] == "off"


def test_propose_isolated_rule_is_the_fine_instrument():
    """Isolated mode: the smallest max_ulps the noise allows (≥ 1), a per-element hard limit where the measured
    maximum allows one, and a ULP rule also for fp32 runs (not the rtol-1e-5 tier)."""
    pts = [_pt(mode="isolated", need_p999=0.5, frac_over2=0.0, max_eff=1)]
    for p in pts:  # p99.9 of the effective ULP distance 0, max 1
        for F in p["by_floor"].values():
            F["p999"] = 0
    rule, F = C.propose_rule(pts)
    assert F == 1 and rule.fields["max_ulps"] == 1 and rule.fields["hard_ulps"] == 4  # hard: max(4, M, 2·1)
    assert rule.fields["allowed_fraction"] == 0.001
    noisy = [_pt(mode="isolated", need_p999=0.5, max_eff=3000)]
    for F in noisy[0]["by_floor"].values():
        F["p999"] = 3
    r2, _ = C.propose_rule(noisy)
    assert r2.fields["max_ulps"] == 8 and r2.fields["hard_ulps"] == 6144  # 2·3 = 6 → 8; 2·3000 → nice 6144
    r3, _ = C.propose_rule([_pt(mode="isolated", max_eff=20000)])
    assert r3.fields["hard_ulps"] == "off"  # above HARD_OFF_ABOVE
    fp32, _ = C.propose_rule([dict(_pt(mode="isolated", dtype="float32", compute="float32", need_p999=10),
                                   grid="float32")])
    assert fp32.fields["rtol"] == "off" and fp32.fields["floor_ulps"] == 32 and fp32.fields["max_ulps"] >= 1


def test_aggregate_reports_worst_and_where():
    pts = [_pt(need_p999=3, corpus="a"), _pt(need_p999=12, corpus="b"), _pt(site="input", need_p999=100)]
    aggs = C.aggregate(pts, {("attn_core", "layer", "bfloat16", "bfloat16"): 32})
    a = aggs[("attn_core", "layer", "bfloat16", "bfloat16")]
    assert a["n_points"] == 2 and a["floor"] == 32
    assert a["floor_needed_p999"]["worst"] == 12 and a["floor_needed_p999"]["worst_at"].startswith("b:")
    assert aggs[("residual", "layer", "bfloat16", "bfloat16")]["floor_needed_p999"]["worst"] == 100


def test_rules_toml_round_trip_and_precedence():
    pts = [_pt(need_p999=10), _pt(mode="free", need_p99=30), _pt(site="input", need_p999=1),
           _pt(dtype="float32", compute="float32", rtol_need=100), _pt(mode="twin_vs_native", need_p999=1e4)]
    rules, floors = C.propose_rules(pts)
    assert all(r.mode in ("layer", "free", "isolated") for r in rules)  # cross-checks do not define rules
    table = _parse_text(C.rules_toml(rules, "# test header"), "test")
    assert table.rule_for("attention.core", "layer", "bfloat16", "bfloat16").floor_ulps == 32
    assert table.rule_for("attention.core", "forced", "bfloat16", "bfloat16").floor_ulps == 32
    assert table.rule_for("attention.core", "free", "bfloat16", "bfloat16").floor_ulps == 64
    assert table.rule_for("input", "layer", "bfloat16", "bfloat16").floor_ulps == 2
    # An unmeasured site falls to the tier's catch-all = loosest measured class.
    assert table.rule_for("attention.q_proj", "layer", "bfloat16", "bfloat16").floor_ulps == 32
    fp = table.rule_for("attention.core", "layer", "float32", "float32")
    assert fp.floor_ulps == 256 and fp.rtol == 1e-5 and fp.max_ulps is None
    assert table.rule_for("x", "layer", "float16").max_ulps == 2  # uncalibrated last resort still resolves


# ------------------------------------------------------------------------------------------------ the committed table
def test_default_table_is_calibrated_and_loads():
    text = resources.files("parity.numerics").joinpath("calibration.toml").read_text(encoding="utf-8")
    assert "PROVISIONAL" not in text
    assert text.startswith("# Calibrated numerics of ling3-parity") and "\n#   noise corpus: `python tools/calibrate.py" in text
    rules = default_rules()
    for site in ("attention.core", "mlp.gate.logits", "output", "logits", "attention.state"):
        for mode in ("layer", "forced", "free"):
            rules.rule_for(site, mode, "bfloat16", "bfloat16")
            rules.rule_for(site, mode, "float32", "bfloat16")
            r = rules.rule_for(site, mode, "float32", "float32")
            assert r.rtol == 1e-5  # the fp32 tier stays an rtol-1e-5 check (DESIGN §5)
