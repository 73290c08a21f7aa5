#!/usr/bin/env python3
"""Measure the detection resolution of each replay mode (thin CLI over parity.numerics.resolution).

    python3 tools/resolution.py [--dump dumps/tiny-bf16.h5 ...] [--modes layer,isolated] [--seeds 5] [--pairs 40]

For every dump and mode: one replay with the reference target gives the (dump, target) array pair of every point and
the rule the default table applies to it; per site class, single-site perturbations (`relative`: every element ×(1 ±
m); `ulps`: every element ±m steps on the comparison grid) are planted in the reference array and the smallest m that
fails the point in ≥ 95 % of the trials (pairs × seeds) is reported. A planted point that fails is also the first
divergence and its source — every earlier point is unchanged and the unplanted replay passes (checked: pairs whose
unplanted comparison fails are left out and counted) — so "detected" here is "detected and pinned to that site"
(tests/test_numerics_resolution.py plants into a dump file and replays to show it). The layer's `input` (fed, not
computed) is left out. Prints a markdown table; --json writes the rows.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from parity.numerics.resolution import resolution  # noqa: E402


def collect(dump: Path, mode: str) -> tuple[dict[str, list], int, str]:
    """{site class: [(ref, test, rule), ...]} of one replay, pairs failing unplanted counted apart; compute dtype."""
    from parity.points import site_class
    from parity.replay import Session, observe, observe_free, observe_model_points

    by_class: dict[str, list] = {}
    failing = 0
    with Session.open(dump, mode=mode) as s:
        from parity.numerics.compare import compare

        streams = [observe_free(s)] if mode == "free" else \
            [observe(s, i) for i in s.layers()] + [observe_model_points(s)]
        for obs in (o for st in streams for o in st):
            p = obs.point
            if obs.skip or obs.ref is None or obs.test is None or obs.forced or p.site == "input":
                continue
            ref = np.asarray(obs.ref)
            if ref.dtype.kind not in "f" and ref.dtype.name != "bfloat16":
                continue  # top-k ids compare exactly
            test = np.asarray(obs.test).reshape(ref.shape)
            rule = s.rules.rule_for(p.site, mode, s.dump.dtype(p), s.dtype)
            if not compare(ref, test, rule).passed:
                failing += 1
                continue
            by_class.setdefault(site_class(p.site), []).append((ref, test, rule))
        return by_class, failing, s.dtype


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", action="append", default=None, help="dump(s) (default: the bundled dumps)")
    ap.add_argument("--modes", default="layer,isolated")
    ap.add_argument("--seeds", type=int, default=5, help="trials per pair and magnitude")
    ap.add_argument("--pairs", type=int, default=40, help="at most this many points per class (evenly spaced)")
    ap.add_argument("--rate", type=float, default=0.95)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    dumps = [Path(d) for d in a.dump] if a.dump else sorted((ROOT / "dumps").glob("*.h5"))
    rows = []
    print("| dump | compute | mode | site class | points | relative (≥95 %) | ULP shift (≥95 %) |")
    print("|---|---|---|---|---|---|---|")
    for d in dumps:
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            by_class, failing, compute = collect(d, mode)
            for cls, pairs in sorted(by_class.items()):
                if len(pairs) > a.pairs:
                    idx = np.linspace(0, len(pairs) - 1, a.pairs).round().astype(int)
                    pairs = [pairs[i] for i in sorted(set(idx))]
                seeds = range(a.seeds)
                rel = resolution(pairs, "relative", seeds=seeds, rate=a.rate)
                ulp = resolution(pairs, "ulps", seeds=seeds, rate=a.rate)
                row = {"dump": d.name, "compute": compute, "mode": mode, "class": cls, "points": len(pairs),
                       "relative": rel.magnitude, "ulps": ulp.magnitude, "trials": rel.trials,
                       "failing_unplanted": failing}
                rows.append(row)
                fmt = (lambda v, f: "not within the scan" if v is None else f.format(v))
                print(f"| {d.name} | {compute} | {mode} | {cls} | {len(pairs)} | {fmt(rel.magnitude, '{:g}')} | "
                      f"{fmt(ulp.magnitude, '{:g}')} |", flush=True)
            print(f"<!-- {d.name} {mode}: {time.perf_counter() - t0:.0f}s, {failing} point(s) failing unplanted "
                  f"left out -->", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
