"""Load a Ling3 checkpoint directory as one of the PyTorch runtimes, with the guards the official remote code needs
on transformers 5.23 (official_remote_code.md — cited ORC; DESIGN §3), and verify instead of trusting.

Runtimes:
- `remote`: the checkpoint's own `auto_map` code (the official file, or the suite's twin copied into bundled
  checkpoints), `trust_remote_code=True`. Guards: the class must come from the remote module (a `bailing_hybrid`
  config silently builds the built-in otherwise, env_notes); `attn_implementation="eager"` (sdpa makes the official
  MLA bidirectional, ORC §2); an explicit `dtype`; `rope_scaling` forced to a plain None on the config (ORC §1.5);
  no `layer_types` on the config (ORC §1.6); every `*.rotary_emb.inv_freq` buffer recomputed from θ^{-2j/r} after
  loading, its original deviation recorded (5.x leaves it as uninitialised memory, ORC §1.4); with `cpu_kernels` (by
  default where fla's real kernels cannot run: no real fla + triton, or no CUDA device and no TRITON_INTERPRET=1) the
  fla CPU stand-ins + transformers shims are installed first (ORC §1.1–1.3) and stay installed (the capture layer's
  KDA observer needs them).
- `native`: transformers' built-in `bailing_hybrid` from the same official-layout directory, `trust_remote_code=False`
  (its conversion mapping renames the keys), `layer_types` passed explicitly from `Ling3Config.layer_kinds` (the
  built-in cannot place a ragged MLA tail itself, ORC §6). The built-in must not bind to the fla stand-ins (it would
  then no longer be independent): checked.
Both: missing checkpoint keys are an error (they would be silently random); unexpected keys only under the MTP layer.

the causality guard is the dumper's (`parity.torch_ref.dump.causality_guard`); `decode_positions` gives the
explicit positions manual decode needs (ORC §3). HF_HUB_OFFLINE=1 and `local_files_only=True` always.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the hub (DESIGN: offline); also set again at every load

import torch  # noqa: E402

from parity.model.config import Ling3Config  # noqa: E402
from parity.errors import CheckpointError, ConfigError, ParityError  # noqa: E402

RUNTIMES = ("remote", "native")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
BUILTIN_MODULE = "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
NATIVE_LAYER_TYPES = {"kda": "linear_attention", "mla": "full_attention"}


@dataclass
class LoadedModel:
    """A loaded runtime: the HF model (eval mode), its Ling3Config, the runtime name, and what was checked."""

    model: torch.nn.Module
    config: Ling3Config
    runtime: str
    guards: dict[str, Any] = field(default_factory=dict)
    stand_ins: Any = None  # fla_cpu.StandIns when this load installed them
    # remote runtime: (fla CPU stand-ins used, why: the explicit option or the default's reason); None for native
    kernels_choice: tuple[bool, str] | None = None

    def release(self) -> None:
        """Uninstall the fla stand-ins / shims this load installed (the model keeps working: its references are
        bound already)."""
        if self.stand_ins is not None:
            self.stand_ins.uninstall()
            self.stand_ins = None


# ----------------------------------------------------------------------------------------------- helpers
def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ParityError(f"dtype {dtype}: expected torch.float32 or torch.bfloat16")
        return dtype
    if dtype not in DTYPES:
        raise ParityError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _remote_model_class(ckpt: Path, hf_cfg):
    """The class `auto_map["AutoModelForCausalLM"]` of the checkpoint's config.json names, from its own files."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    ref = (getattr(hf_cfg, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if not ref:
        raise ParityError(f"{ckpt / 'config.json'}: auto_map has no AutoModelForCausalLM entry; expected the remote "
                          "model class (e.g. modeling_bailing_moe_v3.BailingMoeV3ForCausalLM)")
    return get_class_from_dynamic_module(ref, str(ckpt), local_files_only=True)


