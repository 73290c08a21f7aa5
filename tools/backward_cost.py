"""Cost of the backward replay per layer kind (issue 26): the reference's `layer_backward` (jax.vjp of the layer,
teacher-forced, routing forced) vs the twin's torch autograd backward of the same layer on the same input and
cotangent (forward + backward, as `loss.backward()` runs it; the JAX VJP also runs the forward). Not a test:
`python tools/backward_cost.py CKPT [--T 512] [--dtype bfloat16] [--reps 3]` (CKPT e.g. a 4-layer Ling3-Tiny
from `tools/make_ckpt.py --preset ling3-tiny --layers 4`). Prints one line per layer: kind, JAX first call (compile +
run), JAX warm (median of reps), twin (median of reps), ratio; the same medians in CPU time (`time.process_time`,
all threads: on a shared machine pinned to one core, e.g. `taskset -c 1`, it counts only this process's share of the
core, where wall time counts the other jobs too); the JAX side's peak RSS
above the process's RSS before it loads the layer, against the layer's weights + their gradients (2x its
checkpoint bytes). `--layers 3` measures only layer 3."""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="layer indices (default: all)")
    a = ap.parse_args()
    from parity.jax_ling3.weights import CheckpointReader
    from parity.targets.reference import ReferenceTarget
    from parity.torch_ref.loader import load_model

    lm = load_model(a.ckpt, "remote", dtype=a.dtype)
    model, cfg = lm.model, lm.config
    tdt = model.dtype
    r = CheckpointReader(a.ckpt)
    t = ReferenceTarget()
    t.build(cfg, a.dtype)
    g = torch.Generator().manual_seed(0)
    D = cfg.hidden_size
    pos_ids = torch.arange(a.T).unsqueeze(0)
    for i in range(cfg.num_hidden_layers):
        lay = model.model.layers[i]
        h = (torch.randn(1, a.T, D, generator=g) * 0.5).to(tdt)  # drawn for every layer: the same inputs per layer
        cot = (torch.randn(1, a.T, D, generator=g) * 1e-3).to(tdt)  # whichever --layers are measured
        if a.layers is not None and i not in a.layers:
            continue
        pos_emb = model.model.rotary_emb(h, pos_ids)
        topk = {}
        hk = None
        if cfg.is_moe(i):
            hk = lay.mlp.gate.tap_topk_idx.register_forward_hook(lambda m, x, o: topk.__setitem__("idx", o))
        times, ctimes = [], []
        print(f"layer {i}: twin backward ...", file=__import__("sys").stderr, flush=True)
        for _ in range(a.reps):
            x = h.clone().requires_grad_(True)
            lay.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            out = lay(x, attention_mask=None, position_embeddings=pos_emb)[0]
            out.backward(cot)
            times.append(time.perf_counter() - t0)
            ctimes.append(time.process_time() - c0)
        if hk is not None:
            hk.remove()
        fi = None if "idx" not in topk else np.sort(topk["idx"].numpy(), -1).astype(np.int32)
        print(f"layer {i}: twin {times}; JAX ...", file=__import__("sys").stderr, flush=True)
        base = _rss_gb()
        tensors = r.hf_tensors(i)
        wbytes = sum(np.asarray(v).nbytes for v in tensors.values())
        sampler = _PeakRss()
        t.load_layer(i, tensors)
        del tensors
        hn = h.float().numpy() if a.dtype == "float32" else h.view(torch.int16).numpy().view("bfloat16")
        cn = cot.float().numpy() if a.dtype == "float32" else cot.view(torch.int16).numpy().view("bfloat16")
        t0 = time.perf_counter()
        t.layer_backward(i, hn, np.arange(a.T), cn, fi)
        first = time.perf_counter() - t0
        jt, jc = [], []
        for _ in range(a.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            t.layer_backward(i, hn, np.arange(a.T), cn, fi)
            jt.append(time.perf_counter() - t0)
            jc.append(time.process_time() - c0)
        peak = sampler.stop() - base
        t.unload_layer(i)
        kind = f"{cfg.layer_kind(i).upper()}+{'MoE' if cfg.is_moe(i) else 'dense'}"
        jw, tw = statistics.median(jt), statistics.median(times)
        jcpu, tcpu = statistics.median(jc), statistics.median(ctimes)
        print(f"layer {i} {kind} T={a.T}: JAX first {first:.2f} s, JAX warm {jw:.2f} s, twin {tw:.2f} s, "
              f"ratio {jw / tw:.2f}x; CPU time JAX {jcpu:.2f} s, twin {tcpu:.2f} s, ratio {jcpu / tcpu:.2f}x; "
              f"JAX peak RSS over the start {peak:.2f} GB = {peak / (2 * wbytes / 2**30):.2f} x (layer weights + their "
              f"gradients, {2 * wbytes / 2**30:.2f} GB)", flush=True)


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class _PeakRss:
    """Samples this process's RSS every 5 ms on a thread until `stop()`, which returns the peak (GB)."""

    def __init__(self) -> None:
        self.peak, self._done = _rss_gb(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _rss_gb())

    def stop(self) -> float:
        self._done.set()
        self._t.join()
        return max(self.peak, _rss_gb())


if __name__ == "__main__":
    main()
