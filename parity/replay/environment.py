"""Replay-side provenance (issue 31): where the target ran — platform, devices, jax / jaxlib / libtpu versions, the
XLA environment (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`), JAX's process-wide `jax_default_matmul_precision`, the
matmul-precision policy the replay applied to target calls (`parity.replay.matmul_policy`) and the compiler options the
suite compiles its own reference with (`parity.jax_ling3.REFERENCE_COMPILER_OPTIONS`, per computation, never a port's).
report.json key `replay_env`, beside `target_info` (what the target says it is) and `dump_provenance` (the dump side).

`replay_env(...)` is pure (every input given); `collect(policy)` reads them from this process.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "LING3_REFERENCE_XLA_DEFAULTS")


def replay_env(*, devices: list[Any], versions: Mapping[str, str | None], environ: Mapping[str, str],
               default_matmul_precision: str | None, policy: Mapping[str, str] | None,
               reference_compiler_options: Mapping[str, Any]) -> dict:
    """The `replay_env` section. `devices`: jax devices (objects with `.platform`, `.device_kind`) of the default
    backend; `versions`: {"jax", "jaxlib", "libtpu"}; `environ`: the process environment; `policy`: the resolved
    matmul-precision policy ({"policy", "source"}), None when the replay applied none."""
    platforms = sorted({str(d.platform) for d in devices})
    kinds = sorted({str(d.device_kind) for d in devices})
    return {
        "platform": platforms[0] if len(platforms) == 1 else ",".join(platforms) or None,
        "device_kind": kinds[0] if len(kinds) == 1 else ",".join(kinds) or None,
        "device_count": len(devices),
        "jax": versions.get("jax"), "jaxlib": versions.get("jaxlib"), "libtpu": versions.get("libtpu"),
        "env": {k: environ.get(k) for k in ENV_VARS},
        "jax_default_matmul_precision": default_matmul_precision,
        "matmul_precision": dict(policy) if policy is not None else None,
        "reference_compiler_options": dict(reference_compiler_options),
    }


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect(policy: Mapping[str, str] | None) -> dict:
    """`replay_env` of this process (the replay's)."""
    import jax

    from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

    try:
        devices = list(jax.devices())
    except RuntimeError:  # no backend could start: say so rather than lose the report
        devices = []
    p = jax.config.jax_default_matmul_precision
    return replay_env(devices=devices,
                      versions={"jax": jax.__version__, "jaxlib": _version("jaxlib"),
                                "libtpu": _version("libtpu") or _version("libtpu-nightly")},
                      environ=os.environ, default_matmul_precision=None if p is None else str(p), policy=policy,
                      reference_compiler_options=REFERENCE_COMPILER_OPTIONS)


def env_line(e: dict | None) -> str:
    """One line for the terminal summary / `tools/report.py show`."""
    if not e:
        return "replay environment not recorded"
    mp = e.get("matmul_precision") or {}
    env = e.get("env") or {}
    opts = e.get("reference_compiler_options") or {}
    return (f"{e.get('platform')} x{e.get('device_count')} ({e.get('device_kind')}) | jax {e.get('jax')}, jaxlib "
            f"{e.get('jaxlib')}, libtpu {e.get('libtpu') or '-'} | XLA_FLAGS={env.get('XLA_FLAGS') or 'unset'}, "
            f"LIBTPU_INIT_ARGS={env.get('LIBTPU_INIT_ARGS') or 'unset'} | matmul precision: "
            f"{mp.get('policy', 'none applied')} ({mp.get('source', '-')}), jax_default_matmul_precision "
            f"{e.get('jax_default_matmul_precision')} | reference compiled with "
            + (", ".join(f"{k}={v}" for k, v in opts.items()) or "XLA's defaults"))


def markdown_section(e: dict | None) -> list[str]:
    """The report.md section "Replay environment"."""
    out = ["## Replay environment", ""]
    if not e:
        return out + ["not recorded", ""]
    mp = e.get("matmul_precision") or {}
    env = e.get("env") or {}
    opts = e.get("reference_compiler_options") or {}
    return out + [
        f"- platform: {e.get('platform')}, {e.get('device_count')} device(s), {e.get('device_kind')}",
        f"- jax {e.get('jax')}, jaxlib {e.get('jaxlib')}, libtpu {e.get('libtpu') or '-'}",
        f"- XLA_FLAGS: `{env.get('XLA_FLAGS') or 'unset'}`; "
        f"LIBTPU_INIT_ARGS: `{env.get('LIBTPU_INIT_ARGS') or 'unset'}`",
        f"- matmul precision applied to target calls: **{mp.get('policy', 'none')}** ({mp.get('source', '-')}); "
        f"process-wide jax_default_matmul_precision: {e.get('jax_default_matmul_precision')}",
        "- the suite's reference compiled with: " + (", ".join(f"`{k}={v}`" for k, v in opts.items())
                                                      or "XLA's defaults (LING3_REFERENCE_XLA_DEFAULTS)"), ""]


__all__ = ["ENV_VARS", "collect", "env_line", "markdown_section", "replay_env"]
