"""PyTorch side of the suite: loading runtimes, capture hooks, fla CPU stand-ins, the twin remote code
(`parity.torch_ref.twin`), the official remote code from a cache outside the repository (`official`), the
semantic-fork probes (`semantics`) and the random-checkpoint maker (`parity.torch_ref.ckpt`).

Kept import-light on purpose: importing `parity.torch_ref` must not import torch or transformers; import the
submodules you need.
"""

from pathlib import Path

TWIN_DIR = Path(__file__).resolve().parent / "twin"
TWIN_FILES = ("configuration_bailing_moe_v3.py", "modeling_bailing_moe_v3.py")

__all__ = ["TWIN_DIR", "TWIN_FILES"]
