"""The prepared GPU check (parity/cli/gpu_check.py, tools/gpu_check.py): its plan, its stage runner (a failed stage is
recorded, the stages that need it are skipped, the others still run, the budget holds) and one whole run in
`--cpu-only` mode in a subprocess (official tiny checkpoint, stand-in dumps, CPU replay, comparison)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.cli import gpu_check as gc
from parity.torch_ref import official

REPO = Path(__file__).resolve().parents[1]


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_failed_stage_is_recorded_dependents_skipped_others_run(tmp_path):
    stages = [gc.Stage("a", argv=_py("print('a')")),
              gc.Stage("b", argv=_py("import sys; sys.exit('b broke')")),
              gc.Stage("c", needs=("b",), argv=_py("print('c')")),
              gc.Stage("d", needs=("a",), argv=_py("print('d')")),
              gc.Stage("e", needs=("a",), call=lambda: {"x": 1})]
    res = gc.run_plan(stages, tmp_path, jobs=2, budget_s=120, progress=lambda _: None)
    assert list(res) == ["a", "b", "c", "d", "e"]
    assert res["b"].status == "failed" and res["b"].rc == 1 and "b broke" in res["b"].note
    assert res["c"].status == "skipped" and "needs b (failed)" in res["c"].note
    assert [res[n].status for n in "ade"] == ["ok"] * 3
    assert res["e"].data == {"x": 1}
    assert "c" not in Path(res["a"].log).read_text().split("\n", 1)[1]  # each stage has its own log


def test_a_raising_in_process_stage_is_a_failure_not_a_crash(tmp_path):
    def boom() -> dict:
        raise ValueError("bad dump")

    res = gc.run_plan([gc.Stage("x", call=boom), gc.Stage("y", argv=_py("pass"))], tmp_path, jobs=1, budget_s=60,
                      progress=lambda _: None)
    assert res["x"].status == "failed" and "bad dump" in res["x"].note
    assert res["y"].status == "ok"


def test_budget_kills_a_running_stage_and_skips_later_ones(tmp_path):
    stages = [gc.Stage("slow", argv=_py("import time; time.sleep(30)")),
              gc.Stage("later", needs=("slow",), argv=_py("pass")),
              gc.Stage("after", argv=_py("pass"))]
    res = gc.run_plan(stages, tmp_path, jobs=1, budget_s=2, progress=lambda _: None)
    assert res["slow"].status == "timeout" and res["slow"].seconds < 20
    assert res["later"].status == "skipped"
    assert res["after"].status == "skipped" and "budget" in res["after"].note


def test_plan_gpu_mode(tmp_path):
    opts = gc.Options(out=tmp_path, cpu_ref="interp")
    stages = {s.name: s for s in gc.plan(opts)}
    cases = gc.cases(opts)
    assert len(cases) == 16 and cases[0].prompt_len > 64 and cases[0].precision == "bf16"
    # fp32 IEEE and fp32 TF32 share one CPU reference dump: 2 ckpts x 2 dtypes x 2 prompts
    assert len([n for n in stages if n.endswith(":cpu") and n.startswith("dump:")]) == 8
    tf32, ieee = stages["dump:tiny-fp32-tf32-100:device"], stages["dump:tiny-fp32-ieee-100:device"]
    assert "--allow-tf32" in tf32.argv and "--allow-tf32" not in ieee.argv
    # issue 31: bf16 with torch's reduced-precision bf16 GEMM reductions off (the dumper's default) and kept on; both
    # compared with the one CPU bf16 dump
    red, off = stages["dump:tiny-bf16-reduced-100:device"], stages["dump:tiny-bf16-100:device"]
    assert "--allow-bf16-reduced-precision-reduction" in red.argv
    assert "--allow-bf16-reduced-precision-reduction" not in off.argv
    assert stages["compare:tiny-bf16-reduced-100"].needs == ("dump:tiny-bf16-100:cpu",
                                                             "dump:tiny-bf16-reduced-100:device")
    for s in (tf32, ieee):
        assert s.argv[s.argv.index("--device") + 1] == "cuda" and "--no-cpu-kernels" in s.argv
        assert s.env["TRITON_INTERPRET"] is None
    assert stages["compare:tiny-fp32-tf32-100"].needs == ("dump:tiny-fp32-100:cpu", "dump:tiny-fp32-tf32-100:device")
    assert stages["replay:tiny-bf16-24:cuda"].env["JAX_PLATFORMS"] == "cuda"
    assert stages["replay:tiny-bf16-24:cpu"].env["JAX_PLATFORMS"] == "cpu"
    interp = stages["dump:tiny-bf16-24:cpu"]
    assert interp.env["TRITON_INTERPRET"] == "1" and "--no-cpu-kernels" in interp.argv
    assert interp.env["CUDA_VISIBLE_DEVICES"] == ""


def test_plan_cpu_only_mode_has_no_cuda(tmp_path):
    stages = gc.plan(gc.Options(out=tmp_path, cpu_only=True))
    assert gc.Options(out=tmp_path).cpu_ref == "stand-ins"  # the default CPU reference (see Options)
    assert not [s for s in stages if s.name.endswith(":cuda") or "cuda" in s.argv]
    assert all("--cpu-kernels" in s.argv for s in stages if s.name.startswith("dump:"))


def test_summarize_comparison_worst_point():
    pts = [{"point": "p/a", "max_ulp": 0, "rel_l2": 0.0, "within_tolerance": True},
           {"point": "p/b", "max_ulp": 7, "rel_l2": 1e-3, "within_tolerance": False},
           {"point": "p/c", "max_ulp": None, "rel_l2": None, "within_tolerance": False},  # integer point
           {"point": "p/d", "max_ulp": 3, "rel_l2": 2e-3, "within_tolerance": True}]
    s = gc.summarize_comparison(pts, ["p/e"])
    assert s["worst"]["point"] == "p/b"
    assert (s["compared"], s["within_tolerance"], s["bit_identical"]) == (4, 2, 1)
    assert s["outside_tolerance"] == ["p/b", "p/c"] and s["missing_in_device_dump"] == ["p/e"]


def test_unknown_injected_stage_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--out", str(tmp_path), "--cpu-only",
                        "--inject-failure", "dump:nope"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--inject-failure 'dump:nope': no such stage" in p.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.skipif(not official.available()[0], reason=official.available()[1])
def test_cpu_only_run_end_to_end(tmp_path):
    """The whole pipeline on CPU: two cases of the official tiny checkpoint (24 tokens, bf16 and fp32), one CPU
    reference dump broken on purpose. The bf16 case runs through; the fp32 case's comparison is skipped naming the
    failed stage, while its own dump and replay still run."""
    broken = "dump:tiny-fp32-24:cpu"
    cmd = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--out", str(tmp_path), "--cpu-only",
           "--ckpts", "tiny", "--precisions", "bf16,fp32-ieee", "--prompts", "24", "--decode-steps", "1",
           "--jobs", "2", "--inject-failure", broken]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]  # a failed stage: nonzero exit
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["schema"] == "ling3-parity-gpu-check" and doc["mode"] == "cpu-only"
    assert doc["failed_stages"] == [broken]
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["compare:tiny-fp32-ieee-24"]["status"] == "skipped"
    assert broken in stages["compare:tiny-fp32-ieee-24"]["note"]
    assert all(s["seconds"] > 0 for s in doc["stages"] if s["status"] != "skipped")
    rows = {r["case"]: r for r in doc["cases"]}
    assert set(rows) == {"tiny-bf16-24", "tiny-fp32-ieee-24"}
    for row in rows.values():  # both replays ran, the broken case's too
        rep = row["replay"]["cpu"]
        assert rep["stage"] == "ok" and rep["passed"] and rep["counts"].get("fail", 0) == 0
        assert rep["counts"]["pass"] > 0
    # the same stand-in dump made twice on one machine: every point bit-identical, nothing missing
    cmp = rows["tiny-bf16-24"]["cuda_vs_cpu"]
    assert cmp["compared"] > 0 and cmp["bit_identical"] == cmp["compared"] - _integer_points(tmp_path)
    assert cmp["within_tolerance"] == cmp["compared"] and cmp["missing_in_device_dump"] == []
    assert rows["tiny-fp32-ieee-24"]["cuda_vs_cpu"] is None
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| tiny | bf16 | 24 |" in md and "| tiny | fp32-ieee | 24 |" in md
    assert f"`{broken}`: failed" in md and "not compared" in md


def _integer_points(out: Path) -> int:
    pts = json.loads((out / "gpu_check_points.json").read_text())["tiny-bf16-24"]
    return sum(p["max_ulp"] is None for p in pts)
