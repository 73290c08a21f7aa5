"""Which KDA kernels a dump runs, and a record of which ones actually ran (the dump's `kernels` root attr, DESIGN §4).

Three parts, used by `parity.torch_ref.dump.dump_checkpoint`:
- `choose_cpu_kernels`: the guard/switch. The fla CPU stand-ins replace fla only where the real kernels cannot run
  (no real fla + triton, or neither a CUDA device nor `TRITON_INTERPRET=1`); `--cpu-kernels` / `--no-cpu-kernels`
  decide explicitly on any machine.
- `fp32_matmul_policy`: an fp32 dump on CUDA forces IEEE fp32 dots (torch's TF32 flags off, float32 matmul precision
  "highest", `TRITON_F32_DEFAULT=ieee` before the kernels compile) unless TF32 is allowed explicitly; on NVIDIA GPUs
  both default to TF32 (~1e-3 relative), which would silently make an "fp32" reference a TF32 one.
- `KernelObserver`: wraps the KDA entry points the runtime calls (module globals of the modeling code, and the
  short-conv / gated-norm modules) and records, per call path, the implementation of each call that happened —
  observed at run time, not inferred from what is installed.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from parity.errors import ParityError

STAND_IN_MODULE = "parity.torch_ref.fla_cpu"
# Names in a modeling module whose call is a KDA call path -> the path's name (the fla kernel it stands for).
# chunk_kda / fused_recurrent_kda: the official file and the twin (fla, or the stand-ins under fla's names);
# kda_chunked / kda_recurrent: the twin's own pure-PyTorch path (LING3_TWIN_KERNELS=torch, or no fla importable);
# chunk/recurrent_kimi_delta_attention: transformers' built-in bailing_hybrid (hub kernel or its torch fallback).
# The gate and the q/k l2norm run inside these calls (use_gate_in_kernel, use_qk_l2norm_in_kernel), so their path
# is the call's.
FUNCTION_PATHS = {
    "chunk_kda": "chunk_kda",
    "fused_recurrent_kda": "fused_recurrent_kda",
    "kda_chunked": "chunk_kda",
    "kda_recurrent": "fused_recurrent_kda",
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
}
# Submodule attribute names of a KDA layer (official checkpoint names, DESIGN §3) -> path.
MODULE_PATHS = {"q_conv1d": "short_conv", "k_conv1d": "short_conv", "v_conv1d": "short_conv", "o_norm": "norm_gate"}
UNSET_DOT = "unset (the backend's default: tf32 on NVIDIA GPUs)"
IEEE = {"torch_allow_tf32": False, "cudnn_allow_tf32": False, "float32_matmul_precision": "highest",
        "triton_f32_default": "ieee"}


# ----------------------------------------------------------------------------------------------- guard / switch
def installed_version(dist: str) -> str | None:
    """Version of an installed distribution, or None when it is not installed."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def real_kernels_runnable(device: str, *, cuda_available: bool | None = None,
                          interpret: str | None = None, fla_and_triton: bool | None = None) -> tuple[bool, str]:
    """(can fla's Triton kernels run for a model on `device`, why). They need a real fla and triton, and tensors on a
    CUDA device or Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors). The keyword arguments replace the probes
    of this machine (tests)."""
    from parity.torch_ref import fla_cpu

    if fla_and_triton is None:
        fla_and_triton = fla_cpu.real_fla_with_triton()
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET")
    if not fla_and_triton:
        return False, "no real fla with triton importable"
    if interpret == "1":
        return True, "fla and triton importable, TRITON_INTERPRET=1"
    dev = str(device)
    if dev.startswith("cuda") or dev == "auto":
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if cuda_available:
            return True, f"fla and triton importable, device {dev} with CUDA available"
        return False, f"device {dev} but no CUDA device available, and TRITON_INTERPRET is not 1"
    return False, f"device {dev} is not CUDA and TRITON_INTERPRET is not 1"


def choose_cpu_kernels(cpu_kernels: bool | None, device: str, **probes: Any) -> tuple[bool, str]:
    """(use the fla CPU stand-ins, why). An explicit choice wins on any machine; by default the stand-ins are used
    exactly where the real kernels cannot run (`real_kernels_runnable`)."""
    if cpu_kernels is not None:
        return bool(cpu_kernels), "--cpu-kernels" if cpu_kernels else "--no-cpu-kernels"
    runnable, why = real_kernels_runnable(device, **probes)
    return not runnable, f"default: {why}"


