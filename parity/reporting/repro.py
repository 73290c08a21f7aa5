"""A minimal reproducer of one point (issue 25 item 3): a small bundle a port engineer attaches to a bug report or runs
under a debugger, without the dump, the checkpoint directory or the replay machinery.

`make_bundle(report, out_dir)` writes, for the report's first divergence *source* (or another per-layer point):
- `inputs.npz`: what the point's computation reads, from the dump, and the dumped reference output `ref`.
  - `isolated` repro (the target has capability `isolated`, the site is computed, not an alias): the site's inputs as
    the site graph lists them (`in|<site>`), its `positions` (MLA core), and on a decode step the dumped state of
    earlier steps (`state|<site>`: `Site.carry` of the previous step, `Site.history` of every earlier step).
  - `layer` repro (fallback): the dumped layer `input` of every step up to the point's (`hidden|<phase>|<step>`),
    their positions (`positions|...`), and in forced mode the reference's expert ids (`topk|...`): the layer is run
    step by step as teacher-forced replay runs it, its own state carried.
  bf16 arrays are stored as their uint16 bits; `bundle.json` `arrays` says which (`stored_as`).
- `weights.safetensors`: every `model.layers.{i}.*` tensor of the layer under its HF name (a target's `load_layer`
  converts the whole layer), in its checkpoint dtype.
- `bundle.json`: the point, repro mode, target class path, semantic options, compute dtype, the model config, the
  tolerance rule of the point in that mode, the commands that produced the failure.
- `repro.py`: `parity/reporting/repro_script.py` copied: builds the target, runs that sub-module / that layer, compares with
  `parity.numerics.compare.compare` and prints one line; exit 1 on a mismatch, 0 on a match, 2 when it cannot run.
- `README.txt`: the commands, the point, what is inside.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from parity.errors import ParityError
from parity.model.points import Point, layer_graph, mtp_site

BUNDLE_KIND = "ling3-parity-repro"
BUNDLE_VERSION = 1
SCRIPT = Path(__file__).with_name("repro_script.py")
_POINT_RE = re.compile(r"^(?:prefill|decode/S(\d+))/L(\d+)/(.+)$")


class ReproError(ParityError):
    """A reproducer cannot be made (one line naming the file / key / point and what was expected)."""


# ------------------------------------------------------------------------------------------ which point
def parse_point(text: str) -> Point:
    """`prefill/L03/attention.core` or `decode/S001/L03/attention.core` (report spelling) -> Point."""
    m = _POINT_RE.match(text.strip())
    if m is None:
        raise ReproError(f"--point {text!r}: expected a per-layer point as reports spell it, e.g. "
                         "prefill/L03/attention.core or decode/S001/L03/attention.core")
    step, layer, site = m.groups()
    return Point("prefill" if step is None else "decode", 0 if step is None else int(step), int(layer), site)


def choose_point(report: dict, point: str | None = None) -> Point:
    """`point` if given, else the first divergence's source (where the error starts)."""
    if point:
        return parse_point(point)
    fd = report.get("first_divergence")
    if not fd:
        raise ReproError("report.json: first_divergence is null (the report passed); pass --point to choose a point")
    src = fd.get("source") or fd
    if src.get("layer") is None:
        raise ReproError(f"report.json: first_divergence.source is the model-level point {src.get('site')!r}; only "
                         "per-layer points can be reproduced, pass --point PHASE/Lnn/SITE")
    return Point(src["phase"], int(src.get("step", 0)), int(src["layer"]), src["site"])


def target_spec(report: dict) -> str:
    """What the repro builds: `target_class` (a run_replay report, whose `target` is the display name), else
    `target` (the `--parity-target` value of a pytest run)."""
    spec = report.get("target_class") or report.get("target")
    if not spec:
        raise ReproError("report.json: no target / target_class key; pass --target")
    return spec


def repro_mode(capabilities, cfg, point: Point) -> str:
    """`isolated` where the target can compute the site from its dumped inputs, else `layer` (the whole layer fed
    the dumped layer input)."""
    site = _site(cfg, point)
    if "isolated" in capabilities and site.alias is None:
        return "isolated"
    return "layer"


