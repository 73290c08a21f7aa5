"""Root pytest hook-up. Environment for torch/XLA is set here, before either is imported (reaches xdist workers)."""

import os

# Keep CPU runs deterministic and avoid oversubscribing 2-core machines under `-n 2`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

pytest_plugins = ["parity.plugin"]
