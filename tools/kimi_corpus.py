"""Correct Kimi Linear pairs, measured (issue 34 item 3): the JAX reference against transformers' built-in on fresh
seeded tiny checkpoints, every site in layer (with decode steps), isolated and free modes, fp32 and bf16, judged
under the family's rules (Ling3's calibrated rules with parity/numerics/kimi_linear.toml first).

    python tools/kimi_corpus.py [--seeds 1-8] [--T 70] [--decode-steps 2] [--dtypes float32,bfloat16]
        [--modes layer,isolated,free] [--grads] [--ling3-rules] [--jsonl OUT]

`--grads` also judges one training step's backward in layer mode (each layer's input and parameter gradients, as a
`--grads` dump is judged). Prints per (site, mode, dtype): rows, how many did not pass, the worst largest |Δ| / row RMS (where) and rel-L2.
`--ling3-rules` judges under Ling3's rules alone (what the overlay was set from). Exits 1 if any row did not pass.
"""

from __future__ import annotations

import argparse
import json
import sys


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kimi_corpus.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-8", help="checkpoint seeds, e.g. 1-8 or 1,3,5 (default 1-8)")
    ap.add_argument("--T", type=int, default=70, help="prompt length (default 70)")
    ap.add_argument("--decode-steps", type=int, default=2, help="decode steps judged in layer mode (default 2)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="layer,isolated,free")
    ap.add_argument("--grads", action="store_true", help="also the backward of one training step (layer mode)")
    ap.add_argument("--ling3-rules", action="store_true", help="judge under Ling3's rules alone (no family overlay)")
    ap.add_argument("--jsonl", default=None, metavar="OUT", help="also write every row to OUT (JSON lines)")
    a = ap.parse_args(argv)
    from parity.jax_kimi.corpus import corpus_rows, summary
    from parity.numerics.tolerances import default_rules

    rows = []
    for r in corpus_rows(_seeds(a.seeds), tuple(a.dtypes.split(",")), tuple(a.modes.split(",")), a.T,
                         a.decode_steps, rules=default_rules() if a.ling3_rules else None, grads=a.grads):
        rows.append(r)
        if r["status"] not in ("pass", "variant"):
            print(f"  not passed: seed {r['seed']} {r['dtype']} {r['mode']} L{r['layer']} {r['site']}: {r['status']} "
                  f"(|Δ|max/RMS {r['max_diff_rms']:.3g})", flush=True)
    if a.jsonl:
        with open(a.jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'site':32s} {'mode':8s} {'dtype':9s} {'rows':>5s} {'not passed':>10s} {'worst |Δ|/RMS':>13s} "
          f"{'rel-L2':>9s}  where")
    for s in summary(rows):
        print(f"{s['site']:32s} {s['mode']:8s} {s['dtype']:9s} {s['n']:5d} {s['not_passed']:10d} "
              f"{s['worst_diff_rms']:13.3g} {s['worst_rel_l2']:9.3g}  {s['worst_at']}")
    bad = sum(r["status"] not in ("pass", "variant") for r in rows)
    print(f"{len(rows)} rows, {bad} not passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
