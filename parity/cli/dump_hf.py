"""`tools/dump_hf.py CKPT_DIR --out FILE.h5`: capture per-layer activations of a Ling3 HF model into HDF5.

With --runtime remote (the default) this runs the checkpoint's own Python files (config.json auto_map: for a real
Ling3 checkpoint the official modeling_bailing_moe_v3.py and configuration_bailing_moe_v3.py) in this process, which
needs --trust-remote-code unless they are the suite's own twin byte for byte (the bundled checkpoints, and those
tools/make_ckpt.py writes). --runtime native runs transformers' built-in bailing_hybrid and no checkpoint code.
Bad options are one line and exit status 2; nothing is written under --out unless the dump completes.
The checkpoint's family (config.json `model_type`, `parity.model.families`) picks the config check and the dumper:
Ling3's is `dump_ling3` here, Kimi Linear's `parity.cli.dump_kimi` (transformers' built-in `KimiLinearForCausalLM`).
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

import numpy as np

from parity.errors import ParityError
from parity.model import families
from parity.model.points import parse_layers


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2), like every other refusal of this tool."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog.removesuffix('.py')}: error: {message} (see --help)\n")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {lo}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v}: expected an integer >= {lo}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def check_sites(patterns: list[str], cfg, layers: list[int], grads: bool = False) -> None:
    """Every --sites pattern must match a canonical site of the dumped layers (or a model-level site); with --grads
    also a weight gradient's site (`grad.<HF parameter name>`, e.g. 'grad.*' or 'grad.attention.*')."""
    from parity.model.points import MODEL_SITES_AFTER, MODEL_SITES_BEFORE, sites_for_config

    universe = list(MODEL_SITES_BEFORE + MODEL_SITES_AFTER)
    for i in layers:
        universe += [s for s in sites_for_config(cfg, i, recorded_inputs=True) if s not in universe]
    for p in patterns:
        if not p:
            raise ParityError("--sites: an empty pattern; expected comma-separated glob patterns such as "
                              "'attention.*,mlp'")
        if grads and p.startswith("grad"):
            continue  # a weight gradient's name (the parameter names are known once the model loads)
        if not any(fnmatch.fnmatchcase(s, p) for s in universe):
            raise ParityError(f"--sites: pattern {p!r} matches no site of the dumped layers; expected glob patterns "
                              f"over the canonical site names ({', '.join(universe[:6])}, ... see parity/model/points.py)")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ParityError(f"--ids {text[:40]!r}: expected comma- or space-separated integers") from None


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def parse_dtypes(text: str) -> list[str]:
    """`--dtype bf16` or `--dtype fp32,bf16` -> torch-style names, each once, in the order given."""
    out = []
    for part in (t.strip() for t in text.split(",")):
        if part not in DTYPES:
            raise argparse.ArgumentTypeError(f"{part!r}: expected bf16 or fp32 (or a comma-separated list of them)")
        if DTYPES[part] not in out:
            out.append(DTYPES[part])
    return out


