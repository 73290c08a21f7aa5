"""tools/pytest_compile_log.py (docs/performance.md "Test suite time"): one line per test, with the in-process JAX
compile seconds that test paid — a test that compiles shows compiles > 0, one that only hits the jit cache none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_test_gets_a_line_with_its_compiles(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "f = jax.jit(lambda x: jnp.sin(x) * 3)\n"
        "def test_compiles():\n    assert float(f(jnp.float32(1))) != 0\n"
        "def test_cached():\n    assert float(f(jnp.float32(2))) != 0\n")
    env = {**os.environ, "LING3_COMPILE_LOG_DIR": str(tmp_path / "log"), "PYTEST_ADDOPTS": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]),
           "JAX_ENABLE_COMPILATION_CACHE": "false"}
    env.pop("PYTEST_XDIST_WORKER", None)  # under xdist the child would take its parent's worker name for its file
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_compile_log",
                        "test_two.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "log" / "main.jsonl").read_text().splitlines()}
    assert set(rows) == {"test_two.py::test_compiles", "test_two.py::test_cached"}
    assert rows["test_two.py::test_compiles"]["compiles"] >= 1 and rows["test_two.py::test_compiles"]["compile_s"] > 0
    assert rows["test_two.py::test_cached"]["compiles"] == 0 and rows["test_two.py::test_cached"]["compile_s"] == 0
    assert all(row["wall_s"] > 0 for row in rows.values())
