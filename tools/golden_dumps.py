#!/usr/bin/env python3
"""Regenerate the bundled golden dumps and dumps/MANIFEST.json (file, sha256, bytes, exact command)."""

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.dump_hf import main as dump_main  # noqa: E402
from parity.golden import DUMPS, GOLDEN, ROOT, machine_kind  # noqa: E402


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")  # created_utc fixed: same inputs -> same bytes
    entries = []
    for g in GOLDEN:
        rc = dump_main(g.args())
        if rc:
            return rc
        data = (DUMPS / g.file).read_bytes()
        entries.append({"file": g.file, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                        "checkpoint": f"dumps/ckpt/{g.ckpt}", "dtype": g.dtype, "prompt_len": g.prompt_len,
                        "command": g.command()})
    (DUMPS / "MANIFEST.json").write_text(json.dumps({"machine": machine_kind(), "dumps": entries}, indent=1) + "\n")
    print(f"wrote {DUMPS / 'MANIFEST.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
