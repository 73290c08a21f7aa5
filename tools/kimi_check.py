#!/usr/bin/env python
"""The JAX Kimi Linear reference against transformers' built-in on a checkpoint, site by site (thin CLI over
parity.cli.kimi_check).

    python tools/kimi_check.py CKPT [--dtype bfloat16|float32] [--T 70] [--seed 0] [--conv-kernel torch|fused]
        [--mode layer|isolated|free] [--target package.module:Class] [--grads]
        [--dump OUT.h5 [--force] | --from-dump DUMP.h5]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from parity.cpu_isa import apply_isa_cap  # noqa: E402

apply_isa_cap()  # before torch and jax are imported (LING3_PARITY_CPU_ISA=AVX2 runs it as an AVX2-only CPU)

from parity.cli.kimi_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
