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

# Another CPU kind without another machine (issue 35): LING3_PARITY_CPU_ISA=AVX2 caps oneDNN, MKL, ATen and XLA:CPU
# to AVX2 before torch or jax is imported (parity/cpu_isa.py; docs/troubleshooting.md). Explicit caps are kept.
from parity.cpu_isa import apply_isa_cap, describe_caps  # noqa: E402  (imports neither torch nor jax)

apply_isa_cap()

pytest_plugins = ["parity.pytest_plugin.plugin"]


def pytest_report_header(config):
    """Every run states the vector-ISA caps it ran under (a capped run is another CPU kind: parity/golden.py)."""
    return f"ling3-parity CPU ISA caps: {describe_caps()}"
