"""The minimal reproducer (tools/repro.py, parity.reporting.repro), the reproduce commands of the terminal summary and the CI job
summary (parity.pytest_plugin.ci_summary) — issue 25 items 3 and 4.

A failing report is made the way a user makes one: `pytest parity` in a subprocess on the bundled tiny-bf16 dump,
layer 0, against a catalogue mutant (`kda_a_log_not_exp`: the KDA decay rate is A_log instead of exp(A_log)) named
by `--parity-target module:Class`. Where the error starts is the catalogue's `expected(cfg)`, derived from the bug's
semantics, never from the tool's output. The bundle's script then runs in a fresh process that cannot import the
replay machinery, the dump reader or h5py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
MUTATION = "kda_a_log_not_exp"
MUTANT_MODULE = f'''
from parity.targets.mutants import MutantTarget


class Mutant(MutantTarget):
    def __init__(self, **kw):
        super().__init__({MUTATION!r}, **kw)
'''
# the script may import parity's numerics, config and targets, but not what needs the dump or the replay
BLOCKED = ("parity.replay", "parity.dumpfile", "parity.pytest_plugin.plugin", "h5py")
RUN_BLOCKED = ("import runpy, sys\n"
               f"for m in {BLOCKED!r}: sys.modules[m] = None  # importing them raises ImportError\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _env(tmp: Path) -> dict:
    """The mutant's module importable, and this checkout's `parity` also from another working directory."""
    path = os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTEST_ADDOPTS": "", "PYTHONPATH": path}


def _run(args: list[str], tmp: Path, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=_env(tmp),
                          timeout=timeout)


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """(tmp dir, report dir, pytest stdout) of the mutant's replay of layer 0."""
    tmp = tmp_path_factory.mktemp("repro")
    (tmp / "mutmod.py").write_text(MUTANT_MODULE)
    r = _run(["-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0", "--parity-dump", str(DUMP),
              "--parity-layers", "0", "--parity-target", "mutmod:Mutant", "--parity-report", str(tmp / "reports")],
             tmp)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    return tmp, tmp / "reports" / "tiny-bf16", r.stdout


def _expected_key() -> str:
    from parity.dumpfile import DumpReader
    from parity.model.points import Point
    from parity.targets.mutants import MUTATIONS

    with DumpReader(DUMP) as d:
        e = MUTATIONS[MUTATION].expected(d.config)
    assert len(e.sites) == 1
    return Point(e.phase, e.step, e.layer, e.sites[0]).key()


def _bundle(tmp: Path, report_dir: Path, out: Path, *args: str) -> Path:
    r = _run(["tools/repro.py", str(report_dir), "--out", str(out), *args], tmp)
    assert r.returncode == 0, r.stderr
    return out


