"""Shared fixtures for tests/ (keep small). Session-scoped random checkpoints written by parity.torch_ref.ckpt."""

from __future__ import annotations

import os
from pathlib import Path

# Unit tests jit jax_ling3 functions themselves (not only through the reference's compiled layer), so the machinery
# tests keep the reference's bf16 roundings process-wide; `pytest parity` (a port's replay) does not load this file.
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLED_CKPT = REPO / "dumps" / "ckpt"


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
