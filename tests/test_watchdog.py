"""A stalled target call becomes a failure naming the layer, phase and step, with every thread's Python and native
stacks, after a configurable limit (`parity.replay.watchdog`, `--parity-stall-timeout`). The stall is real: a jitted
function whose host callback never returns, so the calling thread blocks inside XLA (BlockUntilReady under
`ArrayImpl.__array__`) — the signature of the replays that hung for 15 and 30 minutes (issue 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.replay.watchdog import StallError, Watchdog

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"

STALL = '''
import threading
import numpy as np
import jax, jax.numpy as jnp
from parity.targets.reference import ReferenceTarget

NEVER = threading.Event()


def _wait_forever(x):
    NEVER.wait()
    return x


@jax.jit
def stuck(x):
    return jax.pure_callback(_wait_forever, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def block_in_xla():
    return np.asarray(stuck(jnp.ones(4)))


class Stalling(ReferenceTarget):
    """Layer 1's call never returns (blocked in XLA on a host callback)."""
    name = "stalling"

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        if i == 1:
            block_in_xla()
        return super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
'''


@pytest.fixture
def stall_module(tmp_path, monkeypatch):
    (tmp_path / "stalltarget.py").write_text(STALL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("stalltarget")
    yield module
    # Release the call the test left blocked inside XLA: an abandoned thread stuck in a host callback is fine for a
    # replay that ends there, but this xdist worker goes on running other tests with XLA
    module.NEVER.set()


def test_a_call_blocked_in_xla_fails_with_its_stacks_and_later_calls_fail_at_once(tmp_path, stall_module):
    wd = Watchdog(2, out_dir=tmp_path)
    assert wd.call("fine", lambda x: x + 1, 1) == 2
    with pytest.raises(ValueError, match="raised in the call"):  # a call's own exception reaches the caller
        wd.call("raises", lambda: (_ for _ in ()).throw(ValueError("raised in the call")))
    with pytest.raises(StallError) as e:
        wd.call("dump.h5 layer 1 decode step 2: layer_forward", stall_module.block_in_xla)
    msg = str(e.value)
    assert msg.startswith("dump.h5 layer 1 decode step 2: layer_forward: no result after 2 s (stalled); Python and "
                          f"native stacks of every thread: {tmp_path}/ling3-parity-stall-"), msg
    stacks = Path(msg.rsplit(": ", 1)[1]).read_text()
    assert "in _wait_forever" in stacks and "in block_in_xla" in stacks  # the blocked thread's Python stack
    native = stacks.split("== native stacks ==", 1)[1]
    assert native.count("Thread ") >= 2 or native.count("tid ") >= 2, native[:2000]
    with pytest.raises(StallError, match="^later: not run: an earlier target call stalled "
                                         r"\(dump.h5 layer 1 decode step 2: layer_forward\)"):
        wd.call("later", lambda: 1)


def test_pytest_parity_fails_the_stalled_layer_and_finishes(tmp_path):
    (tmp_path / "stalltarget.py").write_text(STALL)
    env = {**os.environ, "PYTEST_ADDOPTS": "", "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "--parity-dump",
                        str(DUMP), "--parity-layers", "0,1", "--parity-target", "stalltarget:Stalling",
                        "--parity-stall-timeout", "5", "--parity-report", str(tmp_path / "reports")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:]
    # one test per site over the dump's 5 steps: layer 1's 27 sites (135 points) fail; layer 0 and the model pass
    assert "27 failed, 28 passed" in r.stdout, r.stdout[-3000:]
    line = "tiny-bf16.h5 layer 1 prefill step 0: layer_forward: no result after 5 s (stalled); Python and native stacks"
    assert r.stdout.count(line) >= 27, r.stdout[-3000:]
    rep = json.loads((tmp_path / "reports" / "tiny-bf16" / "report.json").read_text())
    failed = {(p["phase"], p["step"], p["site"]) for p in rep["points"] if p["status"] == "fail"}
    assert len(failed) == 135 and all(p["layer"] == 1 for p in rep["points"] if p["status"] == "fail"), rep["counts"]
    assert len(list((tmp_path / "reports").glob("ling3-parity-stall-*.txt"))) == 1
