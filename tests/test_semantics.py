"""Semantic forks (parity.model.semantics): the probes read the loaded model's behaviour (not its name), the dump records
it, and the JAX reference can follow it (SwiGLU clamp switch, KDA gate / beta precision).

The probes are shown to discriminate on the same model: the twin with its clamp on is `applied`, with it off
`ignored`; the built-in in bf16 rounds the KDA gate and beta (`bfloat16`), the twin keeps them in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from parity.model import semantics as S
from parity.dumpfile import DumpReader
from parity.errors import ParityError
from parity.model.points import Point
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.loader import load_model
from parity.torch_ref.prompts import builtin_ids
from parity.torch_ref.semantics import probe
from bounds import SEMANTICS_DUMP_REL_L2, SWIGLU_CLAMP_PROBE_REL

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps" / "ckpt"
IDS = torch.as_tensor(builtin_ids(512, 16, seed=2))


def _probe(ckpt, runtime="remote", dtype="bfloat16", **overrides) -> dict:
    lm = load_model(ckpt, runtime, dtype=dtype, config_overrides=overrides or None)
    try:
        return probe(lm.model, lm.config, IDS)
    finally:
        lm.release()


def test_clamp_probe_tells_applied_from_ignored():
    on = _probe(CKPT / "tiny-flash")
    off = _probe(CKPT / "tiny-flash", twin_apply_swiglu_clamp=False)
    assert on["swiglu_clamp"] == "applied" and on["departures"] == []
    assert off["swiglu_clamp"] == "ignored" and off["departures"] == ["swiglu_clamp"]
    for kind in ("routed", "shared"):  # the two references are far apart; the module sits on one of them
        p = on["probes"]["swiglu_clamp"][kind]
        assert p["clamped_vs_unclamped"] > 0.5 and p["rel_err_vs_clamped"] < SWIGLU_CLAMP_PROBE_REL, p
    assert _probe(CKPT / "tiny")["swiglu_clamp"] == "not-configured"  # no limit lists


@pytest.mark.parametrize("dtype,want", [("bfloat16", "bfloat16"), ("float32", "float32")])
def test_kda_precision_probe_native_vs_twin(dtype, want):
    nat = _probe(CKPT / "tiny-flash", "native", dtype)
    assert (nat["kda_gate_precision"], nat["kda_beta_precision"]) == (want, want), nat["probes"]["kda"]
    assert nat["swiglu_clamp"] == "ignored"  # the built-in has no clamp
    twin = _probe(CKPT / "tiny-flash", "remote", dtype)
    assert (twin["kda_gate_precision"], twin["kda_beta_precision"]) == ("float32", "float32"), twin["probes"]["kda"]


def test_departures_and_reference_options():
    sem = {"swiglu_clamp": "ignored", "kda_gate_precision": "bfloat16", "kda_beta_precision": "float32"}
    assert [d["fork"] for d in S.departures(sem)] == ["swiglu_clamp", "kda_gate_precision"]
    assert S.reference_options(sem) == {"clamp": False, "kda_gate_dtype": "bfloat16", "kda_beta_dtype": "float32",
                                        "kda_chunk_dtype": "float32"}
    assert S.reference_options(sem, intended=True) == {"clamp": True, "kda_gate_dtype": "float32",
                                                       "kda_beta_dtype": "float32", "kda_chunk_dtype": "float32"}
    neutral = {"swiglu_clamp": "not-configured", "kda_gate_precision": "not-applicable",
               "kda_beta_precision": "float32"}
    assert S.departures(neutral) == [] and S.reference_options(neutral)["clamp"] is True
    assert S.departures(None) == [] and "not recorded" in S.summarize(None)


def test_native_limits_are_refused_before_loading(tmp_path, monkeypatch):
    import parity.torch_ref.loader as loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(ParityError, match=r"--runtime native cannot dump .*q_lora_rank = 32.*no q-LoRA"):
        dump_checkpoint(CKPT / "tiny", tmp_path / "x.h5", IDS, DumpOptions(runtime="native", progress=False))
    with pytest.raises(ParityError, match="SwiGLU clamp limits are set"):
        dump_checkpoint(CKPT / "tiny-flash", tmp_path / "x.h5", IDS, DumpOptions(runtime="native", progress=False))


@pytest.fixture(scope="module")
def native_bf16_dump(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("nat")
    ck = root / "tf"
    shutil.copytree(CKPT / "tiny-flash", ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["expert_swiglu_limit_list"] = cfg["share_expert_swiglu_limit_list"] = None
    (ck / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    out = root / "native-bf16.h5"
    dump_checkpoint(ck, out, builtin_ids(512, 100, seed=1), DumpOptions(dtype="bfloat16", decode_steps=0,
                                                                        progress=False, runtime="native"))
    return ck, out


def test_jax_reference_follows_the_kda_precision_of_a_native_dump(native_bf16_dump):
    """The built-in rounds the KDA gate and beta to bf16: the JAX KDA layer with kda_*_dtype="bfloat16" reproduces
    its core output (measured rel-L2 ≤ 6e-6, ≤ 0.1 % of elements differ), the fp32 default does not (≈3e-3, >30 %)."""
    import jax.numpy as jnp

    from parity.jax_ling3.layer import decoder_layer_jit
    from parity.jax_ling3.spec import layer_spec
    from parity.jax_ling3.weights import CheckpointReader

    ck, out = native_bf16_dump
    r = CheckpointReader(ck)
    with DumpReader(out) as d:
        # an MTP checkpoint dumps cleanly under the native runtime: its MTP layer is declared unavailable
        assert d.mtp_points() == [] and "no MTP layer" in d.unavailable()["MTP0/*"]
        assert (d.semantics["kda_gate_precision"], d.semantics["kda_beta_precision"]) == ("bfloat16", "bfloat16")
        opts = S.reference_options(d.semantics)
        for i in (0, 1):  # KDA layers
            p = r.layer_params(i, "bfloat16", put=jnp.asarray)
            h = jnp.asarray(d.read(Point("prefill", 0, i, "input")))
            ref = d.read(Point("prefill", 0, i, "attention.core")).astype(np.float64)
            err = {}
            for name, o in (("dump", opts), ("intended", S.reference_options(d.semantics, intended=True))):
                spec = layer_spec(d.config, i, "bfloat16", clamp=o["clamp"], kda_gate_dtype=o["kda_gate_dtype"],
                                  kda_beta_dtype=o["kda_beta_dtype"])
                _, pts, _ = decoder_layer_jit(p, h, jnp.arange(h.shape[1]), spec, None, None)
                t = np.asarray(pts["attention.core"]).astype(np.float64)
                err[name] = float(np.linalg.norm(ref - t) / np.linalg.norm(ref))
            assert err["dump"] < SEMANTICS_DUMP_REL_L2 and err["intended"] > 10 * err["dump"], (i, err)
