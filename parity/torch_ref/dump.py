"""Dump per-layer activations of a Ling3 HF model into an HDF5 file of schema v1 (DESIGN §3, §4).

`dump_checkpoint` loads a checkpoint through `parity.torch_ref.loader` (runtime `remote` = trust_remote_code, the
official file or the twin; `native` = transformers' built-in `bailing_hybrid`), runs the guards of
official_remote_code.md (eager attention, a causality prefix test, inv_freq validated, explicit decode positions,
no padded batches), then prefill + N decode steps with the model's own cache, streaming every canonical point to
disk as the hooks fire. `tools/dump_hf.py` is the CLI over it.
"""

from __future__ import annotations

import os
import platform
import queue
import threading
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from parity.model.config import Ling3Config
from parity.errors import ParityError
from parity.model.mtp_points import MtpPoint, mtp_group
from parity.model.points import Point
from parity.torch_ref import fla_cpu
from parity.torch_ref.backward import (CotangentRecorder, check_mtp_loss, grad_point, hf_param_grads,
                                       lift_no_grad_methods, loss_record, mtp_ce, mtp_loss_record, next_token_ce)
from parity.torch_ref.capture import Capture, runtime_map_name, to_numpy
from parity.torch_ref.kernels import KernelObserver, bf16_gemm_policy, fp32_matmul_policy, kernels_record

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class DumpOptions:
    runtime: str = "remote"  # "remote" | "native"
    cpu_kernels: bool | None = None  # fla CPU stand-ins (None: where fla's real kernels cannot run, kernels.py)
    allow_tf32: bool = False  # fp32 on CUDA: keep TF32 dots allowed instead of forcing IEEE fp32 (recorded)
    # on CUDA: keep torch's reduced-precision reductions in bf16 GEMMs allowed instead of turning them off (recorded)
    allow_bf16_reduced_precision_reduction: bool = False
    device: str = "cpu"  # "cpu" | "cuda" | "auto" (device_map=auto for models larger than one GPU)
    dtype: str = "bfloat16"
    layers: Sequence[int] | None = None
    sites: Sequence[str] | None = None
    decode_steps: int = 4
    continuation_ids: Sequence[int] | None = None  # teacher-forced decode tokens (else greedy)
    stats_only: bool = False
    cache_snapshots: bool = True
    force: bool = False
    seed: int = 0
    progress: bool = True
    causality_check: bool = True
    # HDF5 compression + I/O on a worker thread (BackgroundWriter); None = only when the model runs off-CPU: on CPU
    # the forward already keeps every core busy, and the thread measured no gain (README "Performance").
    write_thread: bool | None = None
    compression: str = "lzf"  # dumpfile.COMPRESSIONS: "lzf" (default) or "none" (cheaper writes, ~15 % bigger)
    # runtime "remote" runs the checkpoint's own Python files only if True, or if they are the suite's twin
    trust_remote_code: bool = False
    # MTP layers (group MTP{j}, parity.model.mtp_points): None = captured when every main layer is dumped (no --layers)
    mtp: bool | None = None
    semantics_probe: bool = True  # probe the semantic forks (parity.torch_ref.semantics) into the `semantics` attr
    # how the fla stand-ins' chunk_kda rounds its intermediates: "fp32" (the maths) or "kernel" (fla's chunked bf16
    # rounding points, parity.torch_ref.fla_cpu); recorded as the `kda_chunk_precision` fork. No effect on real fla.
    kda_chunk_precision: str = "fp32"
    # issue 26: after the prefill, one backward pass of the next-token CE (parity.torch_ref.backward) recorded as the
    # `backward` phase (cotangents at the canonical sites, weight gradients under HF names); decode steps unchanged
    grads: bool = False
    # issue 33: with `grads`, the MTP loss term scaled by this factor is added to the loss (the official training loss
    # with mtp_loss_scaling_factor = this value; parity.torch_ref.backward.MTP_LOSS_DEFINITION) and the MTP layer's
    # backward points are written; None: the next-token CE alone (`backward.mtp_loss` null)
    mtp_loss_scale: float | None = None


@dataclass
class DumpSummary:
    path: Path
    points: int
    bytes: int
    seconds_load: float
    seconds_forward: float  # prefill + decode with capture (incl. writing)
    guards: dict = field(default_factory=dict)
    unavailable: dict = field(default_factory=dict)
    seconds_write: float = 0.0  # of seconds_forward: inside the HDF5 writer (compression, I/O, final flush + seal)
    array_bytes: int = 0  # uncompressed bytes of the arrays written (0 for --stats-only)
    semantics: dict | None = None  # the `semantics` root attr (parity.model.semantics), None when not probed
    kernels: dict | None = None  # the `kernels` root attr (parity.torch_ref.kernels.kernels_record)


STATS_CHUNK = 1 << 24  # elements: larger float arrays get their statistics in chunks (see point_stats)