def _check_module_is_the_checkpoints(ckpt: Path, model) -> None:
    """The remote code that built the model is the checkpoint's own modeling file, byte for byte. transformers names a
    remote module after the checkpoint's folder, and a process that already imported a module of that name (another
    checkpoint in a folder of the same name, e.g. the twin's `tiny-flash` then the official file's) may be handed the
    first one: measured when the golden dumps were regenerated in one process (the official golden came out with the
    twin's code). A dump must never say one runtime and hold another."""
    import hashlib
    import inspect

    src = inspect.getsourcefile(type(model))
    name = Path(src).name if src else None
    own = ckpt / name if name else None
    if own is None or not own.is_file():
        return  # not a file of the checkpoint's (the class path check above has the say)
    if hashlib.sha256(Path(src).read_bytes()).digest() != hashlib.sha256(own.read_bytes()).digest():
        raise ParityError(f"{ckpt}: the model was built by {src}, which is not this checkpoint's {name} (a module of "
                          f"the same name, {type(model).__module__}, was already imported in this process); dump "
                          "each checkpoint folder name in its own process")


def _class_path(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


@contextmanager
def _quiet_transformers():
    """The built-in prints a load report for the MTP keys it does not use (checked by us instead); silence it."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # rope_scaling deprecation notice on our own override
            yield
    finally:
        hf_logging.set_verbosity(level)


def _read_config_json(ckpt_dir: Path) -> dict:
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; expected an HF checkpoint directory with config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _check_load_report(info: dict, cfg: Ling3Config, ckpt_dir: Path, runtime: str) -> dict:
    """Missing keys would be silently random-initialised: error. Unexpected keys: only the MTP layer's (§2)."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    mismatched = sorted(str(m) for m in (info.get("mismatched_keys") or []))
    prefixes = tuple(cfg.mtp_key_prefixes())
    stray = [k for k in unexpected if not k.startswith(prefixes)]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: {runtime} model has {len(missing)} parameters not in the checkpoint "
                              f"(would be random), e.g. {missing[:3]}")
    if mismatched:
        raise CheckpointError(f"{ckpt_dir}: {runtime} model: shape-mismatched keys {mismatched[:3]}")
    if stray:
        raise CheckpointError(f"{ckpt_dir}: {runtime} model ignores checkpoint keys outside the MTP layer "
                              f"{list(prefixes)}: e.g. {stray[:3]}")
    return {"missing": 0, "unexpected_mtp_only": len(unexpected)}


def expected_inv_freq(cfg: Ling3Config, device=None) -> torch.Tensor:
    """θ^{-2j/r}, r = qk_rope_head_dim (facts §4.3; rotary_dim / partial_rotary_factor ignored, §1), fp32 as the
    default rope init computes it."""
    from parity.torch_ref.fla_cpu import default_rope_inv_freq

    return default_rope_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim, device=device)


def repair_inv_freq(model: torch.nn.Module, cfg: Ling3Config) -> dict:
    """Recompute every `*.rotary_emb.inv_freq` buffer from the formula; record each original's deviation (ORC §1.4).

    Module-agnostic: found by buffer name, so it works for the official file, the twin and the built-in alike."""
    found = {}
    for name, buf in model.named_buffers():
        if not (name == "rotary_emb.inv_freq" or name.endswith(".rotary_emb.inv_freq")):
            continue
        want = expected_inv_freq(cfg, device=buf.device)
        if tuple(buf.shape) != tuple(want.shape):
            raise ParityError(f"{name}: shape {tuple(buf.shape)}, expected {tuple(want.shape)} "
                              f"(qk_rope_head_dim/2 = {cfg.qk_rope_head_dim // 2} frequencies, facts §4.3)")
        orig = buf.detach().double()
        finite = bool(torch.isfinite(orig).all())
        dev = float(((orig - want.double()).abs() / want.double()).max()) if finite else math.inf
        with torch.no_grad():
            buf.copy_(want.to(buf.dtype))
        found[name] = {"max_rel_deviation_before": dev if finite else "non-finite", "repaired": dev > 1e-6,
                       "dtype": str(buf.dtype).removeprefix("torch.")}
    if not found:
        raise ParityError(f"{_class_path(model)}: no *.rotary_emb.inv_freq buffer found to verify (ORC §1.4)")
    return {"checked": True, "recomputed": True, "formula": "rope_theta^(-2j/qk_rope_head_dim)", "buffers": found}


