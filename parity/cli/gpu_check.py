"""The prepared GPU check (issue 24 item 6): one run on a machine with one NVIDIA GPU that tells what only a GPU can.

For the official tiny and tiny-flash checkpoints (`tools/make_ckpt.py --modeling official`), per precision (fp32 with
IEEE dots, fp32 with TF32 allowed, bf16 with torch's reduced-precision bf16 GEMM reductions off and on) and prompt
(24 tokens: fla's recurrent KDA kernel; 100: its chunked one):

    dump on CUDA with fla's real kernels -> replay with the reference JAX target on the GPU backend and on CPU
                                         -> compare point by point with the same dump made on CPU

The CPU dump is made under Triton's interpreter (`TRITON_INTERPRET=1 --no-cpu-kernels`, `--cpu-ref interp`) or with
the suite's stand-ins (`--cpu-ref stand-ins`); fp32 IEEE and fp32 TF32 share one CPU dump. Every step is a stage: a
subprocess (fresh interpreter, own environment, timed, its log kept) or an in-process comparison. A stage that fails
is recorded and every stage that does not need it still runs; a stage that does is recorded as skipped with the
reason. `--cpu-only` runs the same pipeline on CPU (stand-ins for the "device" dumps, the CPU replay backend only),
so the check itself is tested on machines without a GPU. Output: `OUT/gpu_check.json` and `OUT/gpu_check.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CKPTS = ("tiny", "tiny-flash")
# bf16: torch's reduced-precision bf16 GEMM reductions off (the dumper's default on CUDA); bf16-reduced: left on
# (`--allow-bf16-reduced-precision-reduction`, issue 31), so the check shows what they cost
PRECISIONS = ("fp32-ieee", "fp32-tf32", "bf16-reduced", "bf16")
PROMPTS = (24, 100)  # <= 64: fla's recurrent KDA kernel; > 64: its chunked kernel (bf16 intermediates)
DTYPE = {"fp32-ieee": "fp32", "fp32-tf32": "fp32", "bf16-reduced": "bf16", "bf16": "bf16"}
DEVICE_FLAGS = {"fp32-tf32": ("--allow-tf32",), "bf16-reduced": ("--allow-bf16-reduced-precision-reduction",)}
BUDGET_S = 480.0  # the "under 8 minutes on one GPU"
SCHEMA = "ling3-parity-gpu-check"


@dataclass(frozen=True)
class Case:
    """One CUDA dump: checkpoint x precision x prompt length."""

    ckpt: str
    precision: str
    prompt_len: int

    @property
    def name(self) -> str:
        return f"{self.ckpt}-{self.precision}-{self.prompt_len}"

    @property
    def grads(self) -> bool:
        """Dumped with the backward phase (`--grads`, issue 26: fla's backward kernels on the GPU): the > 64-token
        prompts (chunk_kda's backward), every precision (so cases sharing a CPU reference dump agree)."""
        return self.prompt_len > 64

    @property
    def cpu_name(self) -> str:
        """The CPU reference dump's name: fp32 IEEE and fp32 TF32 share it (TF32 does not exist on CPU)."""
        return f"{self.ckpt}-{DTYPE[self.precision]}-{self.prompt_len}"


@dataclass(frozen=True)
class Options:
    out: Path
    cpu_only: bool = False
    # stand-ins by default: the device's triton 3.6 interpreter lacks the five fixes fla's KDA kernels need (issue
    # 24: bf16 dots come out as garbage), so "interp" is for when the suite's own interpreter support covers it
    cpu_ref: str = "stand-ins"  # interp | stand-ins
    ckpts: tuple[str, ...] = CKPTS
    precisions: tuple[str, ...] = PRECISIONS
    prompts: tuple[int, ...] = PROMPTS
    decode_steps: int = 2
    budget_s: float = BUDGET_S
    jobs: int = 4
    python: str = sys.executable
    inject_failure: tuple[str, ...] = ()  # stage names whose command is replaced by a failing one (tests)

    @property
    def backends(self) -> tuple[str, ...]:
        return ("cpu",) if self.cpu_only else ("cuda", "cpu")


@dataclass(frozen=True)
class Stage:
    """A unit of work. `argv` set: a subprocess; else `call` runs in this process. `needs`: stages it reads from."""

    name: str
    needs: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    call: Callable[[], dict] | None = None


@dataclass
class StageResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float = 0.0
    rc: int | None = None
    note: str = ""
    log: str | None = None
    data: dict | None = None


def cases(opts: Options) -> list[Case]:
    # long prompts and bf16 first: the case the issue predicts a difference for runs before the budget can run out
    precisions = sorted(opts.precisions, key=PRECISIONS.index, reverse=True)  # bf16 first
    return [Case(c, p, t) for t in sorted(opts.prompts, reverse=True) for p in precisions for c in opts.ckpts]


def dump_path(opts: Options, name: str, where: str) -> Path:
    return opts.out / "dumps" / f"{name}-{where}.h5"


def dump_argv(opts: Options, ckpt: Path, out: Path, dtype: str, prompt_len: int, *, extra: tuple[str, ...]) -> tuple:
    return (opts.python, str(REPO / "tools" / "dump_hf.py"), str(ckpt), "--trust-remote-code", "--out", str(out),
            "--prompt-len", str(prompt_len), "--decode-steps", str(opts.decode_steps), "--dtype", dtype,
            "--no-progress", "--force", *extra)


def _grads(case: Case) -> tuple[str, ...]:
    return ("--grads",) if case.grads else ()


def device_dump_stage(opts: Options, case: Case) -> Stage:
    ckpt = opts.out / "ckpt" / case.ckpt
    if opts.cpu_only:  # the same pipeline without a GPU: the stand-ins on CPU
        extra, env = ("--device", "cpu", "--cpu-kernels"), {"TRITON_INTERPRET": None}
    else:
        extra = ("--device", "cuda", "--no-cpu-kernels") + DEVICE_FLAGS.get(case.precision, ())
        env = {"TRITON_INTERPRET": None}  # real kernels compiled for the GPU, never the interpreter
    argv = dump_argv(opts, ckpt, dump_path(opts, case.name, "device"), DTYPE[case.precision], case.prompt_len,
                     extra=extra + _grads(case))
    return Stage(f"dump:{case.name}:device", needs=(f"ckpt:{case.ckpt}",), argv=argv, env=env)


def cpu_dump_stage(opts: Options, case: Case) -> Stage:
    ckpt = opts.out / "ckpt" / case.ckpt
    if opts.cpu_ref == "interp":
        extra, env = ("--device", "cpu", "--no-cpu-kernels"), {"TRITON_INTERPRET": "1"}
    else:
        extra, env = ("--device", "cpu", "--cpu-kernels"), {"TRITON_INTERPRET": None}
    argv = dump_argv(opts, ckpt, dump_path(opts, case.cpu_name, "cpu"), DTYPE[case.precision], case.prompt_len,
                     extra=extra + _grads(case))
    # CUDA hidden: the CPU reference must not pick up the GPU through any default
    return Stage(f"dump:{case.cpu_name}:cpu", needs=(f"ckpt:{case.ckpt}",), argv=argv,
                 env={**env, "CUDA_VISIBLE_DEVICES": ""})


def replay_stage(opts: Options, case: Case, backend: str) -> Stage:
    report_dir = opts.out / "reports" / f"{case.name}-{backend}"
    argv = (opts.python, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0",
            "--parity-dump", str(dump_path(opts, case.name, "device")),
            "--parity-ckpt", str(opts.out / "ckpt" / case.ckpt), "--parity-report", str(report_dir))
    # JAX_PLATFORMS set explicitly (the root conftest only sets a default): a missing CUDA backend fails the stage
    # instead of falling back to CPU; no preallocation, so JAX and a concurrent torch dump share the GPU
    env = {"JAX_PLATFORMS": backend, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return Stage(f"replay:{case.name}:{backend}", needs=(f"dump:{case.name}:device",), argv=argv, env=env)


def ckpt_stage(opts: Options, preset: str) -> Stage:
    argv = (opts.python, str(REPO / "tools" / "make_ckpt.py"), "--preset", preset, "--seed", "0",
            "--modeling", "official", "--out", str(opts.out / "ckpt" / preset), "--force")
    return Stage(f"ckpt:{preset}", argv=argv)


ENV_PROBE = """
import json, os, platform
out = {"python": platform.python_version(), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
def probe(name, fn):
    try:
        out[name] = fn()
    except Exception as e:
        out[name] = f"unavailable ({type(e).__name__}: {str(e)[:120]})"
def _torch():
    import torch
    cuda = torch.cuda.is_available()
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
            "device": torch.cuda.get_device_name(0) if cuda else None,
            "capability": list(torch.cuda.get_device_capability(0)) if cuda else None}
def _jax():
    import jax
    return {"version": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
def _version(mod):
    return lambda: __import__(mod).__version__
def _reference_jit():
    # the reference target's per-computation XLA options (one is an XLA:CPU option): accepted by this backend?
    import jax
    from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS as opts
    return {"options": sorted(opts), "ok": float(jax.jit(lambda x: x + 1, compiler_options=opts)(1.0)) == 2.0}
probe("torch", _torch)
probe("jax", _jax)
probe("reference_jit", _reference_jit)
for m in ("transformers", "triton", "fla", "h5py", "safetensors", "einops", "flax", "pytest"):
    probe(m, _version(m))
print(json.dumps(out))
"""


def env_stage(opts: Options) -> Stage:
    # no JAX_PLATFORMS: what JAX picks by itself on this machine is part of the answer
    return Stage("env", argv=(opts.python, "-c", ENV_PROBE), env={"JAX_PLATFORMS": None})


def plan(opts: Options) -> list[Stage]:
    """Every stage of the check, in the order they may start (a stage waits for its `needs`)."""
    cs = cases(opts)
    stages = [env_stage(opts)] + [ckpt_stage(opts, c) for c in opts.ckpts]
    stages += [device_dump_stage(opts, c) for c in cs]
    cpu_dumps = {s.name: s for s in (cpu_dump_stage(opts, c) for c in cs)}  # fp32 IEEE / TF32 share one
    stages += cpu_dumps.values()
    stages += [replay_stage(opts, c, b) for c in cs for b in opts.backends]
    stages += [compare_stage(opts, c) for c in cs]
    return [_injected(opts, s) for s in stages]


def compare_stage(opts: Options, case: Case) -> Stage:
    ref, test = dump_path(opts, case.cpu_name, "cpu"), dump_path(opts, case.name, "device")
    return Stage(f"compare:{case.name}", needs=(f"dump:{case.cpu_name}:cpu", f"dump:{case.name}:device"),
                 call=lambda: compare_dumps(ref, test))


def _injected(opts: Options, stage: Stage) -> Stage:
    if stage.name not in opts.inject_failure:
        return stage
    fail = "import sys; sys.exit('injected failure (--inject-failure)')"
    return Stage(stage.name, needs=stage.needs, argv=(opts.python, "-c", fail))


# ------------------------------------------------------------------------------------------------------ comparison
def compare_dumps(ref_path: Path, test_path: Path, mode: str = "layer") -> dict:
    """Each point of `test` against the same point of `ref` (the CPU dump) with the suite's compare and the default
    tolerance rule of `mode` for that site and dtype: max ULP and rel-L2 per point, a summary over the dump."""
    from parity.dumpfile import DumpReader
    from parity.numerics.compare import compare
    from parity.numerics.tolerances import default_rules
    from parity.provenance import kernels_line
    from parity.replay.judge import compare_gradient, rule_site

    rules = default_rules()
    points, missing = [], []
    with DumpReader(ref_path) as ref, DumpReader(test_path) as test:
        compute = ref.meta.get("compute_dtype")
        for p in list(ref.points()) + list(ref.mtp_points()):
            if not test.has(p):
                missing.append(p.key())
                continue
            dtype = ref.dtype(p)
            rule = rules.rule_for(rule_site(p), mode, dtype, compute)  # gradients: their own rules and RMS floor
            v = (compare_gradient if p.phase == "backward" else compare)(ref.read(p), test.read(p), rule, name=p.key())
            points.append({"point": p.key(), "dtype": dtype, "max_ulp": v.max_ulp, "rel_l2": v.rel_l2,
                           "within_tolerance": bool(v.passed)})
        kernels = {"cpu": kernels_line(ref.kernels), "device": kernels_line(test.kernels)}  # which ran, each side
    return {**summarize_comparison(points, missing), "kernels": kernels}


def summarize_comparison(points: list[dict], missing: list[str]) -> dict:
    """Counts and the worst point (largest max ULP; integer points, which have none, count only as outside)."""
    ulps = [p for p in points if p["max_ulp"] is not None]
    worst = max(ulps, key=lambda p: (p["max_ulp"], p["rel_l2"] or 0.0), default=None)
    return {"compared": len(points), "within_tolerance": sum(p["within_tolerance"] for p in points),
            "bit_identical": sum(p["max_ulp"] == 0 for p in ulps), "missing_in_device_dump": missing,
            "worst": worst, "outside_tolerance": [p["point"] for p in points if not p["within_tolerance"]],
            "points": points}


def replay_counts(report_dir: Path) -> dict:
    """Point statuses over every report.json the replay wrote (one per dump x mode)."""
    from parity.model.points import Point

    reports = sorted(report_dir.rglob("report.json"))
    if not reports:
        raise FileNotFoundError(f"{report_dir}: no report.json written by the replay")
    counts: dict[str, int] = {}
    first = None
    for path in reports:
        rep = json.loads(path.read_text())
        for p in rep.get("points", []):
            counts[p["status"]] = counts.get(p["status"], 0) + 1
        fd = rep.get("first_divergence")
        if fd and first is None:
            where = Point(fd["phase"], fd["step"], fd["layer"], fd["site"]).key()
            first = f"{where} ({fd.get('max_ulp')} ULP)"
    return {"counts": counts, "passed": all(json.loads(p.read_text()).get("passed") for p in reports),
            "first_divergence": first, "reports": [str(p) for p in reports]}


# ------------------------------------------------------------------------------------------------------ running
def child_env(overrides: dict) -> dict:
    """This process's environment with `overrides` applied (None removes a variable)."""
    env = dict(os.environ)
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_stage(stage: Stage, log_dir: Path, timeout_s: float) -> StageResult:
    """Run one stage, timed; never raises (a failure is a result)."""
    t0 = time.monotonic()
    if stage.argv:
        log = log_dir / (stage.name.replace(":", "__") + ".log")
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(stage.argv) + f"\n# env overrides: {stage.env}\n")
            fh.flush()
            try:
                rc = subprocess.run(stage.argv, cwd=REPO, env=child_env(stage.env), stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=max(timeout_s, 1.0)).returncode
            except subprocess.TimeoutExpired:
                return StageResult(stage.name, "timeout", time.monotonic() - t0, None,
                                   f"killed after {timeout_s:.0f}s (budget)", str(log))
        status = "ok" if rc == 0 else "failed"
        return StageResult(stage.name, status, time.monotonic() - t0, rc, "" if rc == 0 else last_line(log), str(log))
    try:
        data = stage.call()
    except Exception as e:  # one failed comparison must not stop the check
        return StageResult(stage.name, "failed", time.monotonic() - t0, note=f"{type(e).__name__}: {e}")
    return StageResult(stage.name, "ok", time.monotonic() - t0, data=data)


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_plan(stages: list[Stage], log_dir: Path, *, jobs: int, budget_s: float,
             progress: Callable[[str], None] = print) -> dict[str, StageResult]:
    """Run stages as their needs complete, up to `jobs` at a time, within `budget_s` seconds in all: a stage whose
    need did not succeed is skipped with the reason; one that cannot start before the deadline is skipped; a running
    one is killed at the deadline."""
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    done: dict[str, StageResult] = {}
    pending = list(stages)
    running: dict[Future, str] = {}
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        while pending or running:
            for s in list(pending):
                bad = [n for n in s.needs if n in done and done[n].status != "ok"]
                if bad:
                    done[s.name] = StageResult(s.name, "skipped", note=f"needs {bad[0]} ({done[bad[0]].status})")
                elif time.monotonic() >= deadline:
                    done[s.name] = StageResult(s.name, "skipped", note=f"budget of {budget_s:.0f}s spent")
                elif len(running) < max(jobs, 1) and all(n in done for n in s.needs):
                    running[pool.submit(run_stage, s, log_dir, deadline - time.monotonic())] = s.name
                else:
                    continue
                pending.remove(s)
            if not running:
                for s in pending:  # a need that is no stage of the plan: nothing would ever start these
                    done[s.name] = StageResult(s.name, "skipped", note=f"needs {s.needs} (not in the plan)")
                pending = []
                continue
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in finished:
                r = f.result()
                done[running.pop(f)] = r
                progress(f"[{r.seconds:6.1f}s] {r.status:7s} {r.name}" + (f": {r.note}" if r.note else ""))
    return {s.name: done[s.name] for s in stages}


# ------------------------------------------------------------------------------------------------------ summary
def summary(opts: Options, results: dict[str, StageResult], wall_s: float) -> dict:
    """The gpu_check.json document: environment, one row per case, every stage with its time and status."""
    env = _json_stdout(results.get("env"))
    rows = []
    for c in cases(opts):
        row = {"case": c.name, "ckpt": c.ckpt, "precision": c.precision, "prompt_len": c.prompt_len,
               "device_dump": results[f"dump:{c.name}:device"].status,
               "cpu_dump": results[f"dump:{c.cpu_name}:cpu"].status, "replay": {}, "cuda_vs_cpu": None}
        for b in opts.backends:
            r = results[f"replay:{c.name}:{b}"]
            row["replay"][b] = _replay_entry(opts, c, b, r)
        cmp = results[f"compare:{c.name}"]
        if cmp.status == "ok":
            row["cuda_vs_cpu"] = {k: v for k, v in cmp.data.items() if k != "points"}
        rows.append(row)
    return {"schema": SCHEMA, "version": 1, "mode": "cpu-only" if opts.cpu_only else "gpu",
            "cpu_reference": opts.cpu_ref, "decode_steps": opts.decode_steps, "budget_s": opts.budget_s,
            "wall_s": round(wall_s, 1), "environment": env, "cases": rows,
            "stages": [_stage_json(r) for r in results.values()],
            "failed_stages": [r.name for r in results.values() if r.status in ("failed", "timeout")]}


def _replay_entry(opts: Options, case: Case, backend: str, r: StageResult) -> dict:
    entry = {"stage": r.status}
    if r.status in ("ok", "failed"):  # a failing replay (rc 1) still wrote its report
        try:
            entry.update(replay_counts(opts.out / "reports" / f"{case.name}-{backend}"))
        except (OSError, ValueError) as e:
            entry["error"] = str(e)
    return entry


def _json_stdout(r: StageResult | None) -> dict | None:
    if r is None or r.status != "ok" or r.log is None:
        return None
    for ln in reversed(Path(r.log).read_text().splitlines()):
        if ln.startswith("{"):
            return json.loads(ln)
    return None


def _stage_json(r: StageResult) -> dict:
    d = asdict(r)
    d["seconds"] = round(d["seconds"], 2)
    if d["data"] is not None:  # per-point lists go to the comparison files, not the summary
        d["data"] = None
    return d


def markdown(doc: dict) -> str:
    """gpu_check.md: the environment line, the table (one row per case), failed stages, stage times."""
    env = doc["environment"] or {}
    torch_env = env.get("torch") if isinstance(env.get("torch"), dict) else {}
    lines = [f"# GPU check ({doc['mode']}, CPU reference: {doc['cpu_reference']})", "",
             f"Device: {torch_env.get('device') or 'none'} (capability {torch_env.get('capability')}); "
             f"torch {torch_env.get('version')}, jax {_v(env.get('jax'))}, transformers {env.get('transformers')}, "
             f"triton {env.get('triton')}, fla {env.get('fla')}. Wall {doc['wall_s']} s of a {doc['budget_s']:.0f} s "
             f"budget; {doc['decode_steps']} decode steps.", ""]
    backends = list(doc["cases"][0]["replay"]) if doc["cases"] else []
    head = ["dump", "precision", "prompt"] + [f"replay {b} (pass/fail)" for b in backends] + \
        ["device vs CPU: within tol / bit-identical / compared", "worst point (max ULP, rel-L2)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in doc["cases"]:
        cells = [row["ckpt"], row["precision"], str(row["prompt_len"])]
        cells += [_replay_cell(row["replay"][b]) for b in backends]
        cmp = row["cuda_vs_cpu"]
        if cmp is None:
            cells += [f"not compared (device dump {row['device_dump']}, CPU dump {row['cpu_dump']})", "-"]
        else:
            w = cmp["worst"]
            cells += [f"{cmp['within_tolerance']} / {cmp['bit_identical']} / {cmp['compared']}",
                      "-" if w is None or w["max_ulp"] == 0 else f"{w['point']} ({w['max_ulp']}, {_g(w['rel_l2'])})"]
        lines.append("| " + " | ".join(cells) + " |")
    seen = sorted({row["cuda_vs_cpu"]["kernels"]["cpu"] for row in doc["cases"] if row["cuda_vs_cpu"]})
    lines += ["", "CPU reference dumps ran: " + ("; ".join(seen) if seen else "none compared")]
    failed = [s for s in doc["stages"] if s["status"] != "ok"]
    lines += ["", f"Stages not ok: {len(failed)}" + ("" if failed else " (all ran)")]
    lines += [f"- `{s['name']}`: {s['status']}" + (f" — {s['note']}" if s["note"] else "") for s in failed]
    lines += ["", "Stage times (s): " + ", ".join(f"{s['name']} {s['seconds']}" for s in doc["stages"]), ""]
    return "\n".join(lines)


def _v(x) -> str:
    return x.get("version") if isinstance(x, dict) else str(x)


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _replay_cell(e: dict) -> str:
    if "counts" not in e:
        return e["stage"] + (f" ({e['error']})" if e.get("error") else "")
    c = e["counts"]
    other = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k not in ("pass", "fail"))
    first = f"; first divergence {e['first_divergence']}" if e.get("first_divergence") else ""
    return f"{c.get('pass', 0)}/{c.get('fail', 0)}" + (f" ({other})" if other else "") + first


def run_check(opts: Options, progress: Callable[[str], None] = print) -> dict:
    """Run the whole check and write OUT/gpu_check.json, OUT/gpu_check.md and the per-point comparisons."""
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "dumps").mkdir(exist_ok=True)
    t0 = time.monotonic()
    results = run_plan(plan(opts), opts.out / "logs", jobs=opts.jobs, budget_s=opts.budget_s, progress=progress)
    doc = summary(opts, results, time.monotonic() - t0)
    per_point = {name[len("compare:"):]: r.data["points"] for name, r in results.items()
                 if name.startswith("compare:") and r.status == "ok"}
    (opts.out / "gpu_check_points.json").write_text(json.dumps(per_point, indent=1, default=str))
    (opts.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    (opts.out / "gpu_check.md").write_text(markdown(doc))
    return doc


# ------------------------------------------------------------------------------------------------------ CLI
def _choices(allowed: tuple, cast=str):
    import argparse

    def parse(text: str) -> tuple:
        try:
            vals = tuple(cast(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            vals = ()
        if not vals or any(v not in allowed for v in vals):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {', '.join(map(str, allowed))}")
        return vals
    return parse


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output folder (checkpoints, dumps, reports, logs, summary)")
    ap.add_argument("--cpu-only", "--dry-run", dest="cpu_only", action="store_true",
                    help="no GPU: the same pipeline on CPU (stand-in dumps, CPU replay only), to test the check itself")
    ap.add_argument("--cpu-ref", choices=("interp", "stand-ins"), default="stand-ins",
                    help="how the CPU reference dump runs fla: interp = real kernels under TRITON_INTERPRET=1 "
                         "(needs interpreter fixes for the installed triton: stock triton's interpreter computes bf16 "
                         "dots wrongly), stand-ins = the suite's PyTorch stand-ins (default)")
    ap.add_argument("--ckpts", type=_choices(CKPTS), default=CKPTS, help="tiny,tiny-flash (default both)")
    ap.add_argument("--precisions", type=_choices(PRECISIONS), default=PRECISIONS,
                    help="fp32-ieee,fp32-tf32,bf16-reduced,bf16 (default all)")
    ap.add_argument("--prompts", type=_choices(PROMPTS, int), default=PROMPTS, help="24,100 (default both)")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"wall-clock budget for all stages (default {BUDGET_S:.0f}); later stages are skipped")
    ap.add_argument("--jobs", type=int, default=4, help="stages run at once (default 4)")
    ap.add_argument("--inject-failure", action="append", default=[], metavar="STAGE",
                    help="replace STAGE's command by one that fails (tests the failure recording); repeatable")
    args = ap.parse_args(argv)
    opts = Options(out=args.out, cpu_only=args.cpu_only, cpu_ref=args.cpu_ref, ckpts=args.ckpts,
                   precisions=args.precisions, prompts=args.prompts, decode_steps=args.decode_steps,
                   budget_s=args.budget_s, jobs=args.jobs, inject_failure=tuple(args.inject_failure))
    names = {s.name for s in plan(opts)}
    unknown = [n for n in opts.inject_failure if n not in names]
    if unknown:
        print(f"gpu_check: error: --inject-failure {unknown[0]!r}: no such stage; expected one of "
              f"{', '.join(sorted(names))}", file=sys.stderr)
        return 2
    doc = run_check(opts)
    print(f"wrote {opts.out / 'gpu_check.json'} and {opts.out / 'gpu_check.md'} "
          f"({len(doc['failed_stages'])} stage(s) failed, wall {doc['wall_s']} s)")
    return 1 if doc["failed_stages"] else 0
