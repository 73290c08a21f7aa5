"""The official Ling3 remote code (`modeling_bailing_moe_v3.py`, shipped inside every Ling-3.0 checkpoint) as a
reference runtime: locate and verify the file in a cache OUTSIDE the repository, and install it into a checkpoint
directory made by `parity.torch_ref.ckpt` (tools/make_ckpt.py).

The file is never committed here (its licence and provenance are the checkpoint's). It is found at
`$LING3_OFFICIAL_MODELING` when set, else at `~/.cache/ling3-parity/official/modeling_bailing_moe_v3.py`, and used only
when its sha256 is `OFFICIAL_SHA256` (the revision this suite was measured against, 73,194 bytes): another revision
is refused in one line rather than half-working.

What else the official file needs (official_remote_code.md §1 — cited ORC; env_notes "Loading remote code offline"):
- its configuration class `configuration_bailing_moe_v3.BailingMoeV3Config`: make_ckpt copies the suite's (the
  twin's) class, which defines every attribute the official file reads (`config_attributes_read` lists them from the
  file's syntax tree; tests/test_official.py checks the class against that list);
- the fla CPU stand-ins and the transformers-5 shims (`is_torch_fx_available`, `ROPE_INIT_FUNCTIONS["default"]`):
  installed by `parity.torch_ref.loader.load_model(..., cpu_kernels=True)` before the remote code is imported;
- `einops` (imported at the file's top level; a dependency of fla-core).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
from pathlib import Path

from parity.errors import CheckpointError, ParityError

OFFICIAL_FILE = "modeling_bailing_moe_v3.py"
CONFIG_FILE = "configuration_bailing_moe_v3.py"
OFFICIAL_SHA256 = "c2509bf7ac580c262e2581d34d6403aa21682d2e10beb9ad85ad8820a7e33a40"
OFFICIAL_BYTES = 73194
ENV_VAR = "LING3_OFFICIAL_MODELING"
DEFAULT_CACHE = Path("~/.cache/ling3-parity/official") / OFFICIAL_FILE


class OfficialFileMissing(ParityError):
    """The official modeling file is not available (absent, unreadable or another revision)."""


def default_path() -> Path:
    """Where the file is looked for: `$LING3_OFFICIAL_MODELING`, else the default cache path."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else DEFAULT_CACHE.expanduser()


def how_to_provide() -> str:
    """One line saying how to provide the file (used by skips and errors)."""
    return (f"put the official {OFFICIAL_FILE} (sha256 {OFFICIAL_SHA256}, {OFFICIAL_BYTES} bytes) at "
            f"{DEFAULT_CACHE} or set {ENV_VAR}=/path/to/it")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def locate() -> Path:
    """The verified official file, or OfficialFileMissing with one line naming the path looked at and what to do."""
    path = default_path()
    if not path.is_file():
        raise OfficialFileMissing(f"official modeling file not found at {path}: {how_to_provide()}")
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise OfficialFileMissing(f"{path}: cannot read the official modeling file ({e.strerror or e})") from None
    if digest != OFFICIAL_SHA256:
        raise OfficialFileMissing(f"{path}: sha256 {digest}, expected {OFFICIAL_SHA256} (another revision of the "
                                  f"official file; this suite was measured against that one)")
    return path


def available() -> tuple[bool, str]:
    """(True, path) when the verified file is present, else (False, the one-line reason)."""
    try:
        return True, str(locate())
    except OfficialFileMissing as e:
        return False, str(e)


def install(ckpt_dir: str | os.PathLike) -> Path:
    """Replace the checkpoint's modeling file by the verified official one, and its configuration class by the
    suite's (which defines every attribute the official file reads; the official file imports it from the same
    directory). Returns the installed modeling file's path."""
    from parity.torch_ref import TWIN_DIR

    src = locate()
    ckpt = Path(ckpt_dir)
    if not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{ckpt}: no config.json; expected a checkpoint directory made by tools/make_ckpt.py")
    for f, origin in ((CONFIG_FILE, TWIN_DIR / CONFIG_FILE), (OFFICIAL_FILE, src)):
        dst = ckpt / f
        shutil.copyfile(origin, dst)
        os.chmod(dst, 0o644)
    return ckpt / OFFICIAL_FILE


def is_official(ckpt_dir: str | os.PathLike) -> bool:
    """True when the checkpoint's modeling file is the verified official one."""
    p = Path(ckpt_dir) / OFFICIAL_FILE
    return p.is_file() and p.stat().st_size == OFFICIAL_BYTES and sha256_file(p) == OFFICIAL_SHA256


def config_attributes_read(source: str) -> set[str]:
    """Names of the attributes a modeling file reads from its config: every `config.X` / `self.config.X` load in
    its syntax tree (docstrings and comments do not count; assignments such as `self.config.head_dim = ...` on a
    private copy do not either). Private names (`_attn_implementation`) are transformers' own and are kept."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "config") or (
                isinstance(base, ast.Attribute) and base.attr == "config" and isinstance(base.value, ast.Name)
                and base.value.id == "self"):
            names.add(node.attr)
    return names


__all__ = ["OFFICIAL_FILE", "OFFICIAL_SHA256", "OFFICIAL_BYTES", "ENV_VAR", "DEFAULT_CACHE", "OfficialFileMissing",
           "default_path", "how_to_provide", "locate", "available", "install", "is_official",
           "config_attributes_read"]
