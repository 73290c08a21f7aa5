"""Guard against CPUs that advertise Intel AMX but trap on it (torch's oneDNN bf16 GEMMs die with SIGILL).

Measured on a 2-core Intel Xeon VM (2026-11-23): /proc/cpuinfo lists `amx_tile amx_bf16`, the kernel grants the
XTILEDATA permission, yet the first bf16 matmul of torch 2.13.0+cpu kills the process with "Illegal instruction"
(`traps: python3 ... trap invalid opcode` in dmesg); fp32 GEMMs, bf16 conv1d and JAX's bf16 dots are fine. Capping
oneDNN at `AVX512_CORE_BF16` (its documented `ONEDNN_MAX_CPU_ISA` switch, read at oneDNN's first use) makes the same
matmul work. Whether a machine traps cannot be read off the flags, so it is probed once in a child process; the
verdict is kept in the environment, so child processes and xdist workers inherit it without probing again.

This changes which oneDNN kernels run, not what they compute to within rounding: bf16 GEMM results may differ in the
last bits from an AMX machine's (as they already differ between CPU vendors, `parity.golden`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ISA_VAR = "ONEDNN_MAX_CPU_ISA"
LEGACY_ISA_VAR = "DNNL_MAX_CPU_ISA"
CAPPED_ISA = "AVX512_CORE_BF16"
PROBE_VAR = "LING3_PARITY_AMX_PROBE"  # "ok" | "sigill" | "skipped: ..." once probed in this process tree
_PROBE = ("import torch\n"
          "a = torch.ones(64, 64, dtype=torch.bfloat16)\n"
          "print(float((a @ a).float().sum()))\n")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty when unreadable, e.g. not Linux)."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def probe_bf16_gemm(timeout: float = 300.0) -> str:
    """Run one torch bf16 matmul in a child process: "ok", "sigill", or "skipped: <why>"."""
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, PROBE_VAR: "probing"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"skipped: probe did not run ({type(e).__name__})"
    if r.returncode == -signal.SIGILL:
        return "sigill"
    if r.returncode != 0:  # no torch here (a JAX-only install), or another failure: nothing to decide
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"skipped: probe exited {r.returncode} ({last[:120]})"
    return "ok"


def ensure_usable_onednn_isa(*, probe=probe_bf16_gemm, flags: set[str] | None = None) -> str | None:
    """Cap oneDNN below AMX when AMX is advertised but traps. Call before the process's first torch bf16 GEMM.
    Returns a one-line note when it capped, else None. Never overrides an ISA the user set."""
    if os.environ.get(ISA_VAR) or os.environ.get(LEGACY_ISA_VAR):
        return None
    if "amx_tile" not in (flags if flags is not None else cpu_flags()):
        return None
    verdict = os.environ.get(PROBE_VAR)
    if verdict is None:
        verdict = probe()
        os.environ[PROBE_VAR] = verdict
    if verdict != "sigill":
        return None
    os.environ[ISA_VAR] = CAPPED_ISA
    return (f"ling3-parity: this CPU advertises AMX but a torch bf16 matmul dies with SIGILL here; "
            f"{ISA_VAR}={CAPPED_ISA} set for this process and its children")


# ------------------------------------------------------------------------------ another CPU kind on this machine
# `LING3_PARITY_CPU_ISA=AVX2` runs the suite as an AVX2-only CPU would (issue 35): every library that picks its
# kernels by the CPU's vector ISA is capped, so bounds meet AVX2 summation orders on any AVX-512 machine. Each
# library's own switch, read once at its first use (so set before torch/jax are imported: the root conftest.py):
# oneDNN (torch's bf16 GEMMs; capped at AVX2 torch has no oneDNN bf16 GEMM and uses its own, as on an AVX2 CPU),
# MKL (torch's fp32 GEMMs), ATen's vectorised kernels (torch.backends.cpu.get_cpu_capability()), XLA:CPU's codegen.
CPU_ISA_VAR = "LING3_PARITY_CPU_ISA"
MKL_VAR, ATEN_VAR = "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"
ISA_CAPS = {
    "AVX2": {ISA_VAR: "AVX2", MKL_VAR: "AVX2", ATEN_VAR: "avx2", "xla": "AVX2"},
    "AVX512": {ISA_VAR: "AVX512_CORE", MKL_VAR: "AVX512", ATEN_VAR: "avx512", "xla": "AVX512"},
}


def isa_cap_env(isa: str, environ: dict[str, str]) -> dict[str, str]:
    """The variables to set so the libraries run as on an `isa` CPU (ISA_CAPS). A variable the user already set is
    kept (an explicit cap wins), and an XLA_FLAGS that already names --xla_cpu_max_isa is left alone."""
    caps = ISA_CAPS.get(isa.upper())
    if caps is None:
        raise ValueError(f"{CPU_ISA_VAR}={isa!r}: expected one of {', '.join(ISA_CAPS)}")
    out = {k: v for k, v in caps.items() if k != "xla" and not environ.get(k)}
    if ISA_VAR in out and environ.get(LEGACY_ISA_VAR):
        del out[ISA_VAR]
    xla = environ.get("XLA_FLAGS", "")
    if "--xla_cpu_max_isa" not in xla:
        out["XLA_FLAGS"] = f"{xla} --xla_cpu_max_isa={caps['xla']}".strip()
    return out


def apply_isa_cap(environ=os.environ) -> str | None:
    """Apply LING3_PARITY_CPU_ISA (when set) to `environ`; a one-line note of the caps in effect, else None."""
    isa = environ.get(CPU_ISA_VAR)
    if not isa:
        return None
    environ.update(isa_cap_env(isa, environ))
    return f"ling3-parity: {CPU_ISA_VAR}={isa}: " + describe_caps(environ)


def describe_caps(environ=os.environ) -> str:
    """The ISA caps in effect, whoever set them (for the pytest header: a capped run says so)."""
    names = (ISA_VAR, LEGACY_ISA_VAR, MKL_VAR, ATEN_VAR)
    caps = [f"{n}={environ[n]}" for n in names if environ.get(n)]
    caps += [f for f in environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
    return ", ".join(caps) if caps else "none (each library picks this CPU's widest ISA)"


__all__ = ["ISA_VAR", "CAPPED_ISA", "PROBE_VAR", "CPU_ISA_VAR", "ISA_CAPS", "cpu_flags", "probe_bf16_gemm",
           "ensure_usable_onednn_isa", "isa_cap_env", "apply_isa_cap", "describe_caps"]
