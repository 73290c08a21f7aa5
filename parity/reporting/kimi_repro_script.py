#!/usr/bin/env python3
"""ling3-parity reproducer of one Kimi Linear point (made by `tools/repro.py` from a Kimi report; see README.txt).

Loads the dumped sites (inputs.npz) and the layer's tensors (weights.safetensors), runs the layer as the Kimi check
runs it (`parity.jax_kimi.check`: layer mode on the dumped layer input of each step up to the point's, routed to the
built-in's experts; isolated mode: each block on the built-in's own input of it) with the bundle's target, judges
the point under its tolerance rule and prints one line.
Exit status: 1 on a mismatch, 0 on a match (a bf16 `variant`, more precise than the built-in, is a match, as in the
replay), 2 when it cannot run. Needs the `parity` package and transformers (for `KimiLinearConfig`), not the dump,
the checkpoint directory or pytest.

    python repro.py [--target package.module:Class] [--bundle DIR] [--verbose]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np


def load_steps(bundle: Path, meta: dict) -> list[dict]:
    """[{(layer, site): array} per step] from inputs.npz (bf16 restored from its uint16 bits)."""
    steps: list[dict] = [{} for _ in range(meta["step"] + 1)]
    with np.load(bundle / "inputs.npz") as z:
        for key, note in meta["arrays"].items():
            step, site = key.split("|", 1)
            a = z[key].view(ml_dtypes.bfloat16) if note["dtype"] == "bfloat16" else z[key]
            steps[int(step)][(meta["layer"], site)] = a
    return steps


class OneRule:
    """The bundle's rule for every lookup (the point is the only judged site that matters here)."""

    def __init__(self, rule: dict) -> None:
        from parity.numerics.tolerances import ToleranceRule

        self.rule = ToleranceRule(**rule)

    def rule_for(self, *key) -> object:
        return self.rule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default=str(Path(__file__).resolve().parent), help="bundle directory (default: here)")
    ap.add_argument("--target", default=None, help="Kimi target to run instead of the bundle's (package.module:Class)")
    ap.add_argument("--verbose", action="store_true", help="also print the full comparison message")
    a = ap.parse_args(argv)
    bundle = Path(a.bundle)
    meta = json.loads((bundle / "bundle.json").read_text())
    spec = a.target or meta["target"]
    where = f"{meta['point']} ({meta['mode']} repro, target {spec})"

    from safetensors.numpy import load_file
    from transformers import KimiLinearConfig

    from parity.errors import ParityError
    from parity.jax_kimi.check import decode_verdicts, isolated_verdicts, layer_verdicts
    from parity.reporting.repro import verdict_line
    from parity.targets import resolve

    cfg = KimiLinearConfig.from_dict(meta["config"])
    weights = load_file(str(bundle / "weights.safetensors"))
    steps = load_steps(bundle, meta)
    rules, i, k, dtype = OneRule(meta["rule"]), meta["layer"], meta["step"], meta["dtype"]
    reference = spec == "parity.targets.kimi:KimiReferenceTarget"
    try:
        if meta["mode"] == "isolated":
            if not reference:
                print(f"CANNOT RUN {where}: isolated mode runs the suite's reference only (a Kimi target has "
                      f"layer_forward); remake the bundle with --mode layer")
                return 2
            got = isolated_verdicts(weights, cfg, steps[0], i, dtype, rules=rules)
        elif k == 0:
            target = None
            if not reference:
                target = resolve(spec)()
                target.build(cfg, dtype)
            got = layer_verdicts(weights, cfg, steps[0], i, dtype, jit=True, target=target, rules=rules)[0]
        else:
            if not reference:
                print(f"CANNOT RUN {where}: a Kimi target's decode is not judged (layer_forward has no state)")
                return 2
            got = decode_verdicts(weights, cfg, steps, i, dtype, rules=rules)[k - 1]  # step k's {site: result}
    except ParityError as e:  # a target that cannot be imported or built here, a bundle it cannot read: one line
        print(f"CANNOT RUN {where}: {e}")
        return 2
    res = got.get(meta["site"])
    if res is None or res.verdict is None:
        print(f"CANNOT RUN {where}: the target does not produce this site")
        return 2
    note = " (a variant: more precise than the built-in)" if res.status == "variant" else ""
    print(verdict_line(where, res.verdict, res.status != "fail", note))
    if res.status != "fail":
        return 0
    if a.verbose:
        print(res.message())
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
