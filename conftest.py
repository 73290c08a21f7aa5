"""Root pytest hook-up. Environment for torch/XLA is set here, before either is imported (reaches xdist workers)."""

import os

# Keep CPU runs deterministic and avoid oversubscribing 2-core machines under `-n 2`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Same bf16 roundings as torch (see parity/jax_ling3/__init__.py); set here too for tests that start jax directly.
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

pytest_plugins = ["parity.plugin"]
