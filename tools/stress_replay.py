#!/usr/bin/env python3
"""Replay a dump many times in fresh processes, plain and patched targets alternating, under the watchdog
(thin CLI over parity.replay.stress). Exit status 1 if any run stalled, hung or crashed.

    python tools/stress_replay.py DUMP CKPT --runs 12 --targets reference,mutant:moe_no_group_limit --limit 300
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.replay.stress import stress  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump")
    p.add_argument("ckpt")
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--targets", default="reference,mutant:moe_no_group_limit,mutant:kda_conv_without_silu",
                   help="comma-separated: reference | mutant:NAME (parity/targets/mutants.py), cycled")
    p.add_argument("--limit", type=float, default=300.0, help="watchdog limit per target call, seconds")
    p.add_argument("--json", help="write the per-run results here")
    a = p.parse_args(argv)
    res = stress(a.dump, a.ckpt, [t.strip() for t in a.targets.split(",") if t.strip()], a.runs, a.limit)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    bad = [r for r in res if "counts" not in r]
    walls = sorted(r["wall_s"] for r in res)
    print(f"{len(res)} runs, {len(bad)} stalled/hung/crashed; wall time min {walls[0]:.1f} s, "
          f"median {walls[len(walls) // 2]:.1f} s, max {walls[-1]:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
