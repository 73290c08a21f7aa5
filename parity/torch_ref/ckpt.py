"""Random Ling3 checkpoints in the official layout (facts sheet §7), for the bundled tiny models and for real shapes.

`make_checkpoint` writes: sharded `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, `config.json`
with `auto_map` pointing at the twin remote code (copied in) and NO `layer_types` key (official_remote_code.md §1.6),
`generation_config.json`, and a small deterministic byte-level tokenizer that `AutoTokenizer` loads offline.

Determinism: every tensor is drawn from its own `numpy.random.Generator(PCG64(SeedSequence([seed, crc32(name)])))`,
so a tensor depends only on (seed, name, shape) — not on shard layout or on `layers`; JSON is written with sorted keys
and safetensors with fixed metadata. Same arguments -> byte-identical directory.

Streaming: the shard plan is computed from shapes alone; tensors are generated and written one shard at a time, so
peak memory is one shard (the 24-layer ling3-tiny checkpoint is ~16 GB).

Scales (chosen so activations stay of order 1 in every layer; `tests/test_make_ckpt.py` measures it): linear weights
N(0, 1/in); embeddings N(0, 1); norm weights 1 + N(0, 0.05²); KDA `A_log = log U(1, 16)` (the official init, §3),
`dt_bias` N(0, 0.1²), conv weights N(0, 0.35²); router N(0, 1/D) with `expert_bias` U(−0.1, 0.1) (spread, but smaller
than the logit-driven score spread, so routing is neither degenerate nor bias-driven).
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.errors import CheckpointError, ConfigError, ParityError
from parity.model.config import ALIASES, PRESETS, Ling3Config, field_value_error
from parity.torch_ref.atomic_dir import refuse_existing, written_atomically

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
DTYPES = {"bfloat16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
CKPT_PRESETS = ("tiny", "tiny-flash", "ling3-tiny")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # linear | embed | norm | a_log | dt_bias | conv | router | expert_bias


def resolve_config(preset_or_config: str | dict | Ling3Config, layers: int | None = None,
                   overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict (official field names) for a preset name / config dict / Ling3Config, with `overrides`
    (field -> value, each type-checked by `field_value_error`, then the whole config validated) applied, optionally
    cut to `layers` main layers (SwiGLU limit lists cut alike)."""
    if isinstance(preset_or_config, str):
        if preset_or_config not in PRESETS:
            raise ConfigError(f"preset '{preset_or_config}': unknown, expected one of {sorted(PRESETS)}")
        d = dict(PRESETS[preset_or_config])
    elif isinstance(preset_or_config, Ling3Config):
        d = preset_or_config.to_dict()
    elif isinstance(preset_or_config, dict):
        d = dict(preset_or_config)
    else:
        raise ConfigError(f"make_checkpoint: expected a preset name, config dict or Ling3Config, got {type(preset_or_config).__name__}")
    d.pop("layer_types", None)  # official_remote_code.md §1.6
    for key, value in (overrides or {}).items():
        err = field_value_error(key, value)
        if err:
            raise ConfigError(f"--set {err}")
        d[ALIASES.get(key, key)] = value
    if layers is not None:
        n = d["num_hidden_layers"]
        if not isinstance(layers, int) or not 1 <= layers <= n:
            raise ConfigError(f"layers = {layers!r}: expected an integer in 1..num_hidden_layers = {n}")
        d["num_hidden_layers"] = layers
        for lst in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if d.get(lst) is not None:
                d[lst] = list(d[lst])[:layers]
    Ling3Config.from_dict(d, source="checkpoint config")  # validate (raises ConfigError)
    return d


