"""The official remote code (`modeling_bailing_moe_v3.py`, read from a cache outside the repository) as a reference
runtime: locating / verifying the file, its configuration needs, and official dumps of the bundled checkpoints
against the twin (bit-for-bit in practice; fp32 rel-L2 ≤ 1e-5 required), the built-in (where it supports the shape)
and the JAX reference replay (0 failed points, 0 MoE points not compared).

Tests that need the file skip with one line saying how to provide it (`parity.torch_ref.official.how_to_provide`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from parity.dumpfile import DumpReader
from parity.model.mtp_points import MtpPoint, mtp_sites
from parity.model.points import sites_for_config
from parity.torch_ref import official
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.prompts import builtin_ids
from bounds import OFFICIAL_POINT_REL_L2, OFFICIAL_STREAM_REL_L2

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps" / "ckpt"
OFFICIAL_OK, OFFICIAL_WHY = official.available()
needs_official = pytest.mark.skipif(not OFFICIAL_OK, reason=OFFICIAL_WHY)


# ------------------------------------------------------------------------------------------------ locating the file
def test_locate_refuses_absent_and_other_revisions(tmp_path, monkeypatch):
    monkeypatch.setenv(official.ENV_VAR, str(tmp_path / "nothing.py"))
    with pytest.raises(official.OfficialFileMissing, match=r"not found at .*nothing\.py: put the official .*sha256 "
                       + official.OFFICIAL_SHA256):
        official.locate()
    other = tmp_path / "modeling_bailing_moe_v3.py"
    other.write_text("# another revision\n")
    monkeypatch.setenv(official.ENV_VAR, str(other))
    with pytest.raises(official.OfficialFileMissing, match="sha256 " + hashlib.sha256(other.read_bytes()).hexdigest()):
        official.locate()
    ok, why = official.available()
    assert not ok and "expected " + official.OFFICIAL_SHA256 in why


def test_config_attributes_read_sees_loads_only():
    src = ("class A:\n    def __init__(self, config):\n        self.config = config\n"
           "        x = config.hidden_size\n        y = self.config.rope_scaling.get('f')\n"
           "        self.config.head_dim = 3\n        '''config.in_a_docstring'''\n")
    assert official.config_attributes_read(src) == {"hidden_size", "rope_scaling"}


@needs_official
def test_config_class_defines_every_attribute_the_official_file_reads(tmp_path):
    """The list comes from the official file's syntax tree, not from trial and error (issue 13 item 4)."""
    from transformers import AutoConfig

    names = official.config_attributes_read(official.locate().read_text())
    assert {"attention_dropout", "num_nextn_predict_layers", "mtp_loss_scaling_factor"} <= names
    for preset in ("tiny", "tiny-flash"):
        ck = tmp_path / preset
        shutil.copytree(CKPT / preset, ck)
        official.install(ck)
        cfg = AutoConfig.from_pretrained(ck, trust_remote_code=True, local_files_only=True)
        missing = sorted(n for n in names if not hasattr(cfg, n))
        assert not missing, f"{preset}: the configuration class lacks {missing}"
        assert cfg.rope_scaling is None  # a plain None (official_remote_code.md §1.5)


