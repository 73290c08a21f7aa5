"""Kernel provenance of a dump: the `kernels` root attr (DESIGN §4) checked, and said in one line or a report section.

Written by `parity.torch_ref.kernels.kernels_record` (torch side); read here without torch, so the reader, the
reports and the CLIs can use it. Dumps written before the attr existed have none: "provenance not recorded".
"""

from __future__ import annotations

from typing import Any

from parity.errors import DumpError

NOT_RECORDED = "provenance not recorded (dump written before the `kernels` attr existed)"
# field -> allowed JSON types (None = null allowed)
FIELDS: dict[str, tuple] = {
    "kda_paths": (dict,),
    "cpu_kernels": (bool, type(None)),
    "choice": (str,),
    "fla_core_version": (str, type(None)),
    "fla_core_installed": (str, type(None)),
    "triton_version": (str, type(None)),
    "triton_interpret": (str, type(None)),
    "device": (str,),
    "cuda_name": (str, type(None)),
    "cuda_capability": (str, type(None)),
    "fp32_matmul": (dict,),
}
# optional fields (dumps written before them lack them): issue 31's cuBLAS bf16 GEMM reduction setting
OPTIONAL_FIELDS: dict[str, tuple] = {"bf16_gemm": (dict,)}
BF16_GEMM_FIELDS = ("allow_bf16_reduced_precision_reduction", "policy", "allow_option")
FP32_FIELDS = ("torch_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision", "triton_f32_default", "policy")


def _names(types: tuple) -> str:
    return " or ".join("null" if t is type(None) else {dict: "object", str: "string", bool: "boolean"}[t]
                       for t in types)


def check_kernels(value: Any, where: str) -> dict:
    """The `kernels` attr as a dict, or DumpError naming `where` and the first bad field."""
    if not isinstance(value, dict):
        raise DumpError(f"{where}: root attr kernels is a {type(value).__name__}, expected a JSON object")
    for key, types in FIELDS.items():
        if key not in value:
            raise DumpError(f"{where}: root attr kernels has no field {key!r}")
        if not isinstance(value[key], types):
            raise DumpError(f"{where}: root attr kernels field {key!r} is {value[key]!r}, expected {_names(types)}")
    bad = {k: v for k, v in value["kda_paths"].items() if not isinstance(v, str)}
    if bad:
        raise DumpError(f"{where}: root attr kernels field 'kda_paths' maps {sorted(bad)[0]!r} to "
                        f"{bad[sorted(bad)[0]]!r}, expected an implementation name (string)")
    missing = [k for k in FP32_FIELDS if k not in value["fp32_matmul"]]
    if missing:
        raise DumpError(f"{where}: root attr kernels field 'fp32_matmul' has no {missing[0]!r}")
    for key, types in OPTIONAL_FIELDS.items():
        if key in value and not isinstance(value[key], types):
            raise DumpError(f"{where}: root attr kernels field {key!r} is {value[key]!r}, expected {_names(types)}")
    missing = [k for k in BF16_GEMM_FIELDS if "bf16_gemm" in value and k not in value["bf16_gemm"]]
    if missing:
        raise DumpError(f"{where}: root attr kernels field 'bf16_gemm' has no {missing[0]!r}")
    return value


def bf16_gemm_text(k: dict) -> str:
    """The bf16 GEMM reduction setting of a dump (issue 31), or that the dump predates its record."""
    b = k.get("bf16_gemm")
    if b is None:
        return "bf16 GEMM reduction: not recorded"
    return f"bf16 GEMM reduction: {b['policy']} (allow_bf16_reduced_precision_reduction " \
           f"{b['allow_bf16_reduced_precision_reduction']})"


def kernels_line(k: dict | None) -> str:
    """One line: which implementation ran on each KDA path, versions, interpreter, device, fp32 matmul policy."""
    if k is None:
        return NOT_RECORDED
    paths = ", ".join(f"{p}={impl}" for p, impl in k["kda_paths"].items()) or "no KDA path ran"
    dev = k["device"] + (f" ({k['cuda_name']}, sm {k['cuda_capability']})" if k.get("cuda_name") else "")
    fp = k["fp32_matmul"]
    return (f"{paths} | fla {k['fla_core_version'] or '-'}, triton {k['triton_version'] or '-'}, "
            f"TRITON_INTERPRET={k['triton_interpret'] or 'unset'} | {dev} | fp32 matmul: {fp['policy']} "
            f"(torch tf32 {fp['torch_allow_tf32']}, cudnn tf32 {fp['cudnn_allow_tf32']}, "
            f"precision {fp['float32_matmul_precision']}, TRITON_F32_DEFAULT={fp['triton_f32_default'] or 'unset'}) | "
            f"{bf16_gemm_text(k)}")


def markdown_section(k: dict | None) -> list[str]:
    """The report.md section "Dump provenance (kernels)"."""
    out = ["## Dump provenance (kernels)", ""]
    if k is None:
        return out + [NOT_RECORDED, ""]
    out += ["| KDA path | implementation that ran |", "|---|---|"]
    out += [f"| {p} | {impl} |" for p, impl in k["kda_paths"].items()] or ["| - | no KDA path ran |"]
    fp = k["fp32_matmul"]
    out += ["", f"- stand-ins chosen: {k['cpu_kernels']} ({k['choice']})",
            f"- fla-core (ran): {k['fla_core_version'] or '-'}; installed: {k['fla_core_installed'] or '-'}",
            f"- triton: {k['triton_version'] or '-'}; TRITON_INTERPRET: {k['triton_interpret'] or 'unset'}",
            f"- device: {k['device']}" + (f", {k['cuda_name']} (compute capability {k['cuda_capability']})"
                                          if k.get("cuda_name") else ""),
            f"- fp32 matmul: {fp['policy']}; torch allow_tf32 {fp['torch_allow_tf32']}, cudnn allow_tf32 "
            f"{fp['cudnn_allow_tf32']}, float32_matmul_precision {fp['float32_matmul_precision']}, "
            f"TRITON_F32_DEFAULT {fp['triton_f32_default'] or 'unset'}", f"- {bf16_gemm_text(k)}", ""]
    return out


__all__ = ["bf16_gemm_text", "check_kernels", "kernels_line", "markdown_section", "NOT_RECORDED"]
