"""The JAX MTP layer (parity.jax_ling3.mtp) vs the PyTorch MTP forward, fed the dumped inputs (embedding of the
shifted ids, the main stack's final norm), prefill + 2 decode steps, every MTP point (parity.model.mtp_points).

References: the twin remote code's MTP forward (written from the facts sheet, always available) and the official
`modeling_bailing_moe_v3.py` (skipped with one line saying how to provide it when absent). Checkpoints: the bundled
Flash-shaped `tiny-flash` (num_nextn_predict_layers 1, plain q_proj) and a Tiny-shaped one with q-LoRA and an MTP layer.
fp32: rel-L2 ≤ 1e-5 at every point; bf16: the default layer-mode tolerance rules (as the replay looks them up).
A broken MTP (eh_proj fed [hidden ; embedding] instead of [embedding ; hidden]) must fail the same comparison.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from parity.dumpfile import DumpReader
from parity.model.mtp_points import MtpPoint, mtp_sites
from parity.model.points import Point
from parity.torch_ref import official
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.prompts import builtin_ids

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps" / "ckpt"
T = 40
STEPS = 2
OFFICIAL_OK, OFFICIAL_WHY = official.available()


def _tiny_qlora_mtp(root: Path) -> Path:
    """The bundled Tiny-shaped checkpoint with its MTP layer switched on (num_nextn_predict_layers 1)."""
    d = root / "tiny-mtp"
    shutil.copytree(CKPT / "tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    flash = root / "tiny-flash"
    shutil.copytree(CKPT / "tiny-flash", flash)
    return {"tiny-flash": flash, "tiny-mtp": _tiny_qlora_mtp(root)}


def _dump(ckpt: Path, out: Path, dtype: str) -> Path:
    dump_checkpoint(ckpt, out, builtin_ids(512, T, seed=5), DumpOptions(dtype=dtype, decode_steps=STEPS, trust_remote_code=True,
                                                                        progress=False, semantics_probe=False))
    return out


def _jax_points(ckpt: Path, d: DumpReader, dtype: str, *, break_concat: bool = False) -> dict[MtpPoint, np.ndarray]:
    """Every MTP point of the JAX MTP layer, each step fed the dump's MTP0/embed and model/final_norm (and the MLA
    cache its own earlier steps left); `logits` from the dumped MTP0/final_layernorm."""
    import jax.numpy as jnp

    from parity.jax_ling3.mla import init_mla_cache
    from parity.jax_ling3.model import embed
    from parity.jax_ling3.mtp import mtp_layer_jit, mtp_logits, shift_ids
    from parity.jax_ling3.spec import dtype_of, layer_spec
    from parity.jax_ling3.weights import CheckpointReader

    reader = CheckpointReader(ckpt)
    cfg = reader.config
    p = reader.mtp_params(0, dtype, put=jnp.asarray)
    if break_concat:  # the mutation: eh_proj applied to [hidden ; embedding]
        D = cfg.hidden_size
        p["eh_proj"] = jnp.concatenate([p["eh_proj"][D:], p["eh_proj"][:D]], axis=0)
    g = reader.global_params(dtype)
    spec = layer_spec(cfg, cfg.num_hidden_layers, dtype)
    ids = d.input_ids
    out: dict[MtpPoint, np.ndarray] = {}
    state = init_mla_cache(ids.shape[0], T + STEPS, spec)
    for phase, step in [("prefill", 0)] + [("decode", k) for k in range(1, STEPS + 1)]:
        step_ids = ids[:, :T] if phase == "prefill" else ids[:, T + step - 1:T + step]
        pos = np.arange(T) if phase == "prefill" else np.array([T + step - 1])
        emb = embed(jnp.asarray(g["embed"]), shift_ids(jnp.asarray(step_ids, jnp.int32)))
        out[MtpPoint(phase, step, 0, "embed")] = np.asarray(emb)
        ref_emb = jnp.asarray(d.read(MtpPoint(phase, step, 0, "embed")), dtype_of(dtype))
        hidden = jnp.asarray(d.read(Point(phase, step, None, "final_norm")), dtype_of(dtype))
        y, pts, state = mtp_layer_jit(p, ref_emb, hidden, jnp.asarray(pos, jnp.int32), spec, state)
        # the head is teacher-forced too: fed the dumped MTP output (its own error is compared at final_layernorm)
        ref_out = jnp.asarray(d.read(MtpPoint(phase, step, 0, "final_layernorm")), dtype_of(dtype))
        pts["logits"] = mtp_logits(jnp.asarray(g["lm_head"]), ref_out)
        out.update({MtpPoint(phase, step, 0, s): np.asarray(v) for s, v in pts.items()})
    return out


def _compare(d: DumpReader, got: dict[MtpPoint, np.ndarray], dtype: str) -> list[str]:
    """Failures (one line each) of every dumped MTP point against the JAX one."""
    from parity.numerics.compare import compare
    from parity.numerics.tolerances import default_rules

    rules = default_rules()
    bad = []
    for pt in d.mtp_points():
        ref = d.read(pt)
        assert pt in got, f"JAX MTP layer does not produce {pt.key()}"
        test = got[pt]
        assert test.shape == ref.shape, (pt.key(), test.shape, ref.shape)
        if dtype == "float32" or ref.dtype.kind in "iu":
            r, t = ref.astype(np.float64), test.astype(np.float64)
            rel = float(np.linalg.norm(r - t) / max(np.linalg.norm(r), 1e-30))
            if rel > 1e-5:
                bad.append(f"{pt.key()}: rel-L2 {rel:.3g}")
        else:
            rule = rules.rule_for(pt.site, "layer", d.dtype(pt), "bfloat16")  # as the replay looks it up
            v = compare(ref, test, rule, name=pt.key())
            if not v.passed:
                bad.append(f"{pt.key()}: max {v.max_ulp} ULP, rel-L2 {v.rel_l2:.3g}")
    return bad


def _check(ckpt: Path, tmp_path: Path, dtype: str) -> None:
    with DumpReader(_dump(ckpt, tmp_path / f"{ckpt.name}-{dtype}.h5", dtype)) as d:
        cfg = d.config
        want = {MtpPoint(ph, st, 0, s) for ph, st in [("prefill", 0), ("decode", 1), ("decode", 2)]
                for s in mtp_sites(cfg)}
        have = set(d.mtp_points())
        missing = want - have
        # the official MLA's inline head gate is the only MTP site a runtime may lack (parity.torch_ref.capture)
        assert {p.site for p in missing} <= {"attention.gate"}, sorted(p.key() for p in missing)
        assert not _compare(d, _jax_points(ckpt, d, dtype), dtype)
        broken = _compare(d, _jax_points(ckpt, d, dtype, break_concat=True), dtype)
        assert any("eh_proj" in b for b in broken), "the mutated MTP layer was not caught"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-flash", "tiny-mtp"])
def test_jax_mtp_matches_the_twin(ckpts, tmp_path, name, dtype):
    _check(ckpts[name], tmp_path, dtype)


@pytest.mark.skipif(not OFFICIAL_OK, reason=OFFICIAL_WHY)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-flash", "tiny-mtp"])
def test_jax_mtp_matches_the_official_file(ckpts, tmp_path, name, dtype):
    ck = tmp_path / f"{name}-official"
    shutil.copytree(ckpts[name], ck)
    official.install(ck)
    _check(ck, tmp_path, dtype)