def _script(tmp: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess:
    """The bundle's repro.py in a fresh process, from an unrelated directory, with the replay machinery blocked."""
    return _run(["-c", RUN_BLOCKED, str(bundle / "repro.py"), *args], tmp, cwd=tmp)


def test_the_mutant_report_fails_where_the_bug_starts(failing):
    _, rdir, _ = failing
    rep = json.loads((rdir / "report.json").read_text())
    src = rep["first_divergence"]["source"]
    from parity.model.points import Point

    assert Point(src["phase"], src["step"], src["layer"], src["site"]).key() == _expected_key()
    assert Path(rep["checkpoint"]) == (ROOT / "dumps" / "ckpt" / "tiny").resolve()
    assert Path(rep["dump_file"]) == DUMP.resolve() and rep["report_dir"] == str(rdir)


@pytest.mark.parametrize("mode", ["isolated", "layer"])
def test_bundle_reproduces_the_failure_standalone(failing, mode):
    tmp, rdir, _ = failing
    b = _bundle(tmp, rdir, tmp / f"bundle-{mode}", "--mode", mode)
    assert sorted(p.name for p in b.iterdir()) == ["README.txt", "bundle.json", "inputs.npz", "repro.py",
                                                   "weights.safetensors"]
    meta = json.loads((b / "bundle.json").read_text())
    assert (meta["point"], meta["mode"], meta["target"]) == (_expected_key(), mode, "mutmod:Mutant")
    assert set(meta["weights"]) == {k for k in _layer_keys(0)}  # the layer's tensors, nothing else
    bad = _script(tmp, b)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.startswith(f"MISMATCH {_expected_key()} ({mode} repro, target mutmod:Mutant): "), bad.stdout
    good = _script(tmp, b, "--target", "reference")  # the mutant removed: the same inputs match
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith(f"MATCH {_expected_key()} ({mode} repro, target reference)"), good.stdout


def _layer_keys(i: int) -> set[str]:
    from parity.jax_ling3.weights import CheckpointReader

    return set(CheckpointReader(ROOT / "dumps" / "ckpt" / "tiny").hf_tensors(i))


@pytest.mark.parametrize("point,mode", [
    ("decode/S002/L00/attention.core", "isolated"),  # KDA: the previous step's dumped recurrent state (Site.carry)
    ("decode/S002/L03/attention.core", "isolated"),  # MLA: every earlier token's dumped K/V (Site.history)
    ("decode/S002/L03/attention.core", "layer"),  # the layer run over prefill, decode 1, 2, its own state carried
])
def test_a_decode_point_is_fed_its_earlier_state(failing, point, mode):
    tmp, rdir, _ = failing
    b = _bundle(tmp, rdir, tmp / "bundle-decode", "--point", point, "--target", "reference", "--mode", mode)
    r = _script(tmp, b)
    assert r.returncode == 0 and r.stdout.startswith(f"MATCH {point} ({mode} repro"), r.stdout + r.stderr


def _command_lines(stdout: str) -> tuple[str, str]:
    rep = [ln for ln in stdout.splitlines() if ln.startswith("  reproduce: ")]
    bun = [ln for ln in stdout.splitlines() if ln.startswith("  repro bundle: ")]
    assert len(rep) == 1 and len(bun) == 1, stdout[-3000:]
    return rep[0].split(": ", 1)[1], bun[0].split(": ", 1)[1]


def _collected(cmd: str, tmp: Path) -> list[str]:
    args = shlex.split(cmd)
    assert args[:2] == ["pytest", "parity"]
    r = _run(["-m", "pytest", *args[1:], "--collect-only", "-q", "-p", "no:cacheprovider"], tmp)
    return [ln for ln in r.stdout.splitlines() if "::" in ln]


def test_terminal_summary_prints_commands_that_reproduce(failing):
    tmp, rdir, stdout = failing
    pytest_cmd, bundle_cmd = _command_lines(stdout)
    layer = int(_expected_key().split("/")[1][1:])
    site = _expected_key().split("/", 2)[2]
    assert _collected(pytest_cmd, tmp) == [f"parity/test_points.py::test_point[tiny-bf16/layer_{layer}/{site}]"]
    assert shlex.split(bundle_cmd) == ["python", "tools/repro.py", str(rdir)]


@pytest.mark.parametrize("site", ["attention", "attention.dense", "mlp"])  # prefixes of other sites' names
def test_the_k_expression_selects_exactly_one_site(failing, site):
    from parity.model.points import Point
    from parity.reporting.repro import pytest_command

    tmp, rdir, _ = failing
    rep = json.loads((rdir / "report.json").read_text())
    cmd = pytest_command(rep, Point("prefill", 0, 3, site))
    assert _collected(cmd, tmp) == [f"parity/test_points.py::test_point[tiny-bf16/layer_3/{site}]"]


def test_ci_summary_appends_the_verdict_divergences_table_and_bundle(failing):
    tmp, rdir, _ = failing
    from parity.reporting.report import write_reports

    rep = json.loads((rdir / "report.json").read_text())
    fd = rep["first_divergence"]
    # a second report with the lead's triage section (shape of issue 25), and a passing one
    tri = dict(rep, triage={"first_semantic": fd, "first_precision": None, "variants": []})
    root = tmp / "ci"
    write_reports(rep, root / "a")
    write_reports(tri, root / "b")
    write_reports(dict(rep, passed=True, first_divergence=None), root / "c")
    summary = tmp / "step_summary.md"
    summary.write_text("earlier step\n")
    env_run = subprocess.run([sys.executable, "-m", "parity.pytest_plugin.ci_summary", str(root), "--bundles"], cwd=tmp,
                             capture_output=True, text=True, env={**_env(tmp), "GITHUB_STEP_SUMMARY": str(summary)},
                             timeout=600)
    assert env_run.returncode == 0 and env_run.stdout == "", env_run.stdout + env_run.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n## ling3-parity\n")  # appended, never overwritten
    a, b, c = text.split("### ")[1:]
    key = _expected_key()
    for part, label in ((a, "a"), (b, "b")):
        assert part.startswith("❌ FAILED") and f"- first divergence: `{key}`" in part
        assert "- reproduce: `pytest parity --parity-dump" in part
        assert "| phase | step | layer | points | fail |" in part and "**← HERE** |" in part
        assert f"- repro bundle written: `{root / label / 'repro'}`" in part
    assert "first semantic divergence" not in a
    assert f"- first semantic divergence: `{key}`" in b and "- first precision divergence: none" in b
    assert c.startswith("✅ PASSED") and "reproduce" not in c and "repro bundle" not in c
    assert (root / "a" / "repro" / "repro.py").is_file() and (root / "b" / "repro" / "repro.py").is_file()
    assert not (root / "c" / "repro").exists()


def test_bad_input_is_one_line(failing, tmp_path):
    tmp, rdir, _ = failing
    from parity.reporting.report import write_reports

    rep = json.loads((rdir / "report.json").read_text())
    write_reports(dict(rep, passed=True, first_divergence=None), tmp_path / "ok")
    cases = [([str(tmp_path / "ok")], "repro: error: report.json: first_divergence is null (the report passed); "
                                      "pass --point to choose a point"),
             ([str(rdir), "--point", "L03/attention.core"], "repro: error: --point 'L03/attention.core': expected a "
                                                            "per-layer point as reports spell it"),
             ([str(rdir), "--point", "prefill/L00/attention.dense"], "repro: error: point prefill/L00/attention.dense: "
                                                                    "layer 0 (kda, dense) has no site"),
             ([str(tmp_path / "nothing")], "repro: error: ")]
    for args, want in cases:
        r = _run(["tools/repro.py", *args, "--out", str(tmp_path / "b")], tmp)
        assert r.returncode == 2 and r.stderr.startswith(want) and len(r.stderr.splitlines()) == 1, (args, r.stderr)