def dtype_outputs(out: str, dtypes: list[str]) -> list[str]:
    """One output path per dtype: --out itself for one dtype; with several, '{dtype}' in --out replaced by bf16 /
    fp32, else OUT's stem + '-fp32' / '-bf16' (tiny.h5 -> tiny-fp32.h5, tiny-bf16.h5)."""
    if len(dtypes) == 1 and "{dtype}" not in out:
        return [out]
    if "{dtype}" in out:
        return [out.replace("{dtype}", SHORT[d]) for d in dtypes]
    p = Path(out)
    return [str(p.with_name(f"{p.stem}-{SHORT[d]}{p.suffix or '.h5'}")) for d in dtypes]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dump_hf.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", nargs="?",
                   help="checkpoint directory (config.json + safetensors, remote code for --runtime remote)")
    p.add_argument("--out", help="output HDF5 file (never overwritten without --force); required unless --inspect")
    p.add_argument("--inspect", metavar="DUMP",
                   help="print a dump's provenance (runtime, device, dtype, which KDA kernels ran) and exit")
    p.add_argument("--runtime", choices=["remote", "native"], default="remote",
                   help="remote: the checkpoint's own code (official file or the twin, see --trust-remote-code); "
                        "native: transformers' built-in bailing_hybrid (no checkpoint code), Flash-shaped only — "
                        "checkpoints with q-LoRA (q_lora_rank set) or SwiGLU clamp limits are refused before loading; "
                        "it has no MTP layer")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the checkpoint's own Python files (config.json auto_map: for a real checkpoint the "
                        "official modeling_bailing_moe_v3.py and configuration_bailing_moe_v3.py, and any other .py "
                        "file in the directory) in this process; required by --runtime remote unless they are the "
                        "suite's twin byte for byte (bundled dumps/ckpt/*, tools/make_ckpt.py output)")
    p.add_argument("--cpu-kernels", dest="cpu_kernels", action="store_true", default=None,
                   help="run the remote code through the suite's pure-PyTorch fla stand-ins (default: where fla's "
                        "Triton kernels cannot run: no real fla + triton, or no CUDA device and no TRITON_INTERPRET=1)")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="never install the stand-ins: the remote code imports fla itself (real kernels on CUDA or "
                        "under TRITON_INTERPRET=1)")
    p.add_argument("--allow-tf32", action="store_true",
                   help="fp32 on CUDA: leave TF32 dots allowed (default: IEEE fp32 forced for torch and Triton); "
                        "recorded in the dump's `kernels` attr")
    p.add_argument("--allow-bf16-reduced-precision-reduction", action="store_true",
                   help="on CUDA: leave torch's allow_bf16_reduced_precision_reduction as found (default: turned "
                        "off, so bf16 GEMMs reduce in fp32 as the CPU reference does); recorded in the dump's "
                        "`kernels` attr (bf16_gemm)")
    p.add_argument("--kda-chunk-precision", choices=["fp32", "kernel"], default="fp32",
                   help="how the fla CPU stand-ins' chunk_kda (prompts over 64 tokens) rounds its intermediates: fp32 "
                        "(default, the maths) or kernel (fla's chunked Triton kernels' bf16 rounding points); "
                        "recorded as the dump's semantics fork kda_chunk_precision. Real fla kernels always round "
                        "as the kernel does")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (device_map=auto across GPUs)")
    p.add_argument("--dtype", default="bf16", type=parse_dtypes,
                   help="bf16 | fp32, or a comma-separated list (fp32,bf16: a pair of dumps of the same prompt in one "
                        "go, OUT-fp32.h5 and OUT-bf16.h5 — or --out with '{dtype}' in it — for triage across tiers)")
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--prompt", action="append", help="prompt text (tokenizer from the checkpoint); repeatable")
    src.add_argument("--ids", action="append", help="token ids, comma-separated; repeatable")
    src.add_argument("--prompt-file", help="text file, one prompt per line")
    src.add_argument("--builtin-prompt", choices=["long", "short"],
                     help="long (default): 320 position-sensitive tokens of the checkpoint's tokenizer (five 64-token "
                          "KDA chunks); short: 40 built-in ids (<= 64: the recurrent KDA path)")
    src.add_argument("--prompt-len", type=_int_at_least(1),
                     help="built-in deterministic ids of this length (recurring motif, seed --seed) instead")
    p.add_argument("--decode-steps", type=_int_at_least(0), default=4)
    p.add_argument("--continuation", help="teacher-forced decode ids (comma-separated) instead of greedy")
    p.add_argument("--layers", help="layers to dump, e.g. 0-3,7 (default all)")
    p.add_argument("--sites", help="site glob patterns, comma-separated, e.g. 'attention.*,mlp' (default all)")
    p.add_argument("--stats-only", action="store_true", help="per-point statistics only, no tensors (huge models)")
    p.add_argument("--grads", action="store_true",
                   help="after the prefill, one backward pass of the next-token cross-entropy over the prompt (fp32, "
                        "mean; the root attr `backward` records it) through the same runtime, written as the "
                        "`backward` phase: the cotangent of every canonical site the runtime exposes as a live "
                        "tensor, and every parameter's gradient under its HF name (grad.<name>); with --layers only "
                        "those layers' backward points (the pass still runs through the whole model); decode steps "
                        "are unchanged. Needs a prompt of at least 2 tokens")
    p.add_argument("--mtp-loss-scale", type=float, metavar="F",
                   help="with --grads: add the MTP layer's loss scaled by F > 0 (the official training loss with "
                        "mtp_loss_scaling_factor = F, labels = the prompt: its MTP logits at t scored against token "
                        "t+2) and write the MTP layer's backward points (/backward/MTP0/...). Opt-in: a checkpoint's "
                        "config says 0 (training only). One prompt of at least 3 tokens, every layer dumped")
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
    if args.prompt_len is not None:
        seqs.append(builtin_ids(vocab_size, args.prompt_len, seed=args.seed).tolist()[0])
    builtin = args.builtin_prompt or (None if (texts or seqs) else "long")
    tokenizer = None
    if texts or builtin:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=bool(args.trust_remote_code))
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


