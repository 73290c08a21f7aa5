"""Cost of the backward replay per layer kind (issue 26): the reference's `layer_backward` (jax.vjp of the layer,
teacher-forced, routing forced) vs the twin's torch autograd backward of the same layer on the same input and
cotangent (forward + backward, as `loss.backward()` runs it; the JAX VJP also runs the forward). Not a test:
`python tools/backward_cost.py CKPT [--T 512] [--dtype bfloat16] [--reps 3]` (CKPT e.g. a 4-layer Ling3-Tiny
from `tools/make_ckpt.py --preset ling3-tiny --layers 4`). Prints one line per layer: kind, JAX first call (compile +
run), JAX warm (median of reps), twin (median of reps), ratio. `--layers 3` measures only layer 3."""

from __future__ import annotations

import argparse
import statistics
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
        times = []
        print(f"layer {i}: twin backward ...", file=__import__("sys").stderr, flush=True)
        for _ in range(a.reps):
            x = h.clone().requires_grad_(True)
            lay.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = lay(x, attention_mask=None, position_embeddings=pos_emb)[0]
            out.backward(cot)
            times.append(time.perf_counter() - t0)
        if hk is not None:
            hk.remove()
        fi = None if "idx" not in topk else np.sort(topk["idx"].numpy(), -1).astype(np.int32)
        print(f"layer {i}: twin {times}; JAX ...", file=__import__("sys").stderr, flush=True)
        t.load_layer(i, r.hf_tensors(i))
        hn = h.float().numpy() if a.dtype == "float32" else h.view(torch.int16).numpy().view("bfloat16")
        cn = cot.float().numpy() if a.dtype == "float32" else cot.view(torch.int16).numpy().view("bfloat16")
        t0 = time.perf_counter()
        t.layer_backward(i, hn, np.arange(a.T), cn, fi)
        first = time.perf_counter() - t0
        jt = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            t.layer_backward(i, hn, np.arange(a.T), cn, fi)
            jt.append(time.perf_counter() - t0)
        t.unload_layer(i)
        kind = f"{cfg.layer_kind(i).upper()}+{'MoE' if cfg.is_moe(i) else 'dense'}"
        jw, tw = statistics.median(jt), statistics.median(times)
        print(f"layer {i} {kind}: JAX first {first:.2f} s, JAX warm {jw:.2f} s, twin {tw:.2f} s, "
              f"ratio {jw / tw:.2f}x", flush=True)


if __name__ == "__main__":
    main()
