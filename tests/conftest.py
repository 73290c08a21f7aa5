"""Shared fixtures for tests/ (keep small). Session-scoped random checkpoints written by parity.torch_ref.ckpt."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Unit tests jit jax_ling3 functions themselves (not only through the reference's compiled layer), so the machinery
# tests keep the reference's bf16 roundings process-wide; `pytest parity` (a port's replay) does not load this file.
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

import pytest
from hypothesis import HealthCheck, settings

from parity.cpu_isa import ensure_usable_onednn_isa

# Tests run torch bf16 GEMMs directly (not only through the loader): probe AMX once per run, before any of them
# (parity/cpu_isa.py; the verdict reaches xdist workers and child processes through the environment).
if _note := ensure_usable_onednn_isa():
    print(_note, file=sys.stderr)

REPO = Path(__file__).resolve().parents[1]
BUNDLED_CKPT = REPO / "dumps" / "ckpt"

# Property tests must not fail because a shared machine is busy: no per-example deadline and no "data generation too
# slow" health check (both measure wall time; the tests' own settings may still set them).
settings.register_profile("loaded-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("loaded-machine")


FULL_SWEEP = os.environ.get("LING3_FULL_SWEEP") == "1"
COLLECTED = pytest.StashKey[list]()  # every collected test id, before deselection


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: tests/test_sweeps.py checks the patterns on all of it
def pytest_collection_modifyitems(config, items):
    """README command two stays under 15 minutes on 2 cores (issue 35): the cases of long sweeps beyond their
    representative slice carry `@pytest.mark.full_sweep` and are skipped, saying so, unless LING3_FULL_SWEEP=1
    (docs/performance.md "Test suite time" lists them and what the slice keeps)."""
    from sweeps import beyond_slice

    config.stash[COLLECTED] = [item.nodeid for item in items]
    for item in items:
        why = beyond_slice(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.full_sweep)
        if FULL_SWEEP or item.get_closest_marker("full_sweep") is None:
            continue
        item.add_marker(pytest.mark.skip(reason="beyond the representative slice of a long sweep (LING3_FULL_SWEEP=1 "
                                                f"runs it; kept instead: {why or 'see the test'})"))


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs_near_the_map_limit():
    """After each test file: an xdist worker that compiled thousands of programs nears Linux's limit on memory
    mappings, and XLA's next compilation then segfaults (parity/memory_maps.py); drop jax's compiled programs first."""
    yield
    from parity.memory_maps import release_if_near_limit

    release_if_near_limit()


@pytest.fixture(scope="session")
def tiny_flash_fp32_ckpt(tmp_path_factory) -> Path:
    """Flash-shaped tiny checkpoint (no q-LoRA, ragged MLA tail, clamp lists) stored in fp32, seed 0, 3+ shards."""
    from parity.torch_ref.ckpt import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-flash-fp32", "tiny-flash", seed=0,
                           dtype="float32", max_shard_bytes=1 << 20)


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    """The bundled Tiny-shaped checkpoint (q-LoRA, MTP layer present with num_nextn_predict_layers 0)."""
    path = BUNDLED_CKPT / "tiny"
    if not (path / "config.json").exists():
        pytest.fail(f"{path}: bundled checkpoint missing; regenerate with the command in dumps/ckpt/README.md")
    return path
