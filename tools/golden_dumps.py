#!/usr/bin/env python3
"""Regenerate the bundled golden dumps and dumps/MANIFEST.json (file, sha256, bytes, exact command, machine).

`--only FILE` (repeatable) remakes just those and keeps the other MANIFEST entries as they are (each entry records the
CPU kind that made it: regeneration is bit-identical only there, parity/golden.py). The official-runtime golden needs
the official modeling file (parity.torch_ref.official: cache path or $LING3_OFFICIAL_MODELING).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.dump_hf import main as dump_main  # noqa: E402
from parity.golden import DUMPS, GOLDEN, ROOT, machine_kind  # noqa: E402


def make(g) -> int:
    """Rebuild the golden's checkpoint if it needs one (official runtime), then dump it."""
    prep = g.prepare_command()
    if prep is not None:
        from parity.torch_ref.ckpt import main as make_main
        from parity.dumpfile import fingerprint_checkpoint

        rc = make_main(prep)
        if rc:
            return rc
        if fingerprint_checkpoint(g.ckpt_dir()) != fingerprint_checkpoint(ROOT / "dumps" / "ckpt" / g.ckpt):
            print(f"{g.ckpt_dir()}: fingerprint differs from dumps/ckpt/{g.ckpt}; expected the same weights",
                  file=sys.stderr)
            return 1
    return dump_main(g.args())


def entry(g) -> dict:
    data = (DUMPS / g.file).read_bytes()
    e = {"file": g.file, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
         "checkpoint": f"dumps/ckpt/{g.ckpt}", "dtype": g.dtype, "prompt_len": g.prompt_len,
         "runtime": g.runtime, "machine": machine_kind(), "command": g.command()}
    if g.runtime == "official":
        from parity.torch_ref.official import OFFICIAL_SHA256

        e["official_sha256"] = OFFICIAL_SHA256
    return e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=None, metavar="FILE",
                    help=f"remake only this golden (one of: {', '.join(g.file for g in GOLDEN)})")
    ap.add_argument("--_one", help=argparse.SUPPRESS)  # internal: make one golden in this process
    a = ap.parse_args(argv)
    known = {g.file for g in GOLDEN}
    if a._one is not None:
        os.chdir(ROOT)
        os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
        return make(next(g for g in GOLDEN if g.file == a._one))
    for f in a.only or ():
        if f not in known:
            ap.error(f"--only {f}: not a golden dump; expected one of {', '.join(sorted(known))}")
    os.chdir(ROOT)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")  # created_utc fixed: same inputs -> same bytes
    manifest = DUMPS / "MANIFEST.json"
    old = {e["file"]: e for e in json.loads(manifest.read_text())["dumps"]} if manifest.exists() else {}
    entries = []
    for g in GOLDEN:
        if a.only is None or g.file in a.only:
            # each golden in its own process: transformers names a remote module after the checkpoint folder, and the
            # twin's and the official file's checkpoints are both folders named after the preset (loader guard)
            rc = subprocess.run([sys.executable, __file__, "--_one", g.file]).returncode
            if rc:
                return rc
            entries.append(entry(g))
        elif g.file in old:
            entries.append(old[g.file])
        else:
            print(f"{g.file}: not in {manifest} and not remade (add --only {g.file})", file=sys.stderr)
            return 1
    manifest.write_text(json.dumps({"dumps": entries}, indent=1) + "\n")
    print(f"wrote {manifest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
