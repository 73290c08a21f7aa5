"""Writing a checkpoint directory safely (tools/make_ckpt.py, both families): never over a directory that is not a
checkpoint, never a half-written one left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from parity.errors import CheckpointError


def refuse_existing(out: Path, force: bool) -> None:
    """Refuse (CheckpointError, one line) to replace an existing non-empty `out` unless `force`, and even with `force`
    a directory that holds no config.json (not a checkpoint: never deleted)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise CheckpointError(f"{out}: already exists and is not empty; pass force=True (--force) to replace it")
        if out.is_dir() and not (out / "config.json").exists():
            raise CheckpointError(f"{out}: exists but holds no config.json; refusing to delete a non-checkpoint directory")


@contextlib.contextmanager
def written_atomically(out: Path):
    """A temporary sibling directory to write a checkpoint into; on success it is made world-readable and renamed to
    `out` (replacing it), on any error removed: a crash never leaves a half-written checkpoint under `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
