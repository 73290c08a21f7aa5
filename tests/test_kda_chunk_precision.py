"""The KDA chunk kernel's intermediate precision as a recorded semantic fork (issue 24 item 4).

fla's chunked `chunk_kda` keeps its intermediates in the input dtype (bf16 in a bf16 run; the rounding points with
file:line are listed in `parity.torch_ref.fla_cpu`). The stand-ins follow that with `--kda-chunk-precision kernel`,
the dump records `kda_chunk_precision`, the JAX reference follows the dump's value by default, and a target that keeps
fp32 intermediates is classified `semantic` at the points the fork explains — while a wrong port still fails.

Dump: the bundled `tiny` checkpoint (twin remote code, CPU stand-ins), bf16, 100-token prompt (two KDA chunks: the
chunked path), 1 decode step, stand-ins in "kernel" mode. The real-kernel side of the faithful mode is measured in
tests/test_kda_chunk_precision_kernels.py (needs triton).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from parity.model import semantics as S
from parity.dumpfile import DumpReader
from parity.torch_ref import fla_cpu
from bounds import KDA_BF16_O_FRACTION, KDA_BF16_STATE_REL_L2

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps" / "ckpt" / "tiny"
PROMPT_LEN = 100  # > 64: the official code runs chunk_kda


@pytest.fixture(scope="module")
def kernel_dump(tmp_path_factory) -> Path:
    from parity.model.config import Ling3Config
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    cfg = Ling3Config.from_pretrained_dir(CKPT, strict=False)
    out = tmp_path_factory.mktemp("chunk") / "tiny-bf16-kernel.h5"
    dump_checkpoint(CKPT, out, builtin_ids(cfg.vocab_size, PROMPT_LEN, 0),
                    DumpOptions(dtype="bfloat16", decode_steps=1, progress=False, kda_chunk_precision="kernel"))
    return out


def _failing(report: dict) -> list[tuple]:
    return [(p["phase"], p.get("step", 0), p.get("layer"), p["site"]) for p in report["points"]
            if p["status"] == "fail"]


def _inputs(seed: int, T: int = 150, H: int = 4, K: int = 16):
    """Random KDA inputs as the stand-in's core receives them: bf16-valued q̂/k̂ (l2-normalised) and v; fp32 gate,
    β and S0."""
    g = torch.Generator().manual_seed(seed)
    q = fla_cpu.l2_normalize(torch.randn(1, T, H, K, generator=g).bfloat16())
    k = fla_cpu.l2_normalize(torch.randn(1, T, H, K, generator=g).bfloat16())
    v = torch.randn(1, T, H, K, generator=g).bfloat16().float()
    gate = fla_cpu.kda_gate(torch.randn(1, T, H, K, generator=g) * 2, torch.randn(H, generator=g) * 0.5, None, -5.0)
    beta = torch.randn(1, T, H, generator=g).sigmoid()
    S0 = torch.randn(1, H, K, K, generator=g) * 0.3
    return q, k, v, gate, beta, S0


def test_jax_rounded_chunk_matches_the_faithful_stand_in():
    """Two independent codings of the same rounding points (torch stand-in, JAX reference) agree to a few bf16
    roundings of o (measured: 0.02 % of o's elements differ, final state bit-identical), and each is far from the
    fp32 form (≈ 4e-3 rel-L2, ~60 % of o's elements differ) — the fork is large against that agreement."""
    import jax.numpy as jnp

    from parity.jax_ling3.kda import kda_chunked

    q, k, v, gate, beta, S0 = _inputs(0)
    scale = q.shape[-1] ** -0.5
    o_t, s_t = fla_cpu.kda_chunk_core_kernel(q, k, v, gate, beta, scale, S0, torch.bfloat16)
    o_t = o_t.bfloat16().float().numpy()
    args = [jnp.asarray(x.numpy()) for x in (q, k, v, gate, beta)]
    res = {}
    for dt in ("bfloat16", "float32"):
        o_j, s_j = kda_chunked(*args, scale, jnp.asarray(S0.numpy()), inter_dtype=dt)
        o_j = np.asarray(o_j.astype(jnp.bfloat16).astype(jnp.float32))
        res[dt] = (float(np.mean(o_j != o_t)),
                   float(np.linalg.norm(np.asarray(s_j) - s_t.numpy()) / np.linalg.norm(s_t.numpy())))
    assert res["bfloat16"][0] < KDA_BF16_O_FRACTION and res["bfloat16"][1] < KDA_BF16_STATE_REL_L2, res
    assert res["float32"][0] > 0.3 and res["float32"][1] > 1e-3, res


def test_chunk_precision_rule():
    """What each implementation keeps its chunk intermediates in (parity.torch_ref.semantics.chunk_precision_of)."""
    from parity.torch_ref.semantics import chunk_precision_of

    bf = torch.bfloat16
    assert chunk_precision_of("fla", bf, "fp32") == "bfloat16"  # the real kernels, whatever the stand-ins' mode
    assert chunk_precision_of("stand-in", bf, "kernel") == "bfloat16"
    assert chunk_precision_of("stand-in", bf, "fp32") == "float32"
    assert chunk_precision_of("torch:modeling_bailing_moe_v3", bf, "kernel") == "float32"
    assert chunk_precision_of("fla", torch.float32, "kernel") == "float32"
    assert S.reference_options({"kda_chunk_precision": "bfloat16"})["kda_chunk_dtype"] == "bfloat16"
    assert S.reference_options({"kda_chunk_precision": "bfloat16"}, intended=True)["kda_chunk_dtype"] == "float32"
    assert S.reference_options({})["kda_chunk_dtype"] == "float32"  # dumps written before the fork: fp32


def test_dump_records_the_chunk_precision_it_ran(kernel_dump):
    with DumpReader(kernel_dump) as d:
        sem, kernels = d.semantics, d.meta["kernels"]
    assert kernels["kda_paths"]["chunk_kda"] == "stand-in"
    assert sem["kda_chunk_precision"] == "bfloat16" and "kda_chunk_precision" in sem["departures"], sem
    assert sem["probes"]["kda_chunk"] == {"implementation": "stand-in", "observed": True,
                                          "compute_dtype": "bfloat16", "stand_in_mode": "kernel"}
    assert fla_cpu.get_chunk_precision() == "fp32"  # the dump restored the stand-ins' default mode


def test_reference_follows_the_dump_and_replays_clean(kernel_dump):
    from parity.replay import run_replay

    report = run_replay(kernel_dump, CKPT)
    assert report["passed"] and not _failing(report), report["counts"]
    assert report["counts"].get("semantic", 0) == 0  # the reference computes what the dump's kernel computed
    assert [d["fork"] for d in report["semantics"]["departures"]] == ["kda_chunk_precision"]


def test_fp32_intermediates_are_semantic_not_fail(kernel_dump):
    """A target keeping fp32 chunk intermediates (the intended maths) differs from the dump at the KDA points the
    fork explains — every KDA layer's prefill o_norm / state — which are `semantic`, none `fail`."""
    from parity.replay import run_replay
    from parity.targets.reference import ReferenceTarget

    report = run_replay(kernel_dump, CKPT, target=ReferenceTarget(kda_chunk_dtype="float32"))
    assert report["passed"] and not _failing(report), _failing(report)
    with DumpReader(kernel_dump) as d:
        kda_layers = [i for i in range(d.config.num_hidden_layers) if d.config.layer_kind(i) == "kda"]
    sem = {(p["phase"], p["layer"], p["site"]) for p in report["points"] if p["status"] == "semantic"}
    assert {s for _, _, s in sem} <= {"attention.core", "attention.o_norm", "attention.state", "attention.o_proj",
                                      "attention", "output"}, sem
    assert {lay for ph, lay, _ in sem if ph == "prefill"} == set(kda_layers), sem
    assert report["semantics"]["explained_points"] == len(sem)


@pytest.mark.parametrize("name", ["kda_a_log_not_exp", "kda_scale_missing"])
def test_wrong_port_still_fails_on_the_kernel_dump(kernel_dump, name):
    """Catalogue KDA mutants are detected and pinned at their site on the bf16 chunk-kernel dump: the gate (before the
    chunk kernel) and the chunk kernel's own output (scale dropped inside the kernel)."""
    from parity.replay import run_replay
    from parity.targets.mutants import MUTATIONS, MutantTarget

    m = MUTATIONS[name]
    assert m.preset == "tiny"
    with DumpReader(kernel_dump) as d:
        exp = m.expected(d.config)
    report = run_replay(kernel_dump, CKPT, target=MutantTarget(name, ckpt_dir=CKPT), layers=list(range(exp.layer + 1)))
    assert not report["passed"]
    src = report["first_divergence"]["source"]
    assert (src["phase"], src["step"], src["layer"]) == (exp.phase, exp.step, exp.layer) and src["site"] in exp.sites, \
        (src, exp)
