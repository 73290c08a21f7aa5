"""Steady memory of repeated replays in one process (issue 25 item 5): `run_replay` and the pytest plugin release a
replay's globals (embedding, LM head), layers and its watchdog thread when it ends.

The bundled dumps are tiny (their embedding + LM head are ~0.1 MB), so the resident-memory bound alone cannot see a
leak there; what was kept (the target pinned by the watchdog thread's last call) is seen exactly as live jax arrays
and threads that outlive the call. The figure at Ling3-Tiny shapes is measured in the README (run_replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from parity.golden import DUMPS, ROOT

CALLS = 5
RSS_SLACK_MB = 100  # the bound: call 5 within +100 MB of call 2

_CHILD = """
import gc, json, os, sys, threading
import jax
from parity.replay import run_replay
from parity.targets.reference import release_freed_heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

for _ in range(int(sys.argv[2])):
    rep = run_replay(sys.argv[1], stall_timeout=600)
    del rep
    gc.collect()
    release_freed_heap()
    live = jax.live_arrays()
    print(json.dumps({"rss_mb": rss_mb(), "arrays": len(live), "array_bytes": sum(a.nbytes for a in live),
                      "threads": threading.active_count()}), flush=True)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc to measure resident memory")
def test_repeated_run_replay_keeps_nothing():
    dump = DUMPS / "tiny-bf16.h5"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(dump), str(CALLS)], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(calls) == CALLS
    for k, c in enumerate(calls, 1):  # nothing of a finished replay is alive: no array, no extra thread
        assert c["arrays"] == 0 and c["threads"] == 1, f"after call {k} of run_replay: {c} (expected no live jax " \
                                                       "array and only the main thread)"
    growth = calls[-1]["rss_mb"] - calls[1]["rss_mb"]
    assert growth <= RSS_SLACK_MB, f"RSS grew {growth:.0f} MB from call 2 to call {CALLS}: {calls}"


class _Config:
    """The options `ParitySession.open_session` reads, at their defaults."""

    def __init__(self, report_dir) -> None:
        self._opts = {"--parity-layers": None, "--parity-ckpt": None, "--parity-target": "reference",
                      "--parity-stall-timeout": 600, "--parity-report": str(report_dir),
                      "--parity-semantics": "dump", "--parity-tolerances": None, "--parity-tol": None,
                      "--parity-strict-variants": False, "--parity-matmul-precision": None}
        self.option = SimpleNamespace()

    def getoption(self, name):
        return self._opts[name]


def test_plugin_holds_one_dumps_globals_at_a_time(tmp_path):
    from parity.pytest_plugin.plugin import DumpEntry, ParitySession

    sess = ParitySession(_Config(tmp_path))
    a, b = (DumpEntry(DUMPS / f, f.removesuffix(".h5")) for f in ("tiny-bf16.h5", "tiny-flash-bf16.h5"))
    try:
        sess.records(a, None)  # model-level points: loads a's embedding and LM head
        assert sess.sessions[a.run].target.globals is not None
        sess.records(b, None)
        assert sess.sessions[a.run].target.globals is None, "a's globals stayed loaded while b replayed"
        assert sess.sessions[b.run].target.globals is not None
        sess.records(a, 0)  # a again: b's are released
        assert sess.sessions[b.run].target.globals is None
    finally:
        for s in sess.sessions.values():
            s.close()
        for reader in sess.readers.values():
            reader.close()


def test_a_layer_replay_keeps_no_host_copy_of_the_layers_weights(monkeypatch):
    """After the target has loaded a layer, the replay holds the layer's checkpoint tensors only as a read-on-access
    view (issue 33 item 1: the host copy beside the device copy was ~0.6 GB of a Ling3-Tiny MLA+MoE layer's first-call
    peak). Seen at the shadows, which receive what the replay keeps: a view of the same tensors, not the dict the
    target was given."""
    import numpy as np

    from parity.jax_ling3.weights import CheckpointReader
    from parity.replay import run_replay
    from parity.replay import shadows as S

    seen = []
    real_init = S.LayerShadows.__init__

    def spy(self, session, i, hf):
        seen.append((session, i, hf))
        real_init(self, session, i, hf)

    monkeypatch.setattr(S.LayerShadows, "__init__", spy)
    rep = run_replay(DUMPS / "tiny-bf16.h5", layers=[0], backward=False)
    assert rep["passed"] and len(seen) == 1
    session, i, hf = seen[0]
    assert not isinstance(hf, dict), type(hf)  # a view, not the loaded dict
    full = CheckpointReader(session.ckpt.dir).hf_tensors(i)
    key = "model.layers.0.input_layernorm.weight"
    assert set(hf) == set(full) and np.array_equal(np.asarray(hf[key]), full[key])