def _import_builtin_clean():
    """Import the built-in module with the fla stand-ins hidden, so it binds to its own torch fallback (a first
    import while they are installed would bind it to the stand-ins for the rest of the process)."""
    import importlib

    from parity.torch_ref import fla_cpu

    if BUILTIN_MODULE in sys.modules or not fla_cpu.is_installed():
        return importlib.import_module(BUILTIN_MODULE)
    hidden = {n: sys.modules.pop(n) for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]}
    try:
        return importlib.import_module(BUILTIN_MODULE)
    finally:
        for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[n]
        sys.modules.update(hidden)


# ----------------------------------------------------------------------------------------------- load_model
def _interpreter_support(guards: dict[str, Any]) -> None:
    """Under TRITON_INTERPRET=1 with a real fla + triton, patch Triton's interpreter so fla's KDA kernels run
    correctly on CPU (`triton_interp`; stock Triton 3.9.0 cannot). Process-wide; recorded in the guards."""
    from parity.torch_ref import fla_cpu

    if os.environ.get("TRITON_INTERPRET") == "1" and fla_cpu.real_fla_with_triton():
        from parity.torch_ref import triton_interp

        guards["triton_interpreter"] = {"patches": triton_interp.install()}


def load_model(
    ckpt_dir: str | Path,
    runtime: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    cpu_kernels: bool | None = None,
    layer_types: list[str] | None = None,
    config_overrides: dict[str, Any] | None = None,
    trust_remote_code: bool | None = None,
) -> LoadedModel:
    """Load `ckpt_dir` as runtime `remote` or `native` with the guards of the module docstring.

    `trust_remote_code` (remote only): True runs the checkpoint's own Python files; False runs them only when they
    are the suite's twin byte for byte (`parity.torch_ref.remote_code`), else CheckpointError; None (the default of
    callers that predate the opt-in) runs them unchecked. Recorded in guards["remote_code"].

    `cpu_kernels` installs the fla CPU stand-ins before a `remote` load (None: where fla's real kernels cannot run,
    `parity.torch_ref.kernels.choose_cpu_kernels`; the choice and why in `kernels_choice`); ignored for `native`.
    `layer_types` overrides the built-in's layer kinds (`native` only; default from the config, §2).
    `config_overrides` are extra config attributes (e.g. the twin's quirk switches) — never the guarded ones.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from parity.cpu_isa import ensure_usable_onednn_isa

    if note := ensure_usable_onednn_isa():  # before the model's first bf16 GEMM (parity/cpu_isa.py)
        print(note, file=sys.stderr)
    os.environ["HF_HUB_OFFLINE"] = "1"
    if runtime not in RUNTIMES:
        raise ParityError(f"runtime {runtime!r}: expected one of {RUNTIMES}")
    tdtype = resolve_dtype(dtype)
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a checkpoint directory")
    raw = _read_config_json(ckpt)
    cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
    overrides = dict(config_overrides or {})
    guarded = {"attn_implementation", "rope_scaling", "layer_types", "dtype", "torch_dtype", "trust_remote_code"}
    if guarded & overrides.keys():
        raise ParityError(f"config_overrides {sorted(guarded & overrides.keys())}: these are set by the loader's guards")
    from parity.torch_ref.kernels import choose_cpu_kernels, kernel_binding

    cpu_kernels, kernels_why = choose_cpu_kernels(cpu_kernels, str(device))
    guards: dict[str, Any] = {"runtime": runtime, "dtype": str(tdtype).removeprefix("torch."), "explicit_dtype": True,
                              "device": str(device), "hf_hub_offline": True}
    common = dict(dtype=tdtype, attn_implementation="eager", local_files_only=True, output_loading_info=True)
    stand_ins = None

    if runtime == "remote":
        if layer_types is not None:
            raise ParityError("layer_types is a native-runtime override; the remote config must not carry it (ORC §1.6)")
        if not raw.get("auto_map", {}).get("AutoModelForCausalLM"):
            raise CheckpointError(f"{ckpt / 'config.json'}: no auto_map.AutoModelForCausalLM; the remote runtime needs "
                                  "the checkpoint's own modeling file")
        from parity.torch_ref.remote_code import checkpoint_code, describe_code, twin_mismatch

        not_twin = twin_mismatch(ckpt)
        if not_twin and trust_remote_code is False:
            raise CheckpointError(f"{ckpt}: the remote runtime runs the checkpoint's own Python code "
                                  f"({describe_code(ckpt)}; {not_twin}); pass trust_remote_code=True "
                                  "(--trust-remote-code) if you trust it, or use the native runtime")
        guards["remote_code"] = {"files": describe_code(ckpt), "suite_twin": not not_twin,
                                 "trusted": "explicitly" if trust_remote_code else
                                            ("as the suite's twin" if not not_twin else "unchecked"),
                                 # which code ran, verifiably (e.g. the official file's published sha256)
                                 "sha256": {str(f.relative_to(ckpt)): hashlib.sha256(f.read_bytes()).hexdigest()
                                            for f in checkpoint_code(ckpt)}}
        rs = raw.get("rope_scaling")
        if rs not in (None, {}) and not (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "default"
                                         and len(rs) <= 2):
            raise ConfigError(f"{ckpt / 'config.json'}: rope_scaling = {rs!r}; only null is supported (shipped Ling3, "
                              "facts §1; ORC §1.5)")
        from parity.torch_ref import fla_cpu

        if cpu_kernels:
            stand_ins = fla_cpu.install(force=True)  # the choice is made (choose_cpu_kernels), explicitly or by default
            guards["fla_kernels"] = f"cpu stand-ins (parity.torch_ref.fla_cpu); {kernels_why}"
        else:
            fla_cpu.install_transformers_shims()  # the official file needs them on 5.x on any device
            # what the runtime then calls (fla, or the twin's own path without it) is observed by the dump (`kernels`)
            guards["fla_kernels"] = f"not replaced: the runtime imports fla itself; {kernels_why}"
            _interpreter_support(guards)
        guards["transformers_shims"] = ["import_utils.is_torch_fx_available", "ROPE_INIT_FUNCTIONS['default']"]
        try:
            with _quiet_transformers():
                hf_cfg = AutoConfig.from_pretrained(ckpt, trust_remote_code=True, local_files_only=True)
                hf_cfg.rope_scaling = None  # a plain None, not {rope_type: default} (ORC §1.5)
                if "layer_types" in vars(hf_cfg):
                    del hf_cfg.layer_types  # DynamicCache(config) would build linear-attention layers (ORC §1.6)
                    guards["layer_types"] = "removed from the config (was present)"
                else:
                    guards["layer_types"] = "absent"
                for k, v in overrides.items():
                    setattr(hf_cfg, k, v)
                # the checkpoint's own model class, named by its auto_map: AutoModelForCausalLM would map the config
                # class to a model class registered by an earlier load in this process (two checkpoints whose
                # configuration files are identical share the config class; measured: the twin's and the official
                # file's, folders of one name) — `_check_module_is_the_checkpoints` below verifies the result
                model_cls = _remote_model_class(ckpt, hf_cfg)
                model, info = model_cls.from_pretrained(ckpt, config=hf_cfg, **common)
        except BaseException:
            if stand_ins is not None:
                stand_ins.uninstall()
            raise
        mod = type(model).__module__
        if not mod.startswith("transformers_modules.") or mod.startswith("transformers.models."):
            raise ParityError(f"{ckpt}: remote runtime built {_class_path(model)}, not the checkpoint's remote code "
                              "(trust_remote_code ignored? env_notes 'Loading remote code offline')")
        _check_module_is_the_checkpoints(ckpt, model)
        guards["trust_remote_code"] = True
        guards["model_class"] = _class_path(model)
        if getattr(model.config, "rope_scaling", None) is not None:
            raise ParityError(f"{ckpt}: rope_scaling became {model.config.rope_scaling!r} after loading (ORC §1.5)")
        guards["rope_scaling"] = None
        if getattr(model.config, "layer_types", None) is not None:
            raise ParityError(f"{ckpt}: the loaded remote config carries layer_types (ORC §1.6)")
    else:
        if cpu_kernels:
            guards["cpu_kernels"] = "ignored (the built-in runs its own PyTorch path without fla)"
        builtin = _import_builtin_clean()
        bound = {fn: kernel_binding(getattr(builtin, fn, None))
                 for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")}
        if any(b is not None and b.startswith("parity.") for b in bound.values()):
            raise ParityError(f"native runtime: the built-in bailing_hybrid bound its KDA kernels to {bound}; it was "
                              "first imported while the fla stand-ins were installed and is not independent in this "
                              "process — run it in a fresh process")
        guards["native_kda_kernels"] = bound
        _interpreter_support(guards)  # the built-in calls fla's kernels itself wherever fla + triton import
        kinds = cfg.layer_kinds
        lt = list(layer_types) if layer_types is not None else [NATIVE_LAYER_TYPES[k] for k in kinds]
        if len(lt) != cfg.num_hidden_layers:
            raise ParityError(f"layer_types has {len(lt)} entries, expected num_hidden_layers = {cfg.num_hidden_layers}")
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=False, layer_types=lt,
                                                               **overrides, **common)
        if type(model).__module__ != BUILTIN_MODULE:
            raise ParityError(f"{ckpt}: native runtime built {_class_path(model)}, expected the built-in "
                              f"{BUILTIN_MODULE}")
        guards["trust_remote_code"] = False
        guards["model_class"] = _class_path(model)
        guards["layer_types"] = lt
        guards["ragged_tail"] = cfg.num_hidden_layers % cfg.layer_group_size != 0

    guards["attn_implementation"] = model.config._attn_implementation
    if guards["attn_implementation"] != "eager":
        raise ParityError(f"{ckpt}: attention implementation is {guards['attn_implementation']!r}, expected eager "
                          "(ORC §2)")
    guards["load_report"] = _check_load_report(info, cfg, ckpt, runtime)
    if str(device) != "cpu":
        model = model.to(device)
    model.eval()
    p_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    guards["param_dtypes"] = p_dtypes
    guards["inv_freq"] = repair_inv_freq(model, cfg)
    return LoadedModel(model=model, config=cfg, runtime=runtime, guards=guards, stand_ins=stand_ins,
                       kernels_choice=(cpu_kernels, kernels_why) if runtime == "remote" else None)


# ----------------------------------------------------------------------------------------------- decode
def decode_positions(past_len: int, n: int = 1, *, batch: int = 1, device: str | torch.device = "cpu") -> dict:
    """Explicit `position_ids` [batch, n] and `cache_position` [n] for n tokens decoded after `past_len` tokens.

    Manual decode without them puts every new token at RoPE position 0 in the official file (ORC §3)."""
    if past_len < 0 or n < 1 or batch < 1:
        raise ParityError(f"decode_positions: need past_len ≥ 0, n ≥ 1, batch ≥ 1; got {past_len}, {n}, {batch}")
    pos = torch.arange(past_len, past_len + n, device=device)
    return {"position_ids": pos.unsqueeze(0).expand(batch, n).clone(), "cache_position": pos}


__all__ = ["LoadedModel", "load_model", "decode_positions", "repair_inv_freq",
           "expected_inv_freq", "resolve_dtype", "RUNTIMES"]
