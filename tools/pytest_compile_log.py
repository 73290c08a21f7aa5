"""A pytest plugin that writes, per test, its wall seconds and the seconds JAX spent compiling in-process
(XLA backend compiles; a cache hit costs none) to `$LING3_COMPILE_LOG_DIR/<xdist worker>.jsonl`, one JSON line per
test: where a cold run's time goes (docs/performance.md "Test suite time"), and the persistent-cache keys of the
programs it compiled (`missed`): a key compiled by two tests, or by both workers, is a program built twice.
Subprocesses a test starts are counted in its wall time only.

    LING3_COMPILE_LOG_DIR=/tmp/clog PYTHONPATH=tools python3 -m pytest -q -n 2 -p pytest_compile_log
"""

from __future__ import annotations

import json
import os
import time

import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_acc = {"compile": 0.0, "n": 0}
_missed: list[str] = []


def _listener(event: str, duration: float, **_kw) -> None:
    if event == _COMPILE_EVENT:
        _acc["compile"] += duration
        _acc["n"] += 1


def pytest_configure(config: pytest.Config) -> None:
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_listener)
    from jax._src import compiler  # no public hook names the program a compile built: wrap jax's own logging call

    log_miss = getattr(compiler, "log_persistent_cache_miss", None)
    if log_miss is None:  # another jax: no `missed` keys, the times are still logged
        return

    def _record_miss(module_name: str, cache_key: str) -> None:
        _missed.append(str(cache_key))
        log_miss(module_name, cache_key)

    compiler.log_persistent_cache_miss = _record_miss


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    c0, n0, t0 = _acc["compile"], _acc["n"], time.time()
    _missed.clear()
    yield
    out = os.environ.get("LING3_COMPILE_LOG_DIR", "compile-log")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"), "a") as f:
        f.write(json.dumps({"id": item.nodeid, "wall_s": round(time.time() - t0, 3),
                            "compile_s": round(_acc["compile"] - c0, 3), "compiles": _acc["n"] - n0, "missed": list(_missed)}) + "\n")
