"""Benchmarks of DESIGN §9: JAX layer replay vs the PyTorch twin layer, dump overhead, HDF5 write rate, peak RSS.

Every measurement runs in a fresh child process (`python -m parity.cli.bench <role> <json args>`), so "cold" really is a
first call in a new process (jit compile included), the persistent compilation cache can be empty or warm on
purpose (`LING3_JAX_CACHE`), and peak RSS (`ru_maxrss`) belongs to that measurement alone. The parent
(`run_bench`, `tools/bench.py`) collects the children's JSON lines into one table + one JSON file.

Timing convention: wall clock (`time.perf_counter`) around a call that has finished (`np.asarray` on the JAX
side forces the result to host, as the replay does); warm = min and median over `repeats` calls after the first.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def hidden_states(T: int, D: int, seed: int = 0, B: int = 1) -> np.ndarray:
    """The layer input used by both sides: N(0, 1) fp32 rounded to bf16 (round to nearest even, as torch's
    `.to(torch.bfloat16)`; tests/test_bench.py checks they agree), as float32. ml_dtypes, not torch: importing torch
    in the JAX child added ~140 MB to its measured peak RSS."""
    import ml_dtypes

    x = np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _stats(ts: list[float]) -> dict:
    return {"min": min(ts), "median": statistics.median(ts), "n": len(ts)}


def _tree_nbytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


# ------------------------------------------------------------------------------------------------ child roles
def child_jax(ckpt: str, layer: int, Ts: list[int], repeats: int, dtype: str = "bfloat16") -> list[dict]:
    """JAX teacher-forced replay of one layer (`ReferenceTarget.layer_forward`) at each T (ascending)."""
    import jax

    from parity.jax_ling3 import COMPILATION_CACHE_DIR
    from parity.jax_ling3.weights import CheckpointReader
    from parity.targets.reference import ReferenceTarget

    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4, np.float32)))  # the runtime's own footprint first
    rss0 = current_rss_mb()
    reader = CheckpointReader(ckpt)
    tgt = ReferenceTarget()
    tgt.build(reader.config, dtype)
    t = time.perf_counter()
    tgt.load_layer(layer, reader.lazy_tensors(layer))
    jax.block_until_ready(tgt.params[layer])
    load_s = time.perf_counter() - t
    rss_loaded = current_rss_mb()
    w_bytes = _tree_nbytes(tgt.params[layer])
    out = []
    for T in sorted(Ts):
        h = hidden_states(T, reader.config.hidden_size)
        pos = np.arange(T, dtype=np.int32)
        t = time.perf_counter()
        res = tgt.layer_forward(layer, h, pos)
        cold = time.perf_counter() - t
        act_bytes = h.nbytes // 2 + sum(v.nbytes for v in res.points.values())  # input as bf16 + every point
        del res  # counted once in act_bytes; kept alive it doubled the outputs in the warm calls' peak RSS
        warm = []
        for _ in range(repeats):
            t = time.perf_counter()
            tgt.layer_forward(layer, h, pos)
            warm.append(time.perf_counter() - t)
        out.append({"side": "jax", "layer": layer, "kind": tgt.spec(layer).kind, "moe": tgt.spec(layer).moe, "T": T,
                    "cold_s": cold, "warm": _stats(warm), "compile_s_est": cold - min(warm),
                    "cache_dir": COMPILATION_CACHE_DIR, "load_s": load_s, "weights_mb": w_bytes / 2**20,
                    "activations_mb": act_bytes / 2**20, "rss_base_mb": rss0, "rss_after_load_mb": rss_loaded,
                    "rss_after_mb": current_rss_mb(), "peak_rss_mb": peak_rss_mb(),
                    "affinity": sorted(os.sched_getaffinity(0)), "loadavg": load_average()})
    return out


def _twin_layer_inputs(model, layer_mod, h, T: int):
    import torch

    twin = sys.modules[type(model).__module__]
    pos = torch.arange(T)[None]
    pos_emb = model.model.rotary_emb(h, pos)
    mask = twin._prepare_4d_causal_attention_mask(None, (h.shape[0], T), h, 0)  # eager load, as the model forward
    return dict(attention_mask=mask, position_embeddings=pos_emb, past_key_values=None, use_cache=False)


def child_torch(ckpt: str, layers: list[int], Ts: list[int], repeats: int, dtype: str = "bfloat16") -> list[dict]:
    """The PyTorch twin's decoder layer module called directly on the same hidden states (bf16)."""
    import torch

    from parity.torch_ref.loader import load_model

    t = time.perf_counter()
    loaded = load_model(ckpt, "remote", dtype=dtype)
    load_s = time.perf_counter() - t
    model = loaded.model
    out = []
    with torch.inference_mode():
        for layer in layers:
            mod = model.model.layers[layer]
            for T in sorted(Ts):
                h = torch.from_numpy(hidden_states(T, loaded.config.hidden_size)).to(getattr(torch, dtype))
                kw = _twin_layer_inputs(model, mod, h, T)
                t = time.perf_counter()
                mod(h, **kw)
                cold = time.perf_counter() - t
                warm = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    mod(h, **kw)
                    warm.append(time.perf_counter() - t)
                out.append({"side": "torch", "layer": layer, "T": T, "cold_s": cold, "warm": _stats(warm),
                            "threads": torch.get_num_threads(), "load_s": load_s, "peak_rss_mb": peak_rss_mb(),
                            "affinity": sorted(os.sched_getaffinity(0)), "loadavg": load_average()})
    loaded.release()
    return out