def check_remote_code(args, ckpt: Path) -> None:
    """--runtime remote runs the checkpoint's code: only with --trust-remote-code, or when it is the suite's twin."""
    from parity.torch_ref.remote_code import describe_code, twin_mismatch

    if args.runtime != "remote" or args.trust_remote_code:
        return
    why = twin_mismatch(ckpt)
    if why:
        raise ParityError(f"{ckpt}: --runtime remote would run the checkpoint's own Python code "
                          f"({describe_code(ckpt)}; {why}); pass --trust-remote-code if you trust it, or use "
                          "--runtime native (transformers' built-in bailing_hybrid, no checkpoint code)")


def inspect_lines(path: str) -> list[str]:
    """What `--inspect DUMP` prints: the dump's runtime, device, dtype and kernel provenance."""
    from parity.dumpfile import DumpReader
    from parity.provenance import kernels_line

    with DumpReader(path) as d:
        m = d.meta
        return [f"{path}: runtime {m.get('runtime')}, model {m.get('model_class')}, device {m.get('device')}, "
                f"dtype {m.get('compute_dtype')}, torch {m.get('torch_version')}, "
                f"transformers {m.get('transformers_version')}",
                f"  kernels: {kernels_line(d.kernels)}"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.inspect is not None:
        try:
            print("\n".join(inspect_lines(args.inspect)))
        except ParityError as e:
            print(f"dump_hf: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.ckpt is None or args.out is None:
        parser.error("the checkpoint directory and --out are required (or --inspect DUMP)")
    try:
        from parity.dumpfile import check_output_path

        # everything that can be refused is refused before the model loads (seconds to minutes)
        outs = [check_output_path(o, force=args.force) for o in dtype_outputs(args.out, args.dtype)]
        ckpt = Path(args.ckpt)
        # the checkpoint's family (config.json model_type) validates its config and dumps it (parity.model.families)
        family = families.of_checkpoint(ckpt)
        cfg = family.entry("config")(ckpt)
        return family.entry("dump")(parser, args, ckpt, outs, cfg, argv)
    except ParityError as e:
        print(f"dump_hf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the writer removed its temporary file on the way out
        print(f"dump_hf: interrupted; nothing was written under {args.out}", file=sys.stderr)
        return 130


def dump_ling3(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt: Path, outs: list[str], cfg,
               argv: list[str] | None) -> int:
    """Ling3's dumper (`parity.model.families.LING3`): the checkpoint's runtime (its own files, or the built-in
    `bailing_hybrid` with --runtime native) under the suite's hooks, one dump per dtype of `outs`. `cfg`: its
    validated `Ling3Config`. Refusals raise `ParityError` (one line, exit status 2 in `main`)."""
    from parity.dumpfile import clean_stale_temp_files

    layers = parse_layers(args.layers)
    bad = [i for i in layers or () if i >= cfg.num_hidden_layers]
    if bad:
        raise ParityError(f"--layers {args.layers!r}: layer(s) {bad} out of range; the model has layers "
                          f"0..{cfg.num_hidden_layers - 1}")
    sites = [s.strip() for s in args.sites.split(",")] if args.sites is not None else None
    if sites is not None:
        check_sites(sites, cfg, layers if layers is not None else list(range(cfg.num_hidden_layers)), args.grads)
    check_remote_code(args, ckpt)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # transformers' own "Loading weights" bar too
    if args.runtime == "native":
        from parity.torch_ref.dump import check_native_supports

        check_native_supports(cfg, ckpt)  # before tokenizing or loading anything
    seqs = collect_ids(args, ckpt, cfg.vocab_size)
    if args.grads and min(len(s) for s in seqs) < 2:
        raise ParityError(f"--grads: a prompt of {min(len(s) for s in seqs)} token has no next-token target; "
                          "the loss needs at least 2 tokens")
    for out in outs:
        for note in clean_stale_temp_files(out):
            print(f"dump_hf: note: {note}", file=sys.stderr)

    from parity.torch_ref.dump import DumpOptions, dump_checkpoint

    summaries = []
    for out, dtype in zip(outs, args.dtype):  # a pair: the same prompt and options, one dump per dtype
        opts = _options(args, dtype, layers, sites)
        command = "dump_hf.py " + " ".join(argv or sys.argv[1:])
        if len(outs) > 1:
            command += f"  (the {SHORT[dtype]} dump of this command)"
        summaries.append(dump_checkpoint(ckpt, out, seqs, opts, extra_meta={"command": command}))
    for summary in summaries:
        _print_summary(summary)
    if len(summaries) > 1:
        print("  replay the pair in one run for the triage across tiers: pytest parity "
              + " ".join(f"--parity-dump {x.path}" for x in summaries))
    return 0


def _options(args, dtype: str, layers, sites):
    from parity.torch_ref.dump import DumpOptions

    return DumpOptions(
        runtime=args.runtime, cpu_kernels=args.cpu_kernels, device=args.device,
        dtype=dtype,
        layers=layers, sites=sites,
        decode_steps=args.decode_steps,
        continuation_ids=parse_ids(args.continuation) if args.continuation else None,
        stats_only=args.stats_only, cache_snapshots=not args.no_cache_snapshots, force=args.force,
        write_thread={"auto": None, "on": True, "off": False}[args.write_thread], compression=args.compression,
        seed=args.seed, progress=not args.no_progress, trust_remote_code=args.trust_remote_code,
        allow_tf32=args.allow_tf32, kda_chunk_precision=args.kda_chunk_precision, grads=args.grads,
        mtp_loss_scale=args.mtp_loss_scale,
        allow_bf16_reduced_precision_reduction=args.allow_bf16_reduced_precision_reduction,
    )


def _print_summary(summary) -> None:
    print(f"wrote {summary.path} ({summary.bytes / 1e6:.2f} MB, {summary.points} points; "
          f"load {summary.seconds_load:.1f}s, forward+capture {summary.seconds_forward:.1f}s)")
    if summary.kernels is not None:
        from parity.provenance import kernels_line

        print(f"  kernels: {kernels_line(summary.kernels)}")
    if summary.unavailable:
        print(f"  {len(summary.unavailable)} point(s) unavailable in this runtime (recorded in the file)")
    if summary.semantics is not None:
        from parity.model.semantics import summarize

        print(f"  {summarize(summary.semantics)}")


if __name__ == "__main__":
    raise SystemExit(main())
