"""The JAX Kimi Linear reference against transformers' built-in on a checkpoint directory, site by site (issue 34).

    python tools/kimi_check.py CKPT [--dtype bfloat16|float32] [--T 70] [--seed 0] [--conv-kernel torch|fused]
        [--mode layer|isolated|free] [--target package.module:Class] [--grads]
        [--dump OUT.h5 [--force] | --from-dump DUMP.h5]

CKPT: a Kimi Linear checkpoint (`tools/make_ckpt.py --family kimi-linear --preset tiny|48b-a3b ...`), loaded by
transformers' own loader in `--dtype` with eager attention and experts. One prompt of T random token ids (seeded) runs
through the built-in; every decoder layer of the JAX reference is fed the built-in's layer input and judged at each
site under Ling3's calibrated layer-mode rules (`parity.jax_kimi.check`), jitted with the reference's XLA options,
MoE layers routed to the built-in's experts; then the model-level sites (the embedding, the final norm on the last
layer's output, the head on the final norm). Prints one line per layer and site (pass, or the verdict's message) and
how many tokens the JAX router alone routes elsewhere; exits 1 if any site fails, 2 on bad input. `--dump` also
writes the built-in's sites as a Kimi dump (the dump schema of DESIGN §4, `parity.torch_ref.kimi_dump`);
`--from-dump` judges against such a dump without running the built-in (its fingerprint must be CKPT's). `--target`
judges a port's Kimi target (`parity.targets.kimi`: its protocol) in layer mode instead of the reference. `--grads`
adds the backward: each layer's input and parameter gradients, the built-in's autograd against the reference's VJP
(one seeded cotangent per layer), under the gradient rules a `--grads` replay applies.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kimi_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--T", type=int, default=70, help="prompt length (default 70: two chunks of the chunked KDA)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids")
    ap.add_argument("--conv-kernel", default="torch", choices=("torch", "fused"),
                    help="the short conv's rounding point the JAX side mirrors (parity.jax_kimi.spec)")
    ap.add_argument("--mode", default="layer", choices=("layer", "isolated", "free"),
                    help="layer: each layer fed the built-in's layer input (default); isolated: each sub-module fed "
                         "the built-in's input of it; free: the JAX layers chained from layer 0's input")
    ap.add_argument("--target", default=None, metavar="package.module:Class",
                    help="judge this Kimi target (parity.targets.kimi; layer mode) instead of the suite's reference")
    ap.add_argument("--decode-steps", type=int, default=0, metavar="N",
                    help="after the prompt, N tokens decoded one at a time through the built-in's cache, each judged "
                         "(layer mode, the reference continuing from its own state)")
    ap.add_argument("--grads", action="store_true",
                    help="also the backward: every layer's input and parameter gradients (torch autograd vs jax.vjp)")
    ap.add_argument("--dump", metavar="OUT.h5", default=None,
                    help="also write the built-in's sites to OUT.h5 (a Kimi dump, parity.torch_ref.kimi_dump)")
    ap.add_argument("--force", action="store_true", help="with --dump: replace an existing file")
    ap.add_argument("--from-dump", metavar="DUMP.h5", default=None,
                    help="judge against a Kimi dump of CKPT instead of running the built-in (its prompt and dtype)")
    a = ap.parse_args(argv)
    if a.target and a.mode != "layer":
        print(f"kimi_check: error: --target judges layer mode (a target's layer_forward); --mode {a.mode} runs the "
              "reference's sub-modules", file=sys.stderr)
        return 2
    if a.grads and (a.target or a.from_dump or a.mode != "layer"):
        print("kimi_check: error: --grads runs the built-in's autograd live beside the reference's VJP (layer mode; "
              "not with --target or --from-dump)", file=sys.stderr)
        return 2
    if a.decode_steps and (a.target or a.mode != "layer" or a.from_dump):
        print("kimi_check: error: --decode-steps judges the reference in layer mode on a live run (a dump brings "
              "its own decode steps to --from-dump)", file=sys.stderr)
        return 2
    if a.dump and a.from_dump:
        print("kimi_check: error: --dump and --from-dump exclude each other (a dump is written from a live run)",
              file=sys.stderr)
        return 2

    import torch

    from parity.errors import CheckpointError, ConfigError, DumpError, ParityError, TargetError
    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import capture_steps, read_kimi_dump, write_kimi_dump

    t0 = time.perf_counter()
    target = None
    try:
        if a.target:
            from parity.targets import resolve

            target = resolve(a.target)()
        if a.from_dump:
            steps, ids, T = read_kimi_dump(a.from_dump, a.ckpt)
            sites = steps[0]
            dtype = "bfloat16" if str(sites[(0, "input")].dtype) == "bfloat16" else "float32"
            model = load_kimi_model(a.ckpt, dtype)  # its weights only: the JAX layers' parameters
            source = f"dump {a.from_dump}"
        else:
            dtype = a.dtype
            model = load_kimi_model(a.ckpt, dtype)
            T = a.T
            ids = torch.randint(3, model.config.vocab_size, (1, T + a.decode_steps),
                                generator=torch.Generator().manual_seed(a.seed))
            steps = capture_steps(model, ids, T)
            sites = steps[0]
            source = "built-in run"
            if a.dump:
                write_kimi_dump(a.dump, model, a.ckpt, ids, steps, seed=a.seed, force=a.force)
                source += f", written to {a.dump}"
    except (CheckpointError, ConfigError, DumpError, TargetError) as e:
        print(f"kimi_check: error: {e}", file=sys.stderr)
        return 2
    if target is not None:
        target.build(model.config, dtype)
    cfg = model.config
    who = f"target {a.target}" if target is not None else "the reference"
    print(f"{a.ckpt}: {cfg.num_hidden_layers} layers, {dtype}, T={T} + {len(steps) - 1} decode, {a.mode} mode, {who}; "
          f"{source} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    try:
        failed = _judge_layers(model, steps, dtype, a.mode, a.conv_kernel, T, target, ids if a.grads else None,
                               a.seed, ids=ids)
    except ParityError as e:
        print(f"kimi_check: error: {e}", file=sys.stderr)
        return 2
    print(f"{failed} site(s) failed" if failed else "every site passed")
    return 1 if failed else 0


def _judge_layers(model, steps: list, dtype: str, mode: str, conv_kernel: str, T: int, target=None, grad_ids=None,
                  seed: int = 0, ids=None) -> int:
    """Print every layer's verdicts in `mode` (pass, variant or FAIL: `parity.jax_kimi.check.SiteResult`), then the
    model-level sites' (the embedding, the final norm, the head; the reference only, with `ids`); the number of
    failed sites."""
    from parity.jax_kimi.check import (decode_verdicts, free_verdicts, grad_verdicts, isolated_verdicts,
                                       layer_verdicts, model_verdicts)

    sites = steps[0]

    cfg = model.config
    sd = model.state_dict()
    ids_np = None if ids is None else (ids.numpy() if hasattr(ids, "numpy") else ids)
    if mode == "free":
        free = free_verdicts(sd, cfg, sites, dtype, conv_kernel, jit=True, ids=None if target else ids_np)
        per_layer = iter(free)
    failed = 0
    for i in range(cfg.num_hidden_layers):
        kind = f"{'KDA' if cfg.layer_types[i] == 'linear_attention' else 'MLA'}+{cfg.mlp_layer_types[i]}"
        if mode == "layer":
            verdicts, flips = layer_verdicts(sd, cfg, sites, i, dtype, conv_kernel, jit=True, target=target)
        elif mode == "isolated":
            verdicts, flips = isolated_verdicts(sd, cfg, sites, i, dtype, conv_kernel), None
        else:
            verdicts, flips = next(per_layer)
        if flips is not None:
            how = ("the MLP is judged routed to the built-in's experts, as a layer replay is" if mode == "layer"
                   else "its own routing flows on")
            print(f"layer {i} {kind} routing: the JAX router on its own input chooses another expert set at {flips} of "
                  f"{T} tokens ({how})", flush=True)
        if grad_ids is not None:
            verdicts = verdicts | grad_verdicts(model, grad_ids, sites, i, dtype, seed, conv_kernel)
        if len(steps) > 1 and mode == "layer" and target is None:
            for k, step in enumerate(decode_verdicts(sd, cfg, steps, i, dtype, conv_kernel), start=1):
                verdicts = verdicts | {f"decode {k}/{s}": r for s, r in step.items()}
        failed += _print_verdicts(f"layer {i} {kind}", verdicts)
    if target is None and ids_np is not None and (None, "logits") in sites:
        if mode == "free":
            verdicts = free[cfg.num_hidden_layers][0]
        else:
            verdicts = model_verdicts(sd, cfg, steps if mode == "layer" else steps[:1], ids_np, dtype, mode)
        failed += _print_verdicts("model", verdicts)
    return failed


def _print_verdicts(where: str, verdicts: dict) -> int:
    """One line per site (pass, variant, not provided, or FAIL with its message); the number that failed."""
    failed = 0
    for site, res in verdicts.items():
        v = res.verdict
        failed += res.status == "fail"
        if res.status == "not provided":
            print(f"{where} {site}: not provided by the target", flush=True)
        elif res.status == "pass":
            print(f"{where} {site}: pass (bit-exact {v.frac_exact:.1%}, max {v.max_ulp} ULP)", flush=True)
        elif res.status == "variant":
            e = res.precision
            print(f"{where} {site}: variant, more precise than the reference (error vs the fp32 shadow "
                  f"{e['ratio']:.4f}x the built-in's, allowed {e['allowed_ratio']}; bit-exact {v.frac_exact:.1%})",
                  flush=True)
        else:
            print(f"{where} {site}: FAIL\n    " + res.message().replace("\n", "\n    "), flush=True)
    return failed
