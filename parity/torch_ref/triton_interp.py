"""Support for running fla's real KDA Triton kernels on CPU under Triton's interpreter (`TRITON_INTERPRET=1`).

Stock Triton 3.9.0's interpreter cannot run fla 0.6.0's KDA kernels correctly as is (measured, issue 24). `install()`
patches six gaps, each undone by `uninstall()`:

1. `autotune_single_config`: an autotuner with several configs benchmarks them, which needs a GPU driver ("0 active
   drivers"). Keep the first surviving config, so Triton takes its single-config path (no benchmarking). The config
   changes blocking only, not the maths; on a GPU the autotuner may pick another one (that is GPU-only knowledge).
2. `builtin_aliases`: the interpreter swaps Triton builtins for its own only as attributes of `triton.language`; a
   builtin bound to a module-level name (fla `ops/utils/op.py`: `gather = tl.gather`) stays the compiled-mode builtin
   ("Did you forget to add @triton.jit?"). Also swap builtins found among a kernel's module globals.
3. `range_loop_tensor`: in compiled Triton the variable of `for i in range(n)` / `tl.range` is a tensor (fla calls
   `i_t.to(tl.int64)` on it); the interpreter leaves a Python int. Rebind it as a tensor at the top of the loop body
   (`tl.static_range` stays a Python int, as compiled).
4. `bf16_arithmetic`: the interpreter keeps bf16 as raw uint16 and runs arithmetic on the bit patterns (bf16 dots come
   out ~1e9, bf16×bf16 NaN). Widen bf16 operands to fp32 (exact), compute, round arithmetic results back to bf16;
   comparisons keep their result; a dot accumulates in its accumulator's dtype, as a GPU's MMA does.
5. `bf16_round_nearest_even`: the interpreter's fp32→bf16 cast truncates; GPUs round to nearest even.
6. `dot_bf16x3`: fla's KDA *backward* (`ops/kda/chunk_intra.py`, `SAFE_GATE_DOT_PRECISION = 'bf16x3'` on triton >
   3.6) asks for bf16x3 dots, which the interpreter's options do not list ("input_precision must be one of ('tf32',
   'tf32x3', 'ieee')"). Allow it; the interpreter computes every fp32 dot in full fp32 whatever the precision asked,
   so this is an IEEE dot where a GPU splits each operand into bf16 parts (≈ 2^-16 relative per product: like TF32,
   a difference only a GPU shows).

Only for the interpreter: `install()` refuses unless `TRITON_INTERPRET=1` (patch 1 would disable autotuning on a GPU).
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Any, Callable

import numpy as np

from parity.errors import ParityError

PATCHES = ("autotune_single_config", "builtin_aliases", "range_loop_tensor", "bf16_arithmetic",
           "bf16_round_nearest_even", "dot_bf16x3")
_COMPARISONS = {np.less, np.greater, np.less_equal, np.greater_equal, np.equal, np.not_equal}

_undo: list[tuple[Any, str, Any]] = []  # (object, attribute, original value), restored in reverse order


# ----------------------------------------------------------------------------------------------- bf16 bit maths
def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bf16 stored as uint16 bit patterns -> fp32 (exact: bf16 is fp32's upper half)."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 uint16 bit patterns, rounded to nearest even (as GPUs convert); NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(x), nan, rounded)


# ----------------------------------------------------------------------------------------------- install / uninstall
def installed() -> list[str]:
    """Names of the patches in place (empty when not installed)."""
    return list(PATCHES) if _undo else []


_ABSENT = object()


def _set(obj: Any, name: str, value: Any) -> None:
    _undo.append((obj, name, vars(obj).get(name, _ABSENT) if isinstance(obj, type) else getattr(obj, name)))
    setattr(obj, name, value)


def install() -> list[str]:
    """Apply the six patches (idempotent) and return their names. Raises ParityError when `TRITON_INTERPRET` is not
    1 (on a GPU the compiled kernels need none of this) or triton is not importable."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ParityError("triton_interp.install: TRITON_INTERPRET is not 1; these patches are for Triton's "
                          "interpreter only (on a GPU they would disable autotuning)")
    if _undo:
        return installed()
    try:
        import triton.language as tl
        from triton.runtime import autotuner, interpreter
    except ImportError as e:
        raise ParityError(f"triton_interp.install: triton is not importable ({e})") from None
    _patch_autotune(autotuner.Autotuner)
    _patch_builtin_aliases(interpreter, tl)
    _patch_range_loops(interpreter.ASTTransformer)
    _patch_bf16(interpreter.InterpreterBuilder, interpreter.TensorHandle, tl)
    _patch_dot_precisions(interpreter.interpreter_builder)
    return installed()