# ----------------------------------------------------------------------------------------------- fp32 matmuls
def fp32_matmul_settings() -> dict[str, Any]:
    """The fp32 matmul settings in force now: torch's TF32 flags, float32 matmul precision, Triton's fp32 dot
    default (`TRITON_F32_DEFAULT`; None = unset, Triton then uses TF32 on NVIDIA GPUs)."""
    return {
        "torch_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT") or None,
    }


def _apply(settings: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = settings["torch_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = settings["cudnn_allow_tf32"]
    torch.set_float32_matmul_precision(settings["float32_matmul_precision"])
    if settings["triton_f32_default"] is None:
        os.environ.pop("TRITON_F32_DEFAULT", None)
    else:
        os.environ["TRITON_F32_DEFAULT"] = settings["triton_f32_default"]


@contextmanager
def fp32_matmul_policy(compute_dtype: torch.dtype, device: str, allow_tf32: bool) -> Iterator[dict[str, Any]]:
    """Within the block: IEEE fp32 dots (torch and Triton) for an fp32 dump on CUDA unless `allow_tf32`; everything
    else as it was. Yields the record (settings in force, what was done and whether it matters); restores the
    previous settings on exit. Enter it before the model is loaded: Triton reads its default when a kernel
    compiles."""
    before = fp32_matmul_settings()
    on_cuda = str(device).startswith("cuda") or str(device) == "auto"
    force = compute_dtype == torch.float32 and on_cuda and not allow_tf32
    if force:
        _apply(IEEE)
    if not on_cuda:
        policy = "moot: no CUDA device (TF32 is NVIDIA-only), as found"
    elif compute_dtype != torch.float32:
        policy = "not an fp32 dump, as found"
    elif allow_tf32:
        policy = "TF32 allowed (--allow-tf32), as found"
    else:
        policy = "IEEE fp32 forced (torch and Triton)"
    try:
        yield {**fp32_matmul_settings(), "policy": policy, "allow_tf32_option": bool(allow_tf32)}
    finally:
        if force:
            _apply(before)


# ----------------------------------------------------------------------------------------------- bf16 GEMMs
def bf16_reduction_setting() -> bool | None:
    """torch's `allow_bf16_reduced_precision_reduction` now (None where this torch has no such flag)."""
    return getattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", None)


@contextmanager
def bf16_gemm_policy(device: str, allow_reduced: bool) -> Iterator[dict[str, Any]]:
    """Within the block: bf16 GEMMs on CUDA reduce in full fp32 — torch's
    `backends.cuda.matmul.allow_bf16_reduced_precision_reduction` off (cuBLAS may otherwise use reduced-precision
    reductions for bf16 GEMMs, which the CPU reference never does) — unless `allow_reduced`
    (`--allow-bf16-reduced-precision-reduction`); elsewhere as found. Yields the record (the kernels attr's
    `bf16_gemm`); restores the previous setting on exit."""
    before = bf16_reduction_setting()
    on_cuda = str(device).startswith("cuda") or str(device) == "auto"
    force = on_cuda and not allow_reduced and before is not None
    if force:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if before is None:
        policy = "not settable in this torch, as found"
    elif not on_cuda:
        policy = "moot: no CUDA device, as found"
    elif allow_reduced:
        policy = "reduced-precision reductions allowed (--allow-bf16-reduced-precision-reduction), as found"
    else:
        policy = "full fp32 reductions forced (allow_bf16_reduced_precision_reduction off)"
    try:
        yield {"allow_bf16_reduced_precision_reduction": bf16_reduction_setting(), "policy": policy,
               "allow_option": bool(allow_reduced)}
    finally:
        if force:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


# ----------------------------------------------------------------------------------------------- observer
def kernel_binding(fn: Any) -> str | None:
    """Module of the implementation a transformers `use_kernel_func_from_hub_with_fallback` wrapper bound to."""
    seen = 0
    while fn is not None and seen < 5:
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is not None:
            for var, cell in zip(code.co_freevars, cells):
                if var == "implementation":
                    try:
                        return getattr(cell.cell_contents, "__module__", None)
                    except ValueError:
                        return None
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def implementation_of(obj: Any) -> str:
    """'fla' (a real fla module), 'stand-in' (parity.torch_ref.fla_cpu) or 'torch:<module>' (anything else, e.g. the
    twin's own pure-PyTorch path) for a function, a module instance or a class. A transformers hub-kernel wrapper is
    looked through to the implementation it bound."""
    if isinstance(obj, torch.nn.Module):
        obj = type(obj)  # a module's implementation is its class's
    bound = None if isinstance(obj, type) else kernel_binding(obj)
    mod = bound or getattr(obj, "__module__", None) or ""
    if mod == "fla" or mod.startswith("fla."):
        return "fla"
    if mod == STAND_IN_MODULE:
        return "stand-in"
    return f"torch:{mod.split('.')[-1] or '?'}"


class KernelObserver:
    """Context manager: while open, every call of a KDA path in `model` records {path: implementation}. Wraps the
    names of FUNCTION_PATHS in the modules that define the model's classes (restored on exit) and hooks the KDA
    layers' MODULE_PATHS submodules. `paths` holds only paths that were called; two implementations on one path
    (never expected) are joined with '+'."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.paths: dict[str, str] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []

    def _seen(self, path: str, impl: str) -> None:
        old = self.paths.get(path)
        if old is None:
            self.paths[path] = impl
        elif impl not in old.split("+"):
            self.paths[path] = f"{old}+{impl}"

    def _wrap(self, fn: Callable, path: str) -> Callable:
        impl = implementation_of(fn)

        @functools.wraps(fn)
        def observed(*args: Any, **kwargs: Any) -> Any:
            self._seen(path, impl)
            return fn(*args, **kwargs)

        observed.__parity_observed__ = True
        return observed

    def __enter__(self) -> "KernelObserver":
        import sys

        modules = {type(m).__module__ for m in self.model.modules()}
        for name in sorted(modules):
            mod = sys.modules.get(name)
            if mod is None or name.startswith("torch."):
                continue
            for attr, path in FUNCTION_PATHS.items():
                fn = getattr(mod, attr, None)
                if callable(fn) and not getattr(fn, "__parity_observed__", False):
                    self._undo.append((mod, attr, fn))
                    setattr(mod, attr, self._wrap(fn, path))
        for qual, sub in self.model.named_modules():
            path = MODULE_PATHS.get(qual.rsplit(".", 1)[-1])
            if path is not None:
                impl = implementation_of(sub)
                self._handles.append(sub.register_forward_pre_hook(
                    lambda _m, _a, path=path, impl=impl: self._seen(path, impl)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, attr, fn in reversed(self._undo):
            setattr(mod, attr, fn)
        self._undo.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ----------------------------------------------------------------------------------------------- the record
def device_record(device: torch.device) -> dict[str, Any]:
    """The model's device; for CUDA its name and compute capability ('9.0')."""
    rec: dict[str, Any] = {"device": str(device), "cuda_name": None, "cuda_capability": None}
    if device.type == "cuda":
        rec["cuda_name"] = torch.cuda.get_device_name(device)
        rec["cuda_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    return rec


def triton_fp32_dot_default() -> str | None:
    """Triton's fp32 dot default as Triton reads it (its knobs), or None when triton is not importable."""
    if not _importable("triton"):
        return None
    try:
        from triton import knobs

        return str(knobs.language.fp32_default or UNSET_DOT)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_F32_DEFAULT") or UNSET_DOT


def kernels_record(*, paths: dict[str, str], choice: tuple[bool, str] | None, device: torch.device,
                   fp32: dict[str, Any], bf16_gemm: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `kernels` root attr: observed KDA paths, the stand-in choice and why (`LoadedModel.kernels_choice`; None
    for the native runtime), versions, interpreter, device, fp32 matmul settings."""
    fla_installed = installed_version("fla-core")
    ran_fla = any("fla" in impl.split("+") for impl in paths.values())
    return {
        "kda_paths": dict(sorted(paths.items())),
        "cpu_kernels": None if choice is None else choice[0],
        "choice": "native runtime: transformers' built-in, no fla stand-ins" if choice is None else choice[1],
        "fla_core_version": fla_installed if ran_fla else None,  # of the fla whose kernels ran; None: none ran
        "fla_core_installed": fla_installed,
        "triton_version": installed_version("triton"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") or None,
        **device_record(device),
        # as in force now, at the end of the dump (the runtime may have changed them since the policy was applied)
        "fp32_matmul": {**fp32, **fp32_matmul_settings(), "triton_fp32_dot_default": triton_fp32_dot_default()},
        # issue 31: cuBLAS bf16 GEMM reductions (as in force now, beside the policy applied)
        **({} if bf16_gemm is None else {"bf16_gemm": {**bf16_gemm, "allow_bf16_reduced_precision_reduction":
                                                       bf16_reduction_setting()}}),
    }


__all__ = ["bf16_gemm_policy", "bf16_reduction_setting", "choose_cpu_kernels", "real_kernels_runnable", "fp32_matmul_settings", "fp32_matmul_policy",
           "KernelObserver", "implementation_of", "kernel_binding", "kernels_record", "device_record", "installed_version"]
