"""Targets: the JAX implementations under test (DESIGN §7).

`--parity-target NAME` picks one: `reference` is the suite's own pure-JAX Ling3; any other value of the form
`package.module:ClassName` is imported as an external adapter (a port's repository provides it). A target whose
import fails or whose `available()` says no is a skip with the reason, not an error.
"""

from __future__ import annotations

import importlib

from parity.errors import TargetError
from parity.targets.base import CAPABILITIES, BackwardResult, LayerResult, Target

BUILTIN = {
    "reference": "parity.targets.reference:ReferenceTarget",
    # a flax-nnx Ling3 shaped like a serving port, read through taps (protocol v2 in CI without an external port)
    "portlike": "parity.targets.portlike:PortlikeTarget",
    # sglang-jax's bailing_moe_v3 (pull request #1394), when installed
    "sglang_jax": "parity.targets.sglang_jax:SglangJaxTarget",
}


def resolve(name: str) -> type[Target]:
    """Import a target class; TargetError with the reason when it cannot be used here."""
    spec = BUILTIN.get(name, name)
    if ":" not in spec:
        raise TargetError(f"--parity-target {name!r}: expected one of {sorted(BUILTIN)} or 'package.module:ClassName'")
    mod_name, cls_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise TargetError(f"target {name!r} is not installed here ({e})") from None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise TargetError(f"target {name!r}: module {mod_name} has no class {cls_name}")
    ok, why = cls.available()
    if not ok:
        raise TargetError(f"target {name!r} is not available: {why}")
    return cls


__all__ = ["BackwardResult", "CAPABILITIES", "LayerResult", "Target", "resolve", "BUILTIN"]
