"""Backward replay end to end (issue 26): `--grads` dumps of the bundled tiny checkpoint (twin, CPU, a 100-token
prompt so the chunked KDA's backward runs), fp32 and bf16, replayed by the reference with 0 failures and their backward
points counted; every backward-only mutant (parity.targets.mutants.BACKWARD_MUTATIONS) forward bit-identical and
pinned at its layer and site; the test ids and `-k` selection of the backward phase; a target without the capability
has its backward points skipped with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity.model.points import Point

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps/ckpt/tiny"
T = 100


@pytest.fixture(scope="module")
def grads_dumps(tmp_path_factory) -> dict[str, Path]:
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    root = tmp_path_factory.mktemp("bw")
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = root / f"tiny-grads-{dtype}.h5"
        dump_checkpoint(CKPT, out[dtype], builtin_ids(512, T, seed=7),
                        DumpOptions(dtype=dtype, decode_steps=1, trust_remote_code=True, progress=False,
                                    semantics_probe=False, grads=True))
    return out


def _records(dump: Path, target=None, layers=None) -> list[dict]:
    from parity.replay import Session, judge, observe

    with Session.open(dump, target=target) as s:
        units = [None, *range(s.config.num_hidden_layers)] if layers is None else layers
        return [r.to_json() for u in units for r in judge(s, observe(s, u))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grads_dump_replays_clean(grads_dumps, dtype):
    recs = _records(grads_dumps[dtype])
    bw = [r for r in recs if r["phase"] == "backward"]
    bad = [f"{r['layer']}/{r['site']}: {r['status']} {r.get('reason') or ''}{(r.get('message') or '')[:300]}"
           for r in recs if r["status"] in ("fail", "missing")]
    assert not bad, f"{len(bad)} point(s) fail:\n" + "\n".join(bad[:20])
    passed = [r for r in bw if r["status"] == "pass"]
    grads = [r for r in passed if r["site"].startswith("grad.")]
    assert len(passed) > 600 and len(grads) > 400, (len(passed), len(grads))
    assert {r["site"] for r in passed if r["layer"] is None} >= {"logits", "final_norm", "final_norm:in",
                                                                 "grad.lm_head.weight", "grad.model.norm.weight",
                                                                 "grad.model.word_embeddings.weight"}


def _cases():
    from parity.targets.mutants import BACKWARD_MUTATIONS

    return [(m, d) for m in BACKWARD_MUTATIONS for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("mutation,dtype", _cases())
def test_backward_mutant_forward_identical_and_pinned(grads_dumps, mutation, dtype):
    """The mutant's forward gives the reference's bits (layer output and every point, on the dumped input, routing
    forced as the backward runs it), and the replay's first divergence is its expected backward (layer, site)."""
    from parity.dumpfile import DumpReader
    from parity.jax_ling3.weights import CheckpointReader
    from parity.reporting.report import first_divergence
    from parity.targets.mutants import BACKWARD_MUTATIONS, MutantTarget
    from parity.targets.reference import ReferenceTarget

    m = BACKWARD_MUTATIONS[mutation]
    with DumpReader(grads_dumps[dtype]) as d:
        cfg = d.config
        exp = m.expected(cfg)
    if exp.layer is None:  # a model-level backward bug (the embedding's VJP): no layer forward involved
        recs = _records(grads_dumps[dtype], MutantTarget(mutation), [None])
        assert not [r for r in recs if r["phase"] != "backward" and r["status"] == "fail"]
        fd = first_divergence(cfg, recs)
        assert fd is not None, f"{mutation}: not detected"
        src = fd["source"]
        assert (src["phase"], src["layer"], src["site"]) in {("backward", None, s) for s in exp.sites}, src
        return
    with DumpReader(grads_dumps[dtype]) as d:
        h = d.read(Point("prefill", 0, exp.layer, "input"))
        fi = d.read(Point("prefill", 0, exp.layer, "mlp.gate.topk_idx")) if cfg.is_moe(exp.layer) else None
    hf = CheckpointReader(CKPT).hf_tensors(exp.layer)
    outs = []
    for t in (ReferenceTarget(), MutantTarget(mutation)):
        t.build(cfg, dtype)
        t.load_layer(exp.layer, hf)
        outs.append(t.layer_forward(exp.layer, h, np.arange(T), forced_topk=fi))
    (a, b) = outs
    assert a.output.tobytes() == b.output.tobytes()
    assert all(a.points[k].tobytes() == b.points[k].tobytes() for k in a.points)
    recs = _records(grads_dumps[dtype], MutantTarget(mutation), [exp.layer])
    assert not [r for r in recs if r["phase"] != "backward" and r["status"] == "fail"]
    fd = first_divergence(cfg, recs)
    assert fd is not None, f"{mutation}: not detected"
    src = fd["source"]
    assert (src["phase"], src["layer"], src["site"]) in {("backward", exp.layer, s) for s in exp.sites}, src


def test_target_without_backward_has_backward_points_skipped(grads_dumps):
    from parity.targets.reference import ReferenceTarget

    class NoBackward(ReferenceTarget):
        name = "no-backward"
        capabilities = ReferenceTarget.capabilities - {"backward"}

    recs = _records(grads_dumps["float32"], NoBackward(), [None, 3])
    bw = [r for r in recs if r["phase"] == "backward"]
    assert bw and all(r["status"] == "skipped" and "lacks capability backward" in r["reason"] for r in bw)
    assert any(r["status"] == "pass" for r in recs if r["phase"] == "prefill")


def _collect(dump: Path, *k: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "parity", "--parity-dump", str(dump), "--collect-only",
                          "-q", "-p", "no:cacheprovider", "-n", "0", *k], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    return [line for line in out.stdout.splitlines() if "test_point[" in line]


def test_backward_test_ids_and_selection(grads_dumps):
    d = grads_dumps["float32"]
    lab = d.name.removesuffix(".h5")
    allids = _collect(d)
    assert f"parity/test_points.py::test_point[{lab}/backward/layer_3/grad.attention.dense.weight]" in allids
    assert f"parity/test_points.py::test_point[{lab}/backward/model/grad.lm_head.weight]" in allids
    l3 = _collect(d, "-k", "layer_3")
    assert l3 and all("/layer_3/" in i for i in l3)
    assert any("/backward/layer_3/" in i for i in l3) and any(f"[{lab}/layer_3/" in i for i in l3)
    bw = _collect(d, "-k", "backward")
    assert bw and all("/backward/" in i for i in bw)
    assert len(bw) == sum("/backward/" in i for i in allids)
