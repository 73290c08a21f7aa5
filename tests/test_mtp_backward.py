"""The MTP loss and the MTP layer's backward points (issue 33 item 3): `dump_hf.py --grads --mtp-loss-scale F`.

The checkpoint is the bundled `dumps/ckpt/tiny-flash` (one MTP layer, `model.layers.8`); a 40-token prompt, fp32 and
bf16, scale 0.3 (its config says 0: training only, so the option is explicit).

(a) The dump's loss and points against autograd read directly on the twin (bit-identical: the same code, input and
    order of operations), with the loss written here from the contract's sentence: every MTP backward point
    (`/backward/MTP0/...`: the cotangents, `hnorm:in` = the MTP layer's share of dL/d(model.norm output), the layer's
    weight gradients) and the main stack's, which the MTP term changes (the MTP layer reads the main stack's state
    after model.norm, facts §2).
(b) The loss of dumps made by the official file and by the twin against the official remote code's own `loss` /
    `mtp_loss` (`BailingMoeV3ForCausalLM.forward` with labels = the prompt, its `mtp_loss_scaling_factor` set to 0.3)
    for the same checkpoint and prompt (skipped without the file, as tests/test_official.py).
(c) The MTP unit and the model level replay clean against the JAX reference in `layer` mode (fp32 and bf16); a dump
    without the MTP loss owes no MTP backward point.
(d) Planted MTP-backward bugs (the forward untouched) are caught at the MTP backward point they break: the JAX side's
    MTP loss scale wrong (`MTP0/logits`), the MTP layer's hidden input detached in its VJP (`MTP0/hnorm:in`), the
    head's VJP ignoring the MTP layer's share of the final norm's cotangent (`model/final_norm`).
(e) Refusals: one line naming the option and what was expected.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bounds import TWIN_OFFICIAL_LOSS_FP32_ULPS

from parity.dumpfile import DumpReader, validate_dump
from parity.errors import ParityError
from parity.model.mtp_points import MtpPoint, mtp_backward_sites, mtp_param_sites
from parity.model.points import Point
from parity.targets.reference import ReferenceTarget
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.prompts import builtin_ids

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "dumps" / "ckpt" / "tiny-flash"
SCALE = 0.3  # not-a-bound: the MTP loss scale the dumps are made with (DeepSeek-V3's first-phase value)
T = 40
IDS = builtin_ids(512, T, seed=3)


def _opts(**kw) -> DumpOptions:
    kw.setdefault("progress", False)
    kw.setdefault("decode_steps", 1)
    kw.setdefault("grads", True)
    return DumpOptions(**kw)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """dtype -> a --grads --mtp-loss-scale 0.3 dump of tiny-flash (40 tokens, one decode step)."""
    d = tmp_path_factory.mktemp("mtpbw")
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = d / f"tiny-flash-mtp-{dtype}.h5"
        dump_checkpoint(CKPT, out[dtype], IDS, _opts(dtype=dtype, mtp_loss_scale=SCALE))
    return out


def _mtp_ce(mtp_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Written here from the contract's sentence (not imported): mean over t = 0..T-3 of CE(mtp_logits[0, t],
    ids[0, t+2]), fp32."""
    V = mtp_logits.shape[-1]
    return F.cross_entropy(mtp_logits.float()[:, :-2].reshape(-1, V), ids[:, 2:].reshape(-1))


def _direct(dtype: str):
    """Autograd on the twin as the dump loads it, read without the capture: (main CE, MTP CE, {name: tensor kept with
    its grad}, {param name: grad}). `hnorm_in`: the MTP layer's hnorm fed a view of its input (values unchanged), so
    that view's gradient is the MTP layer's share alone."""
    from parity.torch_ref.loader import load_model

    loaded = load_model(CKPT, "remote", dtype=dtype, trust_remote_code=False)
    try:
        model = loaded.model.eval()
        n = loaded.config.num_hidden_layers
        mtp = model.model.layers[n]
        kept: dict[str, torch.Tensor] = {}

        def keep(name, out_index=None):
            def hook(_m, args, out=None):
                t = args[0] if out is None else (out[out_index] if out_index is not None else out)
                t.retain_grad()
                kept[name] = t
            return hook

        def view_input(_m, args):
            v = args[0].view_as(args[0])
            v.retain_grad()
            kept["hnorm_in"] = v
            return (v,)

        hs = [model.model.norm.register_forward_hook(keep("final_norm")),
              mtp.hnorm.register_forward_pre_hook(view_input),
              mtp.eh_proj.register_forward_hook(keep("eh_proj")),
              mtp.attention.register_forward_hook(keep("attention", 0)),
              mtp.mlp.register_forward_hook(keep("mlp")),
              mtp.final_layernorm.register_forward_hook(keep("final_layernorm"))]
        for i, layer in enumerate(model.model.layers[:n]):
            hs.append(layer.register_forward_pre_hook(keep(f"{i}/input")))
        t_ids = torch.as_tensor(IDS)
        out = model(t_ids)
        for h in hs:
            h.remove()
        lf, mlf = out.logits.float(), out.mtp_logits[0].float()
        mlf.retain_grad()
        main = F.cross_entropy(lf[:, :-1].reshape(-1, lf.shape[-1]), t_ids[:, 1:].reshape(-1))
        mtp_term = _mtp_ce(mlf, t_ids)
        (main + SCALE * mtp_term).backward()
        kept["mtp_logits"] = mlf
        params = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        return main.item(), mtp_term.item(), kept, params
    finally:
        loaded.release()


