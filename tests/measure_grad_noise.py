"""Measure the gradient noise between the twin's torch autograd and the JAX reference's VJP (issue 26), for the
initial gradient tolerance rules (parity/numerics/gradient_tolerances.toml). Not a test: run
`python tests/measure_grad_noise.py [--quick]` from the repository root; prints one JSON line per (class, dtype) with
the worst statistics over the corpus and where they occurred.

Each layer is teacher-forced as the backward replay does it: the twin's layer input and its output cotangent, routing
forced to the twin's top-k; the head fed the twin's last output and dL/dlogits; the embedding the twin's dL/d embed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backward_twin import twin_backward  # noqa: E402

RTOL = 1e-5  # the fp32 tier's relative tolerance (DESIGN §5)


def _stats(ref: np.ndarray, test: np.ndarray, grid: str) -> dict:
    from parity.numerics.ulp import to_dtype, ulp_distance, ulp_of

    r = to_dtype(ref, grid).astype(np.float64)
    t = to_dtype(test, grid).astype(np.float64)
    r2 = r.reshape(1, -1)  # one row: the backward judge floors gradients at the tensor's RMS (judge.judge_array)
    t2 = t.reshape(r2.shape)
    rms = np.sqrt(np.mean(r2 * r2, axis=-1, keepdims=True))
    u = ulp_of(rms, grid)
    d = np.abs(r2 - t2) / u  # |Δ| in ULPs of the tensor's RMS (the floor's unit)
    raw = ulp_distance(to_dtype(ref, grid), to_dtype(test, grid), grid).reshape(r2.shape).astype(np.float64)
    over_rtol = np.abs(r2 - t2) > RTOL * np.abs(r2)
    need = float(d[over_rtol].max()) if over_rtol.any() else 0.0  # floor an rtol rule needs
    return {"p999_floor": float(np.quantile(d, 0.999, method="inverted_cdf")), "max_floor": float(d.max()),
            "need_floor_rtol": need, "raw": raw, "d": d}


def measure(cases) -> dict:
    from parity.jax_ling3.weights import CheckpointReader
    from parity.targets.reference import ReferenceTarget

    worst: dict = {}

    def add(cls, dtype, where, ref, test):
        if "/grad.mlp.experts." in where:
            cls = "grad_expert"  # few tokens each: rank-few, heavy-tailed tensors (their own class)
        grid = "bfloat16" if dtype == "bfloat16" else "float32"
        st = _stats(np.asarray(ref), np.asarray(test), grid)
        w = worst.setdefault((cls, dtype), {"p999_floor": (0, ""), "max_floor": (0, ""), "need_floor_rtol": (0, ""),
                                            "frac_over2_at_floor": [], "points": 0})
        w["points"] += 1
        for k in ("p999_floor", "max_floor", "need_floor_rtol"):
            if st[k] > w[k][0]:
                w[k] = (st[k], where)
        w["frac_over2_at_floor"].append((st["d"], st["raw"], where))

    for ck, dtype, T, seed in cases:
        tb = twin_backward(Path(ck), dtype, T, seed)
        r = CheckpointReader(ck)
        cfg = r.config
        t = ReferenceTarget()
        t.build(cfg, dtype)
        tag = f"{Path(ck).name}/T{T}/s{seed}/{dtype}"
        for i in range(cfg.num_hidden_layers):
            t.load_layer(i, r.hf_tensors(i))
            b = t.layer_backward(i, tb.inputs[i], np.arange(T), tb.grads[i]["output"], tb.topk[i])
            add("grad_activation", dtype, f"{tag}:L{i}/input", tb.grads[i]["input"], b.input_grad)
            for s, v in tb.grads[i].items():
                if s in b.points:
                    add("grad_activation", dtype, f"{tag}:L{i}/{s}", v, b.points[s])
            for k, v in tb.param_grads[i].items():
                if k in b.param_grads:
                    add("grad_weight", dtype, f"{tag}:L{i}/grad.{k}", v, b.param_grads[k])
            t.unload_layer(i)
        t.load_globals(r.hf_global_tensors())
        _, dl = t.loss_backward(tb.logits, tb.input_ids)
        add("grad_activation", dtype, f"{tag}:model/logits", tb.d_logits, dl)
        hb = t.head_backward(tb.last_output, tb.d_logits)
        add("grad_activation", dtype, f"{tag}:model/final_norm", tb.final_norm_grad, hb["final_norm"])
        add("grad_activation", dtype, f"{tag}:model/final_norm:in", tb.grads[-1]["output"], hb["input"])
        for k in ("model.norm.weight", "lm_head.weight"):
            add("grad_weight", dtype, f"{tag}:model/grad.{k}", tb.global_grads[k], hb[f"grad.{k}"])
        eg = t.embed_backward(tb.input_ids, tb.embed_out_grad)
        add("grad_weight", dtype, f"{tag}:model/grad.model.word_embeddings.weight",
            tb.global_grads["model.word_embeddings.weight"], eg)
        t.release()
        print(f"measured {tag}", file=sys.stderr, flush=True)
    return worst


def summarise(worst: dict, floor_for: dict | None = None) -> list[dict]:
    """Per (class, dtype): the worst statistics; with `floor_for` {(cls, dtype): floor}, the worst fraction of
    elements above 2 ULP (raw distance) outside that floor, and the worst such ULP."""
    out = []
    for (cls, dtype), w in sorted(worst.items()):
        row = {"class": cls, "dtype": dtype, "points": w["points"],
               **{k: [round(w[k][0], 3), w[k][1]] for k in ("p999_floor", "max_floor", "need_floor_rtol")}}
        if floor_for and (cls, dtype) in floor_for:
            f = floor_for[(cls, dtype)]
            fr, mx = (0.0, ""), (0.0, "")
            for d, raw, where in w["frac_over2_at_floor"]:
                eff = np.where(d <= f, 0.0, raw)
                frac = float((eff > 2).mean())
                if frac > fr[0]:
                    fr = (frac, where)
                if eff.max() > mx[0]:
                    mx = (float(eff.max()), where)
            row.update(floor=f, frac_over2=[round(fr[0], 6), fr[1]], max_eff_ulp=[mx[0], mx[1]])
        out.append(row)
    return out


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    cks = ["dumps/ckpt/tiny", "dumps/ckpt/tiny-flash"]
    dtypes = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--dtype=")] or ["float32", "bfloat16"]
    cases = [(ck, dt, T, seed) for dt in dtypes for ck in cks for T in ((100,) if quick else (40, 100))
             for seed in ((1,) if quick else (1, 2))]
    worst = measure(cases)
    out = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--save=")), None)
    if out:  # per point: |Δ| in ULPs of the tensor RMS and the raw element ULP distance (for choosing rules)
        np.savez_compressed(out, **{f"{cls}|{dt}|{where}|{k}": arr.astype(np.float32)
                                    for (cls, dt), w in worst.items() for d, raw, where in w["frac_over2_at_floor"]
                                    for k, arr in (("d", d), ("raw", raw))})
    floors = {}
    for (cls, dtype), w in worst.items():
        floors[(cls, dtype)] = max(1.0, 2 * w["p999_floor"][0])
    for row in summarise(worst, floors):
        print(json.dumps(row))
