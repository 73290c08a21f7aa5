"""Replay one dump many times, each in a fresh process under the watchdog, alternating plain and patched targets —
the setting in which replays hung (issue 14: 2 of 3 runs with trace-time-patched targets sat in `BlockUntilReady`).

Each run is `run_replay(dump, ckpt, target=..., stall_timeout=limit)` in its own interpreter (as the runs that hung
were), its wall time measured from outside; a stall is the watchdog's StallError (with the stack file), a run that
does not end at all within 4 × limit is killed and counted as a hang too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from parity.replay import run_replay
from parity.replay.watchdog import StallError

dump, ckpt, spec, limit, out = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
if spec.startswith("mutant:"):
    from parity.targets.mutants import MutantTarget
    target = MutantTarget(spec.split(":", 1)[1], ckpt_dir=ckpt)
else:
    target = spec
t0 = time.perf_counter()
res = {"target": spec}
try:
    rep = run_replay(dump, ckpt, target=target, stall_timeout=limit)
    res["counts"] = rep["counts"]
except StallError as e:
    res["stall"] = str(e)
res["seconds"] = round(time.perf_counter() - t0, 2)
print("RESULT " + json.dumps(res), flush=True)
"""


def stress(dump: str | Path, ckpt: str | Path, targets: list[str], runs: int, limit_s: float,
           env: dict | None = None, log=print) -> list[dict]:
    """`runs` replays of `dump`, cycling through `targets` ("reference" or "mutant:NAME"); one result dict per run:
    target, seconds (wall, from outside), counts | stall (the watchdog's message) | hang (killed from outside)."""
    results = []
    for k in range(runs):
        spec = targets[k % len(targets)]
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, str(dump), str(ckpt), spec, str(limit_s), "."],
                               capture_output=True, text=True, timeout=4 * limit_s + 300, env=env or os.environ)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"target": spec, "error": (r.stderr or r.stdout)[-2000:]}
        except subprocess.TimeoutExpired:
            res = {"target": spec, "hang": f"killed after {4 * limit_s + 300:.0f} s"}
        res["wall_s"] = round(time.monotonic() - t0, 2)
        res["run"] = k
        results.append(res)
        log(json.dumps(res))
    return results