def checkpoint_tensors(cfg: Ling3Config) -> list[TensorSpec]:
    """Every tensor of the official checkpoint (§7) in file order, MTP layer `model.layers.{N}` included (§2, §10.10)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    out = [TensorSpec("model.word_embeddings.weight", (cfg.vocab_size, D), "embed")]

    def lin(name, o, i):
        out.append(TensorSpec(name, (o, i), "linear"))

    def norm(name, n):
        out.append(TensorSpec(name, (n,), "norm"))

    def mla(p):
        r, c = cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora:
            lin(p + "attention.q_a_proj.weight", cfg.q_lora_rank, D)
            norm(p + "attention.q_a_layernorm.weight", cfg.q_lora_rank)
            lin(p + "attention.q_b_proj.weight", H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            lin(p + "attention.q_proj.weight", H * cfg.qk_head_dim, D)
        lin(p + "attention.kv_a_proj_with_mqa.weight", c + r, D)
        norm(p + "attention.kv_a_layernorm.weight", c)
        lin(p + "attention.kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), c)
        lin(p + "attention.g_proj.weight", H, D)
        lin(p + "attention.dense.weight", D, H * cfg.v_head_dim)

    def kda(p):
        P, d, W = cfg.kda_proj_size, cfg.head_dim, cfg.short_conv_kernel_size
        for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
            lin(p + f"attention.{n}.weight", P, D)
        lin(p + "attention.b_proj.weight", H, D)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            out.append(TensorSpec(p + f"attention.{n}.weight", (P, 1, W), "conv"))
        out.append(TensorSpec(p + "attention.A_log", (H,), "a_log"))
        out.append(TensorSpec(p + "attention.dt_bias", (P,), "dt_bias"))
        norm(p + "attention.o_norm.weight", d)
        lin(p + "attention.o_proj.weight", D, P)

    def mlp(p, size):
        lin(p + "gate_proj.weight", size, D)
        lin(p + "up_proj.weight", size, D)
        lin(p + "down_proj.weight", D, size)

    def moe(p):
        out.append(TensorSpec(p + "mlp.gate.weight", (cfg.num_experts, D), "router"))
        out.append(TensorSpec(p + "mlp.gate.expert_bias", (cfg.num_experts,), "expert_bias"))
        for e in range(cfg.num_experts):
            mlp(p + f"mlp.experts.{e}.", cfg.moe_intermediate_size)
        if cfg.has_shared_expert:
            mlp(p + "mlp.shared_experts.", cfg.shared_intermediate_size)

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", D)
        (mla if cfg.layer_kind(i) == "mla" else kda)(p)
        norm(p + "post_attention_layernorm.weight", D)
        moe(p) if cfg.is_moe(i) else mlp(p + "mlp.", cfg.intermediate_size)
    for p in cfg.mtp_key_prefixes():
        lin(p + "eh_proj.weight", D, 2 * D)
        norm(p + "enorm.weight", D)
        norm(p + "hnorm.weight", D)
        norm(p + "input_layernorm.weight", D)
        mla(p)
        norm(p + "post_attention_layernorm.weight", D)
        moe(p)
        norm(p + "final_layernorm.weight", D)
    norm("model.norm.weight", D)
    lin("lm_head.weight", cfg.vocab_size, D)
    return out


def draw(spec: TensorSpec, seed: int) -> np.ndarray:
    """The fp32 values of one tensor; depends only on (seed, name, shape)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.name.encode())])))
    shape = spec.shape
    if spec.init == "linear":
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1])))
    if spec.init == "embed":
        return rng.standard_normal(shape, dtype=np.float32)
    if spec.init == "norm":
        return (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if spec.init == "a_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if spec.init == "dt_bias":
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if spec.init == "conv":
        return (0.35 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if spec.init == "router":
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1])))
    if spec.init == "expert_bias":
        return rng.uniform(-0.1, 0.1, shape).astype(np.float32)
    raise ValueError(f"unknown init kind {spec.init!r} for {spec.name}")


