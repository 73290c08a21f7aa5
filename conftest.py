"""Root pytest hook-up. Environment for torch/XLA is set here, before either is imported (reaches xdist workers)."""

import os

# Keep CPU runs deterministic and avoid oversubscribing 2-core machines under `-n 2`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` on a 2-core machine: one thread per worker instead of each worker spawning a thread per core.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()

pytest_plugins = ["parity.plugin"]
