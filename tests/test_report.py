"""First divergence / source logic and report rendering on hand-made records (no dump, no target needed)."""

import json

from parity.model.config import PRESETS, Ling3Config
from parity.model.points import sites_for_config
from parity.reporting.report import build_report, diff_reports, first_divergence, html_page, summary_text, write_reports

CFG = Ling3Config.from_dict(PRESETS["tiny"])


def _records(fail: dict[tuple[int, str], int]) -> list[dict]:
    """All prefill points of the tiny model; (layer, site) in `fail` fail with that many ULP."""
    recs = [{"phase": "prefill", "step": 0, "layer": None, "site": s, "status": "pass", "max_ulp": 0, "rel_l2": 0.0}
            for s in ("embed", "final_norm", "logits")]
    for i in range(CFG.num_hidden_layers):
        for s in sites_for_config(CFG, i):
            u = fail.get((i, s))
            recs.append({"phase": "prefill", "step": 0, "layer": i, "site": s,
                         "status": "fail" if u else "pass", "max_ulp": u or 0, "rel_l2": 1e-2 if u else 1e-4,
                         "worst_index": [0, 5, 7] if u else None})
    return recs


def test_source_is_first_failing_point_whose_inputs_pass():
    # layer 3 (MLA): core fails, and everything downstream inherits it; an earlier-executed but *independent*
    # failure does not exist, so first divergence == source == core.
    fails = {(3, "attention.core"): 400, (3, "attention.dense:in"): 300, (3, "attention.dense"): 200,
             (3, "attention"): 100, (3, "output"): 50, (4, "input"): 50, (4, "output"): 30}
    fd = first_divergence(CFG, _records(fails))
    assert (fd["layer"], fd["site"]) == (3, "attention.core")
    assert fd["source"]["layer"] == 3 and fd["source"]["site"] == "attention.core"


def test_source_skips_points_whose_inputs_fail():
    # KDA layer 1: o_norm fails because g_proj fails; g_proj executes after core in §3 order, so the first failing
    # point in execution order is g_proj itself and it is also the source; o_norm inherits.
    fails = {(1, "attention.g_proj"): 9, (1, "attention.o_norm"): 9, (1, "attention.o_proj"): 9}
    fd = first_divergence(CFG, _records(fails))
    assert fd["site"] == "attention.g_proj" and fd["source"]["site"] == "attention.g_proj"
    # If only the downstream point and a *later layer's* independent point fail, the source is the downstream one.
    fails = {(1, "attention.o_proj"): 9, (2, "attention.q_proj"): 9}
    fd = first_divergence(CFG, _records(fails))
    assert (fd["layer"], fd["site"]) == (1, "attention.o_proj") and fd["source"]["site"] == "attention.o_proj"


def test_inherited_failure_is_not_its_own_source():
    # teacher-forced input of layer 2 fails (dump edited), so layer 2's layernorm inherits it: source = the input
    fails = {(2, "input"): 5, (2, "input_layernorm"): 5}
    fd = first_divergence(CFG, _records(fails))
    assert fd["site"] == "input" and fd["source"]["site"] == "input"
    fails = {(1, "output"): 5, (2, "input"): 5, (2, "input_layernorm"): 5}
    assert first_divergence(CFG, _records(fails))["source"] == {
        "phase": "prefill", "step": 0, "layer": 1, "site": "output", "max_ulp": 5, "rel_l2": 0.01,
        "worst_index": [0, 5, 7]}


def test_reports_render_and_roundtrip(tmp_path):
    rep = build_report(CFG, _records({(3, "attention.core"): 400}), dump="d.h5", target="reference", mode="layer")
    assert not rep["passed"] and rep["first_divergence"]["site"] == "attention.core"
    out = write_reports(rep, tmp_path)
    j = json.loads((out / "report.json").read_text())
    assert j["schema"] == "ling3-parity-report" and j["version"] == 1
    assert j["first_divergence"]["source"] == {"phase": "prefill", "step": 0, "layer": 3, "site": "attention.core",
                                               "max_ulp": 400, "rel_l2": 0.01, "worst_index": [0, 5, 7]}
    page = (out / "report.html").read_text()
    assert "HERE" in page and "<svg" in page and "http" not in page.replace('http://www.w3.org/2000/svg', '')
    assert "<- HERE" in summary_text(rep)
    ok = build_report(CFG, _records({}), dump="d.h5", target="reference", mode="layer")
    assert ok["passed"] and ok["first_divergence"] is None
    d = diff_reports(rep, ok)
    assert "1 point(s) changed" in d or "point(s) changed" in d
    assert "prefill/L03/attention.core: fail 400 ULP -> pass 0 ULP" in d
    assert html_page(ok).count("HERE") == 0


