"""`tools/dump_hf.py CKPT_DIR --out FILE.h5`: capture per-layer activations of a Ling3 HF model into HDF5."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from parity.errors import ParityError


def parse_layers(text: str | None) -> list[int] | None:
    """"0-3,7" -> [0, 1, 2, 3, 7]."""
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ParityError(f"--layers {text!r}: expected comma-separated layer numbers or ranges like 0-3,7") from None
    return out


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ParityError(f"--ids {text[:40]!r}: expected comma- or space-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dump_hf.py", description=__doc__)
    p.add_argument("ckpt", help="checkpoint directory (config.json + safetensors, remote code for --runtime remote)")
    p.add_argument("--out", required=True, help="output HDF5 file (never overwritten without --force)")
    p.add_argument("--runtime", choices=["remote", "native"], default="remote",
                   help="remote: trust_remote_code (official file or the twin); native: transformers' built-in "
                        "bailing_hybrid, Flash-shaped only — checkpoints with q-LoRA (q_lora_rank set) or SwiGLU clamp "
                        "limits are refused before loading; it has no MTP layer")
    p.add_argument("--cpu-kernels", dest="cpu_kernels", action="store_true", default=None,
                   help="run the remote code through the suite's pure-PyTorch fla stand-ins (default on CPU)")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (device_map=auto across GPUs)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "bfloat16", "float32"])
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--prompt", action="append", help="prompt text (tokenizer from the checkpoint); repeatable")
    src.add_argument("--ids", action="append", help="token ids, comma-separated; repeatable")
    src.add_argument("--prompt-file", help="text file, one prompt per line")
    src.add_argument("--builtin-prompt", choices=["long", "short"],
                     help="long (default): 320 position-sensitive tokens of the checkpoint's tokenizer (five 64-token "
                          "KDA chunks); short: 40 built-in ids (<= 64: the recurrent KDA path)")
    src.add_argument("--prompt-len", type=int,
                     help="built-in deterministic ids of this length (recurring motif, seed --seed) instead")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--continuation", help="teacher-forced decode ids (comma-separated) instead of greedy")
    p.add_argument("--layers", help="layers to dump, e.g. 0-3,7 (default all)")
    p.add_argument("--sites", help="site glob patterns, comma-separated, e.g. 'attention.*,mlp' (default all)")
    p.add_argument("--stats-only", action="store_true", help="per-point statistics only, no tensors (huge models)")
    p.add_argument("--no-cache-snapshots", action="store_true", help="do not record KDA state from the cache")
    p.add_argument("--write-thread", choices=("auto", "on", "off"), default="auto",
                   help="compress + write on a worker thread overlapping the forward (auto: only off-CPU)")
    p.add_argument("--compression", choices=("lzf", "none"), default="lzf",
                   help="HDF5 filter: lzf (+shuffle, default) or none (~10x cheaper writes, ~15%% bigger files)")
    p.add_argument("--force", action="store_true", help="replace an existing dump (only once the new one is complete)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def collect_ids(args, ckpt: Path, vocab_size: int) -> list[list[int]]:
    from parity.torch_ref.prompts import DEFAULT_LONG_TOKENS, builtin_ids, builtin_long_ids

    texts: list[str] = list(args.prompt or [])
    if args.prompt_file:
        try:
            texts += [ln for ln in Path(args.prompt_file).read_text().splitlines() if ln.strip()]
        except OSError as e:
            raise ParityError(f"--prompt-file {args.prompt_file}: cannot read ({e.strerror})") from None
    seqs: list[list[int]] = [parse_ids(s) for s in (args.ids or [])]
    if args.prompt_len:
        seqs.append(builtin_ids(vocab_size, args.prompt_len, seed=args.seed).tolist()[0])
    builtin = args.builtin_prompt or (None if (texts or seqs) else "long")
    tokenizer = None
    if texts or builtin:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        except Exception as e:  # no tokenizer files in the checkpoint
            if texts:
                raise ParityError(f"{ckpt}: cannot load a tokenizer for --prompt ({type(e).__name__}); use --ids") from None
    if builtin == "long":
        if tokenizer is not None:
            seqs.append(builtin_long_ids(tokenizer, DEFAULT_LONG_TOKENS))
            print(f"prompt: built-in long text, {DEFAULT_LONG_TOKENS} tokens of the tokenizer in {ckpt}", flush=True)
        else:
            seqs.append(builtin_ids(vocab_size, DEFAULT_LONG_TOKENS).tolist()[0])
            print(f"prompt: built-in ids, {DEFAULT_LONG_TOKENS} tokens (no tokenizer in {ckpt})", flush=True)
    elif builtin == "short":
        seqs.append(builtin_ids(vocab_size, 40).tolist()[0])
    for t in texts:
        seqs.append(tokenizer(t, add_special_tokens=False)["input_ids"])
    for s in seqs:
        bad = [x for x in s if not 0 <= x < vocab_size]
        if bad:
            raise ParityError(f"input ids {bad[:5]} out of the vocabulary 0..{vocab_size - 1}")
    return seqs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from parity.config import Ling3Config
        from parity.torch_ref.dump import DumpOptions, dump_checkpoint

        ckpt = Path(args.ckpt)
        cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
        if args.runtime == "native":
            from parity.torch_ref.dump import check_native_supports

            check_native_supports(cfg, ckpt)  # before tokenizing or loading anything
        seqs = collect_ids(args, ckpt, cfg.vocab_size)
        opts = DumpOptions(
            runtime=args.runtime, cpu_kernels=args.cpu_kernels, device=args.device,
            dtype={"bf16": "bfloat16", "fp32": "float32"}.get(args.dtype, args.dtype),
            layers=parse_layers(args.layers),
            sites=[s.strip() for s in args.sites.split(",")] if args.sites else None,
            decode_steps=args.decode_steps,
            continuation_ids=parse_ids(args.continuation) if args.continuation else None,
            stats_only=args.stats_only, cache_snapshots=not args.no_cache_snapshots, force=args.force,
            write_thread={"auto": None, "on": True, "off": False}[args.write_thread], compression=args.compression,
            seed=args.seed, progress=not args.no_progress,
        )
        summary = dump_checkpoint(ckpt, args.out, seqs, opts,
                                  extra_meta={"command": "dump_hf.py " + " ".join(argv or sys.argv[1:])})
    except ParityError as e:
        print(f"dump_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.path} ({summary.bytes / 1e6:.2f} MB, {summary.points} points; "
          f"load {summary.seconds_load:.1f}s, forward+capture {summary.seconds_forward:.1f}s)")
    if summary.unavailable:
        print(f"  {len(summary.unavailable)} point(s) unavailable in this runtime (recorded in the file)")
    if summary.semantics is not None:
        from parity.semantics import summarize

        print(f"  {summarize(summary.semantics)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