def point_stats(arr: np.ndarray) -> dict:
    """Per-point statistics for --stats-only dumps of huge models (no tensor is stored). A float array of more than
    STATS_CHUNK elements (a real vocabulary's logits, or the embedding / LM head gradients of --grads: 241 M elements
    for Ling3-Tiny, ~6 GB of float64 temporaries at once) is reduced in chunks: same counts, min, max and absmax; mean
    and rms summed chunk by chunk in float64 (rounding-level differences from the one-pass form)."""
    if arr.size > STATS_CHUNK and (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        return _chunked_stats(arr)
    a = np.asarray(arr, dtype=np.float64) if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else arr
    finite = np.isfinite(a) if a.dtype.kind == "f" else np.ones(a.shape, bool)
    f = a[finite] if a.dtype.kind == "f" else a.ravel()
    return {
        "shape": list(arr.shape),
        "dtype": str(arr.dtype),
        "nan": int(np.isnan(a).sum()) if a.dtype.kind == "f" else 0,
        "inf": int(np.isinf(a).sum()) if a.dtype.kind == "f" else 0,
        "min": float(f.min()) if f.size else 0.0,
        "max": float(f.max()) if f.size else 0.0,
        "mean": float(f.mean()) if f.size else 0.0,
        "rms": float(np.sqrt(np.mean(np.square(f, dtype=np.float64)))) if f.size else 0.0,
        "absmax": float(np.abs(f).max()) if f.size else 0.0,
    }


def _chunked_stats(arr: np.ndarray) -> dict:
    flat = arr.reshape(-1)
    nan = inf = n = 0
    lo, hi, amax, total, squares = np.inf, -np.inf, 0.0, 0.0, 0.0
    for start in range(0, flat.size, STATS_CHUNK):
        a = np.asarray(flat[start:start + STATS_CHUNK], dtype=np.float64)
        nan += int(np.isnan(a).sum())
        inf += int(np.isinf(a).sum())
        f = a[np.isfinite(a)]
        if f.size:
            n += f.size
            lo, hi = min(lo, float(f.min())), max(hi, float(f.max()))
            amax = max(amax, float(np.abs(f).max()))
            total += float(f.sum())
            squares += float(np.square(f).sum())
    return {"shape": list(arr.shape), "dtype": str(arr.dtype), "nan": nan, "inf": inf,
            "min": lo if n else 0.0, "max": hi if n else 0.0, "mean": total / n if n else 0.0,
            "rms": float(np.sqrt(squares / n)) if n else 0.0, "absmax": amax}


def check_batch(input_ids: np.ndarray) -> np.ndarray:
    """Ragged batches are rejected: the official KDA ignores padding masks (official_remote_code.md §2)."""
    if isinstance(input_ids, (list, tuple)):
        lens = {len(x) for x in input_ids}
        if len(lens) > 1:
            raise ParityError(
                f"prompts of different lengths {sorted(lens)}: the official KDA ignores padding masks, so a padded "
                "batch leaks pad tokens into the state (official_remote_code.md §2); dump them one at a time"
            )
        input_ids = np.asarray(input_ids)
    input_ids = np.asarray(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.dtype.kind not in "iu":
        raise ParityError(f"input ids: expected a non-empty [batch, tokens] integer array, got {input_ids.shape}")
    return input_ids.astype(np.int64)


def runtime_versions() -> dict:
    import transformers

    try:
        import importlib.metadata as md

        fla_v = md.version("fla-core")
    except Exception:  # not installed
        fla_v = "none"
    import parity

    return {
        "tool_version": parity.__version__,
        "torch_version": str(torch.__version__),
        "transformers_version": str(transformers.__version__),
        "fla_version": fla_v,
        "python_version": platform.python_version(),
    }


def _determinism(seed: int) -> dict:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {
        "seed": seed,
        "torch_deterministic_algorithms": True,
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "torch_num_threads": torch.get_num_threads(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }


CAUSALITY_RTOL = 1e-3  # causal: exactly 0 measured (bf16 and fp32); a leak: 7-35 % of the output scale (tiny-flash)
# The guard runs on the first GUARD_MAX_TOKENS prompt tokens: causality is structural, and > 64 tokens takes the
# official KDA's chunked kernel (its recurrent one is checked by prompts ≤ 64). Bounds its cost on long prompts
# (README, section 1: measured ≈ 10 % of a Ling3-Tiny-shaped dump).
GUARD_MAX_TOKENS = 80

NATIVE_LIMITS = ("transformers' built-in bailing_hybrid is Flash-shaped: no q-LoRA (q_lora_rank must be null), no "
                 "SwiGLU clamp (expert_/share_expert_swiglu_limit_list must be null or all 0), no MTP layer")


def check_native_supports(cfg: Ling3Config, ckpt_dir) -> None:
    """Refuse, in one line and before loading, a checkpoint the native runtime cannot represent (NATIVE_LIMITS):
    q-LoRA would load with random q weights refused later; a clamp would be silently ignored."""
    why = []
    if cfg.q_lora:
        why.append(f"q_lora_rank = {cfg.q_lora_rank}")
    if cfg.has_swiglu_clamp:
        why.append("SwiGLU clamp limits are set")
    if why:
        raise ParityError(f"{ckpt_dir}: --runtime native cannot dump this checkpoint ({'; '.join(why)}): "
                          f"{NATIVE_LIMITS}")


def _attention_modules(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, token-mixing module) of every decoder layer: `attention` (official/twin) or `self_attn`
    (transformers' built-in bailing_hybrid), the MTP layers' (after the main layers) included where the model has
    them (they run in the forward when num_nextn_predict_layers > 0)."""
    out = []
    n = model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        mod = getattr(layer, "attention", None) or getattr(layer, "self_attn", None)
        if mod is None:
            if i >= n:
                continue
            raise ParityError(f"causality guard: decoder layer {i} ({type(layer).__name__}) has no attention/self_attn")
        out.append((i, mod))
    return out


KDA_LAYERS_CHECKED = 1  # KDA attention modules the causality guard re-runs (the first ones; see causality_guard)


def _guarded_modules(model, cfg: Ling3Config | None) -> list[tuple[int, torch.nn.Module]]:
    """The attention modules the causality guard checks: every MLA (and MTP) layer's, the first KDA layers' (all of
    them without a config to tell the kinds)."""
    out, kda = [], 0
    n = model.config.num_hidden_layers
    for i, mod in _attention_modules(model):
        if cfg is not None and i < n and cfg.layer_kind(i) == "kda":
            kda += 1
            if kda > KDA_LAYERS_CHECKED:
                continue
        out.append((i, mod))
    return out


def _first_tensor(x):
    return x if isinstance(x, torch.Tensor) else next(t for t in x if isinstance(t, torch.Tensor))


_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache_params")


def _cut_call(args: tuple, kwargs: dict, T: int, Tg: int, where: str) -> tuple[tuple, dict]:
    """A recorded prefill call of an attention module, cut to its first Tg positions and without the cache (the
    runtimes' known call arguments: hidden states, 2-D / 4-D attention masks, RoPE tables, positions)."""
    def cut(name, v):
        if name in _CACHE_KWARGS:
            return None
        if name == "use_cache":
            return False
        if isinstance(v, tuple) and name == "position_embeddings":
            return tuple(t[:, :Tg] for t in v)
        if not isinstance(v, torch.Tensor) or T == Tg:
            return v
        if name == "attention_mask" and v.dim() == 4:
            return v[:, :, :Tg, :Tg]
        if name == "cache_position" and v.dim() == 1:
            return v[:Tg]
        if v.dim() >= 2 and v.shape[1] == T:
            return v[:, :Tg]
        if T in v.shape:
            raise ParityError(f"causality guard: {where}: cannot cut its argument {name} {tuple(v.shape)} to "
                              f"{Tg} positions")
        return v

    args = tuple(cut("hidden_states" if j == 0 else f"arg{j}", a) for j, a in enumerate(args))
    return args, {k: cut(k, v) for k, v in kwargs.items()}


def record_guarded_calls(model, cfg: Ling3Config | None) -> tuple[dict, list]:
    """Pre-hooks recording the first call of each guarded attention module (see causality_guard): (calls, handles);
    remove the handles after the forward."""
    calls: dict[int, tuple] = {}
    handles = []
    for i, mod in _guarded_modules(model, cfg):
        def record(_m, args, kwargs, i=i):
            calls.setdefault(i, (args, dict(kwargs)))
        handles.append(mod.register_forward_pre_hook(record, with_kwargs=True))
    return calls, handles


def causality_guard(model, input_ids: torch.Tensor, *, rtol: float = CAUSALITY_RTOL,
                    cfg: Ling3Config | None = None, recorded: dict | None = None) -> dict:
    """Per-layer causality test of the token-mixing modules (official_remote_code.md §2).

    The prefill of the dump itself (`recorded`, from `record_guarded_calls`), or else one prefill of the base model,
    records the call of each checked attention module (KDA or MLA: the only modules that mix tokens): every MLA
    layer's (MTP layers included where they run; the mask handling of ORC §2 lives there), and the first KDA layer's
    — the KDA code path takes no mask (the official KDA drops it), so one layer exercises it, and it is the costly one
    (`KDA_LAYERS_CHECKED`). Each module is then called once more, on its first GUARD_MAX_TOKENS positions and
    without a cache, on a batch of variants of its recorded input: the input itself, and for each prefix length L the
    input with every row from position L on replaced. A causal module's outputs at positions < L equal those of the
    unchanged variant in the same call (same shapes, same kernel path, masked terms contribute exact zeros); a leaking
    one moves them by a large fraction of the output scale. Cost: one batched call per checked layer, plus a
    base-model prefill when nothing was recorded (README, section 1: the guard's share of a Ling3-Tiny-shaped dump).

    (Comparing whole-model logits instead — session-1's form of this guard — is exact on small models but not on a
    24-layer bf16 one: the MoE's per-expert GEMMs change shape when later tokens change their routing, which moves
    earlier rows by an ULP, and 24 random layers amplify that to 15 % of the logit scale (measured on a generated
    Ling3-Tiny). Comparing a shorter prefix mixes in kernel-path noise: the official KDA is recurrent up to 64
    tokens and chunked beyond.)"""
    ids = torch.as_tensor(input_ids)
    B, T_full = ids.shape
    T = min(T_full, GUARD_MAX_TOKENS)
    if T < 2:
        return {"checked": False, "reason": "prompt of one token"}
    lengths = sorted({L for L in (T // 4, T // 2, T - 1) if 1 <= L < T})  # position 0 is before every L
    checked = _guarded_modules(model, cfg)
    if recorded is None:
        calls, handles = record_guarded_calls(model, cfg)
        try:
            with torch.no_grad():
                # the base model only: the attention inputs are all it needs, and the LM head is the biggest GEMM of
                # a real-vocabulary model (Ling3-Tiny: 157k x 1536 per token)
                getattr(model, "model", model)(input_ids=ids[:, :T], use_cache=False)
        finally:
            for h in handles:
                h.remove()
        T_rec = T
    else:
        calls, T_rec = recorded, T_full
    worst = {"max_abs_diff": 0.0}
    n = model.config.num_hidden_layers
    with torch.no_grad():
        for i, mod in checked:
            if i not in calls:
                if i >= n:
                    continue  # an MTP layer the runtime builds but does not run
                raise ParityError(f"causality guard: the attention module of layer {i} was not called in a prefill")
            args, kwargs = _cut_call(*calls[i], T_rec, T, f"layer {i}'s {type(mod).__name__}")
            key = "hidden_states" if "hidden_states" in kwargs else None
            x = kwargs[key] if key else args[0]
            # one call on all variants, stacked along the batch (the mask / RoPE tables broadcast over it): the
            # recorded input first, then one variant per L with other rows of the same scale from position L on
            alt = x.repeat(1 + len(lengths), 1, 1)
            for j, L in enumerate(lengths, start=1):
                alt[j * B:(j + 1) * B, L:] = -x[:, L:].flip(1) + 1
            out = _first_tensor(mod(**{**kwargs, key: alt}) if key else mod(alt, *args[1:], **kwargs)).float()
            if out.shape[0] != alt.shape[0]:
                raise ParityError(f"causality guard: layer {i}'s {type(mod).__name__} returned batch {out.shape[0]} "
                                  f"for a batch of {alt.shape[0]} input variants")
            ref = out[:B]
            for j, L in enumerate(lengths, start=1):
                d = float((out[j * B:(j + 1) * B, :L] - ref[:, :L]).abs().max())
                scale = float(ref[:, :L].abs().max().clamp_min(1e-30))
                if d > worst["max_abs_diff"]:
                    worst = {"max_abs_diff": d, "layer": i, "prefix_length": L, "output_scale": scale}
                if d > rtol * scale:
                    raise ParityError(
                        f"reference model is not causal ({type(model).__module__}.{type(model).__name__}): layer {i}'s "
                        f"{type(mod).__name__}, fed rows changed from position {L} on, moves its outputs before it by "
                        f"max|Δ| = {d:.3g} (> {rtol:g} × max|out| {scale:.3g}); load with attn_implementation='eager' "
                        "(official_remote_code.md §2)")
    return {"checked": True, "causal": True,
            "method": "each layer's attention module, one batched call: its recorded prefill input and, per L, that "
                      "input with the rows from L on replaced; outputs before L unchanged",
            "prompt_length": T, "inputs": "the dump's prefill" if recorded is not None else "a base-model prefill",
            "prefix_lengths": lengths, "layers": sorted(calls), "rtol": rtol, **worst}


def _mtp_capture(opts: DumpOptions, cfg: Ling3Config) -> bool:
    if cfg.num_nextn_predict_layers <= 0:
        return False
    return opts.layers is None if opts.mtp is None else bool(opts.mtp)


def _cache_snapshot(pkv, cfg: Ling3Config, layer: int) -> dict[str, torch.Tensor]:
    """KDA recurrent + conv states from the model's cache, for runtimes whose taps do not give them.

    Official/twin layout (official_remote_code.md §3): KDA layer i keeps the recurrent state in `layers[i].keys` and
    the (q, k, v) conv states in `layers[i].values`. The built-in hybrid cache exposes get_recurrent_state /
    get_conv_state (its conv state is one merged q|k|v tensor).
    """
    if pkv is None or cfg.layer_kind(layer) != "kda":
        return {}
    out: dict[str, torch.Tensor] = {}
    layers = getattr(pkv, "layers", None)
    entry = layers[layer] if layers is not None and layer < len(layers) else None
    keys, values = getattr(entry, "keys", None), getattr(entry, "values", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:  # official / twin layout
        out["attention.state"] = keys
        if isinstance(values, (tuple, list)) and len(values) == 3 and all(isinstance(v, torch.Tensor) for v in values):
            out["attention.conv_state"] = torch.stack(list(values))
        return out
    try:  # built-in hybrid cache
        st = pkv.get_recurrent_state(layer, state_idx=0)
        cv = pkv.get_conv_state(layer, state_idx=0)
    except (AttributeError, ValueError, IndexError):
        return out
    if st is not None:
        out["attention.state"] = st
    if cv is not None:  # one merged q|k|v conv state [B, 3P, W] -> [3, B, P, W]
        b, c3, w = cv.shape
        out["attention.conv_state"] = cv.view(b, 3, c3 // 3, w).transpose(0, 1)
    return out


def dump_checkpoint(
    ckpt_dir: str | Path,
    out_path: str | Path,
    input_ids,
    opts: DumpOptions | None = None,
    *,
    extra_meta: dict | None = None,
) -> DumpSummary:
    """Dump prefill over `input_ids` ([B,T], equal lengths) + `opts.decode_steps` decode steps into `out_path`."""
    from parity.dumpfile import DumpWriter, check_output_path, fingerprint_checkpoint
    from parity.torch_ref.loader import load_model

    opts = opts or DumpOptions()
    ids = check_batch(input_ids)
    ckpt_dir = Path(ckpt_dir)
    out_path = Path(out_path)
    check_output_path(out_path, force=opts.force)
    if opts.dtype not in DTYPES:
        raise ParityError(f"--dtype {opts.dtype!r}: expected one of bf16, fp32")
    if opts.kda_chunk_precision not in fla_cpu.CHUNK_PRECISIONS:
        raise ParityError(f"--kda-chunk-precision {opts.kda_chunk_precision!r}: expected one of "
                          f"{', '.join(fla_cpu.CHUNK_PRECISIONS)}")
    if opts.continuation_ids is not None and len(opts.continuation_ids) < opts.decode_steps:
        raise ParityError(
            f"--continuation has {len(opts.continuation_ids)} ids but --decode-steps is {opts.decode_steps}"
        )
    if opts.grads and ids.shape[1] < 2:
        raise ParityError(f"--grads: the prompt has {ids.shape[1]} token; the next-token loss needs at least 2")
    determinism = _determinism(opts.seed)
    cfg = Ling3Config.from_pretrained_dir(ckpt_dir, strict=False)
    layers = sorted(set(opts.layers)) if opts.layers is not None else list(range(cfg.num_hidden_layers))
    bad = [i for i in layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ParityError(f"--layers {bad}: the model has layers 0..{cfg.num_hidden_layers - 1}")
    if opts.mtp_loss_scale is not None:  # before loading anything (the runtime's MTP layer is checked after)
        if not opts.grads:
            raise ParityError("--mtp-loss-scale: expected --grads too (it sets the backward pass's loss)")
        if opts.runtime == "native":
            raise ParityError("--mtp-loss-scale: the native runtime (transformers' built-in bailing_hybrid) has no MTP "
                              "layer; expected --runtime remote")
        check_mtp_loss(opts.mtp_loss_scale, *ids.shape, cfg.num_nextn_predict_layers, True)
        if not _mtp_capture(opts, cfg):
            raise ParityError("--mtp-loss-scale: the MTP layer's points are not captured (--layers selects main layers "
                              "only); expected a dump of every layer")
    if opts.runtime == "native":
        check_native_supports(cfg, ckpt_dir)

    t0 = time.perf_counter()
    # fp32 matmul policy before the load (Triton reads its fp32 default when a kernel compiles); restored at the end
    stack = ExitStack()
    fp32 = stack.enter_context(fp32_matmul_policy(DTYPES[opts.dtype], opts.device, opts.allow_tf32))
    bf16_gemm = stack.enter_context(bf16_gemm_policy(opts.device, opts.allow_bf16_reduced_precision_reduction))
    stack.enter_context(fla_cpu.chunk_precision(opts.kda_chunk_precision))  # the stand-ins' mode, restored at the end
    try:
        loaded = load_model(ckpt_dir, opts.runtime, dtype=DTYPES[opts.dtype], device=opts.device,
                            cpu_kernels=opts.cpu_kernels if opts.runtime == "remote" else False,
                            trust_remote_code=opts.trust_remote_code)
    except BaseException:
        stack.close()
        raise
    try:
        model = loaded.model
        model.eval()
        device = next(model.parameters()).device
        observer = stack.enter_context(KernelObserver(model))  # every forward from here on (probe, dump, guard)
        guards = dict(loaded.guards)
        t_ids = torch.as_tensor(ids, device=device)
        if opts.causality_check:  # run on the prefill's own inputs, right after it (see below)
            guards["causality"] = {"checked": False, "reason": "the dump did not finish its prefill"}
        semantics = None
        if opts.semantics_probe:
            from parity.torch_ref.semantics import probe

            semantics = probe(model, cfg, t_ids)
        guards["decode_positions"] = "explicit position_ids and cache_position at every decode step"
        guards["batch"] = f"{ids.shape[0]} sequence(s) of equal length {ids.shape[1]} (no padding)"
        t_load = time.perf_counter() - t0

        B, T = ids.shape
        meta = {
            **runtime_versions(),
            "runtime": opts.runtime,
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config_json": cfg.to_dict(),
            "checkpoint_fingerprint": fingerprint_checkpoint(ckpt_dir),
            "checkpoint_dir": str(ckpt_dir),
            "device": str(device),
            "compute_dtype": "bfloat16" if DTYPES[opts.dtype] == torch.bfloat16 else "float32",
            "seed": opts.seed,
            "determinism": determinism,
            "guards": guards,
            "decode_steps": opts.decode_steps,
            "decode_mode": "teacher_forced" if opts.continuation_ids is not None else "greedy",
            "stats_only": opts.stats_only,
            "layers_dumped": layers,
            "sites_filter": list(opts.sites) if opts.sites else [],
            **({"semantics": semantics} if semantics is not None else {}),
            **(extra_meta or {}),
        }
        map_name = runtime_map_name(model, "native" if opts.runtime == "native" else "remote")
        meta["capture_map"] = map_name
        # how many MTP layers this dump set out to capture (0: the model has none, or --layers left them out): the
        # replay's coverage rule owes exactly those (a runtime without them declares `MTP{j}/*` unavailable)
        meta["mtp_captured"] = cfg.num_nextn_predict_layers if _mtp_capture(opts, cfg) else 0

        t1 = time.perf_counter()
        with DumpWriter(out_path, meta, force=opts.force, compression=opts.compression) as writer:
            written: set[Point] = set()

            def write_point(point: Point, arr: np.ndarray, attrs: dict) -> None:
                if opts.stats_only:
                    writer.write_stats(point, point_stats(arr))
                else:
                    writer.write(point, arr, **attrs)

            threaded = opts.write_thread if opts.write_thread is not None else device.type != "cpu"
            background = BackgroundWriter(write_point) if threaded else None

            def sink(point: Point, arr: np.ndarray, attrs: dict) -> None:
                written.add(point)  # in the caller's thread: _snapshot reads it
                (background.put if background else write_point)(point, arr, attrs)

            try:
                want_mtp = _mtp_capture(opts, cfg)
                cap = Capture(model, cfg, map_name, sink, layers=layers, sites=opts.sites, mtp=want_mtp)
                unavailable: dict[str, str] = {}
                for i in layers:
                    for site in cap.unavailable_sites(i):
                        if cap.wants(i, site):
                            unavailable[f"L{i:02d}/{site}"] = cap.unexposed_reason(site, i)
                all_tokens = [ids]
                with_mtp_loss = opts.mtp_loss_scale is not None
                recorder = CotangentRecorder(cap, sink, mtp=with_mtp_loss).attach() if opts.grads else None
                lifted = stack.enter_context(lift_no_grad_methods(model)) if opts.grads else []
                if recorder is not None:
                    stack.callback(recorder.detach)  # hooks and the stand-ins' observer out, also on a failure
                    if map_name == "twin":
                        recorder.observe_kernel_gate(model)
                progress = _progress(opts.progress, (1 + opts.decode_steps) * len(layers))
                with cap, torch.no_grad():
                    if with_mtp_loss:
                        check_mtp_loss(opts.mtp_loss_scale, B, T, cfg.num_nextn_predict_layers, bool(cap.mtp_layers))
                        recorder.watch_mtp_hidden(model, 0)
                    if want_mtp:
                        for j in range(cfg.num_nextn_predict_layers):
                            if cfg.num_hidden_layers + j not in cap.mtp_layers:
                                unavailable[f"{mtp_group(j)}/*"] = (f"the {map_name} runtime has no MTP layer "
                                                                    f"model.layers.{cfg.num_hidden_layers + j}")
                            else:
                                for site in cap.unavailable_mtp_sites():
                                    if cap.wants(cfg.num_hidden_layers + j, site):
                                        unavailable[f"{mtp_group(j)}/{site}"] = cap.unexposed_reason(
                                            site, cfg.num_hidden_layers + j)
                    _count_layers(model, cfg, layers, progress, cap)
                    cap.begin("prefill", 0, B, T)
                    pos = torch.arange(T, device=device)
                    guard_calls, guard_hooks = (record_guarded_calls(model, cfg) if opts.causality_check
                                                else ({}, []))
                    try:
                        # --grads: the prefill runs with autograd on (same forward, same bits: tests/
                        # test_backward_dump.py); its backward follows at once, every later step is no_grad again
                        with torch.enable_grad() if opts.grads else nullcontext():
                            out = model(input_ids=t_ids, position_ids=pos[None].expand(B, T), cache_position=pos,
                                        attention_mask=torch.ones(B, T, dtype=torch.long, device=device),
                                        use_cache=True)
                    finally:
                        for h in guard_hooks:
                            h.remove()
                    pkv = out.past_key_values
                    _snapshot(cap, sink, written, pkv, cfg, layers, "prefill", 0, opts)
                    logits = out.logits
                    if recorder is not None:
                        with torch.enable_grad():
                            backward_meta = run_backward(model, map_name, cfg, cap, recorder, sink, logits, t_ids,
                                                         opts, getattr(out, "mtp_logits", None))
                        recorder.detach()
                        if lifted:
                            backward_meta["no_grad_lifted"] = lifted  # (the official moe_infer, backward.py)
                        writer.set_meta("backward", backward_meta)
                        logits = logits.detach()
                    for k in range(1, opts.decode_steps + 1):
                        if opts.continuation_ids is not None:
                            nxt = torch.full((B, 1), int(opts.continuation_ids[k - 1]), device=device)
                        else:
                            nxt = logits[:, -1].float().argmax(-1, keepdim=True)
                        all_tokens.append(to_numpy(nxt).astype(np.int64))
                        p = T + k - 1
                        cap.begin("decode", k, B, 1)
                        out = model(input_ids=nxt, past_key_values=pkv, use_cache=True,
                                    position_ids=torch.full((B, 1), p, device=device),
                                    cache_position=torch.tensor([p], device=device),
                                    attention_mask=torch.ones(B, p + 1, dtype=torch.long, device=device))
                        pkv, logits = out.past_key_values, out.logits
                        _snapshot(cap, sink, written, pkv, cfg, layers, "decode", k, opts)
                progress.close()
                if opts.causality_check:  # outside the capture (its hooks must not see the guard's calls); a leak
                    t_guard = time.perf_counter()  # raises here: the dump is abandoned, no file is left
                    with torch.no_grad():
                        guards["causality"] = causality_guard(model, t_ids, cfg=cfg, recorded=guard_calls)
                    guards["causality"]["seconds"] = round(time.perf_counter() - t_guard, 3)
                    writer.set_meta("guards", guards)
            except BaseException:
                if background:
                    background.close(raise_error=False)  # stop writing before the writer deletes its file
                raise
            if background:
                background.close()  # the remaining points are written; a write error is raised here
            kernels = kernels_record(paths=observer.paths, choice=loaded.kernels_choice, device=device, fp32=fp32,
                                     bf16_gemm=bf16_gemm)
            writer.set_meta("kernels", kernels)
            chunk_impl = observer.paths.get("chunk_kda")
            if semantics is not None and chunk_impl is not None:  # the chunk path ran: record what ran on it
                from parity.torch_ref.semantics import observed_chunk_precision

                semantics = observed_chunk_precision(semantics, chunk_impl, DTYPES[opts.dtype])
                writer.set_meta("semantics", semantics)
            steps = [("prefill", 0)] + [("decode", k) for k in range(1, opts.decode_steps + 1)]
            mtp_ran = bool(cap.mtp_layers) and cap.mtp_ran("prefill", 0)
            if cap.mtp_layers and not mtp_ran:  # e.g. a twin copy older than its MTP forward
                for j in range(len(cap.mtp_layers)):
                    unavailable[f"{mtp_group(j)}/*"] = f"the {map_name} runtime builds the MTP layer but does not run it"
            missing = [p.key() for s in steps for p in cap.missing(*s, mtp=mtp_ran)]
            for key in missing:
                unavailable[key] = "hook registered but did not fire"
            if recorder is not None:
                for p in cap.missing("prefill", 0, mtp=recorder.mtp):
                    unavailable[f"backward/{p.key().split('/', 1)[1]}"] = "no forward tensor (the hook did not fire)"
                unavailable.update(recorder.unavailable())
            # a site the map lacks may still have come from the cache snapshot (KDA conv_state): then it is not
            # unavailable
            got = {f"{p.h5_parts()[1]}/{p.site}" for p in written if p.phase == "prefill"}
            unavailable = {k: v for k, v in unavailable.items() if k not in got}
            for pattern, reason in sorted(unavailable.items()):
                writer.mark_unavailable(pattern, reason)
            writer.write_tokens(np.concatenate(all_tokens, axis=1), T)
            n_points = len(written)
        t_fwd = time.perf_counter() - t1
        return DumpSummary(out_path, n_points, out_path.stat().st_size, t_load, t_fwd, guards, unavailable,
                           writer.seconds_writing, writer.array_bytes, semantics, kernels)
    finally:
        loaded.release()  # uninstall the fla stand-ins this load installed (the model keeps its bound names)
        stack.close()  # the kernel observer's wrappers out, the fp32 matmul settings back


class BackgroundWriter:
    """Runs `write(point, array, attrs)` on one worker thread, in call order, so HDF5 compression and I/O overlap the
    model's next layers (h5py's compressed writes run alongside torch's kernels: an 80 MB lzf write during 0.92 s of
    bf16 GEMMs on 2 cores took the pair from 1.37 s serial to 1.01 s). Arrays must be owned copies (`to_numpy` makes
    them). At most `max_pending_bytes` of arrays wait (one larger array may wait alone); `put` blocks beyond that.
    A write error stops the writing; it is raised in the caller at the next `put` or at `close`."""

    def __init__(self, write, max_pending_bytes: int = 1 << 30) -> None:
        self._write = write
        self._max = max_pending_bytes
        self._pending = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ling3-dump-writer", daemon=True)
        self._thread.start()

    def put(self, point: Point, arr: np.ndarray, attrs: dict) -> None:
        self._raise()
        n = arr.nbytes
        with self._cv:
            while self._pending and self._pending + n > self._max and self._error is None:
                self._cv.wait()
            self._pending += n
        self._raise()
        self._queue.put((point, arr, attrs, n))

    def close(self, raise_error: bool = True) -> None:
        """Wait until every queued point is written (or skipped after an error), then stop the thread."""
        self._queue.put(None)
        self._thread.join()
        if raise_error:
            self._raise()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            point, arr, attrs, n = item
            try:
                if self._error is None:
                    self._write(point, arr, attrs)
            except BaseException as e:  # handed to the caller's thread
                self._error = e
            finally:
                with self._cv:
                    self._pending -= n
                    self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def run_backward(model, map_name: str, cfg: Ling3Config, cap: Capture, recorder: CotangentRecorder, sink, logits,
                 input_ids: torch.Tensor, opts: DumpOptions, mtp_logits=None) -> dict:
    """The backward pass of --grads (parity.torch_ref.backward): loss on the prefill's logits — plus, with
    `opts.mtp_loss_scale`, the scaled MTP term on the MTP layer's fp32 logits (`mtp_logits`, the runtime's own
    `out.mtp_logits`) —, L.backward() (the recorder's tensor hooks write the cotangents as they arrive), then every
    parameter's gradient under its HF name. Returns the root attr `backward`. Gradients are released after (the
    decode steps need none)."""
    lf = logits.float()  # the same tensor when the runtime already returns fp32 logits
    recorder.watch_logits(lf)
    main = next_token_ce(lf, input_ids)
    loss, mtp = main, None
    if opts.mtp_loss_scale is not None:
        if not mtp_logits:
            raise ParityError(f"--mtp-loss-scale: the {map_name} runtime's forward returned no mtp_logits")
        mlf = mtp_logits[0].float()  # fp32 already (lm_head(...).float()): the same tensor
        recorder.watch_mtp_logits(0, mlf)
        mtp = mtp_ce(mlf, input_ids)
        loss = main + opts.mtp_loss_scale * mtp  # the official forward's `loss += scaling_factor * mtp_loss`
    try:
        loss.backward()
        _check_kda_cores_differentiated(model, map_name, cfg)
        for hf_name, _p, g in hf_param_grads(model, map_name):
            point = grad_point(hf_name, cfg.num_hidden_layers, mtp=mtp is not None)
            layer = point.mtp + cfg.num_hidden_layers if isinstance(point, MtpPoint) else getattr(point, "layer", None)
            if point is not None and cap.wants(layer, point.site):
                sink(point, to_numpy(g), {"module": f"parameter {hf_name}", "io": "output", "shape_names": ""})
    finally:
        for p in model.parameters():
            p.grad = None
    B, T = input_ids.shape
    grad_dtype = "bfloat16" if DTYPES[opts.dtype] == torch.bfloat16 else "float32"
    mtp_rec = None if mtp is None else mtp_loss_record(opts.mtp_loss_scale, float(mtp.detach()),
                                                       float(main.detach()), B * (T - 2))
    return loss_record(float(main.detach()), B * (T - 1), grad_dtype, opts.stats_only, mtp_rec)


def _check_kda_cores_differentiated(model, map_name: str, cfg: Ling3Config) -> None:
    """Refuse a --grads dump whose KDA core passed no gradient back: then every KDA layer's q_proj weight has none
    (autograd gave it nothing, where a real gradient — however small — is a tensor). fla's `fused_recurrent_kda` is
    forward-only (a plain function around its forward kernel: no autograd Function), and the official file calls it
    for prompts of ≤ 64 tokens on fla's kernels; those gradients would be written as zeros (measured: the official
    tiny-flash at 40 tokens under Triton's interpreter, its q_proj gradient 0 and input_layernorm's cotangent 12× off
    in rel-L2 against the reference's VJP)."""
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"]
    if not kda:
        return
    names = {f"model.layers.{i}.attention.q_proj.weight" for i in kda}
    none = [hf for hf, p, _g in hf_param_grads(model, map_name) if hf in names and p.grad is None]
    if len(none) == len(kda):
        raise ParityError(f"--grads: no KDA layer's core passed a gradient back ({none[0]} has none): the kernel "
                          "that ran the KDA core has no backward — fla's fused_recurrent_kda is forward-only, and "
                          "the official file and the twin call it for prompts of ≤ 64 tokens; dump --grads with a "
                          "prompt of more than 64 tokens (chunk_kda has a backward) or on the CPU stand-ins "
                          "(--cpu-kernels)")


def _snapshot(cap: Capture, sink, written: set, pkv, cfg, layers, phase, step, opts: DumpOptions) -> None:
    """Recurrent/conv state from the cache where the runtime's taps did not already record them."""
    if not opts.cache_snapshots:
        return
    for i in layers:
        for site, t in _cache_snapshot(pkv, cfg, i).items():
            pt = Point(phase, step, i, site)
            if pt not in written and cap.wants(i, site):
                cap.emit(i, site, t, module="past_key_values", io="output")


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="dump (layer forwards)", unit="layer", leave=False)


def _count_layers(model, cfg, layers, progress, cap: Capture) -> None:
    """A progress tick per decoder layer forward (hook on each dumped layer)."""
    mods = dict(model.named_modules())
    for i in layers:
        for name in (f"model.layers.{i}", f"layers.{i}"):
            if name in mods:
                def tick(*_):  # a forward hook's return value would replace the module output: return None
                    progress.update(1)

                cap.handles.append(mods[name].register_forward_hook(tick))
                break