# ------------------------------------------------------------------------------------------------ dumps
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Per preset: the official runtime, and the twin with the clamp off (the official file ignores it)."""
    if not OFFICIAL_OK:
        pytest.skip(OFFICIAL_WHY)
    root = tmp_path_factory.mktemp("official")
    out = {}
    for preset in ("tiny", "tiny-flash"):
        off, twin = root / f"{preset}-official", root / f"{preset}-twin"
        shutil.copytree(CKPT / preset, off)
        shutil.copytree(CKPT / preset, twin)
        official.install(off)
        cfg = json.loads((twin / "config.json").read_text())
        cfg["twin_apply_swiglu_clamp"] = False
        (twin / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        out[preset] = (off, twin)
    return out


def _dump(ck: Path, out: Path, T: int, dtype: str, **kw) -> DumpReader:
    dump_checkpoint(ck, out, builtin_ids(512, T, seed=1), DumpOptions(dtype=dtype, decode_steps=2, progress=False, trust_remote_code=True,
                                                                       **kw))
    return DumpReader(out)


def _all(d: DumpReader):
    return set(d.points()) | set(d.mtp_points())


# Both presets, both KDA kernel paths (≤ 64 tokens: recurrent, > 64: chunked) in fp32, the chunked one in bf16 (the
# README's acceptance run covers bf16 at 40 tokens too).
CASES = [("tiny", 40, "float32"), ("tiny", 100, "float32"), ("tiny", 100, "bfloat16"),
         ("tiny-flash", 40, "float32"), ("tiny-flash", 100, "float32"), ("tiny-flash", 100, "bfloat16")]


@needs_official
@pytest.mark.parametrize("preset,T,dtype", CASES, ids=[f"{p}-{t}-{d}" for p, t, d in CASES])
def test_official_dump_is_complete_and_equals_the_twin(ckpts, tmp_path, preset, T, dtype):
    off, twin = ckpts[preset]
    with _dump(off, tmp_path / "off.h5", T, dtype) as a, _dump(twin, tmp_path / "twin.h5", T, dtype) as b:
        cfg = a.config
        assert a.meta["capture_map"] == "official" and b.meta["capture_map"] == "twin"
        # completeness: every canonical point but the MLA head gate (an inline sigmoid in the official MLA)
        un = a.unavailable()
        assert all(k.endswith("/attention.gate") for k in un), un
        assert not [k for k in un if "/mlp" in k], "MoE points must all be captured"
        for i in range(cfg.num_hidden_layers):
            want = set(sites_for_config(cfg, i)) - ({"attention.gate"} if cfg.layer_kind(i) == "mla" else set())
            assert want <= set(a.sites("prefill", 0, i)), (i, sorted(want - set(a.sites("prefill", 0, i))))
        if cfg.num_nextn_predict_layers:
            got = {p.site for p in a.mtp_points() if p.phase == "prefill"}
            assert set(mtp_sites(cfg)) - got == {"attention.gate"}
            assert {p.step for p in a.mtp_points()} == {0, 1, 2}
        assert a.semantics["swiglu_clamp"] == ("ignored" if cfg.has_swiglu_clamp else "not-configured")
        assert (a.semantics["kda_gate_precision"], a.semantics["kda_beta_precision"]) == ("float32", "float32")
        # official == twin at every point both hold
        shared = _all(a) & _all(b)
        assert shared == _all(a)
        worst = (0.0, "")
        for p in shared:
            x, y = a.read(p), b.read(p)
            assert x.shape == y.shape and x.dtype == y.dtype, p.key()
            if x.dtype.kind in "iu":
                assert np.array_equal(x, y), p.key()
                continue
            x, y = x.astype(np.float64), y.astype(np.float64)
            worst = max(worst, (float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)), p.key()))
        assert worst[0] <= (1e-5 if dtype == "float32" else 1e-2), worst


@needs_official
def test_official_equals_native_where_native_supports_the_shape(ckpts, tmp_path):
    """Flash-shaped (no q-LoRA) with the clamp lists removed (the built-in has none), fp32, 100 tokens.

    Both run free (each on its own hidden states), so fp32 summation-order noise compounds over the 8 layers and is
    largest on one-token decode tensors (64 elements). Measured worst rel-L2: AVX-512 machines ~3e-6 at 100 tokens
    (2.3e-5 at 40 tokens, decode/S001/L05); AMD EPYC without AVX-512 (2026-11-25) 2.84e-5 at decode/S001/L04
    attention.o_proj, 71 of 486 points above 1e-5, the residual stream (layer outputs) ≤ 1.35e-5. Bounds: the
    residual stream within 2e-5 (the fp32 tier, as tests/test_twin_vs_builtin.py), every point within 1e-4 (3.5× the
    worst measured; widened from 2e-5 for that measured cause — this test has no bug control of its own)."""
    off = tmp_path / "off"
    shutil.copytree(ckpts["tiny-flash"][0], off)
    cfg = json.loads((off / "config.json").read_text())
    cfg["expert_swiglu_limit_list"] = cfg["share_expert_swiglu_limit_list"] = None
    (off / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    with _dump(off, tmp_path / "off.h5", 100, "float32") as a, \
            _dump(off, tmp_path / "nat.h5", 100, "float32", runtime="native") as b:
        assert b.unavailable().get("MTP0/*", "").startswith("the native runtime has no MTP layer")
        shared = set(a.points()) & set(b.points())
        assert len(shared) > 300
        worst, worst_stream = (0.0, ""), (0.0, "")
        for p in shared:
            x, y = a.read(p), b.read(p)
            assert x.shape == y.shape, p.key()
            if x.dtype.kind in "iu":
                assert np.array_equal(x, y), p.key()
                continue
            x, y = x.astype(np.float64), y.astype(np.float64)
            rel = (float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)), p.key())
            worst = max(worst, rel)
            if p.site in ("output", "logits"):
                worst_stream = max(worst_stream, rel)
        assert worst_stream[1] and float(worst_stream[0]) < OFFICIAL_STREAM_REL_L2, worst_stream
        assert float(worst[0]) < OFFICIAL_POINT_REL_L2, worst


@needs_official
def test_reference_replay_of_an_official_dump(ckpts, tmp_path):
    """Replayed with the dump's semantics (clamp ignored): 0 failed points, every MoE point compared, the MTP
    layer's points included."""
    from parity.replay import run_replay
    from parity.model.semantics import reference_options
    from parity.targets.reference import ReferenceTarget

    off = ckpts["tiny-flash"][0]
    with _dump(off, tmp_path / "off.h5", 100, "bfloat16") as d:
        opts = reference_options(d.semantics)
    assert opts["clamp"] is False
    rep = run_replay(tmp_path / "off.h5", off, target=ReferenceTarget(clamp=opts["clamp"]))
    status = Counter(p["status"] for p in rep["points"])
    assert status["fail"] == 0, status
    moe = [p for p in rep["points"] if p["site"].startswith("mlp")]
    assert moe and all(p["status"] in ("pass", "benign") for p in moe)
    skipped = {p["site"] for p in rep["points"] if p["status"] == "skipped"}
    assert skipped == {"attention.gate", "MTP0/attention.gate"}  # the official MLA's inline head gate
    # and the clamp does matter here: replayed with it applied, the clamped layers differ — reported as `semantic`
    # (the dump's runtime departs from the intended behaviour there), not as failures
    rep = run_replay(tmp_path / "off.h5", off, target=ReferenceTarget(clamp=True))
    assert any(p["status"] == "semantic" and p["site"].startswith("mlp") for p in rep["points"])
    assert not any(p["status"] == "fail" for p in rep["points"])