def child_dump(ckpt: str, T: int, out_dir: str, repeats: int, dtype: str = "bfloat16",
               compression: str = "lzf") -> list[dict]:
    """Dump (capture + HDF5 streaming) vs the same prefill forward without capture, same process, same model.

    Plain forward: `load_model` + the model's forward on the same ids (prefill only, no decode steps); dump:
    `dump_checkpoint(..., decode_steps=0, causality_check=False)` whose `seconds_forward` is the captured forward
    incl. writing. Both repeated; min taken."""
    import torch

    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.loader import load_model
    from parity.torch_ref.prompts import builtin_ids

    loaded = load_model(ckpt, "remote", dtype=dtype)
    cfg = loaded.config
    ids = np.asarray(builtin_ids(cfg.vocab_size, T, 0)).reshape(1, -1)[:, :T]
    plain = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            loaded.model(input_ids=torch.from_numpy(ids).long(), use_cache=False)
            plain.append(time.perf_counter() - t)
    loaded.release()
    del loaded
    dumps, sizes, writes = [], [], []
    for r in range(repeats):
        path = Path(out_dir) / f"bench-dump-{r}.h5"
        s = dump_checkpoint(ckpt, path, ids, DumpOptions(dtype=dtype, decode_steps=0, causality_check=False,
                                                         progress=False, force=True, compression=compression))
        dumps.append(s.seconds_forward)
        writes.append(s.seconds_write)
        sizes.append(path.stat().st_size)
        path.unlink()
    n_layers = cfg.num_hidden_layers
    size = sizes[0]
    return [{"side": "dump", "T": T, "layers": n_layers, "compression": compression, "plain_forward": _stats(plain),
             "dump_forward": _stats(dumps), "ratio_min": min(dumps) / min(plain), "file_mb": size / 2**20,
             "points": s.points, "raw_bytes": s.bytes,
             "bytes_per_token_layer": size / (T * n_layers),
             # the writer's own clock: arrays handed to HDF5 (uncompressed) per second inside it
             "write_s": _stats(writes), "array_mb": s.array_bytes / 2**20,
             "write_mb_per_s": (s.array_bytes / 2**20) / max(1e-9, min(writes)),
             "peak_rss_mb": peak_rss_mb(), "loadavg": load_average()}]


ROLES = {"jax": child_jax, "torch": child_torch, "dump": child_dump}