def test_summary_names_a_rounding_check_failure():
    # a point failed by the RMSNorm rounding check has max 0 ULP after the floor: the summary says what failed it
    recs = _records({(2, "input_layernorm"): 0})
    for r in recs:
        if r["layer"] == 2 and r["site"] == "input_layernorm":
            r["status"] = "fail"
            r["rounding"] = {"applied": True, "outside": 7, "elements": 640, "index": [0, 3, 5], "test": -0.84765625,
                             "ref": -0.84375}
    text = summary_text(build_report(CFG, recs, dump="d.h5", target="t", mode="layer"))
    assert "rounding check: 7 element(s) outside what fp32 rounding of the RMSNorm formula gives, first at [0, 3, 5] " \
           "(test -0.847656, dump -0.84375)" in text
    assert "rounding check" not in summary_text(build_report(CFG, _records({(3, "attention.core"): 400}), dump="d.h5",
                                                             target="t", mode="layer"))


def _table_fields(text: str) -> dict[str, list[str]]:
    """The terminal's per-layer table rows keyed by layer, each split into its columns at runs of 2+ spaces."""
    import re

    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.split()[:2] == ["phase", "step"])
    rows = {}
    for line in lines[start + 1:]:
        fields = re.split(r" {2,}", line.strip(), maxsplit=8)
        rows[fields[2]] = fields
    return rows


def test_summary_table_columns_never_run_together():
    # issue 25: benign 0 followed by max ULP 2131735856 printed as `02131735856`; huge and non-finite values too
    # (issue 31: the column is now max |Δ|/RMS, which can be as wide: 1e+300, inf)
    huge = {(0, "attention.core"): 2131735856, (1, "attention.core"): 9, (2, "attention.core"): 7}
    recs = _records(huge)
    for r in recs:
        if (r["layer"], r["site"]) == (0, "attention.core"):
            r["rel_l2"], r["max_diff_rms"] = 1e300, 2131735856.0
        if (r["layer"], r["site"]) == (1, "attention.core"):
            r["max_diff_rms"] = "inf"  # report.json's spelling of a non-finite statistic
        if (r["layer"], r["site"]) == (2, "attention.core"):
            r["rel_l2"], r["max_diff_rms"] = float("nan"), 7.0
    text = summary_text(build_report(CFG, recs, dump="d.h5", target="t", mode="layer"))
    rows = _table_fields(text)
    for layer, (ulp, rel) in {"0": ("2.13e+09", "1.00e+300"), "1": ("inf", "1.00e-02"), "2": ("7", "1.00e-04")}.items():
        fields = rows[layer]
        assert len(fields) == 9, f"layer {layer}: columns ran together: {fields}"
        assert fields[:2] == ["prefill", "0"] and fields[4:8] == ["1", "0", ulp, rel], fields
        assert fields[8].startswith("attention.core")
    assert rows["0"][8].endswith("<- HERE") and all(line == line.rstrip() for line in text.splitlines())


def test_ulp_figures_name_their_grid():
    """issue 31 item 4: every ULP figure says which grid it counts on (the point's comparison dtype)."""
    recs = _records({(3, "attention.core"): 400})
    for r in recs:
        r["dtype"] = "float32" if r["site"] == "attention.core" else "bfloat16"
    rep = build_report(CFG, recs, dump="d.h5", target="t", mode="layer")
    assert "first divergence: prefill/L03/attention.core  max 400 fp32 ULP" in summary_text(rep)
    from parity.reporting.report import markdown

    md = markdown(rep)
    assert "max 400 fp32 ULP, p99 None fp32 ULP" in md and "`prefill/L03/attention.core`: max 400 fp32 ULP" in md
    assert "max 400 fp32 ULP" in html_page(rep)
    assert "| max \\|Δ\\|/RMS |" in md  # the per-layer table's column has no ULP (grid-free)
