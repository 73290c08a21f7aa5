#!/usr/bin/env python
"""Write a random Ling3 checkpoint in the official layout (thin CLI over parity.torch_ref.ckpt).

    python tools/make_ckpt.py --preset tiny --seed 0 --out dumps/ckpt/tiny [--layers N] [--dtype bf16|fp32] [--force]
        [--gate-form lower-bound|softplus] [--q-lora-rank N|none] [--swiglu-clamp L|none] [--set KEY=VALUE ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from parity.torch_ref.ckpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
