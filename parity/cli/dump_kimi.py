"""Kimi Linear's dumper (`parity.model.families.KIMI_LINEAR`, issue 34): what `tools/dump_hf.py` runs for a checkpoint
whose config.json says `model_type: kimi_linear` — transformers' built-in `KimiLinearForCausalLM` under the hooks of
`parity.torch_ref.kimi_dump`, which capture the sites `parity.model.kimi_family.SITES` names.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.dump_hf import parse_ids
from parity.errors import ParityError

# The options a Kimi Linear dump takes (issue 34: transformers' built-in `KimiLinearForCausalLM`, its sites as
# `parity.model.kimi_family.SITES` names them); the others are Ling3's (its runtimes, kernels, prompts, --grads).
KIMI_OPTIONS = ("ckpt", "out", "dtype", "prompt_len", "decode_steps", "seed", "force", "no_progress", "ids",
                "runtime", "write_thread", "compression", "inspect", "grads")
# set by the parser pair --cpu-kernels / --no-cpu-kernels (its own default): the built-in runs its torch fallbacks
KIMI_IGNORED = ("cpu_kernels",)
KIMI_PROMPT_LEN = 70  # without --prompt-len / --ids, as tools/kimi_check.py: two chunks of the chunked KDA


def dump_kimi(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt: Path, outs: list[str], cfg,
              argv: list[str] | None) -> int:
    """A Kimi Linear checkpoint (config.json `model_type: kimi_linear`): the built-in's sites of one prompt — the
    prefill, then `--decode-steps` tokens one at a time through its cache, and with `--grads` one training step's
    backward on the prompt (`kimi_dump.capture_backward`) — written per dtype as a Kimi dump
    (`parity.torch_ref.kimi_dump`; the same capture and file as `tools/kimi_check.py --dump`: the same --seed and
    prompt length give the same ids and the same dump). The prompt: `--ids` (one sequence), else `--prompt-len`
    (default 70) seeded random ids, whose decode tokens are seeded too (teacher-forced, not the greedy argmax).
    `cfg`: the checkpoint's `KimiLinearConfig`, validated (`parity.jax_kimi.spec.checkpoint_config`)."""
    import torch

    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import capture_backward, capture_steps, write_kimi_dump

    given = [a for a in vars(args) if a not in KIMI_OPTIONS + KIMI_IGNORED and getattr(args, a) != parser.get_default(a)]
    if given:
        names = ", ".join("--" + a.replace("_", "-") for a in given)
        raise ParityError(f"{ckpt}: a Kimi Linear checkpoint (model_type kimi_linear) is dumped from transformers' "
                          f"built-in with --out, --dtype, --prompt-len or --ids, --decode-steps, --seed, --grads, "
                          f"--force; not with {names}")
    if args.runtime != "remote":
        raise ParityError("--runtime native: a Kimi Linear checkpoint always runs transformers' built-in "
                          "KimiLinearForCausalLM (no checkpoint code); leave --runtime out")
    if args.ids and len(args.ids) > 1:
        raise ParityError(f"--ids given {len(args.ids)} times: a Kimi Linear dump holds one prompt")
    for out, dtype in zip(outs, args.dtype):
        model = load_kimi_model(ckpt, dtype)
        vocab = model.config.vocab_size
        if args.ids:
            prompt = parse_ids(args.ids[0])
            bad = [x for x in prompt if not 0 <= x < vocab]
            if bad or not prompt:
                raise ParityError(f"--ids: {bad[:5] or 'no ids'}: expected ids in the vocabulary 0..{vocab - 1}")
            T = len(prompt)
            tail = torch.randint(3, vocab, (args.decode_steps,), generator=torch.Generator().manual_seed(args.seed))
            ids = torch.tensor([prompt + tail.tolist()])
        else:
            T = args.prompt_len or KIMI_PROMPT_LEN
            ids = torch.randint(3, vocab, (1, T + args.decode_steps), generator=torch.Generator().manual_seed(args.seed))
        if args.grads and T < 2:
            raise ParityError(f"--grads: a prompt of {T} token has no next-token target; the loss needs at least 2")
        steps = capture_steps(model, ids, T)
        backward = capture_backward(model, ids[:, :T]) if args.grads else None
        write_kimi_dump(out, model, ckpt, ids, steps, seed=args.seed, force=args.force, backward=backward)
        print(f"wrote {out}: Kimi Linear ({type(model).__name__}, transformers' built-in), {dtype}, "
              f"{model.config.num_hidden_layers} layers, prompt {T} tokens + {args.decode_steps} decode steps; "
              f"replay: pytest parity --parity-dump {out} --parity-ckpt {ckpt}", flush=True)
    return 0
