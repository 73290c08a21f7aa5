"""Smoke test of parity.cli.bench: one JAX child and one twin child on the bundled tiny checkpoint, and the table."""

from __future__ import annotations

from pathlib import Path

from parity.cli.bench import run_child, table

CKPT = str(Path(__file__).resolve().parents[1] / "dumps" / "ckpt" / "tiny")


def test_bench_children_pinned_and_table():
    """The JAX and twin layer children measure a layer and the table shows it; `--cpus`: each layer child runs on
    the given CPUs only, and the twin sizes its thread pool from that (one child pair for both claims: each child
    is a fresh process importing JAX or torch)."""
    j = run_child("jax", {"ckpt": CKPT, "layer": 3, "Ts": [8], "repeats": 1}, cpus=[0])
    t = run_child("torch", {"ckpt": CKPT, "layers": [3], "Ts": [8], "repeats": 1}, cpus=[0])
    assert j[0]["kind"] == "mla" and j[0]["moe"] and j[0]["warm"]["min"] > 0 and j[0]["peak_rss_mb"] > 0
    assert t[0]["layer"] == 3 and t[0]["warm"]["min"] > 0
    assert j[0]["affinity"] == [0] and t[0]["affinity"] == [0] and t[0]["threads"] == 1
    res = {"jax": [dict(j[0], persistent_cache="empty")], "torch": t, "dump": [], "loadavg_start": [0, 0, 0],
           "ncpu": 2}
    out = table(res)
    assert "| 3 | MLA+MoE | 8 |" in out, out
    free = run_child("torch", {"ckpt": CKPT, "layers": [3], "Ts": [8], "repeats": 1})
    assert free[0]["affinity"] == sorted(__import__("os").sched_getaffinity(0))


def test_bench_dump_child_times_the_writer(tmp_path):
    d = run_child("dump", {"ckpt": CKPT, "T": 8, "out_dir": str(tmp_path), "repeats": 1})[0]
    # the writer's clock is part of the captured forward; the arrays it was handed are counted uncompressed
    assert 0 < d["write_s"]["min"] <= d["dump_forward"]["min"]
    assert d["array_mb"] > 0 and d["write_mb_per_s"] > 0 and d["file_mb"] > 0
    assert "HDF5 writer" in table({"jax": [], "torch": [], "dump": [d], "loadavg_start": [0, 0, 0], "ncpu": 2})


def test_bench_inputs_round_like_torch():
    """The bench input is rounded to bf16 with ml_dtypes (no torch import in the JAX child): same bits as torch's
    `.to(torch.bfloat16)` (round to nearest even), including ties, which a truncating rounding gets wrong."""
    import numpy as np
    import torch

    from parity.cli.bench import hidden_states

    h = hidden_states(64, 96)
    x = np.random.default_rng(0).standard_normal((1, 64, 96)).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(h.view(np.uint32), ref.view(np.uint32))
    assert (h.view(np.uint32) & 0xFFFF == 0).all()
    # a tie (exactly half a bf16 ULP above 1.0) and its odd neighbour: RNE rounds 1+2^-8 down, 1+3·2^-8 up
    import ml_dtypes
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)
    np.testing.assert_array_equal(ties.astype(ml_dtypes.bfloat16).astype(np.float32),
                                  torch.from_numpy(ties).to(torch.bfloat16).float().numpy())