def run_child(role: str, kwargs: dict, env: dict | None = None, timeout: float = 3600,
              cpus: list[int] | None = None) -> list[dict]:
    """Run one role in a fresh interpreter; returns its records (the child prints one JSON line). `cpus`: pin the
    child to these CPUs (sched_setaffinity before exec; torch and XLA size their thread pools from it)."""
    cmd = [sys.executable, "-m", "parity.cli.bench", role, json.dumps(kwargs)]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                       preexec_fn=pin)
    if p.returncode != 0:
        raise RuntimeError(f"bench child {role} {kwargs} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def pytest_parity_timings(repo: str | Path, workers: tuple[int, ...] = (0, 2), log=print) -> list[dict]:
    """Wall time of `pytest parity` on the bundled dumps (DESIGN §9): for each worker count (0 = serial), once with an
    empty JAX compilation cache ("cold") and once more reusing it ("warm"). Each run is a fresh interpreter."""
    out = []
    for n in workers:
        with tempfile.TemporaryDirectory(prefix="ling3-bench-pytest-cache-") as cache:
            for state in ("cold", "warm"):
                cmd = [sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider"]
                cmd += ["-n", str(n)] if n else []
                t = time.perf_counter()
                p = subprocess.run(cmd, cwd=str(repo), capture_output=True, text=True,
                                   env={**os.environ, "LING3_JAX_CACHE": cache})
                wall = time.perf_counter() - t
                summary = (p.stdout.strip().splitlines() or [""])[-1]
                if p.returncode != 0:
                    raise RuntimeError(f"`{' '.join(cmd)}` failed (rc {p.returncode}): {summary}\n{p.stdout[-3000:]}")
                rec = {"side": "pytest", "workers": n, "cache": state, "wall_s": wall, "summary": summary,
                       "loadavg": load_average()}
                log(f"pytest parity -n {n} {state}: {wall:.1f}s ({summary})")
                out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------ parent
def run_bench(ckpt: str, layers: list[int], Ts: list[int], repeats: int = 3, dump_T: int | None = None,
              dump_ckpt: str | None = None, pytest_repo: str | None = None, log=print,
              cpus: list[int] | None = None) -> dict:
    """Layer replay (JAX cold with an empty cache, cold with the cache warm, warm) vs the twin layer, + dump overhead.
    `cpus`: pin the layer children (JAX and twin alike) to these CPUs — on a shared machine, one core each keeps the
    comparison fair: with 2 threads on 2 busy cores both torch's OpenMP and XLA's thread pool stall on descheduled
    threads (measured under load ~9: a 32x1536x512 bf16 torch GEMM 0.27 ms on 1 thread, 4-14 ms on 2)."""
    res: dict[str, Any] = {"ckpt": ckpt, "layers": layers, "Ts": Ts, "repeats": repeats, "cpus": cpus,
                           "loadavg_start": load_average(), "ncpu": os.cpu_count(), "jax": [], "torch": [], "dump": [], "pytest": []}
    with tempfile.TemporaryDirectory(prefix="ling3-bench-cache-") as cache:
        for layer in layers:
            for cache_state in ("empty", "warm"):  # the first run fills the fresh cache, the second reads it
                recs = run_child("jax", {"ckpt": ckpt, "layer": layer, "Ts": Ts, "repeats": repeats},
                                 env={"LING3_JAX_CACHE": cache}, cpus=cpus)
                for r in recs:
                    r["persistent_cache"] = cache_state
                    log(f"jax L{layer} T={r['T']} cache={cache_state}: cold {r['cold_s']:.2f}s "
                        f"warm {r['warm']['min']:.3f}s peak {r['peak_rss_mb']:.0f} MB")
                res["jax"] += recs
    recs = run_child("torch", {"ckpt": ckpt, "layers": layers, "Ts": Ts, "repeats": repeats}, cpus=cpus)
    for r in recs:
        log(f"torch L{r['layer']} T={r['T']}: cold {r['cold_s']:.2f}s warm {r['warm']['min']:.3f}s")
    res["torch"] = recs
    if dump_T:
        for compression in ("lzf", "none"):
            with tempfile.TemporaryDirectory(prefix="ling3-bench-dump-") as d:
                res["dump"] += run_child("dump", {"ckpt": dump_ckpt or ckpt, "T": dump_T, "out_dir": d,
                                                  "repeats": repeats, "compression": compression})
            log(f"dump ({compression}): {res['dump'][-1]['ratio_min']:.2f}x plain forward")
    if pytest_repo:
        res["pytest"] = pytest_parity_timings(pytest_repo, log=log)
    res["loadavg_end"] = load_average()
    return res


def table(res: dict) -> str:
    """Markdown table: per layer and T, JAX warm/cold vs the twin, ratio, compile, peak RSS vs weights+activations."""
    torch_t = {(r["layer"], r["T"]): r for r in res["torch"]}
    rows = ["| layer | kind | T | JAX warm min / med (s) | twin warm min / med (s) | JAX/twin | JAX cold, empty cache (s) "
            "| JAX cold, warm cache (s) | compile est. (s) | twin cold (s) | peak RSS: compiling / cache warm (MB) "
            "| weights + act. (MB) | RSS / (w+a): compiling / cache warm |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    jx = {(r["layer"], r["T"], r["persistent_cache"]): r for r in res["jax"]}
    for (layer, T, c), r in sorted(jx.items()):
        if c != "empty":
            continue
        w = jx.get((layer, T, "warm"), r)
        tt = torch_t.get((layer, T))
        kind = ("KDA" if r["kind"] == "kda" else "MLA") + ("+MoE" if r["moe"] else "+dense")
        jw = min(r["warm"]["min"], w["warm"]["min"])
        jm = statistics.median([r["warm"]["median"], w["warm"]["median"]])
        # the empty-cache child compiles (XLA's compiler memory is in its peak); the warm-cache child only replays
        peak_c, peak_w = r["peak_rss_mb"] - r["rss_base_mb"], w["peak_rss_mb"] - w["rss_base_mb"]
        wa = r["weights_mb"] + r["activations_mb"]
        tw = f"{tt['warm']['min']:.3f} / {tt['warm']['median']:.3f}" if tt else "-"
        ratio = f"{jw / tt['warm']['min']:.2f}" if tt else "-"
        rows.append(f"| {layer} | {kind} | {T} | {jw:.3f} / {jm:.3f} | {tw} | {ratio} | {r['cold_s']:.2f} | "
                    f"{w['cold_s']:.2f} | {r['compile_s_est']:.2f} | {tt['cold_s'] if tt else float('nan'):.2f} | "
                    f"{peak_c:.0f} / {peak_w:.0f} | {wa:.0f} | {peak_c / wa:.2f} / {peak_w / wa:.2f} |")
    for d in res.get("dump", []):
        rows.append("")
        rows.append(f"dump (T={d['T']}, {d['layers']} layers, prefill only, compression {d.get('compression', 'lzf')}): "
                    f"captured forward "
                    f"{d['dump_forward']['min']:.2f}s vs plain {d['plain_forward']['min']:.2f}s = "
                    f"{d['ratio_min']:.2f}x; file {d['file_mb']:.1f} MB = {d['bytes_per_token_layer'] / 1024:.1f} KiB "
                    f"per token per layer; HDF5 writer {d['write_s']['min']:.2f}s for {d['array_mb']:.1f} MB of arrays = "
                    f"{d['write_mb_per_s']:.0f} MB/s (incl. final flush and seal)")
    for r in res.get("pytest", []):
        mode = f"-n {r['workers']}" if r["workers"] else "serial"
        rows.append(f"`pytest parity` {mode}, {r['cache']} JAX cache: {r['wall_s']:.1f} s ({r['summary']})")
    rows.append("")
    threads = sorted({r.get("threads") for r in res["torch"]} - {None})
    rows.append(f"load average start {res['loadavg_start']} end {res.get('loadavg_end')}, {res['ncpu']} CPUs"
                + (f", layer children pinned to CPUs {res['cpus']}" if res.get("cpus") else "")
                + (f", twin threads {threads}" if threads else "")
                + "; peak RSS is the child's ru_maxrss minus its RSS after imports and JAX runtime start-up")
    return "\n".join(rows)


def _child_main(argv: list[str]) -> None:
    role, kwargs = argv[0], json.loads(argv[1])
    recs = ROLES[role](**kwargs)
    sys.stdout.flush()
    print(json.dumps(recs))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
