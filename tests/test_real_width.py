"""Ling3's fp32 rules at real widths (parity/numerics/real_width.toml; docs/numerics.md "Real widths").

The calibrated rules come from tiny checkpoints (hidden size 64); a dump wider than the calibration corpora
(`width_class`: hidden_size > 256) is judged with the real-width section first, a handful of fp32 floors measured on
three Ling3-Tiny-wide checkpoints. Here: the section applies to wide dumps only (the tiny goldens and Kimi Linear keep
their rules), touches fp32 only, keeps the conv history's entry equal to the projections' rule it stands for — and
the porting bugs of the catalogue whose first divergence is at a site the section loosens are still detected and
localised under it (their dumps are tiny; the section is forced on them).
"""

from __future__ import annotations

import pytest

from parity.numerics.tolerances import TINY_WIDTH_MAX, default_rules, real_width_rules, rule_semantics, width_class

from test_mutations import PORTING, _ckpt, _matches, mut_dumps  # noqa: F401 (mut_dumps: a fixture)

FP32 = ("float32", "float32")


def test_width_class():
    assert width_class(64) == "tiny" and width_class(TINY_WIDTH_MAX) == "tiny" and width_class(None) == "tiny"
    assert width_class(TINY_WIDTH_MAX + 1) == "real" and width_class(1536) == "real"
    assert rule_semantics({"kda_chunk_precision": "bfloat16"}, 1536) == {"kda_chunk_precision": "bfloat16",
                                                                          "width": "real"}


def test_the_section_applies_to_wide_dumps_and_fp32_only():
    tiny = default_rules().for_semantics(rule_semantics({}, 64))
    real = default_rules().for_semantics(rule_semantics({}, 1536))
    assert real_width_rules().entries and all(e.when == (("width", "real"),) for e in real_width_rules().entries)
    changed = []
    for site in ("attention.gate", "attention.conv_state", "attention.state", "logits", "mlp.down_proj",
                 "attention.f_proj", "input_layernorm", "attention.core"):
        for mode in ("layer", "isolated", "free"):
            for dt in (FP32, ("bfloat16", "bfloat16"), ("float32", "bfloat16")):
                a, b = tiny.rule_for(site, mode, *dt), real.rule_for(site, mode, *dt)
                assert a == default_rules().rule_for(site, mode, *dt)  # tiny: the calibrated rules as they were
                if a != b:
                    changed.append((site, mode, dt))
                    assert dt == FP32 and b.floor_ulps > a.floor_ulps, (site, mode, dt, a, b)
    assert ("attention.state", "free", FP32) in changed
    assert {s for s, _, _ in changed} == {"attention.gate", "attention.conv_state", "attention.state", "logits",
                                          "mlp.down_proj", "attention.f_proj"}, changed


def test_the_conv_history_is_judged_as_the_projections_it_holds():
    real = default_rules().for_semantics(rule_semantics({}, 1536))
    conv = real.rule_for("attention.conv_state", "layer", *FP32)
    proj = default_rules().rule_for("attention.k_proj", "layer", *FP32)
    assert (conv.floor_ulps, conv.bound_rms) == (proj.floor_ulps, proj.bound_rms), (conv, proj)


def test_a_session_on_a_tiny_dump_keeps_the_calibrated_rules():
    from parity.golden import DUMPS
    from parity.replay.session import Session

    with Session.open(DUMPS / "tiny-fp32.h5") as s:
        assert s.rules.rule_for("attention.gate", "layer", *FP32) == default_rules().rule_for(
            "attention.gate", "layer", *FP32)


# The catalogue's porting bugs whose expected first divergence is a site the section loosens (its layer-mode sites:
# the gate, the conv history, the state, the head). Under the real-width rules they must still fail there.
LOOSENED = ("attention.gate", "attention.conv_state", "attention.state", "logits")