def _site(cfg, point: Point):
    for s in layer_graph(cfg.layer_kind(point.layer), cfg.is_moe(point.layer), cfg.q_lora):
        if s.name == point.site:
            return s
    raise ReproError(f"point {point.key()}: layer {point.layer} ({cfg.layer_kind(point.layer)}, "
                     f"{'moe' if cfg.is_moe(point.layer) else 'dense'}) has no site {point.site!r}")


# ------------------------------------------------------------------------------------------ what it reads
def _read(reader, p: Point) -> np.ndarray:
    if not reader.has(p):
        raise ReproError(f"{reader.path}: holds no {p.key()}, which the repro of this point needs")
    return reader.read(p)


def _earlier(steps: list[tuple[str, int]], point: Point) -> list[tuple[str, int]]:
    return steps[:steps.index((point.phase, point.step))]


def _positions(prompt_len: int, phase: str, step: int, T: int) -> np.ndarray:
    """Absolute positions of a step's T tokens (as the replay gives them)."""
    start = 0 if phase == "prefill" else prompt_len + step - 1
    return np.arange(start, start + T, dtype=np.int32)


def isolated_arrays(reader, cfg, point: Point) -> dict[str, np.ndarray]:
    """The site's dumped inputs (`in|<site>`), positions, earlier-step state (`state|<site>`) and `ref`."""
    from parity.replay.session import dump_steps

    site = _site(cfg, point)
    out = {f"in|{n}": _read(reader, Point(point.phase, point.step, point.layer, n)) for n in site.inputs}
    if site.positions:
        T = _read(reader, Point(point.phase, point.step, point.layer, "input")).shape[1]
        out["positions"] = _positions(int(reader.prompt_len), point.phase, point.step, T)
    earlier = _earlier(dump_steps(reader), point)
    if point.phase == "decode" and (site.carry or site.history):
        if not earlier:
            raise ReproError(f"{reader.path}: {point.key()} is a decode step with no earlier step in the dump")
        ph, st = earlier[-1]
        for n in site.carry:  # the previous step's state
            out[f"state|{n}"] = _read(reader, Point(ph, st, point.layer, n))
        for n in site.history:  # every earlier token, in order
            out[f"state|{n}"] = np.concatenate([_read(reader, Point(ph, st, point.layer, n)) for ph, st in earlier],
                                               axis=1)
    out["ref"] = _read(reader, point)
    return out


def layer_arrays(reader, cfg, point: Point, forced: bool) -> dict[str, np.ndarray]:
    """The dumped layer input of every step up to the point's (`hidden|phase|step`), positions, forced expert ids
    (forced mode, MoE layers) and `ref`."""
    from parity.replay.session import dump_steps

    steps = dump_steps(reader)
    out: dict[str, np.ndarray] = {}
    for ph, st in _earlier(steps, point) + [(point.phase, point.step)]:
        h = _read(reader, Point(ph, st, point.layer, "input"))
        out[f"hidden|{ph}|{st}"] = h
        out[f"positions|{ph}|{st}"] = _positions(int(reader.prompt_len), ph, st, h.shape[1])
        if forced and cfg.is_moe(point.layer):
            out[f"topk|{ph}|{st}"] = _read(reader, Point(ph, st, point.layer, "mlp.gate.topk_idx")).astype(np.int32)
    out["ref"] = _read(reader, point)
    return out