def uninstall() -> None:
    """Restore everything `install()` changed."""
    while _undo:
        obj, name, value = _undo.pop()
        if value is _ABSENT:
            delattr(obj, name)  # was inherited (e.g. NodeTransformer's generic visit_For)
        else:
            setattr(obj, name, value)


# ----------------------------------------------------------------------------------------------- the patches
def _patch_autotune(Autotuner: type) -> None:
    original = Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return list(original(self, kwargs))[:1]  # one config left: Triton runs it without benchmarking

    _set(Autotuner, "prune_configs", prune_configs)


def _patch_builtin_aliases(interpreter: Any, tl: Any) -> None:
    original = interpreter._patch_lang

    def patch_lang(fn):
        scope = original(fn)
        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        if module is not None and vars(module) is fn.__globals__:
            for name, value in list(fn.__globals__.items()):
                if tl.core.is_builtin(value):  # e.g. `gather = tl.gather`: swapped for the run, restored by scope
                    interpreter._patch_attr(module, name, value, interpreter.interpreter_builder, scope)
        return scope

    _set(interpreter, "_patch_lang", patch_lang)


def _is_dynamic_range(call: ast.expr) -> bool:
    """`range(...)` or `tl.range(...)` (not `tl.static_range`, whose variable is a Python int when compiled too)."""
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    return (isinstance(f, ast.Name) and f.id == "range") or (isinstance(f, ast.Attribute) and f.attr == "range")


def _patch_range_loops(ASTTransformer: type) -> None:
    def visit_For(self, node: ast.For) -> ast.For:
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name) and _is_dynamic_range(node.iter):
            # i = interpreter_semantic.to_tensor(i, False): the name the interpreter's rewritten source uses
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            value = ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                   ast.Constant(value=False)], keywords=[])
            rebind = ast.copy_location(ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                                  value=value), node)
            node.body.insert(0, rebind)
        return node

    _set(ASTTransformer, "visit_For", visit_For)


def _patch_bf16(Builder: type, TensorHandle: type, tl: Any) -> None:
    bf16, fp32 = tl.bfloat16, tl.float32

    def is_bf16(h: Any) -> bool:
        return getattr(h, "dtype", None) is not None and h.dtype.scalar == bf16

    def widen(h: Any) -> Any:
        return TensorHandle(bf16_bits_to_fp32(h.data), fp32) if is_bf16(h) else h

    def narrow(h: Any) -> Any:
        return TensorHandle(fp32_to_bf16_bits(h.data), bf16)

    original_binary = Builder.binary_op

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return original_binary(self, lhs, rhs, op)
        out = original_binary(self, widen(lhs), widen(rhs), op)
        return out if op in _COMPARISONS else narrow(out)  # a comparison's result is not a bf16 value

    def widened_unary(original: Callable) -> Callable:
        def method(self, arg, *rest):
            if not is_bf16(arg):
                return original(self, arg, *rest)
            return narrow(original(self, widen(arg), *rest))
        return method

    original_fma = Builder.create_fma

    def create_fma(self, x, y, z):
        if not any(is_bf16(h) for h in (x, y, z)):
            return original_fma(self, x, y, z)
        out = original_fma(self, widen(x), widen(y), widen(z))
        return narrow(out) if is_bf16(z) else out

    original_dot = Builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not any(is_bf16(h) for h in (a, b, d)):
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = original_dot(self, widen(a), widen(b), widen(d), input_precision, max_num_imprecise_acc)
        return narrow(out) if is_bf16(d) else out  # products of bf16 are exact in fp32; the sum in d's dtype

    original_cast = Builder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == fp32 and d == bf16:
            return narrow(src)
        if s == bf16 and d == fp32:
            return widen(src)
        return original_cast(self, src, dst_type)

    _set(Builder, "binary_op", binary_op)
    _set(Builder, "unary_op", widened_unary(Builder.unary_op))
    for name in ("create_rsqrt", "create_erf"):  # unary maths that bypass unary_op
        _set(Builder, name, widened_unary(getattr(Builder, name)))
    _set(Builder, "create_fma", create_fma)
    _set(Builder, "create_dot", create_dot)
    _set(Builder, "cast_impl", cast_impl)


def _patch_dot_precisions(builder: Any) -> None:
    """Let the interpreter's one builder accept `input_precision="bf16x3"` (patch 6; its create_dot ignores it)."""
    import dataclasses

    allowed = builder.options.allowed_dot_input_precisions
    if "bf16x3" not in allowed:
        _set(builder, "options", dataclasses.replace(builder.options, allowed_dot_input_precisions=(*allowed, "bf16x3")))


__all__ = ["PATCHES", "install", "uninstall", "installed", "bf16_bits_to_fp32", "fp32_to_bf16_bits"]
