"""`pytest parity` as a pre-merge gate: its exit code is the verdict (issue 14).

- Bad input is one usage error (exit status 4, one `ERROR:` line naming the option/file/field), never a traceback or
  a skip per test: a target that cannot be imported or constructed, options, tolerance files, a checkpoint that is not
  the dump's (or is broken), token ids outside the vocabulary, a dump given twice.
- The coverage rule: a point the dump's model has and the dump lacks (a deleted layer, a lost decode step) fails
  naming it; a held point no replay compares fails naming it; what the user deselects is listed as not tested; a run
  that compares nothing fails.
- Two dumps with one file name get two labels and two reports; a report never lands outside the report directory.
Each case runs `pytest parity` in a subprocess on (copies of) the bundled bf16 tiny dump, mostly one layer of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from parity.dumpfile import seal_dump

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
CKPT = ROOT / "dumps" / "ckpt" / "tiny"

TARGETS = '''
from parity.targets.reference import ReferenceTarget


class Boom(ReferenceTarget):
    def __init__(self):
        raise RuntimeError("cannot find the port's weights cache\\nsecond line of the story")


class Nothing(ReferenceTarget):
    """Builds and runs, but hands back no point at all."""
    name = "nothing"

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        res = super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
        res.points.clear()
        res.output = None
        return res

    def embed(self, ids):
        return None

    def head(self, h):
        return {}
'''


def _pytest(*args: str, tmp: Path, env_path: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTEST_ADDOPTS": ""}
    if env_path is not None:
        env["PYTHONPATH"] = f"{env_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider",
                           "--parity-report", str(tmp / "reports"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800, env=env)


def _edited(tmp: Path, name: str, edit) -> Path:
    out = tmp / name
    shutil.copy(DUMP, out)
    with h5py.File(out, "r+") as f:
        edit(f)
    seal_dump(out)
    return out


def _set_ids(f):
    ids = f["tokens/input_ids"][()]
    ids[0, 5] = 600
    del f["tokens/input_ids"]
    f["tokens/input_ids"] = ids


def _ckpt_copy(tmp: Path, edit) -> Path:
    ck = tmp / "ck"
    shutil.copytree(CKPT, ck)
    edit(ck)
    return ck


def _truncate(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[:len(b) // 2])


CASES = {
    "target not importable": (lambda t: ["--parity-target", "nonexistent.module:X"],
                              "ERROR: target 'nonexistent.module:X' is not installed here (No module named"),
    "target constructor raises": (lambda t: ["--parity-target", "boomtargets:Boom"],
                                  "ERROR: target 'boomtargets:Boom': constructing Boom() raised RuntimeError: "
                                  "cannot find the port's weights cache"),
    "layer not in the model": (lambda t: ["--parity-layers", "99"],
                               "ERROR: --parity-layers '99': layer(s) [99] not in the model of "),
    "reversed layer range": (lambda t: ["--parity-layers", "3-1"],
                             "ERROR: --parity-layers '3-1': range 3-1 is empty (start > end)"),
    "malformed --parity-tol": (lambda t: ["--parity-tol", "garbage"],
                               "ERROR: --parity-tol 1 'garbage': expected SITE:MODE:DTYPE:field=value"),
    "missing tolerance file": (lambda t: ["--parity-tolerances", str(t / "nope.toml")],
                               "ERROR: {t}/nope.toml: cannot read tolerance file (No such file or directory)"),
    "dump given twice": (lambda t: ["--parity-dump", str(DUMP)],
                         f"ERROR: --parity-dump {DUMP}: given twice"),
    "another checkpoint": (lambda t: ["--parity-ckpt", str(ROOT / "dumps" / "ckpt" / "tiny-flash")],
                           f"ERROR: {ROOT}/dumps/ckpt/tiny-flash: not the checkpoint tiny-bf16.h5 was made from"),
    "broken config.json": (lambda t: ["--parity-ckpt", str(_ckpt_copy(t, lambda ck: (ck / "config.json")
                                                                        .write_text('{"broken')))],
                           "ERROR: {t}/ck/config.json: not valid JSON"),
    "missing shard": (lambda t: ["--parity-ckpt", str(_ckpt_copy(t, lambda ck: (
        ck / "model-00002-of-00003.safetensors").unlink()))],
                      "ERROR: {t}/ck/model.safetensors.index.json: names shard 'model-00002-of-00003.safetensors', "
                      "which does not exist"),
    "truncated shard": (lambda t: ["--parity-ckpt", str(_ckpt_copy(t, lambda ck: _truncate(
        ck / "model-00002-of-00003.safetensors")))],
                        "ERROR: {t}/ck/model-00002-of-00003.safetensors: malformed safetensors header"),
    "token ids outside the vocabulary": (lambda t: ["--parity-dump", str(_edited(t, "tok.h5", _set_ids))],
                                         "ERROR: {t}/tok.h5: /tokens/input_ids holds 1 id(s) outside the vocabulary "
                                         "0..511 of its config, e.g. [600]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "n2"])
def test_bad_input_is_one_usage_error(tmp_path, case, xdist):
    if xdist and case not in ("target not importable", "target constructor raises", "another checkpoint"):
        pytest.skip("the xdist controller runs the same checks; three cases are enough to show it")
    (tmp_path / "boomtargets.py").write_text(TARGETS)
    args, want = CASES[case]
    extra = args(tmp_path)
    dump = [] if case.startswith("token ids") else ["--parity-dump", str(DUMP)]
    r = _pytest(*dump, *extra, *(["-n", "2"] if xdist else []), tmp=tmp_path, env_path=tmp_path)
    want = want.format(t=tmp_path)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR:")]
    assert r.returncode == 4, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert len(errors) == 1 and errors[0].startswith(want), (errors, r.stderr[-1500:])
    assert "Traceback" not in r.stderr + r.stdout and "passed" not in r.stdout, r.stdout[-1500:]


def test_a_run_that_compares_nothing_fails(tmp_path):
    (tmp_path / "boomtargets.py").write_text(TARGETS)
    r = _pytest("--parity-dump", str(DUMP), "--parity-layers", "0", "--parity-target", "boomtargets:Nothing",
                tmp=tmp_path, env_path=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:])
    assert "FAILED: no point was compared (" in r.stdout and "target nothing does not produce this point" in r.stdout
    rep = json.loads((tmp_path / "reports" / "tiny-bf16" / "report.json").read_text())
    assert rep["passed"] is False and rep["note"] == "no point of this dump was compared"


def _report(tmp: Path, label: str) -> dict:
    return json.loads((tmp / "reports" / label / "report.json").read_text())


def test_a_deleted_layer_and_a_lost_decode_step_fail_naming_their_points(tmp_path):
    def drop(f):
        del f["prefill/L03"]
        del f["decode/S003"]

    d = _edited(tmp_path, "holes.h5", drop)
    r = _pytest("--parity-dump", str(d), "--parity-layers", "0,3", tmp=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "holes: prefill/L03/attention.core missing: the dump lacks it" in r.stdout
    assert "holes: decode/S003/L00/output missing: the dump lacks it" in r.stdout
    st = {(p["phase"], p["step"], p["layer"], p["site"]): p["status"] for p in _report(tmp_path, "holes")["points"]}
    assert st[("prefill", 0, 3, "attention.core")] == "missing" and st[("decode", 3, None, "logits")] == "missing"
    assert st[("prefill", 0, 0, "attention.core")] == "pass" and st[("prefill", 0, 5, "mlp")] == "not-tested"


def test_a_held_point_no_replay_compares_fails_naming_it(tmp_path):
    def add(f):
        src = f["prefill/L00/attention.core"]
        f.create_dataset("prefill/L00/attention.secret", data=src[()])
        for k, v in src.attrs.items():
            f["prefill/L00/attention.secret"].attrs[k] = v

    d = _edited(tmp_path, "extra.h5", add)
    r = _pytest("--parity-dump", str(d), "--parity-layers", "0", tmp=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    assert f"{d}: holds prefill/L00/attention.secret, which is not a point of its model" in r.stdout


def test_deselected_points_are_listed_as_not_tested(tmp_path):
    r = _pytest("--parity-dump", str(DUMP), "-k", "layer_3", tmp=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "NOT TESTED: 925 point(s) — 925: not run (deselected with -k / --deselect, or the run stopped early)" \
        in r.stdout
    rep = _report(tmp_path, "tiny-bf16")
    assert rep["counts"] == {"pass": 110, "not-tested": 925}, rep["counts"]
    r = _pytest("--parity-dump", str(DUMP), "--parity-layers", "0,1", tmp=tmp_path)
    assert r.returncode == 0 and "NOT TESTED: 760 point(s) — 760: not selected (--parity-layers 0,1)" in r.stdout


def test_a_dump_made_with_layers_lists_the_others_as_not_tested(tmp_path):
    def keep_layer_0(f):
        for ph in ("prefill", *(f"decode/S00{k}" for k in range(1, 5))):
            for i in range(1, 8):
                del f[f"{ph}/L0{i}"]
        f.attrs["layers_dumped"] = json.dumps([0])

    d = _edited(tmp_path, "l0.h5", keep_layer_0)
    r = _pytest("--parity-dump", str(d), tmp=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "NOT TESTED: 905 point(s) — 895: not in the dump: it was made with --layers 0; 10: the head is fed layer " \
           "7's output, not in the dump: it was made with --layers 0" in r.stdout, r.stdout[-3000:]


def test_dumps_with_one_file_name_get_one_report_each_inside_the_report_dir(tmp_path):
    for sub in ("before", "after"):
        (tmp_path / sub).mkdir()
        shutil.copy(DUMP, tmp_path / sub / DUMP.name)
    shutil.copy(DUMP, tmp_path / "...h5")  # label '..' would be the report directory's parent
    r = _pytest("--parity-dump", str(tmp_path / "before" / DUMP.name), "--parity-dump",
                str(tmp_path / "after" / DUMP.name), "--parity-dump", str(tmp_path / "...h5"), "--parity-layers", "0",
                tmp=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["dump", "tiny-bf16@after", "tiny-bf16@before"]
    for label in ("tiny-bf16@after", "tiny-bf16@before", "dump"):
        assert _report(tmp_path, label)["counts"]["pass"] == 140
    assert not (tmp_path / "report.json").exists()


def test_dump_labels():
    from parity.pytest_plugin.plugin import dump_labels

    P = Path
    assert dump_labels([P("/d/a/x.h5"), P("/d/b/y.h5")]) == ["x", "y"]
    assert dump_labels([P("/d/a/x.h5"), P("/d/b/x.h5")]) == ["x@a", "x@b"]
    assert dump_labels([P("/d/a/x.h5"), P("/d/c/a/x.h5")]) == ["x@a-1", "x@a-2"]
    # one harmless path component each: never empty, '.', '..' or with a separator
    assert dump_labels([P("/d/...h5"), P("/d/x/.h5"), P("/d/a b.h5")]) == ["dump@d", "dump@x", "a_b"]
