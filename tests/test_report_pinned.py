"""Behaviour unchanged by the replay refactor (issue 12): the report of a fixed replay equals the one the code
*before* the refactor produced (commit 99c16a3, `run_replay("dumps/tiny-flash-bf16.h5", layers=[2, 5])`, written by
that code to `tests/data/report_tiny-flash-bf16_layer_L2_L5.json`). The expected file was not produced by the code
under test; its only claim is "same as before". Layers: 2 = KDA + MoE with a benign routing flip (so the forced
re-run and `forced_routing` points are pinned), 5 = MLA + MoE (`attention.dense:in`). Reports carry no timing
fields; should one be added, drop it in `_strip`. A deliberate behaviour change regenerates the file and says why.
Regenerated for issue 15 (same 250 points, same statuses and counts as the pre-refactor file, checked when
regenerating): verdicts carry the per-element safety bound (`n_bound`, `max_diff_rms`, `bound_rms` in the rule), fp32
tensors of the bf16 run are compared in fp32 (their ULP / rel-L2 statistics are now fp32-grid numbers), and the table
was recalibrated.
"""

from __future__ import annotations

import json
from pathlib import Path

from parity.replay import run_replay

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tests" / "data" / "report_tiny-flash-bf16_layer_L2_L5.json"
TIMING = ("seconds", "elapsed", "wall_s")


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def test_report_identical_to_before_the_refactor():
    rep = run_replay(ROOT / "dumps" / "tiny-flash-bf16.h5", layers=[2, 5])
    rep["dump"] = "dumps/tiny-flash-bf16.h5"
    got, want = _strip(json.loads(json.dumps(rep, default=str))), _strip(json.loads(EXPECTED.read_text()))
    assert got.keys() == want.keys()
    for k in want:
        if k != "points":
            assert got[k] == want[k], k
    assert [(p["phase"], p["step"], p["layer"], p["site"]) for p in got["points"]] == \
        [(p["phase"], p["step"], p["layer"], p["site"]) for p in want["points"]]
    for g, w in zip(got["points"], want["points"]):
        assert g == w, (g["phase"], g["step"], g["layer"], g["site"])
    assert any(p.get("forced_routing") for p in want["points"]) and want["counts"].get("benign")
