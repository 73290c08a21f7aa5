"""Cost of the backward replay per layer kind (issue 26): the reference's `layer_backward` (jax.vjp of the layer,
teacher-forced, routing forced) vs the twin's torch autograd backward of the same layer on the same input and
cotangent (forward + backward, as `loss.backward()` runs it; the JAX VJP also runs the forward). Not a test:
`python tools/backward_cost.py CKPT [--T 512] [--dtype bfloat16] [--reps 3] [--xla-memory] [--heap-reuse]` (CKPT e.g. a 4-layer
Ling3-Tiny from `tools/make_ckpt.py --preset ling3-tiny --layers 4`). `--layers 3` measures only layer 3.
`LING3_PARITY_CPU_ISA=AVX2` runs it as on an AVX2-only CPU (`parity.cpu_isa`: caps oneDNN, MKL, ATen, XLA:CPU).

Prints per layer: kind, JAX first call (compile or persistent-cache load + run), JAX warm (median of reps), twin
first call (its warm-up: oneDNN builds its kernels, the allocator fills) and twin warm (median of the reps after it),
ratio of the warm medians; the same medians in CPU time (`time.process_time`, all threads: on a shared machine pinned to
one core, e.g. `taskset -c 1`, it counts only this process's share of the core, where wall time counts the other
jobs too). Then memory (`parity.backward_cost` defines the terms): the layer's weights + their gradients (2x its
checkpoint bytes), the activations (bytes the twin's autograd saves for the backward of the layer, parameters
excluded), the JAX side's peak RSS above the process's RSS before it loads the layer, for the first call (with its
compilation or cache load) and for the warm calls alone, each / (weights + gradients + activations) — the issue's
bound is <= 2 — and the twin's peak RSS above its start (its weights already resident) as a second reading. Each
baseline, and the warm calls' start, is read after `malloc_trim` (`reference.release_freed_heap`: memory glibc keeps
from an earlier step would be reused unseen and a peak would read low). The JAX outputs are split into weight
gradients, dL/d input and the probes' sub-module cotangents; `--xla-memory` adds `compiled.memory_analysis()` of the
layer VJP (XLA temporaries, arguments, outputs)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from parity.cpu_isa import apply_isa_cap, describe_caps

apply_isa_cap()  # before torch and jax are imported: each library reads its ISA switch at first use

# `--heap-reuse`: glibc keeps and reuses freed memory for the whole process, both sides alike (glibc reads these at
# start-up, so the tool re-executes itself with them). XLA:CPU allocates a layer VJP's outputs (Ling3-Tiny MLA+MoE:
# three 201 MB expert-gradient stacks) and its temporaries afresh each call, each a new mmap whose pages fault in and
# are unmapped after; torch's autograd allocates many small tensors that glibc recycles from its heap.
HEAP_REUSE_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
if "--heap-reuse" in sys.argv[1:] and any(os.environ.get(k) != v for k, v in HEAP_REUSE_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HEAP_REUSE_ENV})

import numpy as np  # noqa: E402
import torch  # noqa: E402

from parity.backward_cost import GB, PeakRss, rss_bound_ratio, rss_bytes, saved_activation_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="layer indices (default: all)")
    ap.add_argument("--xla-memory", action="store_true", help="also print compiled.memory_analysis() of the VJP")
    ap.add_argument("--heap-reuse", action="store_true",
                    help="glibc keeps and reuses freed memory (MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
                         "MALLOC_TRIM_THRESHOLD_=2^34) for the whole process: both sides without fresh mmaps")
    a = ap.parse_args()
    from parity.jax_ling3.weights import CheckpointReader
    from parity.targets.reference import ReferenceTarget, release_freed_heap
    from parity.torch_ref.loader import load_model

    heap = " ".join(f"{k}={os.environ[k]}" for k in HEAP_REUSE_ENV if k in os.environ)
    print(f"ISA caps: {describe_caps()}; allocator: {heap or 'glibc defaults'}", flush=True)
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
        print(f"layer {i}: twin backward ...", file=sys.stderr, flush=True)
        release_freed_heap()
        tbase, tsampler, act = rss_bytes(), PeakRss(), 0
        for _ in range(a.reps + 1):  # the first is the twin's warm-up (oneDNN's kernels built, allocator primed),
            x = h.clone().requires_grad_(True)  # set apart as the JAX side's first call is
            lay.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            # the saved-tensor hook only logs two numbers per saved tensor: timed with the rest
            out, act = saved_activation_bytes(
                lambda: lay(x, attention_mask=None, position_embeddings=pos_emb)[0], lay.parameters())
            out.backward(cot)
            times.append(time.perf_counter() - t0)
            ctimes.append(time.process_time() - c0)
            del out
        twin_peak = tsampler.stop() - tbase
        lay.zero_grad(set_to_none=True)
        if hk is not None:
            hk.remove()
        fi = None if "idx" not in topk else np.sort(topk["idx"].numpy(), -1).astype(np.int32)
        print(f"layer {i}: twin {times}; JAX ...", file=sys.stderr, flush=True)
        del x
        release_freed_heap()  # the twin's freed memory: not reused unseen by the JAX side
        base = rss_bytes()
        tensors = r.hf_tensors(i)
        wbytes = sum(np.asarray(v).nbytes for v in tensors.values())
        sampler = PeakRss()
        t.load_layer(i, tensors)
        del tensors
        release_freed_heap()  # as a replay does after loading (parity.replay.strategies: no host copy kept)
        peak_load, after_load = sampler.peak() - base, rss_bytes() - base  # the loader's part of the first peak
        hn = h.float().numpy() if a.dtype == "float32" else h.view(torch.int16).numpy().view("bfloat16")
        cn = cot.float().numpy() if a.dtype == "float32" else cot.view(torch.int16).numpy().view("bfloat16")
        t0 = time.perf_counter()
        res = t.layer_backward(i, hn, np.arange(a.T), cn, fi)
        first = time.perf_counter() - t0
        peak_first = sampler.peak() - base
        del res
        release_freed_heap()  # the warm calls' peak, not the compilation's heap that glibc keeps
        sampler.reset()
        jt, jc = [], []
        for _ in range(a.reps):
            res = None  # one call's result alive at a time, as in a replay (not the last rep's beside this one's)
            t0, c0 = time.perf_counter(), time.process_time()
            res = t.layer_backward(i, hn, np.arange(a.T), cn, fi)
            jt.append(time.perf_counter() - t0)
            jc.append(time.process_time() - c0)
        peak_warm = sampler.stop() - base
        xla = _xla_memory(t, i, hn, cn, fi) if a.xla_memory else None
        t.unload_layer(i)
        kind = f"{cfg.layer_kind(i).upper()}+{'MoE' if cfg.is_moe(i) else 'dense'}"
        jw, tw = statistics.median(jt), statistics.median(times[1:])
        jcpu, tcpu = statistics.median(jc), statistics.median(ctimes[1:])
        print(f"layer {i} {kind} T={a.T}: JAX first {first:.2f} s, JAX warm {jw:.2f} s, twin first {times[0]:.2f} s, twin warm {tw:.2f} s, "
              f"ratio {jw / tw:.2f}x; CPU time JAX {jcpu:.2f} s, twin {tcpu:.2f} s, ratio {jcpu / tcpu:.2f}x",
              flush=True)
        wg = 2 * wbytes
        print(f"layer {i} {kind} T={a.T} memory: weights+grads {wg / GB:.3f} GB, activations (twin's saved) "
              f"{act / GB:.3f} GB, bound 2x(sum) {2 * (wg + act) / GB:.3f} GB; JAX peak RSS over its start: first call "
              f"{peak_first / GB:.2f} GB = {rss_bound_ratio(peak_first, wbytes, act):.2f}x (loading the layer: peak "
              f"{peak_load / GB:.2f} GB, after it {after_load / GB:.2f} GB), warm calls "
              f"{peak_warm / GB:.2f} GB = {rss_bound_ratio(peak_warm, wbytes, act):.2f}x of (weights+grads+"
              f"activations); twin peak RSS over its start {twin_peak / GB:.2f} GB; JAX outputs: grads "
              f"{_nbytes(res.param_grads.values()) / GB:.3f} GB, d input {res.input_grad.nbytes / GB:.3f} GB, probe "
              f"cotangents {_nbytes(res.points.values()) / GB:.3f} GB ({len(res.points)} sites)", flush=True)
        if xla is not None:
            print(f"layer {i} {kind} T={a.T} XLA memory_analysis: "
                  + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in xla.items()), flush=True)
        del res


def _nbytes(arrays) -> int:
    return sum(np.asarray(v).nbytes for v in arrays)


def _xla_memory(t, i, hn, cn, fi) -> dict[str, int]:
    """memory_analysis() of the layer VJP `ReferenceTarget.layer_backward` runs, lowered on the same arguments."""
    import jax.numpy as jnp

    from parity.backward_cost import xla_memory
    from parity.jax_ling3.spec import dtype_of

    dt = dtype_of(t.dtype)
    f = None if fi is None else jnp.asarray(fi, jnp.int32)
    lowered = t._backward_fn().lower(t.params[i], jnp.asarray(hn, dt), jnp.asarray(np.arange(len(hn[0])), jnp.int32),
                                     jnp.asarray(cn, dt), f, spec=t.spec(i), hf_experts=True)
    return xla_memory(lowered.compile())


if __name__ == "__main__":
    main()
