"""The calibration corpus walk: random checkpoints, twin dumps, replays by the reference target, and what each replay
measures — the one walk behind every derived quantity of parity.calibration (tolerance rules, safety bounds,
exactness rates, norm-scale noise).

A corpus is a list of `Run`s (one dump each). A run measures
  - `noise_modes`: per-point noise of the JAX reference against the twin's dump in those replay modes
    (`measure_replay`, statistic `parity.calibration.noise.point_noise`) -> `Measurement.points` / `.routing`;
  - `native`: the twin against transformers' built-in bailing_hybrid, dump to dump (`twin_vs_native`);
  - `exactness`: an isolated replay counting the rows that are not bit-identical, and per RMSNorm point the row-scale
    noise its rounding check needs (`replay_rows`) -> `Measurement.rows`.
Runs of one checkpoint and prompt length in both bf16 and fp32 (noise runs) are also compared with each other
(`twin_fp32_vs_bf16`). A run with `kernels = "fla"` is dumped with fla's real Triton kernels (`--no-cpu-kernels`) in
a separate Python that has triton (`kernel_python`; under Triton's interpreter, TRITON_INTERPRET=1, where there is no
CUDA device), and replayed here like any other: that is the real-kernel corpus (KernelSpec), whose bf16 dumps record
`kda_chunk_precision = bfloat16` (the chunk kernel's bf16 intermediates) and are replayed following it.
A run with `grads` is dumped with the backward phase (`tools/dump_hf.py --grads`: DumpOptions.grads) and replayed in
`layer` mode, where the reference's VJP is teacher-forced on each layer's dumped input and output cotangent
(parity.replay.strategies.observe_backward_layer / observe_backward_model, the replay's own path); each backward point
gives one gradient measurement (`measure_grad_replay`, statistic `parity.calibration.noise.grad_noise`) ->
`Measurement.points`: that is the gradient corpus (GradSpec), behind the gradient rules (parity.calibration.gradients).
`noise_runs`, `exactness_runs`, `kernel_runs` and `grad_runs` give the four recorded corpora (CorpusSpec, ExactnessSpec,
KernelSpec, GradSpec);
they keep their own dump recipes (prompt lengths, decode steps, dump seed), so the walk puts them in separate folders
and the measurements of each stay what the recorded commands produced.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from parity.calibration.noise import grad_noise, point_noise
from parity.numerics.compare import compare, comparison_grid
from parity.numerics.tolerances import ToleranceRule
from parity.model.points import site_class

Log = Callable[[str], None]
NOCLAMP = "tiny-flash-noclamp"  # tiny-flash without SwiGLU clamp: the built-in bailing_hybrid has none
EXACTNESS_DIR = "exactness"  # sub-folder of the workdir holding the exactness corpus
KERNELS_DIR = "kernels"  # sub-folder of the workdir holding the real-kernel corpus
GRADS_DIR = "grads"  # sub-folder of the workdir holding the gradient corpus
# the Python that dumps real-kernel runs: one with triton (the main environment has none, .ci/run's triton step)
KERNEL_PYTHON_ENV = "LING3_TRITON_PYTHON"
ROW_COUNT_RULE = ToleranceRule(floor_ulps=0, max_ulps=0, allowed_fraction=1.0, hard_ulps=None)  # only the row counts


@dataclass(frozen=True)
class CorpusSpec:
    """The noise corpus (tolerance rules, safety bounds)."""

    presets: tuple[str, ...] = ("tiny", "tiny-flash")
    seeds: tuple[int, ...] = (1, 2)
    prompt_lens: tuple[int, ...] = (40, 160)  # ≤ 64: recurrent KDA path of the official kernel; > 64: chunked
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    decode_steps: int = 2
    modes: tuple[str, ...] = ("layer", "free", "isolated")
    native_seeds: tuple[int, ...] = (1,)  # twin vs built-in on an unclamped copy of tiny-flash


@dataclass(frozen=True)
class ExactnessSpec:
    """The exactness corpus (isolated-mode exactness rates, norm-scale noise): bf16 runs, seeds alternating the
    presets as the no-false-alarm sweep does (odd: tiny, q-LoRA; even: tiny-flash, clamp)."""

    seeds: tuple[int, ...] = (1, 2, 3, 4)
    prompt_lens: tuple[int, ...] = (24, 100)
    decode_steps: int = 2


@dataclass(frozen=True)
class KernelSpec:
    """The real-kernel corpus: checkpoints dumped with fla's real Triton kernels (bf16: the chunk kernel's bf16
    intermediates, recorded as the `kda_chunk_precision` fork), replayed by the reference in `modes`; its isolated
    bf16 replays also count exactness rows. Empty `seeds`: no real-kernel corpus. `runtimes`: whose modeling file
    runs the dump — "twin" (the suite's, make_checkpoint's) and/or "official" (the official
    modeling_bailing_moe_v3.py installed into the checkpoint, parity.torch_ref.official; its runs are refused in one
    line where the file is absent)."""

    presets: tuple[str, ...] = ("tiny", "tiny-flash")
    seeds: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = (40, 160)  # ≤ 64: fused_recurrent_kda; > 64: chunk_kda (bf16 intermediates)
    dtypes: tuple[str, ...] = ("bfloat16",)
    decode_steps: int = 4
    modes: tuple[str, ...] = ("layer", "free", "isolated")
    runtimes: tuple[str, ...] = ("twin",)


KERNEL_RUNTIMES = ("twin", "official")


@dataclass(frozen=True)
class GradSpec:
    """The gradient corpus (the gradient rules, parity.calibration.gradients): fresh checkpoints (seeds other than the
    bundled 0 and disjoint from the no-false-alarm sweep's 11-20) dumped with the backward phase (`--grads`), prefill
    only (there is no backward of decode steps), replayed by the reference in `layer` mode (teacher-forced VJP)."""

    presets: tuple[str, ...] = ("tiny", "tiny-flash")
    seeds: tuple[int, ...] = (1, 2)
    prompt_lens: tuple[int, ...] = (40, 160)  # ≤ 64: recurrent KDA backward of the official kernel; > 64: chunked
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    runtimes: tuple[str, ...] = ("twin",)  # whose modeling file is dumped: the twin, the official file (KERNEL_RUNTIMES)
    kernels: str = ""  # "" = this process (the CPU stand-ins); "fla" = fla's real kernels (kernel_python: Triton)


@dataclass(frozen=True)
class Run:
    """One corpus dump and what is measured on it (module docstring)."""

    name: str  # checkpoint name: a preset or NOCLAMP
    seed: int
    prompt_len: int
    dtype: str
    decode_steps: int
    folder: str = ""  # sub-folder of the workdir ("" or EXACTNESS_DIR)
    noise_modes: tuple[str, ...] = ()
    native: bool = False
    exactness: bool = False
    dump_seed: int = 0  # DumpOptions.seed: the exactness corpus was recorded with the run's seed, the noise corpus 0
    causality_check: bool = False  # the exactness corpus was recorded with the dump's causality check on
    kernels: str = ""  # "" = in this process (the stand-ins where fla's kernels cannot run); "fla" = real kernels
    grads: bool = False  # dumped with the backward phase (--grads) and its gradients measured (the gradient corpus)
    runtime: str = "twin"  # whose modeling file the checkpoint holds: "twin" or "official" (KernelSpec.runtimes)

    @property
    def tag(self) -> str:
        return "fp32" if self.dtype == "float32" else "bf16"

    @property
    def label(self) -> str:
        """name/seed/prompt length, prefixed `fla:` for a real-kernel run (`fla-official:` for one of the official
        file) and `official:` for an official-file run on the CPU stand-ins (the gradient corpus)."""
        prefix = ("fla" + ("-official" if self.runtime == "official" else "") + ":") if self.kernels else \
            ("official:" if self.runtime == "official" else "")
        return f"{prefix}{self.name}/s{self.seed}/T{self.prompt_len}"

    @property
    def corpus_id(self) -> str:
        return f"{self.label}/{self.tag}"

    @property
    def ckpt_name(self) -> str:
        return f"{self.name}-s{self.seed}" + ("-official" if self.runtime == "official" else "")

    @property
    def dump_name(self) -> str:
        return f"{self.ckpt_name}-T{self.prompt_len}-{self.tag}.h5"


@dataclass
class Measurement:
    """Flat per-point measurements: noise points, routing counts, exactness rows, and the time of each step."""

    points: list[dict] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def preset_of(seed: int) -> str:
    """Preset of an exactness-corpus seed (ExactnessSpec)."""
    return "tiny" if seed % 2 else "tiny-flash"


def noise_runs(spec: CorpusSpec) -> list[Run]:
    """The noise corpus in walk order: checkpoint × prompt length × dtype; NOCLAMP runs also dump the built-in."""
    jobs = [(p, s) for p in spec.presets for s in spec.seeds] + [(NOCLAMP, s) for s in spec.native_seeds]
    return [Run(name, seed, T, dtype, spec.decode_steps, noise_modes=tuple(spec.modes), native=name == NOCLAMP)
            for name, seed in jobs for T in spec.prompt_lens for dtype in spec.dtypes]


def exactness_runs(spec: ExactnessSpec) -> list[Run]:
    """The exactness corpus in walk order: seed × prompt length, bf16, isolated replays."""
    return [Run(preset_of(seed), seed, T, "bfloat16", spec.decode_steps, folder=EXACTNESS_DIR, exactness=True,
                dump_seed=seed, causality_check=True) for seed in spec.seeds for T in spec.prompt_lens]


def kernel_runs(spec: KernelSpec) -> list[Run]:
    """The real-kernel corpus in walk order: runtime × checkpoint × prompt length × dtype, dumped with fla's real
    kernels."""
    bad = [r for r in spec.runtimes if r not in KERNEL_RUNTIMES]
    if bad:
        raise ValueError(f"real-kernel corpus: unknown runtime(s) {', '.join(bad)} (expected "
                         f"{' or '.join(KERNEL_RUNTIMES)})")
    return [Run(name, seed, T, dtype, spec.decode_steps, folder=KERNELS_DIR, noise_modes=tuple(spec.modes),
                exactness=dtype == "bfloat16" and "isolated" in spec.modes, kernels="fla", runtime=rt)
            for rt in spec.runtimes for name in spec.presets for seed in spec.seeds for T in spec.prompt_lens
            for dtype in spec.dtypes]


def kernel_specs(meta: dict) -> list[KernelSpec]:
    """The KernelSpecs a stored real-kernel corpus was walked with (`kernel_corpus.json`): its `corpus`, and the
    `corpus` of each walk merged into it since (`merged`: e.g. the official runtime's runs added to the twin ones)."""
    def spec(d: dict) -> KernelSpec:
        return KernelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    return [spec(meta["corpus"])] + [spec(m["corpus"]) for m in meta.get("merged", [])]


def merge_kernel_corpus(stored: tuple[Measurement, dict] | None, new: Measurement, new_meta: dict) \
        -> tuple[Measurement, dict]:
    """A real-kernel walk of some runtimes merged into the stored corpus. The stored corpus is made of walks (its
    own metadata and each entry of `merged`), each of some runtimes: a stored walk whose runtimes the new one covers
    is replaced (its points, routing, rows and step records), the others are kept. The new walk's metadata becomes
    the corpus' own where the own walk was replaced (the kept walks stay in `merged`), else it is appended to
    `merged`. A stored walk only partly covered cannot be split (one provenance per walk): ValueError."""
    walked = set(new_meta["corpus"].get("runtimes", ["twin"]))
    if stored is None:
        return new, new_meta
    old, meta = stored
    parts = [{k: v for k, v in meta.items() if k not in ("merged", "runs")}] + list(meta.get("merged", []))
    for m in parts:
        rts = set(m["corpus"].get("runtimes", ["twin"]))
        if rts & walked and not rts <= walked:
            raise ValueError(f"real-kernel corpus: a walk of runtimes {', '.join(sorted(walked))} would replace "
                             f"part of a stored walk of {', '.join(sorted(rts))} ({m['command']}); walk those "
                             f"runtimes together")
    kept = [m for m in parts if not set(m["corpus"].get("runtimes", ["twin"])) <= walked]

    def keep(text: str) -> bool:  # a corpus id, row point or step record ("dump ... NAME.h5", "replay MODE ID")
        official = text.startswith("fla-official:") or " fla-official:" in text or "-official-T" in text
        return ("official" if official else "twin") not in walked
    merged = Measurement(points=[p for p in old.points if keep(p["corpus"])] + new.points,
                         routing=[r for r in old.routing if keep(r["corpus"])] + new.routing,
                         runs=[r for r in old.runs if keep(r["what"])] + new.runs,
                         rows=[r for r in old.rows if keep(r["point"])] + new.rows)
    if kept and kept[0] is parts[0]:  # the corpus' own walk stays; the new one is merged into it
        return merged, {**parts[0], "merged": kept[1:] + [new_meta]}
    return merged, ({**new_meta, "merged": kept} if kept else new_meta)


def grad_runs(spec: GradSpec) -> list[Run]:
    """The gradient corpus in walk order: runtime × checkpoint × prompt length × dtype, `--grads` dumps without decode
    steps."""
    bad = [r for r in spec.runtimes if r not in KERNEL_RUNTIMES]
    if bad or spec.kernels not in ("", "fla"):
        raise ValueError(f"gradient corpus: runtimes {', '.join(spec.runtimes)}, kernels {spec.kernels!r}: expected "
                         f"runtimes among {', '.join(KERNEL_RUNTIMES)} and kernels '' or 'fla'")
    return [Run(name, seed, T, dtype, 0, folder=GRADS_DIR, dump_seed=seed, grads=True, kernels=spec.kernels, runtime=rt)
            for rt in spec.runtimes for name in spec.presets for seed in spec.seeds for T in spec.prompt_lens
            for dtype in spec.dtypes]


def grad_specs(meta: dict) -> list[GradSpec]:
    """The GradSpecs a stored gradient corpus was walked with (`grad_corpus.json`): its `corpus` and each merged
    walk's (`merged`)."""
    def spec(d: dict) -> GradSpec:
        return GradSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    return [spec(meta["corpus"])] + [spec(m["corpus"]) for m in meta.get("merged", [])]


def merge_grad_corpus(stored: tuple[list[dict], dict] | None, points: list[dict], meta: dict) \
        -> tuple[list[dict], dict]:
    """A gradient walk added to the stored gradient corpus (`--merge`): its points appended, its metadata (command,
    date, machine, spec, step times) appended to `merged`. A run already stored is refused (ValueError naming it):
    nothing measured is replaced silently — walk other seeds, runtimes or kernels, or walk the corpus anew."""
    if stored is None:
        return points, meta
    old, ometa = stored
    have = {p["corpus"] for p in old}
    dup = sorted({p["corpus"] for p in points} & have)
    if dup:
        raise ValueError(f"gradient corpus --merge: {len(dup)} run(s) already stored, e.g. {dup[0]} "
                         f"(parity/numerics/calibration/grad_points.json.gz); walk runs not yet in the corpus")
    return old + points, {**ometa, "merged": list(ometa.get("merged", [])) + [meta]}


def _config_of(name: str) -> Any:
    """make_checkpoint's preset argument: the preset name, or for NOCLAMP tiny-flash with both SwiGLU limit lists
    null (the built-in bailing_hybrid has no clamp)."""
    if name != NOCLAMP:
        return name
    from parity.torch_ref.ckpt import resolve_config

    d = dict(resolve_config("tiny-flash"))
    d["expert_swiglu_limit_list"] = None
    d["share_expert_swiglu_limit_list"] = None
    return d


# ------------------------------------------------------------------------------------------------ measuring one dump
def measure_replay(dump_path: Path, ckpt_dir: Path, mode: str, corpus_id: str, out: Measurement,
                   target: Any = None) -> dict:
    """Replay one dump (reference target unless given), record per-point noise and routing outcomes into `out`, and
    return the report. The noise is measured on exactly the arrays the judge compared (`PointRecord.observation`:
    for a benign routing flip, the run forced to the reference's experts)."""
    from parity.numerics.tolerances import default_rules
    from parity.replay import Session, replay_records
    from parity.reporting.report import build_report, order_key

    records = []
    with Session.open(dump_path, ckpt_dir, target=target, mode=mode, rules=default_rules()) as ses:
        compute = ses.dtype
        judged = sorted(((r.to_json(), r) for r in replay_records(ses)), key=lambda jr: order_key(ses.config, jr[0]))
        for js, rec in judged:  # in report order, so ties in the aggregation resolve as before
            records.append(js)
            p = rec.point
            base = {"corpus": corpus_id, "mode": mode, "phase": p.phase, "step": p.step, "layer": p.layer,
                    "site": p.site, "compute": compute}
            if p.site == "mlp.gate.topk_idx":
                out.routing.append({**base, "status": rec.status.value, "tokens": rec.stats.get("tokens"),
                                    "flipped": rec.stats.get("flipped", 0),
                                    "benign_flips": rec.stats.get("benign_flips", 0)})
                continue
            obs = rec.observation
            if rec.status.value not in ("pass", "fail") or obs is None or obs.ref is None or obs.test is None:
                continue
            tdtype = ses.dump.dtype(p)
            if tdtype not in ("bfloat16", "float32", "float16") or np.shape(obs.test) != obs.ref.shape:
                continue
            # measured in the precision the tensor was computed in (comparison_grid, DESIGN §5)
            out.points.append({**base, "class": site_class(p.site), "dtype": tdtype,
                               "forced_routing": rec.forced_routing, "status_old_rules": rec.status.value,
                               "replay_max_ulp_raw": rec.stats.get("max_ulp_raw"),
                               **point_noise(obs.ref, obs.test, comparison_grid(tdtype))})
        return build_report(ses.config, records, dump=str(dump_path), target=getattr(ses.target, "name", "?"),
                            mode=mode)


FED_GRAD_SITES = ("output", "embed")  # backward points the replay feeds from the dump (compared with themselves)


def measure_grad_replay(dump_path: Path, ckpt_dir: Path, corpus_id: str, out: Measurement) -> dict:
    """Replay one `--grads` dump in `layer` mode with the reference target and record one gradient measurement per
    backward point into `out` (`grad_noise` on the arrays the judge compared, on the grid it compares them: the
    tensor's own in fp32 runs, bf16 for every gradient of a bf16 run — the gradient rules' compare_dtype); returns
    the report. Points the replay feeds from the dump (FED_GRAD_SITES) are left out: they are the dump's own."""
    from parity.numerics.compare import comparison_grid
    from parity.numerics.tolerances import default_rules
    from parity.replay import Session, replay_records
    from parity.reporting.report import build_report

    records = []
    with Session.open(dump_path, ckpt_dir, mode="layer", rules=default_rules()) as ses:
        compute = ses.dtype
        for rec in replay_records(ses):
            records.append(rec.to_json())
            p, obs = rec.point, rec.observation
            if p.phase != "backward" or p.site in FED_GRAD_SITES:
                continue
            if rec.status.value not in ("pass", "fail") or obs is None or obs.ref is None or obs.test is None:
                continue
            ref, test = np.asarray(obs.ref), np.asarray(obs.test)
            tdtype = ref.dtype.name
            if tdtype not in ("bfloat16", "float32") or test.shape != ref.shape:
                continue
            grid = "bfloat16" if compute == "bfloat16" else comparison_grid(tdtype)
            out.points.append({"corpus": corpus_id, "mode": "layer", "phase": p.phase, "step": p.step,
                               "layer": p.layer, "site": p.site, "compute": compute, "dtype": tdtype,
                               "status_old_rules": rec.status.value, **grad_noise(ref, test, grid)})
        return build_report(ses.config, records, dump=str(dump_path), target=getattr(ses.target, "name", "?"),
                            mode="layer")


def measure_dump_pair(ref_path: Path, test_path: Path, kind: str, corpus_id: str, out: Measurement,
                      grid: str | None = None) -> None:
    """Compare two dumps of the same checkpoint and ids directly, point by point (both are free runs)."""
    from parity.dumpfile import DumpReader

    a, b = DumpReader(ref_path), DumpReader(test_path)
    try:
        compute = a.meta.get("compute_dtype", "bfloat16")
        for pt in a.points():
            if not b.has(pt):
                continue
            base = {"corpus": corpus_id, "mode": kind, "phase": pt.phase, "step": pt.step, "layer": pt.layer,
                    "site": pt.site, "compute": compute}
            ra, rb = a.read(pt), b.read(pt)
            if pt.site == "mlp.gate.topk_idx":
                same = (np.sort(ra, -1) == np.sort(rb.reshape(ra.shape), -1)).all(-1)
                out.routing.append({**base, "status": "pass" if same.all() else "flipped", "tokens": int(same.size),
                                    "flipped": int((~same).sum()), "benign_flips": None})
                continue
            tdtype = a.attrs(pt).get("dtype", str(ra.dtype))
            if tdtype not in ("bfloat16", "float32", "float16") or ra.size != rb.size or "cache" in pt.site:
                continue
            out.points.append({**base, "class": site_class(pt.site), "dtype": tdtype,
                               **point_noise(ra, rb.reshape(ra.shape), grid or comparison_grid(tdtype))})
    finally:
        a.close()
        b.close()


def replay_rows(dump: Path, ckpt: Path, label: str) -> list[dict]:
    """One record per bf16 point of an isolated replay of `dump` by the reference target: label, site, class, rows,
    inexact rows; RMSNorm points also the row-scale noise their rounding check needs (`scale_need`)."""
    from parity.numerics import rounding
    from parity.replay.session import Session
    from parity.replay.strategies import observe

    out = []
    with Session.open(dump, ckpt, mode="isolated") as s:
        for layer in [None] + list(s.layers()):
            for ob in observe(s, layer):
                if ob.ref is None or ob.test is None or ob.skip or np.asarray(ob.ref).dtype.name != "bfloat16":
                    continue
                ref, test = np.asarray(ob.ref), np.asarray(ob.test)
                if ref.shape != test.shape or not ref.size:
                    continue
                v = compare(ref, test, ROW_COUNT_RULE)  # counts the rows as the exactness test will
                rec = {"point": f"{label}:{ob.point.key()}", "site": ob.point.site,
                       "class": site_class(ob.point.site), "rows": v.rows, "inexact": v.inexact_rows}
                if ob.rounding is not None:  # what the RMSNorm rounding check must allow for dump and target alike
                    c = rounding.needed_scale_noise(ob.rounding.x, ob.rounding.w, ob.rounding.eps, ref, test)
                    rec["scale_need"] = c if math.isfinite(c) else None
                out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------ the walk
def dump_run(ckpt: str, path: str, run_fields: str, runtime: str = "remote") -> None:
    """Dump one run (its `Run` fields as JSON) in this process; `kernels = "fla"` asks for fla's real kernels (no
    stand-ins). `_dump` calls it in `kernel_python` for real-kernel runs."""
    import json

    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    run = Run(**json.loads(run_fields))
    ids = builtin_ids(512, run.prompt_len, seed=run.seed)  # 512: the tiny presets' vocabulary
    dump_checkpoint(Path(ckpt), Path(path), ids,
                    DumpOptions(runtime=runtime, dtype=run.dtype, decode_steps=run.decode_steps, progress=False,
                                force=True, seed=run.dump_seed, causality_check=run.causality_check,
                                cpu_kernels=False if run.kernels == "fla" else None, grads=run.grads,
                                trust_remote_code=run.runtime == "official"))


def kernel_python() -> str:
    """The Python that dumps real-kernel runs: $LING3_TRITON_PYTHON, else .ci/run's .venv-triton (or
    $LING3_TRITON_VENV) of the repository."""
    import os

    if os.environ.get(KERNEL_PYTHON_ENV):
        return os.environ[KERNEL_PYTHON_ENV]
    venv = Path(os.environ.get("LING3_TRITON_VENV", Path(__file__).resolve().parents[2] / ".venv-triton"))
    return str(venv / "bin" / "python")


def _dump_with_real_kernels(ckpt: Path, path: Path, run: Run) -> None:
    import dataclasses
    import json
    import os
    import subprocess

    py = kernel_python()
    if not Path(py).exists():
        raise ValueError(f"real-kernel run {run.corpus_id}: no Python with triton at {py} (set ${KERNEL_PYTHON_ENV} "
                         f"or make .venv-triton as .ci/run does)")
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")  # no effect where a CUDA device runs the kernels
    code = "import sys; from parity.calibration.corpus import dump_run; dump_run(*sys.argv[1:])"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([py, "-c", code, str(ckpt), str(path), json.dumps(dataclasses.asdict(run))], cwd=root,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"real-kernel dump {path.name} failed ({py}, exit {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}")
    from parity.dumpfile import DumpReader

    r = DumpReader(path)
    try:
        paths = r.kernels.get("kda_paths", {})
        chunk = (r.semantics or {}).get("kda_chunk_precision")
    finally:
        r.close()
    if not paths or set(paths.values()) != {"fla"}:  # observed at run time (parity.torch_ref.kernels)
        raise ValueError(f"real-kernel dump {path.name}: not every KDA call path ran fla's kernels: {paths}")
    if run.dtype == "bfloat16" and chunk != "bfloat16":  # the condition its calibration sections are keyed on
        raise ValueError(f"real-kernel dump {path.name}: semantics kda_chunk_precision {chunk!r}, expected "
                         f"'bfloat16' (fla's chunk kernel in a bf16 run)")


def _dump(ckpt: Path, path: Path, run: Run, runtime: str, out: Measurement, log: Log) -> None:
    import dataclasses
    import json

    t0 = time.perf_counter()
    if run.kernels == "fla":
        _dump_with_real_kernels(ckpt, path, run)
    else:
        dump_run(str(ckpt), str(path), json.dumps(dataclasses.asdict(run)), runtime)
    if run.noise_modes or run.grads:  # the exactness corpus never recorded its steps' times
        out.runs.append({"what": f"dump {runtime}{' fla' if run.kernels else ''} {path.name}", "seconds": round(time.perf_counter() - t0, 1)})
    log(f"dumped {path.name} ({runtime}) in {time.perf_counter() - t0:.1f}s")


def measure_run(run: Run, ckpt: Path, folder: Path, out: Measurement, log: Log = print) -> Path:
    """Dump one run and take its measurements into `out`; returns the dump's path."""
    path = folder / run.dump_name
    _dump(ckpt, path, run, "remote", out, log)
    if run.grads:
        t0 = time.perf_counter()
        n0 = len(out.points)
        rep = measure_grad_replay(path, ckpt, run.corpus_id, out)
        out.runs.append({"what": f"replay layer {run.corpus_id} (backward)", "seconds": round(time.perf_counter() - t0, 1),
                         "counts_old_rules": rep["counts"]})
        log(f"replayed {run.corpus_id} layer in {time.perf_counter() - t0:.1f}s: {len(out.points) - n0} gradient "
            f"points, {rep['counts']} (old rules)")
    for mode in run.noise_modes:
        t0 = time.perf_counter()
        rep = measure_replay(path, ckpt, mode, run.corpus_id, out)
        out.runs.append({"what": f"replay {mode} {run.corpus_id}", "seconds": round(time.perf_counter() - t0, 1),
                         "counts_old_rules": rep["counts"]})
        log(f"replayed {run.corpus_id} {mode} in {time.perf_counter() - t0:.1f}s: {rep['counts']} (old rules)")
    if run.native:
        npath = folder / run.dump_name.replace(".h5", "-native.h5")
        _dump(ckpt, npath, run, "native", out, log)
        measure_dump_pair(path, npath, "twin_vs_native", run.corpus_id, out)
    if run.exactness:
        recs = replay_rows(path, ckpt, run.label)
        log(f"{run.name} seed {run.seed} T={run.prompt_len}: {len(recs)} points, "
            f"{sum(r['inexact'] for r in recs)} inexact rows of {sum(r['rows'] for r in recs)}")
        out.rows += recs
    return path


def walk(runs: Sequence[Run], workdir: Path, log: Log = print) -> Measurement:
    """Dump and measure every run in order (checkpoints made once per folder, name and seed); after the last run of a
    (checkpoint, prompt length) that has both a bf16 and an fp32 noise run, compare those two dumps."""
    from parity.torch_ref.ckpt import make_checkpoint

    out = Measurement()
    ckpts: dict[tuple[str, str], Path] = {}
    dumped: dict[tuple, dict[str, Path]] = {}
    for i, run in enumerate(runs):
        folder = Path(workdir) / run.folder
        folder.mkdir(parents=True, exist_ok=True)
        if (run.folder, run.ckpt_name) not in ckpts:
            ckpts[run.folder, run.ckpt_name] = make_checkpoint(folder / run.ckpt_name, _config_of(run.name),
                                                               seed=run.seed, force=True)
            if run.runtime == "official":  # the same weights, run by the official modeling file
                from parity.torch_ref import official

                official.install(ckpts[run.folder, run.ckpt_name])
        path = measure_run(run, ckpts[run.folder, run.ckpt_name], folder, out, log)
        key = (run.folder, run.name, run.seed, run.prompt_len)
        if run.noise_modes:
            dumped.setdefault(key, {})[run.dtype] = path
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        pair = dumped.get(key, {})
        if (nxt is None or (nxt.folder, nxt.name, nxt.seed, nxt.prompt_len) != key) and len(pair) > 1 \
                and {"float32", "bfloat16"} <= set(pair):
            measure_dump_pair(pair["float32"], pair["bfloat16"], "twin_fp32_vs_bf16",
                              f"{run.name}/s{run.seed}/T{run.prompt_len}", out, grid="bfloat16")
    return out


def remeasure(meas: Measurement, workdir: Path, modes: Sequence[str], log: Log = print) -> Measurement:
    """Replay the noise-corpus dumps kept in `workdir` (by `walk`) again in `modes` and replace those modes' points
    and routing records in `meas` — e.g. after a change to how a mode feeds a site, without rebuilding the corpus.
    Dumps are found by `Run`'s names: `<preset>-s<seed>-T<T>-<bf16|fp32>.h5`, checkpoint `<preset>-s<seed>/`."""
    import re

    workdir = Path(workdir)
    keep = [p for p in meas.points if p["mode"] not in modes]
    keep_r = [r for r in meas.routing if r["mode"] not in modes]
    out = Measurement(points=keep, routing=keep_r, runs=list(meas.runs), rows=list(meas.rows))
    pat = re.compile(r"^(?P<name>.+)-s(?P<seed>\d+)-T(?P<T>\d+)-(?P<tag>bf16|fp32)\.h5$")
    dumps = sorted(p for p in workdir.glob("*.h5") if pat.match(p.name))
    if not dumps:
        raise ValueError(f"{workdir}: no corpus dumps (<preset>-s<seed>-T<T>-<bf16|fp32>.h5) to re-measure")
    for path in dumps:
        m = pat.match(path.name)
        cid = f"{m['name']}/s{m['seed']}/T{m['T']}/{m['tag']}"
        ckpt = workdir / f"{m['name']}-s{m['seed']}"
        for mode in modes:
            t0 = time.perf_counter()
            rep = measure_replay(path, ckpt, mode, cid, out)
            out.runs.append({"what": f"re-measure {mode} {cid}", "seconds": round(time.perf_counter() - t0, 1),
                             "counts_old_rules": rep["counts"]})
            log(f"re-measured {cid} {mode} in {time.perf_counter() - t0:.1f}s: {rep['counts']} (old rules)")
    return out


__all__ = ["CorpusSpec", "EXACTNESS_DIR", "ExactnessSpec", "FED_GRAD_SITES", "GRADS_DIR", "GradSpec", "KERNELS_DIR",
           "KERNEL_RUNTIMES", "KernelSpec", "Measurement", "NOCLAMP", "kernel_specs", "merge_kernel_corpus",
           "ROW_COUNT_RULE", "Run", "dump_run", "exactness_runs", "grad_runs", "measure_grad_replay", "kernel_python", "kernel_runs", "measure_dump_pair", "measure_replay", "measure_run", "noise_runs", "preset_of",
           "remeasure", "replay_rows", "walk"]
