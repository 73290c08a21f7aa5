"""Which Python code a checkpoint directory makes transformers run, and whether it is the suite's own twin.

`--runtime remote` loads a checkpoint's `auto_map` classes with `trust_remote_code=True`: transformers imports the
`.py` files of the directory (the official `modeling_bailing_moe_v3.py` / `configuration_bailing_moe_v3.py` of a real
checkpoint) and runs them in this process. That is an explicit opt-in (`--trust-remote-code`), as in transformers,
vLLM and SGLang, except for code that is byte-for-byte the suite's own twin (`parity/torch_ref/twin/`): the bundled
checkpoints under dumps/ckpt and every checkpoint `tools/make_ckpt.py` writes carry copies of it, and running it runs
nothing the suite does not already run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TWIN_DIR = Path(__file__).resolve().parent / "twin"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint_code(ckpt_dir: str | Path) -> list[Path]:
    """Every Python file in the checkpoint directory (any of them can be imported by the auto_map modules)."""
    return sorted(p for p in Path(ckpt_dir).rglob("*.py") if p.is_file())


def auto_map_refs(ckpt_dir: str | Path) -> list[str]:
    """The `auto_map` class references of config.json (e.g. `modeling_bailing_moe_v3.BailingMoeV3ForCausalLM`)."""
    try:
        raw = json.loads((Path(ckpt_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    refs = raw.get("auto_map") if isinstance(raw, dict) else None
    if not isinstance(refs, dict):
        return []
    out = []
    for v in refs.values():
        out += [str(x) for x in v if x] if isinstance(v, (list, tuple)) else [str(v)]
    return out


def twin_mismatch(ckpt_dir: str | Path) -> str | None:
    """None when the code `trust_remote_code` would run is exactly the suite's twin (every .py file of the directory
    has the sha256 of the twin file of the same name, and auto_map names only modules of the directory), else why
    not, in a few words."""
    ckpt = Path(ckpt_dir)
    files = checkpoint_code(ckpt)
    if not files:
        return "the checkpoint holds no Python files"
    for f in files:
        rel = f.relative_to(ckpt)
        twin = TWIN_DIR / rel.name
        if len(rel.parts) > 1 or not twin.is_file():
            return f"{rel} is not a file of the suite's twin"
        if _sha256(f) != _sha256(twin):
            return f"{rel} differs from the suite's twin (sha256)"
    names = {f.stem for f in files}
    for ref in auto_map_refs(ckpt):
        module = ref.rsplit(".", 1)[0]
        if "--" in ref or module not in names:
            return f"auto_map names {ref!r}, not a module of the directory"
    return None


def describe_code(ckpt_dir: str | Path) -> str:
    ckpt = Path(ckpt_dir)
    files = [str(f.relative_to(ckpt)) for f in checkpoint_code(ckpt)]
    return ", ".join(files) if files else "none"