def plan_shards(specs: list[TensorSpec], itemsize: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy shard plan in file order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = int(np.prod(s.shape)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes
    return shards


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def build_tokenizer_files(out: Path, vocab_size: int, pad_id: int | None, eos_id: int | None) -> None:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + <|pad|> / <|endoftext|> at the config's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {}
    if pad_id is not None:
        specials["<|pad|>"] = int(pad_id)
    if eos_id is not None and eos_id != pad_id:
        specials["<|endoftext|>"] = int(eos_id)
    taken = set(specials.values())
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    nxt = 0
    for ch in byte_chars:
        while nxt in taken:
            nxt += 1
        vocab[ch] = nxt
        nxt += 1
    vocab.update(specials)
    if max(vocab.values()) >= vocab_size:
        raise ConfigError(f"vocab_size = {vocab_size} cannot hold a 256-byte tokenizer plus special ids {specials}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    inv = {v: k for k, v in specials.items()}
    if pad_id is not None:
        tcfg["pad_token"] = inv[int(pad_id)]
    if eos_id is not None:
        tcfg["eos_token"] = inv[int(eos_id)]
    _write_json(out / "tokenizer_config.json", tcfg)


def make_checkpoint(
    out_dir: str | Path,
    preset_or_config: str | dict | Ling3Config,
    *,
    seed: int,
    layers: int | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random Ling3 checkpoint directory and return its path.

    Refuses (CheckpointError) to replace an existing non-empty `out_dir` unless `force`; with `force` it replaces
    only a directory that looks like a checkpoint (has config.json). Written into a temporary sibling and renamed,
    so a crash never leaves a half-written checkpoint under `out_dir`.
    """
    import torch
    from safetensors.torch import save_file

    from parity.torch_ref import TWIN_DIR, TWIN_FILES

    out = Path(out_dir)
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype = {dtype!r}: expected one of bf16/bfloat16/fp32/float32")
    refuse_existing(out, force)
    d = resolve_config(preset_or_config, layers, overrides)
    cfg = Ling3Config.from_dict(d, source="checkpoint config")
    specs = checkpoint_tensors(cfg)
    shards = plan_shards(specs, DTYPES[dtype], max_shard_bytes)
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    with written_atomically(out) as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        n = len(shards)
        for k, shard in enumerate(shards, start=1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for s in shard:
                tensors[s.name] = torch.from_numpy(draw(s, seed)).to(tdtype).contiguous()
                total += tensors[s.name].numel() * tensors[s.name].element_size()
                weight_map[s.name] = fname
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})

        conf = dict(d)
        conf.pop("layer_types", None)
        conf.update(
            architectures=["BailingMoeV3ForCausalLM"],
            model_type="bailing_hybrid",
            torch_dtype=dtype,
            auto_map={
                "AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
                "AutoModel": "modeling_bailing_moe_v3.BailingMoeV3Model",
                "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM",
            },
        )
        _write_json(tmp / "config.json", conf)
        gen = {"do_sample": False}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if conf.get(key) is not None:
                gen[key] = conf[key]
        _write_json(tmp / "generation_config.json", gen)
        build_tokenizer_files(tmp, cfg.vocab_size, cfg.pad_token_id,
                              cfg.eos_token_id if not isinstance(cfg.eos_token_id, list) else cfg.eos_token_id[0])
        for f in TWIN_FILES:
            shutil.copyfile(TWIN_DIR / f, tmp / f)
    return out


def directory_digest(path: str | Path) -> dict[str, str]:
    """sha256 of every file under `path` (relative path -> hex digest), for determinism checks."""
    import hashlib

    root = Path(path)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


GATE_FORMS = ("lower-bound", "softplus")


def parse_set(item: str) -> tuple[str, Any]:
    """`key=value` of `--set`: the value is JSON (`null`, `-5.0`, `[1.0, 2.0]`, `true`), else taken as a string."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value (a Ling3 config field, a JSON value)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return key.strip(), value


def cli_overrides(preset: str, sets: list[str], gate_form: str | None, q_lora_rank: str | None,
                  swiglu_clamp: str | None) -> dict[str, Any]:
    """The config overrides of make_ckpt's fork options (facts sheet §3.5 gate form, §4.1 q-LoRA, §5.7 clamp) and its
    `--set` items, in that order (a later `--set` wins)."""
    out: dict[str, Any] = {}
    if gate_form == "softplus":  # Kimi's form: fla picks it by `lower_bound is None` (facts §3.5)
        out["kda_lower_bound"] = None
    elif gate_form == "lower-bound":
        out["kda_lower_bound"] = PRESETS[preset].get("kda_lower_bound") or -5.0
    if q_lora_rank is not None:
        if q_lora_rank in ("none", "null", "off"):
            out["q_lora_rank"] = None
        else:
            try:
                out["q_lora_rank"] = int(q_lora_rank)
            except ValueError:
                raise ConfigError(f"--q-lora-rank {q_lora_rank!r}: expected a positive integer or 'none'") from None
    for item in sets:
        k, v = parse_set(item)
        out[k] = v
    if swiglu_clamp is not None:
        n = out.get("num_hidden_layers", PRESETS[preset]["num_hidden_layers"])
        if swiglu_clamp in ("none", "null", "off"):
            lim = None
        else:
            try:
                lim = [float(swiglu_clamp)] * n
            except ValueError:
                raise ConfigError(f"--swiglu-clamp {swiglu_clamp!r}: expected a limit L > 0 or 'none'") from None
        out["expert_swiglu_limit_list"] = out["share_expert_swiglu_limit_list"] = lim
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: make_ckpt.py --preset {tiny,tiny-flash,ling3-tiny} --seed N --out DIR [--layers N] [--dtype bf16|fp32]
    [--gate-form lower-bound|softplus] [--q-lora-rank N|none] [--swiglu-clamp L|none] [--set key=value ...]
    [--max-shard-mb M] [--modeling twin|official] [--force]."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="make_ckpt.py", description="Write a random Ling3 checkpoint (official layout, "
                                 "twin remote code) — deterministic: same arguments, byte-identical directory.")
    from parity.torch_ref.kimi_ckpt import KIMI_PRESETS

    from parity.model import families

    ap.add_argument("--family", choices=[f.make_ckpt for f in families.FAMILIES], default="ling3",
                    help="ling3 (default): the official layout with the twin's remote code; kimi-linear: "
                         "transformers' built-in KimiLinearForCausalLM written by its save_pretrained (issue 34)")
    ap.add_argument("--preset", required=True, choices=sorted(set(CKPT_PRESETS) | set(KIMI_PRESETS)),
                    help=f"ling3: {', '.join(CKPT_PRESETS)}; kimi-linear: {', '.join(KIMI_PRESETS)}")
    ap.add_argument("--seed", required=True, type=int)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="keep N main layers (the MTP layer is kept too)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**20,
                    help="shard size limit in MiB (default %(default)s)")
    ap.add_argument("--modeling", choices=("twin", "official"), default="twin",
                    help="remote code in the checkpoint: the suite's twin (default) or the official "
                         "modeling_bailing_moe_v3.py from $LING3_OFFICIAL_MODELING or "
                         "~/.cache/ling3-parity/official/ (sha256-verified; never copied into the repository)")
    ap.add_argument("--force", action="store_true", help="replace an existing checkpoint directory")
    ap.add_argument("--keep-layers", default=None, metavar="LIST",
                    help="kimi-linear: the preset's layers to keep, e.g. 0,3 (each with its own kind; renumbered)")
    fk = ap.add_argument_group("config forks (facts sheet; each is a config.json field, validated by the config)")
    fk.add_argument("--gate-form", choices=GATE_FORMS, default=None,
                    help="KDA decay gate: lower-bound (Ling3, kda_lower_bound = the preset's -5) or softplus "
                         "(Kimi's form, kda_lower_bound: null) (facts §3.5)")
    fk.add_argument("--q-lora-rank", default=None, metavar="N|none",
                    help="MLA query path: q-LoRA of rank N (Tiny) or none (a plain q_proj, Flash) (facts §4.1)")
    fk.add_argument("--swiglu-clamp", default=None, metavar="L|none",
                    help="SwiGLU clamp limit L on every layer's routed and shared experts, or none (facts §5.7)")
    fk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any Ling3 config field, VALUE as JSON (null, -5.0, [1.0, 2.0], true); repeatable")
    a = ap.parse_args(argv)
    if families.by_make_ckpt(a.family) == families.KIMI_LINEAR:
        return _main_kimi(a)
    if a.keep_layers is not None:
        print("make_ckpt: error: --keep-layers is a Kimi Linear option (--family kimi-linear); for Ling3 --layers N "
              "keeps the first N layers", file=sys.stderr)
        return 2
    if a.preset not in CKPT_PRESETS:
        print(f"make_ckpt: error: --preset {a.preset}: not a Ling3 preset (expected one of {', '.join(CKPT_PRESETS)}; "
              f"--family kimi-linear for the Kimi Linear ones)", file=sys.stderr)
        return 2
    try:
        if a.modeling == "official":
            from parity.torch_ref import official

            official.locate()  # before writing anything: one line saying how to provide the file
        overrides = cli_overrides(a.preset, a.set, a.gate_form, a.q_lora_rank, a.swiglu_clamp)
        path = make_checkpoint(a.out, a.preset, seed=a.seed, layers=a.layers, dtype=a.dtype,
                               max_shard_bytes=int(a.max_shard_mb * 2**20), force=a.force, overrides=overrides)
        if a.modeling == "official":
            official.install(path)
    except (CheckpointError, ConfigError, ParityError) as e:
        print(f"make_ckpt: error: {e}", file=sys.stderr)
        return 2
    n = len(directory_digest(path))
    print(f"wrote {path} ({n} files)")
    return 0


def _main_kimi(a) -> int:
    """`make_ckpt.py --family kimi-linear`: the built-in Kimi Linear (parity.torch_ref.kimi_ckpt). The Ling3 layout
    options do not apply to it: each given one is refused in one line."""
    import sys

    from parity.torch_ref.kimi_ckpt import make_kimi_checkpoint

    ling3_only = [opt for opt, given in (("--layers", a.layers is not None), ("--gate-form", a.gate_form is not None),
                                         ("--q-lora-rank", a.q_lora_rank is not None),
                                         ("--swiglu-clamp", a.swiglu_clamp is not None), ("--set", bool(a.set)),
                                         ("--modeling", a.modeling != "twin"),
                                         ("--max-shard-mb", a.max_shard_mb != DEFAULT_MAX_SHARD_BYTES / 2**20))
                  if given]
    if ling3_only:
        print(f"make_ckpt: error: {ling3_only[0]} is a Ling3 option; --family kimi-linear takes --preset, --seed, "
              f"--out, --dtype, --keep-layers and --force", file=sys.stderr)
        return 2
    try:
        from parity.model.points import parse_layers

        keep = parse_layers(a.keep_layers, "--keep-layers")
        path = make_kimi_checkpoint(a.out, a.preset, seed=a.seed, dtype=a.dtype, force=a.force, keep_layers=keep)
    except (CheckpointError, ConfigError, ParityError) as e:
        print(f"make_ckpt: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(directory_digest(path))} files)")
    return 0
