"""A Kimi Linear report's repro bundle (issue 34): what `parity.reporting.repro` makes for a Ling3 point, for a Kimi
dump's decoder-layer point — a small directory a port engineer attaches to a bug report or runs under a debugger,
without the dump, the checkpoint directory or pytest.

`make_kimi_bundle(report, out_dir)` writes, for the report's first divergence *source* (or `--point`):
- `inputs.npz`: the dumped sites the check reads (`parity.jax_kimi.check`), keyed `<step>|<site>`. Layer repro
  (the report's `layer` and `free` modes; a free-mode failure is reproduced on the dumped layer input): each step's
  layer `input` up to the point's step and the built-in's expert ids (`mlp.gate.topk_idx`), the prefill's `mlp:in`
  and `mlp` (the teacher-forced MLP), and the point's own dumped tensor. Isolated repro: the layer's block inputs and
  outputs of the prefill (`input`, `input_layernorm`, `attention`, `post_attention_layernorm`, `mlp:in`, `mlp`,
  `output`, the expert ids). bf16 arrays are stored as their uint16 bits (`bundle.json` `arrays`).
- `weights.safetensors`: the layer's tensors as transformers' built-in loads them (`model.layers.{i}.*`), in the
  dump's compute dtype (as the replay casts them).
- `bundle.json`: the point, mode, target, compute dtype, the `KimiLinearConfig` as a dict, the point's tolerance rule
  (the family's rules, the report's overrides merged), the pytest command that reproduces it in the suite.
- `repro.py` (`parity/reporting/kimi_repro_script.py` copied) and `README.txt`.
Model-level and backward points have no bundle (one line says so; their pytest command reproduces them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity.model.families import KIMI_LINEAR
from parity.model.points import Point
from parity.reporting.repro import ReproError, choose_point, point_rule, pytest_command, write_bundle

BUNDLE_KIND = "ling3-parity-kimi-repro"
BUNDLE_VERSION = 1
SCRIPT = Path(__file__).with_name("kimi_repro_script.py")
# the prefill sites `check.isolated_verdicts` reads and judges (its blocks' inputs and outputs)
ISOLATED_SITES = ("input", "input_layernorm", "attention", "post_attention_layernorm", "mlp:in", "mlp", "output",
                  "mlp.gate.topk_idx")
DEFAULT_TARGET = "parity.targets.kimi:KimiReferenceTarget"


def _checkpoint(report: dict, dump: Path, ckpt: str | None) -> Path:
    """--ckpt, else the dump's recorded checkpoint directory where it still holds the dump's fingerprint, else the
    bundled checkpoint with that fingerprint (as `pytest parity` finds one)."""
    from parity.dumpfile import DumpReader, fingerprint_checkpoint
    from parity.replay.session import find_checkpoint

    if ckpt:
        return Path(ckpt)
    with DumpReader(dump) as d:
        fp, recorded = d.fingerprint, d.meta.get("checkpoint_dir")
    if recorded and Path(recorded).is_dir():
        try:
            if fingerprint_checkpoint(recorded) == fp:
                return Path(recorded)
        except (OSError, ValueError):
            pass
    return Path(find_checkpoint(fp, None))


def make_kimi_bundle(report: dict, out_dir: str | Path, *, point: str | None = None, target: str | None = None,
                     mode: str = "auto", dump: str | None = None, ckpt: str | None = None,
                     report_path: str | None = None) -> Path:
    """Write the repro bundle of `point` (default: the first divergence's source) of a Kimi report into `out_dir`.
    `mode`: auto (the report's: isolated, else layer), layer or isolated."""
    from parity.torch_ref.capture import to_numpy
    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import read_kimi_dump

    pt = choose_point(report, point)
    if pt.phase == "backward":
        raise ReproError(f"{pt.key()}: a backward point has no Kimi repro bundle; its pytest command reproduces it: "
                         f"{pytest_command(report, pt)}")
    rep_mode = report.get("mode", "layer")
    chosen = ("isolated" if rep_mode == "isolated" else "layer") if mode == "auto" else mode
    if chosen not in ("layer", "isolated"):
        raise ReproError(f"--mode {mode!r}: expected auto, layer or isolated")
    if chosen == "isolated" and pt.phase != "prefill":
        raise ReproError(f"{pt.key()}: isolated mode judges the prefill only; use --mode layer")
    dump_path = Path(dump or report.get("dump") or "")
    if not dump_path.is_file():
        raise ReproError(f"report.json: dump {str(dump_path)!r} is not a file here; pass --dump PATH")
    ckpt_dir = _checkpoint(report, dump_path, ckpt)
    steps, _, _ = read_kimi_dump(dump_path, ckpt_dir)
    i, k = pt.layer, pt.step
    base = pt.site.split(" ")[0]  # `mlp (teacher-forced)` is the dumped `mlp`
    if k >= len(steps) or (i, base) not in steps[k]:
        raise ReproError(f"{pt.key()}: the dump holds no such point (layer {i}, site {base!r}, step {k})")
    arrays: dict[str, np.ndarray] = {}
    if chosen == "isolated":
        want = [(0, s) for s in ISOLATED_SITES]
    else:
        want = [(s, n) for s in range(k + 1) for n in ("input", "mlp.gate.topk_idx")]
        want += [(0, "mlp:in"), (0, "mlp")] if k == 0 else []
    for s, name in want + [(k, base)]:
        if (i, name) in steps[s]:
            arrays[f"{s}|{name}"] = np.asarray(steps[s][(i, name)])
    dtype = "bfloat16" if np.asarray(steps[0][(i, "input")]).dtype.name == "bfloat16" else "float32"
    model = load_kimi_model(ckpt_dir, dtype)
    prefix = f"model.layers.{i}."
    weights = {n: to_numpy(t.detach()) for n, t in model.state_dict().items() if n.startswith(prefix)}
    spec = target or (report.get("target") if report.get("target") not in (None, "reference", "kimi-reference")
                      else DEFAULT_TARGET)
    meta = {
        "kind": BUNDLE_KIND, "version": BUNDLE_VERSION, "family": "kimi_linear", "point": pt.key(), "phase": pt.phase,
        "step": k, "layer": i, "site": pt.site, "mode": chosen, "target": spec, "dtype": dtype,
        "config": model.config.to_dict(),
        "rule": point_rule(report, dtype, chosen, Point(pt.phase, k, i, base), arrays[f"{k}|{base}"].dtype.name,
                           base=KIMI_LINEAR.entry("rules")()),  # the family's rules, the report's overrides
        "report": report_path, "dump": str(dump_path), "checkpoint": str(ckpt_dir), "report_mode": rep_mode,
        "pytest_command": pytest_command(report, pt),
    }
    return write_bundle(Path(out_dir), meta, arrays, weights, script=SCRIPT, readme=_readme)


def _readme(meta: dict) -> str:
    how = ("each block of the layer fed the built-in's own input of it" if meta["mode"] == "isolated"
           else "the layer fed the built-in's layer input of each step up to the point's, routed to its experts")
    return "\n".join([
        f"ling3-parity reproducer of a Kimi Linear point: {meta['point']} (target {meta['target']}, {meta['mode']} "
        f"repro: {how}).",
        "",
        "Run:   python repro.py                 # exit 1 and one MISMATCH line when it reproduces, 0 when it matches",
        "       python repro.py --target parity.targets.kimi:KimiReferenceTarget   # the suite's reference instead",
        "       python repro.py --verbose       # the full comparison message",
        "",
        f"In the suite: {meta['pytest_command']}",
        "Inside: inputs.npz (the dumped sites the check reads), weights.safetensors (the layer's tensors as "
        "transformers loads them), bundle.json (point, mode, target, dtype, config, rule).",
        ""])
