"""Root pytest hook-up. Environment for torch/XLA is set here, before either is imported (reaches xdist workers)."""

import os

# Keep CPU runs deterministic and avoid oversubscribing 2-core machines under `-n 2`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _worker_threads() -> int | None:
    """Intra-op threads per xdist worker: the usable cores shared among the workers (None outside a worker).

    torch starts one intra-op thread per core in every worker and every child it spawns; with `-n 2` on 2 cores two
    busy workers then run 4 threads on 2 cores, and a GEMM whose threads are descheduled waits for them (docs/
    performance.md "How to measure": a bf16 GEMM 0.27 ms on one thread, 4-14 ms on two busy cores). Measured
    (issue 35, 2-core Xeon VM): tests/test_golden_dumps.py with -n 2, 41 s default vs 25 s at one thread each, the
    regenerated goldens still bit-identical. Only the thread count: an explicit OMP_NUM_THREADS is kept."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


if (_threads := _worker_threads()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # read by torch (and its children) at import
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