def _bw(j_or_layer, site) -> Point | MtpPoint:
    return MtpPoint("backward", 0, j_or_layer[1], site) if isinstance(j_or_layer, tuple) else \
        Point("backward", 0, j_or_layer, site)


MTP0 = ("MTP", 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_grads_dump_equals_autograd(dumps, dtype):
    """(a) The loss record and every MTP backward point the twin exposes, bit for bit against autograd; the main
    stack's gradients include the MTP term (they equal autograd of the total loss)."""
    main, mtp_term, kept, params = _direct(dtype)
    validate_dump(dumps[dtype])
    with DumpReader(dumps[dtype]) as d:
        cfg = d.config
        n = cfg.num_hidden_layers
        meta = d.meta["backward"]
        m = meta["mtp_loss"]
        assert meta["value"] == main and meta["terms"] == T - 1
        assert m["loss"] == "mtp_next_next_token_ce_mean_fp32" and m["scale"] == SCALE and m["terms"] == T - 2
        assert m["value"] == mtp_term and m["total"] == main + SCALE * mtp_term and m["labels"] == "input_ids"

        def np_(t):
            from parity.torch_ref.capture import to_numpy

            return to_numpy(t.grad)

        assert np.array_equal(d.read(_bw(MTP0, "logits")), np_(kept["mtp_logits"]))
        assert np.array_equal(d.read(_bw(MTP0, "hnorm:in")), np_(kept["hnorm_in"]))
        for site in ("eh_proj", "attention", "mlp", "final_layernorm"):
            assert np.array_equal(d.read(_bw(MTP0, site)), np_(kept[site])), site
        # the main state after model.norm gets both shares: its dumped cotangent is autograd's total
        assert np.array_equal(d.read(_bw(None, "final_norm")), np_(kept["final_norm"]))
        for i in range(n):
            assert np.array_equal(d.read(_bw(i, "input")), np_(kept[f"{i}/input"])), i
        from parity.torch_ref.capture import to_numpy

        for site in mtp_param_sites(cfg):
            name = f"model.layers.{n}.{site[len('grad.'):]}"
            want = to_numpy(params[name]) if name in params else np.zeros(d.shape(_bw(MTP0, site)), np.float32)
            assert np.array_equal(np.asarray(d.read(_bw(MTP0, site))).astype(np.float32),
                                  np.asarray(want).astype(np.float32)), site
        for name in ("lm_head.weight", "model.word_embeddings.weight", "model.norm.weight"):
            assert np.array_equal(d.read(_bw(None, "grad." + name)), to_numpy(params[name])), name
        # every MTP backward site is held or declared unavailable, with its reason
        un = d.unavailable()
        held = {p.site for p in d.mtp_points() if p.phase == "backward"}
        lacking = [s for s in mtp_backward_sites(cfg) if s not in held]
        assert all(f"backward/MTP0/{s}" in un or f"MTP0/{s}" in un for s in lacking), (lacking, un)
        assert lacking == [], lacking  # the twin exposes every MTP site, its MLA head gate included


def test_mtp_term_changes_the_main_gradients(dumps, tmp_path):
    """Without --mtp-loss-scale the same dump has `mtp_loss: null`, no MTP backward point, and main-stack gradients
    that differ from the MTP dump's (the MTP term reaches every main layer through model.norm)."""
    plain = tmp_path / "plain.h5"
    dump_checkpoint(CKPT, plain, IDS, _opts(dtype="float32", decode_steps=0))
    with DumpReader(plain) as a, DumpReader(dumps["float32"]) as b:
        assert a.meta["backward"]["mtp_loss"] is None
        assert not [p for p in a.mtp_points() if p.phase == "backward"]
        assert a.meta["backward"]["value"] == b.meta["backward"]["value"]  # the main term is the same
        assert np.array_equal(a.read(_bw(None, "logits")), b.read(_bw(None, "logits")))
        for i in range(a.config.num_hidden_layers):
            assert not np.array_equal(a.read(_bw(i, "input")), b.read(_bw(i, "input"))), i
        for p in a.points():  # the forward is the same forward
            if p.phase == "prefill":
                assert np.array_equal(a.read(p), b.read(p)), p.key()


# ---------------------------------------------------------------------------------------------- (b) official file
def test_mtp_loss_equals_the_official_files_loss(tmp_path):
    """(b) tiny-flash without its clamp lists (`--swiglu-clamp none`: the official file ignores the clamp, the twin
    applies it; without limits both compute the same maths), made twice from one seed — with the official file and
    with the twin —, each dumped with --mtp-loss-scale 0.3; the official file's own forward with labels = the prompt
    and its `mtp_loss_scaling_factor` 0.3. Both dumps' MTP term is the official `mtp_loss[0]` bit for bit (the same
    form of the same fp32 logits), their main term the official `loss` with the factor 0, and the official `loss` the
    fp32 sum of the two terms (the record's `total` is that sum in Python floats). The official runtime's MTP
    backward points replay clean too."""
    from parity.torch_ref import official

    ok, why = official.available()
    if not ok:
        pytest.skip(why)
    from parity.torch_ref.ckpt import main as make_ckpt
    from parity.torch_ref.loader import load_model

    metas = {}
    for modeling in ("official", "twin"):
        ck = tmp_path / f"tf-{modeling}"
        extra = ["--modeling", "official"] if modeling == "official" else []
        assert make_ckpt(["--preset", "tiny-flash", "--seed", "0", "--out", str(ck), "--max-shard-mb", "1",
                          "--swiglu-clamp", "none", *extra]) == 0
        dump = tmp_path / f"{modeling}-mtp.h5"
        dump_checkpoint(ck, dump, IDS, _opts(dtype="float32", decode_steps=0, trust_remote_code=True,
                                             mtp_loss_scale=SCALE))
        with DumpReader(dump) as d:
            assert d.meta["capture_map"] == modeling
            metas[modeling] = d.meta["backward"]
            held = {p.site for p in d.mtp_points() if p.phase == "backward"}
        assert {"logits", "hnorm:in", "eh_proj", "grad.eh_proj.weight", "grad.hnorm.weight"} <= held
    ck, dump = tmp_path / "tf-official", tmp_path / "official-mtp.h5"
    loaded = load_model(ck, "remote", dtype="float32", trust_remote_code=True)
    try:
        model = loaded.model.eval()
        ids = torch.as_tensor(IDS)
        # the official forward reads its factor from this attribute (set from the config's mtp_loss_scaling_factor,
        # 0 in make_ckpt's configs): set as a training run would configure it
        assert model.mtp_loss_scaling_factor == 0
        with torch.no_grad():
            main_only = model(input_ids=ids, labels=ids, use_cache=False).loss  # factor 0: the main term alone
            model.mtp_loss_scaling_factor = SCALE
            out = model(input_ids=ids, labels=ids, use_cache=False)
    finally:
        loaded.release()
    mtp_off = out.mtp_loss[0]
    for modeling, meta in metas.items():
        # the official runtime's dump: the official loss bit for bit; the twin's (a second implementation): within
        # fp32 ULPs (bit-identical on AVX-512, 1 ULP under the AVX2 caps: tests/bounds.py)
        ulps = 0.0 if modeling == "official" else TWIN_OFFICIAL_LOSS_FP32_ULPS
        # the official fp32 `loss += factor * mtp_loss`, redone from the dump's two terms in fp32
        redo = torch.tensor(meta["value"], dtype=torch.float32) + SCALE * torch.tensor(meta["mtp_loss"]["value"],
                                                                                       dtype=torch.float32)
        for what, got, want in (("mtp_loss", meta["mtp_loss"]["value"], mtp_off.item()),
                                ("main loss", meta["value"], main_only.item()), ("total", redo.item(), out.loss.item())):
            off = abs(got - want) / float(np.spacing(np.float32(abs(want))))
            assert off <= ulps, f"{modeling} {what}: {got!r} vs the official {want!r} ({off:.1f} fp32 ULPs > {ulps})"
    print(f"official loss {out.loss.item()!r} mtp_loss {mtp_off.item()!r}; dump totals "
          f"{ {m: v['mtp_loss']['total'] for m, v in metas.items()} }")
    # the official runtime's MTP backward points replay clean (the MLA head gate, an inline sigmoid there, is
    # declared unavailable: skipped with that reason)
    recs = [r for unit in ("MTP0", None) for r in _replay(dump, ReferenceTarget(), unit, ck)]
    bad = [(r["site"], r["status"]) for r in recs if r["status"] not in ("pass", "skipped")]
    assert not bad, bad[:10]
    skipped = {r["site"] for r in recs if r["phase"] == "backward" and r["status"] == "skipped"}
    assert skipped == {"MTP0/attention.gate"}, skipped


# ---------------------------------------------------------------------------------------------- (c) replay
def _replay(dump: Path, target, unit, ckpt: Path | None = None):
    """Records (as dicts) of one replay unit: "MTP0" or None (the model level)."""
    from parity.replay import Session, judge, observe

    with Session.open(dump, ckpt, target=target) as s:
        return [r.to_json() for r in judge(s, observe(s, unit))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_backward_replays_clean(dumps, dtype):
    """(c) Every MTP backward point and every model-level backward point is compared and passes."""
    from parity.model.points import BACKWARD_MODEL_SITES

    with DumpReader(dumps[dtype]) as d:
        cfg = d.config
    recs = _replay(dumps[dtype], ReferenceTarget(), "MTP0") + _replay(dumps[dtype], ReferenceTarget(), None)
    bad = [(r["phase"], r["layer"], r["site"], r["status"], (r.get("message") or r.get("reason") or "")[:160])
           for r in recs if r["status"] not in ("pass", "skipped")]
    assert not bad, bad[:10]
    bw = {(r["layer"], r["site"]): r["status"] for r in recs if r["phase"] == "backward"}
    want = [(None, f"MTP0/{s}") for s in mtp_backward_sites(cfg)] + \
        [(None, s) for s in BACKWARD_MODEL_SITES if s != "embed"]  # `embed`: fed, its own dumped cotangent
    assert [w for w in want if bw.get(w) != "pass"] == []
    fwd = [r for r in recs if r["phase"] != "backward" and r["status"] == "fail"]
    assert not fwd


def test_mtp_backward_test_ids_and_selection(dumps):
    """Ids `<dump>/backward/MTP0/<site>` beside the forward's `<dump>/MTP0/<site>`; `-k MTP0` selects both phases."""
    import subprocess
    import sys

    def collect(*k):
        out = subprocess.run([sys.executable, "-m", "pytest", "parity", "--parity-dump", str(dumps["float32"]),
                              "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *k], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        return [line for line in out.stdout.splitlines() if "test_point[" in line]

    lab = dumps["float32"].name.removesuffix(".h5")
    ids = collect("-k", "MTP0")
    with DumpReader(dumps["float32"]) as d:
        sites = mtp_backward_sites(d.config)
    bw = [i for i in ids if f"[{lab}/backward/MTP0/" in i]
    assert len(bw) == len(sites) and f"parity/test_points.py::test_point[{lab}/backward/MTP0/hnorm:in]" in bw
    assert f"parity/test_points.py::test_point[{lab}/MTP0/eh_proj]" in ids


def test_a_target_without_the_mtp_backward_skips_its_points_saying_so(dumps):
    """A target without the capability `mtp` (or without the three MTP backward methods) cannot take the MTP term:
    the MTP layer's backward points and the model-level points with an MTP share are skipped, saying why; the main
    term's `logits` cotangent is still compared."""
    from parity.targets.base import Target

    class NoMtp(ReferenceTarget):
        name = "no-mtp"
        capabilities = ReferenceTarget.capabilities - {"mtp"}

    class NoMtpBackward(ReferenceTarget):
        name = "no-mtp-backward"
        mtp_backward = Target.mtp_backward

    for target, why in ((NoMtp(), "lacks capability mtp"), (NoMtpBackward(), "does not implement the MTP backward")):
        recs = _replay(dumps["float32"], target, "MTP0") + _replay(dumps["float32"], target, None)
        bw = {r["site"]: r for r in recs if r["phase"] == "backward"}
        shared = [s for s in bw if s.startswith("MTP0/")] + ["final_norm", "final_norm:in", "grad.model.norm.weight",
                                                            "grad.lm_head.weight", "grad.model.word_embeddings.weight"]
        assert all(bw[s]["status"] == "skipped" and why in bw[s]["reason"] for s in shared), target.name
        assert bw["logits"]["status"] == "pass"


def test_old_dumps_owe_no_mtp_backward_point():
    """A --grads dump without the MTP loss (the bundled golden: `mtp_loss` null) owes the same points as before:
    no `backward/MTP0/*`."""
    from parity.model.points import mtp_site
    from parity.replay.coverage import owed_points

    with DumpReader(ROOT / "dumps" / "tiny-flash-bf16.h5") as d:
        assert d.meta["backward"]["mtp_loss"] is None
        owed = owed_points(d)
    assert [o.point for o in owed if o.point.phase == "backward" and mtp_site(o.point.site)] == []
    assert any(o.point.phase == "backward" for o in owed)


# ---------------------------------------------------------------------------------------------- (d) planted bugs
class _ScaleIgnored(ReferenceTarget):
    """Planted: the JAX side's MTP loss ignores the dump's scale (the term weighted 1)."""
    name = "reference+mtp-scale-ignored"

    def mtp_loss_backward(self, logits, input_ids, scale):
        return super().mtp_loss_backward(logits, input_ids, 1.0)


def _mtp_layer_hidden_detached(p, embedded, hidden, positions, spec, state=None, forced_idx=None, probes=None):
    from parity.jax_ling3.mtp import mtp_layer

    return mtp_layer(p, embedded, jax.lax.stop_gradient(hidden), positions, spec, state, forced_idx, probes=probes)


class _HiddenDetached(ReferenceTarget):
    """Planted: the MTP layer's hidden input detached in its VJP only (stop_gradient: the forward is unchanged)."""
    name = "reference+mtp-hidden-detached"

    def _mtp_pure_fn(self):
        return _mtp_layer_hidden_detached


class _MtpShareIgnored(ReferenceTarget):
    """Planted: the head's VJP ignores the MTP layer's share of the final norm's cotangent."""
    name = "reference+mtp-share-ignored"

    def head_backward(self, hidden, d_logits, d_final_norm=None):
        return super().head_backward(hidden, d_logits)


PLANTED = [(_ScaleIgnored, "MTP0", "MTP0/logits"), (_HiddenDetached, "MTP0", "MTP0/hnorm:in"),
           (_MtpShareIgnored, None, "final_norm")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target,unit,site", PLANTED, ids=[t.name for t, _, _ in PLANTED])
def test_planted_mtp_backward_bug_is_caught(dumps, dtype, target, unit, site):
    """(d) The bug's first divergence is its backward point; the forward points pass (the bug is backward-only). The
    correct reference passes the same unit (test_mtp_backward_replays_clean)."""
    from parity.reporting.report import first_divergence

    with DumpReader(dumps[dtype]) as d:
        cfg = d.config
    recs = _replay(dumps[dtype], target(), unit)
    assert not [r for r in recs if r["phase"] != "backward" and r["status"] == "fail"], "forward points fail"
    fd = first_divergence(cfg, recs)
    assert fd is not None, f"{target.name} ({dtype}): not detected"
    assert (fd["phase"], fd["layer"], fd["site"]) == ("backward", None, site), fd
    assert (fd["source"]["phase"], fd["source"]["layer"], fd["source"]["site"]) == ("backward", None, site)
    print(f"\nCAUGHT {target.name} {dtype} at backward/{site}: max_ulp {fd.get('max_ulp')}, rel_l2 {fd.get('rel_l2')}, "
          f"failing points {sorted(r['site'] for r in recs if r['status'] == 'fail')}")


# ---------------------------------------------------------------------------------------------- (e) refusals
@pytest.mark.parametrize("kw,ids,msg", [
    ({"grads": False, "mtp_loss_scale": SCALE}, IDS, "expected --grads too"),
    ({"mtp_loss_scale": 0.0}, IDS, "expected a finite number > 0"),  # not-a-bound: a refused option value
    ({"mtp_loss_scale": SCALE}, np.concatenate([IDS, IDS]), "a batch of 2 prompts; expected 1"),
    ({"mtp_loss_scale": SCALE}, IDS[:, :2], "expected at least 3"),
    ({"mtp_loss_scale": SCALE, "layers": [0, 1]}, IDS, "expected a dump of every layer"),
    ({"mtp_loss_scale": SCALE, "runtime": "native"}, IDS, "has no MTP layer"),
], ids=["no-grads", "zero", "batch", "short", "layers", "native"])
def test_mtp_loss_scale_refusals(tmp_path, kw, ids, msg):
    with pytest.raises(ParityError, match=msg):
        dump_checkpoint(CKPT, tmp_path / "x.h5", ids, _opts(**kw))
    assert not (tmp_path / "x.h5").exists()


def test_mtp_loss_scale_refused_without_an_mtp_layer(tmp_path):
    with pytest.raises(ParityError, match="num_nextn_predict_layers = 0"):
        dump_checkpoint(ROOT / "dumps" / "ckpt" / "tiny", tmp_path / "x.h5", IDS, _opts(mtp_loss_scale=SCALE))
