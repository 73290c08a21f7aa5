"""Root pytest hook-up. Environment for torch/XLA is set here, before either is imported (reaches xdist workers)."""

import os

# Keep CPU runs deterministic and avoid oversubscribing 2-core machines under `-n 2`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No process-wide XLA_FLAGS here: the reference's `xla_allow_excess_precision=false` is a per-computation compiler
# option of its own jitted functions (parity/jax_ling3/__init__.py), so a port replayed by `pytest parity` runs under
# its production flags (DESIGN §7). Unit tests that jit jax_ling3 functions themselves get it from tests/conftest.py.

pytest_plugins = ["parity.pytest_plugin.plugin"]