def encode_arrays(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """npz-storable arrays and their dtype notes: bf16 (not a numpy dtype) stored as its uint16 bits."""
    stored, notes = {}, {}
    for k, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.name == "bfloat16":
            stored[k], notes[k] = a.view(np.uint16), {"dtype": "bfloat16", "stored_as": "uint16 bits"}
        else:
            stored[k], notes[k] = a, {"dtype": a.dtype.name, "stored_as": "as is"}
    return stored, notes


def point_rule(report: dict, cfg_dtype: str, mode: str, point: Point, dump_dtype: str,
               semantics: dict | None = None, base=None) -> dict:
    """The tolerance rule of the point in the repro's mode: the default table (or `base`: a family's rules) with the
    report's recorded `tolerances` (file, overrides) merged over it, resolved for the dump's `semantics`, looked up as
    the judge does."""
    from parity.numerics.tolerances import default_rules, load_rules, parse_overrides

    rules = default_rules() if base is None else base
    tol = report.get("tolerances") or {}  # {"custom": true} (run_replay given a rules object): the defaults
    if tol.get("file"):
        rules = rules.merged(load_rules(tol["file"]))
    if tol.get("overrides"):
        rules = rules.merged(parse_overrides(tol["overrides"], source="--parity-tol"))
    return rules.for_semantics(semantics).rule_for(point.site, mode, dump_dtype, cfg_dtype).to_dict()


# ------------------------------------------------------------------------------------------ report.json keys
def run_context(reader, ckpt: str | Path | None, tol_file: str | None, tol_overrides, report_dir) -> dict:
    """Top-level report.json keys a reproducer needs beside `dump`, `target`, `mode`: `checkpoint` (the directory
    the replay used, absolute; None if it cannot be found), `dump_file` (the dump, absolute: `dump` is the path as
    given, relative to the run's directory), `tolerances` (`file`, `overrides`: the rules merged over
    the defaults) and `report_dir` (where the report is written; None when the caller writes it)."""
    from parity.replay.session import find_checkpoint

    try:
        ck: str | None = str(Path(find_checkpoint(reader.fingerprint, ckpt)).resolve())
    except ParityError:
        ck = None
    return {"checkpoint": ck, "dump_file": str(Path(reader.path).resolve()),
            "tolerances": {"file": str(Path(tol_file).resolve()) if tol_file else None,
                           "overrides": list(tol_overrides or [])},
            "report_dir": None if report_dir is None else str(report_dir)}


# ------------------------------------------------------------------------------------------ commands
def pytest_command(report: dict, point: Point | None = None) -> str:
    """`pytest parity ... -k '<layer> and <site>]'` selecting exactly the test of `point` (default: the first
    divergence) on the report's dump, target, checkpoint, mode, semantics and tolerances. The trailing `]` ends the
    test id (`test_point[tiny-bf16/layer_3/attention.core]`), so `attention` does not also select
    `attention.o_proj`, nor `attention.dense` select `attention.dense:in`."""
    if point is None:
        fd = report["first_divergence"]
        point = Point(fd["phase"], fd.get("step", 0), fd.get("layer"), fd["site"])
    q = shlex.quote
    env = [f"{k}={q(v)}" for k, v in (report.get("target_environment") or {}).items() if v is not None]
    parts = env + ["pytest parity", f"--parity-dump {q(str(report['dump']))}", f"--parity-target {q(str(report['target']))}"]
    if report.get("checkpoint"):
        parts.append(f"--parity-ckpt {q(str(report['checkpoint']))}")
    if report.get("mode", "layer") != "layer":
        parts.append(f"--parity-mode {q(report['mode'])}")
    if (report.get("semantics") or {}).get("replayed_with") == "intended":
        parts.append("--parity-semantics intended")
    policy = ((report.get("replay_env") or {}).get("matmul_precision") or {})  # issue 31: a chosen precision
    if policy.get("source") == "--parity-matmul-precision":
        parts.append(f"--parity-matmul-precision {q(policy['policy'])}")
    tol = report.get("tolerances") or {}
    if tol.get("file"):
        parts.append(f"--parity-tolerances {q(tol['file'])}")
    parts += [f"--parity-tol {q(t)}" for t in tol.get("overrides") or ()]
    if report.get("family", "ling3") != "ling3":  # one test per layer (`test_kimi_layer[<dump>/layer_3]`) and one
        expr = f"layer_{point.layer}]" if point.layer is not None else "/model]"  # for the model-level sites
    elif point.layer is not None:
        expr = f"layer_{point.layer} and {point.site}]"
    else:  # model-level (`.../model/logits]`) or an MTP layer's point (`.../MTP0/enorm]`: its site holds the unit)
        expr = f"{point.site}]" if mtp_site(point.site) else f"model/{point.site}]"
    parts.append(f"-k {q(expr)}")
    return " ".join(parts)


def repro_commands(report: dict) -> list[str]:
    """Terminal summary lines under a first divergence: the pytest command that reproduces it and, where its source
    is a per-layer point, the repro-bundle command (no line for a passing report)."""
    fd = report.get("first_divergence")
    if not fd:
        return []
    out = [f"  reproduce: {pytest_command(report)}"]
    src = fd.get("source") or fd
    if src.get("layer") is not None and (report.get("family", "ling3") == "ling3" or src.get("phase") != "backward"):
        # the bundle reproduces a per-layer point (its default point is the source; a Kimi one a forward point)
        where = report.get("report_dir") or "<report dir>"
        out.append(f"  repro bundle: python tools/repro.py {shlex.quote(str(where))}")
    return out


# ------------------------------------------------------------------------------------------ the bundle
def make_bundle(report: dict, out_dir: str | Path, *, point: str | None = None, target: str | None = None,
                mode: str = "auto", dump: str | None = None, ckpt: str | None = None,
                report_path: str | None = None) -> Path:
    """Write the repro bundle of `point` (default: the first divergence's source) into `out_dir`; returns it.
    `target`, `dump`, `ckpt` override the report's; `mode` is auto | isolated | layer."""
    from parity.dumpfile import DumpReader
    from parity.replay.session import check_checkpoint, find_checkpoint
    from parity.model.semantics import reference_options
    from parity.numerics.tolerances import rule_semantics
    from parity.targets import resolve

    pt = choose_point(report, point)
    spec = target or target_spec(report)
    cls = resolve(spec)
    dump_path = Path(dump or report.get("dump_file") or report.get("dump") or "")
    if not dump_path.is_file():
        key = "--dump" if dump else "dump_file" if report.get("dump_file") else "dump"
        raise ReproError(f"report.json: {key} {str(dump_path)!r} is not a file here; pass --dump PATH")
    with DumpReader(dump_path) as reader:
        cfg = reader.config
        _site(cfg, pt)
        ckpt_dir = find_checkpoint(reader.fingerprint, ckpt or report.get("checkpoint"))
        ck = check_checkpoint(reader, ckpt_dir, explicit=bool(ckpt or report.get("checkpoint")))
        chosen = repro_mode(cls.capabilities, cfg, pt) if mode == "auto" else mode
        if chosen == "isolated" and "isolated" not in cls.capabilities:
            raise ReproError(f"--mode isolated: target {spec!r} lacks capability 'isolated'; use --mode layer")
        if chosen == "isolated" and _site(cfg, pt).alias:
            raise ReproError(f"--mode isolated: {pt.site} has no computation of its own ({_site(cfg, pt).alias}); "
                             "use --mode layer")
        arrays = (isolated_arrays(reader, cfg, pt) if chosen == "isolated"
                  else layer_arrays(reader, cfg, pt, forced=report.get("mode") == "forced"))
        compute = reader.meta.get("compute_dtype", "bfloat16")
        intended = (report.get("semantics") or {}).get("replayed_with") == "intended"
        meta = {
            "kind": BUNDLE_KIND, "version": BUNDLE_VERSION, "point": pt.key(), "phase": pt.phase, "step": pt.step,
            "layer": pt.layer, "site": pt.site, "mode": chosen, "target": spec,
            "semantic_options": reference_options(reader.semantics, intended=intended),
            "dtype": compute, "config": json.loads(reader.meta["config_json"]),
            "rule": point_rule(report, compute, chosen, pt, reader.dtype(pt),
                               rule_semantics(reader.semantics, reader.config.hidden_size)),
            "forced_routing": chosen == "layer" and report.get("mode") == "forced",
            "report": report_path, "dump": str(dump_path), "checkpoint": str(ckpt_dir),
            "report_mode": report.get("mode"), "report_target": report.get("target"),
            "pytest_command": pytest_command(report, pt),
            "environment": bundle_environment(report, cls),
        }
        weights = ck.hf_tensors(pt.layer)
    return write_bundle(Path(out_dir), meta, arrays, weights)


def bundle_environment(report: dict, cls) -> dict[str, str]:
    """The environment a bundle's script sets before building the target: the values the report recorded
    (`target_environment`), else the ones the target class declares as set here; unset variables are left out."""
    from parity.targets.base import target_environment

    env = report.get("target_environment") or target_environment(cls)
    return {k: v for k, v in env.items() if v is not None}


def write_bundle(out: Path, meta: dict, arrays: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                 script: Path | None = None, readme=None) -> Path:
    """inputs.npz, weights.safetensors, bundle.json, repro.py (`script`, default Ling3's) and README.txt
    (`readme(meta)`, default `readme_text`) in `out`."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    stored, notes = encode_arrays(arrays)
    np.savez_compressed(out / "inputs.npz", **stored)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out / "weights.safetensors"))
    meta = dict(meta, arrays=notes, weights=sorted(weights))
    (out / "bundle.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    shutil.copyfile(script or SCRIPT, out / "repro.py")
    (out / "README.txt").write_text((readme or readme_text)(meta))
    return out


def readme_text(meta: dict) -> str:
    how = ("the site computed alone by the target's `submodule` from its dumped inputs" if meta["mode"] == "isolated"
           else "the whole layer fed the dumped layer input of each step up to the point's (target `layer_forward`)")
    lines = [
        f"ling3-parity reproducer of {meta['point']} (target {meta['target']}, {meta['mode']} repro: {how}).",
        "",
        "Run:   python repro.py                 # exit 1 and one MISMATCH line when it reproduces, 0 when it matches",
        "       python repro.py --target reference   # the same inputs against the suite's reference target",
        "       (needs the ling3-parity package and the target's module importable; not the dump or checkpoint)",
        "",
        f"Failure found by:  {meta['pytest_command']}",
        f"Report:            {meta.get('report')} (mode {meta.get('report_mode')}, target {meta.get('report_target')})",
        f"Dump / checkpoint: {meta['dump']} / {meta['checkpoint']}",
        f"Tolerance rule:    {meta['rule']}",
        f"Environment:       {_env_text(meta.get('environment'))}",
        "",
        "Inside:",
        "  inputs.npz          dumped inputs of the point and its dumped reference output `ref`; bf16 arrays stored as",
        "                      uint16 bits (bundle.json `arrays`: dtype and stored_as per array)",
        f"  weights.safetensors every model.layers.{meta['layer']}.* tensor under its HF name, checkpoint dtype",
        "  bundle.json         point, mode, target, semantic options, compute dtype, config, tolerance rule,",
        "                      environment (set by repro.py before it builds the target)",
        "  repro.py            builds the target, runs the one sub-module / layer, compares (parity.numerics.compare)",
    ]
    return "\n".join(lines) + "\n"


def _env_text(env: dict | None) -> str:
    if not env:
        return "none declared by the target"
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " (repro.py sets these itself)"


def verdict_line(where: str, v, matched: bool, note: str = "") -> str:
    """The one line a bundle's script prints (`repro_script.py`, `kimi_repro_script.py`): MATCH with the greatest
    ULP and rel-L2, or MISMATCH with how many elements are outside the rule and the worst one."""
    if matched:
        return f"MATCH {where}{note}: max {v.max_ulp} ULP, rel-L2 {v.rel_l2} ({v.n} elements, {v.dtype})"
    bad = v.n_over if v.n_over else v.n_hard or v.n_bound or v.n_tol_fail or v.nan_inf_mismatches
    return (f"MISMATCH {where}: {bad} of {v.n} elements outside the rule, max {v.max_ulp} ULP, worst at index "
            f"{v.worst_index} (ref {v.worst_ref!r}, test {v.worst_test!r}), rel-L2 {v.rel_l2}")

