"""A run that tests no backward point of a dump does not compute that dump's backward phase (issue 35: the slice of
README command two leaves the goldens' backward points to `pytest parity` and CI, and their layer VJPs were most of
its cold compile time): `pytest parity -k "not backward"` costs a forward replay only.

Observed through a target whose every backward method raises: a unit's replay that called one would fail every test
of the unit with that usage error (one replay serves all of a layer's points), so the forward-only run passes only
because no backward call is made; the same target with a backward point selected fails (the check can fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-fp32.h5"  # a --grads golden: it holds the backward phase

TARGET = '''
from parity.targets.reference import ReferenceTarget


class NoBackward(ReferenceTarget):
    name = "raises-in-every-backward-call"

    def _raise(self, *a, **kw):
        raise RuntimeError("a backward method was called")

    layer_backward = head_backward = embed_backward = loss_backward = _raise
'''


def _run(tmp_path: Path, keyword: str) -> subprocess.CompletedProcess:
    (tmp_path / "nobackward.py").write_text(TARGET)
    env = {**os.environ, "PYTEST_ADDOPTS": "",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "--parity-dump", str(DUMP), "--parity-layers", "0", "--parity-target",
                           "nobackward:NoBackward", "-k", keyword, "--parity-report", str(tmp_path / "rep")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_forward_only_selection_makes_no_backward_call(tmp_path):
    r = _run(tmp_path, "layer_0 and not backward")
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-2000:]


def test_a_selected_backward_point_makes_the_backward_calls(tmp_path):
    r = _run(tmp_path, "layer_0")  # forward and backward points of layer 0
    assert r.returncode == 1, r.stdout[-3000:]
    assert "a backward method was called" in r.stdout, r.stdout[-3000:]


def test_run_replay_without_backward_makes_no_backward_call_and_says_why(tmp_path, monkeypatch):
    """`run_replay(..., backward=False)`: the same target, programmatically — its backward points are reported
    skipped naming why, and no backward method is called (the forward-only replay passes); with backward (the
    default) the raising method is reached (the check can fail)."""
    import importlib

    from parity.errors import TargetCallError
    from parity.replay import run_replay

    (tmp_path / "nobackward.py").write_text(TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = importlib.import_module("nobackward").NoBackward
    rep = run_replay(DUMP, target=target, layers=[0], backward=False)
    bw = [p for p in rep["points"] if p["phase"] == "backward"]
    assert rep["passed"] and bw, rep["counts"]
    assert all(p["status"] == "skipped" and "run_replay(backward=False)" in p["reason"] for p in bw), bw[:2]
    with pytest.raises(TargetCallError, match="layer 0 backward: target call layer_backward raised RuntimeError: a "
                                              "backward method was called"):
        run_replay(DUMP, target=target, layers=[0])
