"""`pytest parity -n 2`: every point of one (dump, layer) runs on one xdist worker, so each layer is replayed once
(xdist's default `load` spread a layer's points over both workers, and each replayed it)."""

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
LINE = re.compile(r"\[(gw\d+)\] .*PASSED parity/test_points\.py::test_point\[([^\]]+)\](@\S+)?")


def _workers_by_layer(*extra: str) -> tuple[dict, set]:
    cmd = [sys.executable, "-m", "pytest", "parity", "-v", "-p", "no:cacheprovider", "-n", "2", "--parity-dump",
           str(DUMP), "--parity-layers", "0,1", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTEST_ADDOPTS": ""})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    workers, suffixes = defaultdict(set), set()
    for m in LINE.finditer(out.stdout):
        parts = m.group(2).split("/")  # <dump>/<phase>/<layer_i|model>/<site>
        workers[parts[2]].add(m.group(1))
        suffixes.add(m.group(3))
    assert set(workers) == {"model", "layer_0", "layer_1"}, out.stdout[-2000:]
    return workers, suffixes


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_a_layers_points_run_on_one_worker():
    workers, suffixes = _workers_by_layer()
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert suffixes == {"@parity:tiny-bf16:model", "@parity:tiny-bf16:L00", "@parity:tiny-bf16:L01"}


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_an_explicit_dist_is_honoured():
    # the negative control: with the user's own --dist load, the points of a layer do spread over both workers
    workers, suffixes = _workers_by_layer("--dist", "load")
    assert suffixes == {None} and any(len(w) == 2 for w in workers.values()), dict(workers)
