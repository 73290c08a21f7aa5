#!/usr/bin/env python3
"""The prepared GPU check (thin CLI over parity.cli.gpu_check): official tiny/tiny-flash dumped on CUDA with fla's real
kernels, replayed on the GPU and CPU JAX backends, compared with the same dumps made on CPU.

    python tools/gpu_check.py --out OUT [--cpu-only] [--cpu-ref interp|stand-ins] [--jobs N] [--budget-s S]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from parity.cli.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
