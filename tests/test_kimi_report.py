"""A Kimi Linear dump's report (issue 34 §1: the report works from the family's description): Ling3's report
(`parity.reporting.report`) over `kimi_family.KimiGraph`, which reads `kimi_family.SITES` alone — execution order and
the sites each site is computed from. The end-to-end run (pytest parity on the bundled golden with a planted bug:
report.json, report.html, the reproduce command) is tests/test_kimi_goldens.py."""

from __future__ import annotations

from parity.model import kimi_family
from parity.model.kimi_family import SITES, KimiGraph
from parity.model.points import Point
from parity.reporting.report import build_report, first_divergence, order_key


def _rec(layer, site, status="pass", phase="prefill", step=0):
    return {"phase": phase, "step": step, "layer": layer, "site": site, "status": status, "max_ulp": 0}


def test_the_site_graph_is_in_execution_order():
    names = [s.site for s in SITES]
    assert len(set(names)) == len(names)
    for s in SITES:
        for i in s.inputs:
            assert i in names, f"{s.site}: input {i} is not a site"
            assert names.index(i) < names.index(s.site), f"{s.site} comes before its input {i}"


def test_inputs_follow_the_description():
    g = KimiGraph()
    assert g.point_inputs(Point("prefill", 0, 2, "input")) == [Point("prefill", 0, 1, "output")]
    assert g.point_inputs(Point("prefill", 0, 0, "input")) == [Point("prefill", 0, None, "embed")]
    assert [p.site for p in g.point_inputs(Point("decode", 1, 3, "attention.q_b_proj"))] == ["attention.q_a_layernorm"]
    assert {p.site for p in g.point_inputs(Point("prefill", 0, 0, "output"))} == {"input", "attention", "mlp"}


def test_first_divergence_in_execution_order():
    g = KimiGraph()
    recs = [_rec(1, "attention.o_proj", "fail"), _rec(0, "mlp", "fail"), _rec(0, "attention.o_norm"),
            _rec(0, "mlp.routed", "fail"), _rec(0, "mlp.gate.logits"), _rec(0, "output", "fail"),
            _rec(0, "attention.gate", "fail", phase="decode", step=1)]
    fd = first_divergence(g, recs)
    assert (fd["phase"], fd["layer"], fd["site"]) == ("prefill", 0, "mlp.routed")
    assert fd["source"]["site"] == "mlp.routed"
    ordered = [(r["phase"], r["layer"], r["site"]) for r in sorted(recs, key=lambda r: order_key(g, r))]
    assert ordered[:3] == [("prefill", 0, "attention.o_norm"), ("prefill", 0, "mlp.gate.logits"),
                           ("prefill", 0, "mlp.routed")] and ordered[-1][0] == "decode"


def test_a_site_added_to_the_description_is_ordered_by_it(monkeypatch):
    """Adding a site is one change in `SITES`: the report orders it where the description puts it."""
    extra = kimi_family.KimiSite("attention.f_a_proj", "self_attn.forget_gate.f_a_proj", inputs=("input_layernorm",))
    names = [s.site for s in SITES]
    at = names.index("attention.gate")
    monkeypatch.setattr(kimi_family, "SITES", SITES[:at] + (extra,) + SITES[at:])
    recs = [_rec(0, "attention.gate", "fail"), _rec(0, "attention.f_a_proj", "fail")]
    rep = build_report(KimiGraph(), recs, dump="d.h5", target="t", mode="layer", extra={"family": "kimi_linear"})
    assert rep["first_divergence"]["site"] == "attention.f_a_proj" and not rep["passed"]
    assert [p["site"] for p in rep["points"]] == ["attention.f_a_proj", "attention.gate"]


def test_backward_points_after_the_forward_last_layer_first():
    g = KimiGraph()
    recs = [_rec(0, "input", "fail", phase="backward"), _rec(3, "grad.mlp.experts.0.w1.weight", "fail",
                                                               phase="backward"),
            _rec(3, "input", phase="backward"), _rec(0, "output")]
    ordered = [(r["phase"], r["layer"], r["site"]) for r in sorted(recs, key=lambda r: order_key(g, r))]
    assert ordered == [("prefill", 0, "output"), ("backward", 3, "grad.mlp.experts.0.w1.weight"),
                       ("backward", 3, "input"), ("backward", 0, "input")]


def test_model_level_sites_embed_first_head_last():
    g = KimiGraph(num_layers=4)
    recs = [_rec(None, "logits", "fail"), _rec(3, "output"), _rec(None, "embed"), _rec(0, "input_layernorm"),
            _rec(None, "final_norm", "fail")]
    ordered = [(r["layer"], r["site"]) for r in sorted(recs, key=lambda r: order_key(g, r))]
    assert ordered == [(None, "embed"), (0, "input_layernorm"), (3, "output"), (None, "final_norm"), (None, "logits")]
    fd = first_divergence(g, recs)
    assert fd["site"] == "final_norm" and fd["source"]["site"] == "final_norm"
    assert g.point_inputs(Point("prefill", 0, None, "final_norm")) == [Point("prefill", 0, 3, "output")]
    assert g.point_inputs(Point("prefill", 0, 0, "input")) == [Point("prefill", 0, None, "embed")]
