#!/usr/bin/env python
"""Benchmark the JAX replay vs the PyTorch twin per layer, and the dump overhead (DESIGN §9). Prints a markdown
table and writes the raw records as JSON. Example (real Ling3-Tiny layer shapes):

    python tools/make_ckpt.py --preset ling3-tiny --layers 4 --seed 0 --out /tmp/lt4
    python tools/bench.py /tmp/lt4 --layers 0,1,3 --T 128,512,2048 --dump-T 128 --pytest --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.bench import run_bench, table  # noqa: E402


def cpu_list(text: str) -> list[int]:
    """`--cpus` value: comma-separated CPU ids this process may run on."""
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated CPU ids (e.g. 1 or 0,1), got {text!r}") from None
    allowed = sorted(os.sched_getaffinity(0))
    if not cpus or any(c not in allowed for c in cpus):
        raise argparse.ArgumentTypeError(f"CPU ids {cpus} not all usable here (allowed: {allowed})")
    return cpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="checkpoint directory (e.g. a ling3-tiny one from tools/make_ckpt.py)")
    ap.add_argument("--layers", default="0,1,3", help="layer indices, comma-separated (default 0,1,3)")
    ap.add_argument("--T", default="128,512,2048", help="sequence lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="warm calls per measurement (min and median reported)")
    ap.add_argument("--dump-T", type=int, default=0, help="also measure dump overhead at this prompt length (0: skip)")
    ap.add_argument("--dump-ckpt", default=None, help="checkpoint for the dump measurement (default: ckpt)")
    ap.add_argument("--pytest", action="store_true",
                    help="also time `pytest parity` on the bundled dumps: serial and -n 2, cold and warm JAX cache")
    ap.add_argument("--cpus", type=cpu_list, default=None,
                    help="pin the layer children (JAX and twin) to these CPU ids, comma-separated (e.g. 1: one core "
                         "each, a fair comparison on a busy machine); default: no pinning")
    ap.add_argument("--json", default="bench.json", help="output JSON path")
    a = ap.parse_args(argv)
    res = run_bench(a.ckpt, [int(x) for x in a.layers.split(",")], [int(x) for x in a.T.split(",")], a.repeats,
                    a.dump_T or None, a.dump_ckpt,
                    str(Path(__file__).resolve().parents[1]) if a.pytest else None,
                    log=lambda m: print(m, file=sys.stderr, flush=True),
                    cpus=a.cpus)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
