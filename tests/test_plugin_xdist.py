"""`pytest parity -n 2`: every point of one (dump, layer) runs on one xdist worker, so each layer is replayed once
(xdist's default `load` spread a layer's points over both workers, and each replayed it). Checked with whatever
pytest / pytest-xdist is installed: on pytest 9.2 xdist's own loadgroup no longer groups (pytest-xdist #1386)."""

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from parity.pytest_plugin.xdist_groups import point_group

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
        parts = m.group(2).split("/")  # <dump>/<layer_i|model>/<site>
        workers[parts[1]].add(m.group(1))
        suffixes.add(m.group(3))
    assert set(workers) == {"model", "layer_0", "layer_1"}, out.stdout[-2000:]
    return workers, suffixes


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_a_layers_points_run_on_one_worker():
    workers, suffixes = _workers_by_layer()
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert suffixes == {None}  # test ids stay as collected (no xdist `@group` suffix)


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_an_explicit_loadgroup_groups_too():
    workers, _ = _workers_by_layer("--dist", "loadgroup")
    assert all(len(w) == 1 for w in workers.values()), dict(workers)


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_an_explicit_dist_is_honoured():
    # the negative control: with the user's own --dist load, the points of a layer do spread over both workers
    workers, suffixes = _workers_by_layer("--dist", "load")
    assert suffixes == {None} and any(len(w) == 2 for w in workers.values()), dict(workers)


def test_point_group_reads_dump_and_layer_from_the_id():
    f = "parity/test_points.py::test_point"
    assert point_group(f"{f}[tiny-bf16/layer_3/attention.core]") == "parity:tiny-bf16:layer_3"
    assert point_group(f"{f}[tiny-bf16/layer_13/attention.dense:in]") == "parity:tiny-bf16:layer_13"
    assert point_group(f"{f}[a.b-c/model/logits]") == "parity:a.b-c:model"
    assert point_group(f"{f}[tiny-bf16/isolated/layer_2/mlp]") == "parity:tiny-bf16/isolated:layer_2"  # with a mode
    assert point_group(f"{f}[tiny-bf16/MTP0/eh_proj]") == "parity:tiny-bf16:MTP0"
    # a layer's backward points share its group (one replay of the unit serves both phases)
    assert point_group(f"{f}[tiny-bf16/backward/layer_3/input]") == "parity:tiny-bf16:layer_3"
    assert point_group(f"{f}[tiny-bf16/isolated/backward/layer_2/mlp]") == "parity:tiny-bf16/isolated:layer_2"
    assert point_group(f"{f}[tiny-bf16/backward/MTP0/logits]") == "parity:tiny-bf16:MTP0"
    assert point_group(f"{f}[tiny-bf16/backward/model/embed]") == "parity:tiny-bf16:model"
    # other tests, and a dump that could not be read, are their own units
    assert point_group(f"{f}[tiny-bf16/unreadable]") is None
    assert point_group("tests/test_x.py::test_point[tiny/prefill/layer_3]") is None
    assert point_group("tests/test_x.py::test_other[tiny/prefill/layer_3/core]") is None


def test_file_grouping_of_other_tests_is_the_ini_options():
    from parity.pytest_plugin.xdist_groups import ParityGroupScheduling

    sched = object.__new__(ParityGroupScheduling)  # _split_scope reads nothing else of the scheduler
    point = "parity/test_points.py::test_point[tiny-bf16/layer_3/attention.core]"
    for on, other in ((False, "tests/test_x.py::test_a[1]"), (True, "tests/test_x.py")):
        sched._group_files = on
        assert sched._split_scope("tests/test_x.py::test_a[1]") == other
        assert sched._split_scope(point) == "parity:tiny-bf16:layer_3"
