"""Errors that say what to do (issue 32 items 6, 7): a target call that raises is ONE usage error per layer naming
the layer, the call and the exception's last frame (the layer's points not tested); a target output in another dtype
than the dump's is a note with the rounding applied; a target's declared environment travels in the reproduce line
and the repro bundle, which then reproduces in a fresh shell with a clean environment.

Each runs `pytest parity` in a subprocess on the bundled tiny-bf16 dump against small reference subclasses written
here (the planted behaviour is this file's, so what must be reported is known independently of the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
TARGETS = '''
import os

import numpy as np

from parity.targets.reference import ReferenceTarget


def _port_kernel(h):
    raise ValueError(f"port kernel: unsupported shape {h.shape}")


class Raises(ReferenceTarget):
    """Raises inside layer_forward of layer 1 only."""

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        if i == 1:
            _port_kernel(hidden)
        return super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)


class Fp32Mlp(ReferenceTarget):
    """Returns the `mlp` point in float32 (the dump holds bfloat16): same values, upcast."""

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        res = super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
        res.points["mlp"] = np.asarray(res.points["mlp"]).astype(np.float32)
        return res


class EnvScaled(ReferenceTarget):
    """Scales attention.o_proj by PORTTEST_SCALE (a bug only under that setting), and declares it."""

    environment = ("PORTTEST_SCALE",)

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        res = super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
        f = float(os.environ.get("PORTTEST_SCALE", "1"))
        o = np.asarray(res.points["attention.o_proj"])
        res.points["attention.o_proj"] = (o.astype(np.float32) * f).astype(o.dtype)
        return res
'''


def _env(tmp: Path, **extra) -> dict:
    path = os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTEST_ADDOPTS": "", "PYTHONPATH": path, **extra}


def _parity(tmp: Path, target: str, layers: str, **env) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / f"reports-{target}"
    r = subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0",
                        "--parity-dump", str(DUMP), "--parity-layers", layers, "--parity-target",
                        f"porttargets:{target}", "--parity-report", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=_env(tmp, **env), timeout=600)
    return r, json.loads((out / "tiny-bf16" / "report.json").read_text())


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("port")
    (d / "porttargets.py").write_text(TARGETS)
    return d


def test_a_raising_layer_forward_is_one_usage_error_per_layer(tmp):
    r, rep = _parity(tmp, "Raises", "0,1")
    assert r.returncode == 1, r.stdout[-3000:]
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "layer_1/" in failed[0], failed  # one, not one per site of layer 1
    assert "usage error" in r.stdout and "layer 1 prefill step 0" in r.stdout
    assert "Traceback" not in r.stdout
    (err,) = rep["target_errors"]
    assert err["call"] == "layer_forward" and err["where"] == "layer 1 prefill step 0"
    assert err["exception"].startswith("ValueError: port kernel: unsupported shape")
    assert "porttargets.py" in err["frame"] and err["frame"].endswith("in _port_kernel")
    l1 = [p for p in rep["points"] if p["layer"] == 1 and p["phase"] != "backward"]
    assert l1 and {p["status"] for p in l1} == {"not-tested"}
    assert err["points"] == len(l1)
    l0 = [p for p in rep["points"] if p["layer"] == 0 and p["phase"] != "backward"]
    assert {p["status"] for p in l0} <= {"pass", "skipped"}
    assert rep["passed"] is False
    assert "TARGET ERROR: layer 1 prefill step 0: target call layer_forward raised ValueError" in r.stdout


def test_an_output_in_another_dtype_is_noted_with_its_rounding(tmp):
    r, rep = _parity(tmp, "Fp32Mlp", "0")
    assert r.returncode == 0, r.stdout[-3000:]  # the upcast bf16 values round back exactly: no failure
    # (the reference's own LM head returns float32 logits where the dump holds bfloat16: a model-level note too)
    (note,) = [n for n in rep["dtype_notes"] if n["layer"] is not None]
    assert note["layer"] == 0 and note["sites"] == ["mlp"]
    assert "target returned float32 where the dump holds bfloat16" in note["note"]
    assert "rounded (round-to-nearest-even) to bfloat16" in note["note"]
    mlp = [p for p in rep["points"] if p["layer"] == 0 and p["site"] == "mlp"]
    assert mlp and all("dtype_note" in p for p in mlp) and note["points"] == len(mlp)
    assert not [p for p in rep["points"] if p.get("dtype_note") and p["site"] != "mlp" and p["layer"] is not None]
    assert "dtype note, layer 0: target returned float32" in r.stdout


def test_a_declared_environment_reproduces_in_a_fresh_shell(tmp):
    r, rep = _parity(tmp, "EnvScaled", "0", PORTTEST_SCALE="1.5")
    assert r.returncode == 1, r.stdout[-3000:]
    assert rep["target_environment"] == {"PORTTEST_SCALE": "1.5"}
    assert "reproduce: PORTTEST_SCALE=1.5 pytest parity" in r.stdout
    bundle = tmp / "bundle"
    b = subprocess.run([sys.executable, "tools/repro.py", str(tmp / "reports-EnvScaled" / "tiny-bf16"), "--out",
                        str(bundle), "--mode", "layer"], capture_output=True, text=True, cwd=ROOT,
                       env=_env(tmp), timeout=600)
    assert b.returncode == 0, b.stderr
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["environment"] == {"PORTTEST_SCALE": "1.5"}
    assert "PORTTEST_SCALE=1.5" in (bundle / "README.txt").read_text()
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
             "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}
    run = subprocess.run([sys.executable, str(bundle / "repro.py")], capture_output=True, text=True, cwd=tmp,
                         env=clean, timeout=600)
    assert run.returncode == 1 and run.stdout.startswith("MISMATCH"), run.stdout + run.stderr[-2000:]
    # the control: the same bundle without its environment does not reproduce (the scale is the only bug)
    meta["environment"] = {}
    (bundle / "bundle.json").write_text(json.dumps(meta))
    run = subprocess.run([sys.executable, str(bundle / "repro.py")], capture_output=True, text=True, cwd=tmp,
                         env=clean, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("MATCH"), run.stdout + run.stderr[-2000:]