def _loosened_bugs() -> list[str]:
    from parity.model.config import Ling3Config
    from parity.targets.mutants import MUTATIONS

    out = []
    for name in PORTING:
        m = MUTATIONS[name]
        exp = m.expected(Ling3Config.from_pretrained_dir(_ckpt(m.preset), strict=False))
        if set(exp.sites) & set(LOOSENED):
            out.append(name)
    return out


@pytest.mark.parametrize("name", _loosened_bugs())
def test_bugs_at_loosened_sites_are_still_detected_and_localised(name, mut_dumps):
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay
    from parity.targets.mutants import MUTATIONS, MutantTarget

    m = MUTATIONS[name]
    dump = mut_dumps(m.preset)
    with DumpReader(dump) as r:
        cfg, sem = r.config, r.semantics
        assert width_class(cfg.hidden_size) == "tiny" and r.meta.get("compute_dtype") == "float32"
    exp = m.expected(cfg)
    rules = default_rules().for_semantics(rule_semantics(sem, 1536))  # the section forced on a tiny dump
    assert rules.rule_for("attention.gate", "layer", *FP32).floor_ulps == 512
    report = run_replay(dump, _ckpt(m.preset), target=MutantTarget(name, ckpt_dir=_ckpt(m.preset)),
                        layers=list(range(exp.layer + 1)), rules=rules)
    assert not report["passed"], f"{name}: passes under the real-width rules ({report['counts']})"
    src = report["first_divergence"]["source"]
    assert _matches(src, exp), f"{name}: source {src}, expected {exp}"


def _isolated_loosened_bugs() -> list[str]:
    """The catalogue's porting bugs expected first at a GEMM output whose isolated fp32 floor the section raises."""
    import fnmatch

    from parity.model.config import Ling3Config
    from parity.targets.mutants import MUTATIONS

    patterns = [e.site for e in real_width_rules().entries if e.mode == "isolated"]
    out = []
    for name in PORTING:
        m = MUTATIONS[name]
        if m.needs_decode or m.isolated():  # prefill bugs whose isolated site function is the layer's own code
            continue
        exp = m.expected(Ling3Config.from_pretrained_dir(_ckpt(m.preset), strict=False))
        if exp.phase == "prefill" and any(fnmatch.fnmatchcase(s, p) for s in exp.sites for p in patterns):
            out.append(name)
    return out


@pytest.mark.parametrize("name", _isolated_loosened_bugs())
def test_bugs_at_loosened_gemm_outputs_still_fail_in_isolated_mode(name, mut_dumps):
    """Isolated mode feeds each module the dump's own input: a bug that fails its site there under the calibrated
    rules still fails it under the raised fp32 floors (one whose site function does not run the planted code, and so
    passes under both, is skipped saying so)."""
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay
    from parity.targets.mutants import MUTATIONS, MutantTarget

    m = MUTATIONS[name]
    dump = mut_dumps(m.preset)
    with DumpReader(dump) as r:
        cfg, sem = r.config, r.semantics
    exp = m.expected(cfg)
    def expected_points(width: int) -> list[dict]:
        rules = default_rules().for_semantics(rule_semantics(sem, width))
        report = run_replay(dump, _ckpt(m.preset), target=MutantTarget(name, ckpt_dir=_ckpt(m.preset)),
                            mode="isolated", layers=[exp.layer], rules=rules, backward=False)
        return [p for p in report["points"] if (p["phase"], p["step"], p["layer"]) == (exp.phase, exp.step, exp.layer)
                and p["site"] in exp.sites]

    calibrated = expected_points(64)
    if not any(p["status"] == "fail" for p in calibrated):
        pytest.skip(f"{name}: isolated mode does not see it under the calibrated rules either "
                    f"({[(p['site'], p['status']) for p in calibrated]}): its site function is not the planted code")
    hits = expected_points(1536)
    assert hits and any(p["status"] == "fail" for p in hits), (
        f"{name}: {[(p['site'], p['status'], p.get('max_diff_rms')) for p in hits]} under the real-width rules")
