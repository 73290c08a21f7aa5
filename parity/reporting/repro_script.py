#!/usr/bin/env python3
"""ling3-parity reproducer of one point (made by `tools/repro.py`; see README.txt beside this file).

Loads the dumped inputs (inputs.npz) and the layer's checkpoint tensors (weights.safetensors), builds the target,
runs only the one sub-module (isolated repro) or the one layer (layer repro), compares its output with the dumped
reference under the point's tolerance rule and prints one line.
Exit status: 1 on a mismatch, 0 on a match, 2 when it cannot run. Needs the `parity` package (and the target's
module) importable, not the dump, the checkpoint directory or the replay session.

    python repro.py [--target reference|package.module:Class] [--bundle DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np


def use_environment(meta: dict) -> None:
    """Set the environment variables the target declared (bundle.json `environment`, the values of the failing run)
    before anything imports the target or jax, so the bundle reproduces in a fresh shell; a different value already
    set here is overridden, saying so."""
    import os

    for k, v in (meta.get("environment") or {}).items():
        if os.environ.get(k) not in (None, v):
            print(f"note: {k} was {os.environ[k]!r} here; set to the bundle's {v!r}")
        os.environ[k] = v


def load_arrays(bundle: Path, notes: dict) -> dict[str, np.ndarray]:
    """inputs.npz with bf16 arrays restored from their uint16 bits (bundle.json `arrays`)."""
    with np.load(bundle / "inputs.npz") as z:
        return {k: (z[k].view(ml_dtypes.bfloat16) if n["dtype"] == "bfloat16" else z[k]) for k, n in notes.items()}


def load_weights(bundle: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(bundle / "weights.safetensors"))


def build_target(meta: dict, spec: str):
    """The target as the replay builds it: resolved by name or class path, semantic forks set, built, layer loaded."""
    from parity.model.config import Ling3Config
    from parity.targets import resolve

    cfg = Ling3Config.from_dict(meta["config"], source="bundle.json config", strict=False)
    target = resolve(spec)()
    if getattr(target, "follows_semantics", False):  # the suite's reference (and its mutants) follow the dump's
        target.use_semantics(**meta["semantic_options"])
    target.build(cfg, meta["dtype"])
    return target


def run_isolated(target, meta: dict, arrays: dict):
    inputs = {k.split("|", 1)[1]: v for k, v in arrays.items() if k.startswith("in|")}
    if "positions" in arrays:
        inputs["positions"] = arrays["positions"]
    state = {k.split("|", 1)[1]: v for k, v in arrays.items() if k.startswith("state|")} or None
    return target.submodule(meta["layer"], meta["site"], inputs, state)


def run_layer(target, meta: dict, arrays: dict):
    """The layer run step by step (prefill, decode 1, ...) up to the point's step, each fed its dumped input."""
    state, res, hidden = None, None, None
    steps = sorted((k.split("|")[1:] for k in arrays if k.startswith("hidden|")),
                   key=lambda ps: (ps[0] != "prefill", int(ps[1])))
    for phase, step in steps:
        hidden = arrays[f"hidden|{phase}|{step}"]
        topk = arrays.get(f"topk|{phase}|{step}") if meta["forced_routing"] else None
        res = target.layer_forward(meta["layer"], hidden, arrays[f"positions|{phase}|{step}"], state,
                                   forced_topk=topk)
        state = res.state
    if meta["site"] == "output":
        return res.output
    if meta["site"] == "input":
        return hidden
    return res.points.get(meta["site"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default=str(Path(__file__).resolve().parent), help="bundle directory (default: here)")
    ap.add_argument("--target", default=None, help="target to run instead of the bundle's (e.g. reference)")
    ap.add_argument("--verbose", action="store_true", help="also print the full comparison message")
    a = ap.parse_args(argv)
    bundle = Path(a.bundle)
    meta = json.loads((bundle / "bundle.json").read_text())
    use_environment(meta)
    spec = a.target or meta["target"]
    arrays = load_arrays(bundle, meta["arrays"])
    ref = arrays["ref"]

    from parity.numerics.compare import compare
    from parity.numerics.tolerances import ToleranceRule
    from parity.reporting.repro import verdict_line

    from parity.errors import ParityError

    try:
        target = build_target(meta, spec)
    except ParityError as e:  # a target that cannot be imported or built here: one line
        print(f"CANNOT RUN: {e}")
        return 2
    target.load_layer(meta["layer"], load_weights(bundle))
    test = run_isolated(target, meta, arrays) if meta["mode"] == "isolated" else run_layer(target, meta, arrays)
    where = f"{meta['point']} ({meta['mode']} repro, target {spec})"
    if test is None:
        print(f"CANNOT RUN {where}: the target does not produce this site"
              + (" in isolation; remake the bundle with --mode layer" if meta["mode"] == "isolated" else ""))
        return 2
    test = np.asarray(test)
    if test.shape != ref.shape:
        print(f"MISMATCH {where}: shape {test.shape}, dumped reference {ref.shape}")
        return 1
    v = compare(ref, test, ToleranceRule(**meta["rule"]), name=meta["point"])
    print(verdict_line(where, v, v.passed))
    if v.passed:
        return 0
    if a.verbose:
        print(v.message())
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
