#!/usr/bin/env python3
"""Capture per-layer activations of a Ling3 HF model into HDF5 (thin CLI over parity.torch_ref.dump)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.dump_hf import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
