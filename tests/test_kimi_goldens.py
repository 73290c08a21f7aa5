"""The bundled Kimi Linear goldens (`parity.golden.KIMI_GOLDEN`, dumps/kimi/, issue 34): `pytest parity` replays
them clean in layer (with decode steps), isolated and free modes; a planted porting bug fails at its site in fp32 and
bf16; regenerating one gives the same dump (its structure anywhere, its bits on the CPU kind that made it); a dump
without its checkpoint is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity.golden import KIMI_DUMPS, KIMI_GOLDEN, KIMI_MACHINE, ROOT, dump_structure, machine_kind, \
    structure_differences
from parity.targets.kimi import KimiReferenceTarget
from parity.targets.kimi_mutants import CATALOGUE


def _pytest(*args: str, reports: Path | None = None) -> subprocess.CompletedProcess:
    """`pytest parity -k kimi ARGS` in a subprocess, its reports under `reports` (default: a fresh temporary folder,
    never the repository's reports/)."""
    import tempfile

    reports = reports or Path(tempfile.mkdtemp(prefix="kimi-reports-"))
    return subprocess.run([sys.executable, "-m", "pytest", "parity", "-p", "no:cacheprovider", "-n", "0", "-q",
                           "-k", "kimi", "--parity-report", str(reports), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def test_goldens_replay_clean_in_every_mode():
    r = _pytest("--parity-mode", "layer,isolated,free")
    n = 2 * 3 * (4 + 1)  # two goldens, three modes, four layers and the model-level sites
    assert r.returncode == 0 and f"{n} passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    listed = _pytest("--parity-mode", "layer,isolated,free", "--co").stdout
    assert "kimi-tiny-bf16/isolated/layer_3" in listed and "kimi-tiny-fp32/free/model" in listed


@pytest.mark.parametrize("golden", [g.file for g in KIMI_GOLDEN])
def test_a_planted_bug_fails_at_its_site(golden, tmp_path):
    """A SiLU between the low-rank gate projections (`parity.targets.kimi.KimiPlantedGateActivation`, a porting bug
    issue 34 names): layer 0 (KDA) fails at `attention.gate`; layer 1 (MLA, untouched) passes; the run's summary and
    its report (report.json in DESIGN §8's schema, report.html with the HERE marker, the pytest command that
    reproduces it) name layer 0's `attention.gate` as the first divergence and its source."""
    import json

    label = golden.removesuffix(".h5")
    r = _pytest("--parity-dump", str(KIMI_DUMPS / golden), "--parity-target",
                "parity.targets.kimi:KimiPlantedGateActivation", "-k", "layer_0 or layer_1", reports=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-3000:]
    assert f"{label} (layer mode) layer 0 attention.gate: Tensor-likes are not close!" in r.stdout, r.stdout[-3000:]
    assert f"{label} (Kimi Linear): FIRST DIVERGENCE layer mode, prefill layer 0 attention.gate: max " in r.stdout, \
        r.stdout[-3000:]
    rep = json.loads((tmp_path / label / "report.json").read_text())
    assert (rep["schema"], rep["family"], rep["mode"], rep["passed"]) == ("ling3-parity-report", "kimi_linear",
                                                                          "layer", False)
    fd = rep["first_divergence"]
    assert (fd["phase"], fd["layer"], fd["site"], fd["status"]) == ("prefill", 0, "attention.gate", "fail")
    assert (fd["source"]["layer"], fd["source"]["site"]) == (0, "attention.gate") and rep["counts"]["fail"] >= 1
    assert fd["max_ulp"] > 0 and fd["worst_index"] is not None and fd["dtype"] in ("float32", "bfloat16")
    assert all(p["status"] == "pass" for p in rep["points"] if p["layer"] == 1)
    from parity.reporting.repro import pytest_command

    assert pytest_command(rep).endswith("-k 'layer_0]'")  # the test holding the failure: one per layer
    page = (tmp_path / label / "report.html").read_text()
    assert "HERE ▶" in page and "prefill/L00/attention.gate" in page


def test_an_fp32_and_bf16_pair_is_triaged(tmp_path):
    """Both goldens (one checkpoint, fp32 and bf16) with the planted gate bug in one run: their reports carry the
    per-site triage, which calls the bug semantic (it fails the fp32 dump too: the formula differs), first at layer 0's
    `attention.gate`, and the terminal says so."""
    import json

    r = _pytest(*[a for g in KIMI_GOLDEN for a in ("--parity-dump", str(KIMI_DUMPS / g.file))], "--parity-target",
                "parity.targets.kimi:KimiPlantedGateActivation", "-k", "layer_0", reports=tmp_path)
    assert r.returncode == 1 and "first semantic  (fails on the fp32 dump" in r.stdout, r.stdout[-3000:]
    for g in KIMI_GOLDEN:
        tri = json.loads((tmp_path / g.file.removesuffix(".h5") / "report.json").read_text())["triage"]
        sem = tri["first_semantic"]
        assert (sem["layer"], sem["site"]) == (0, "attention.gate") and tri["first_precision"] is None


class PartialKimiTarget(KimiReferenceTarget):
    """A port that returns only `attention` and `mlp` besides its output (as docs/porting.md's Kimi example does)."""

    def layer_forward(self, i, state_dict, hidden, forced_idx):
        out, pts = super().layer_forward(i, state_dict, hidden, forced_idx)
        return out, {k: v for k, v in pts.items() if k in ("attention", "mlp")}


def test_sites_a_target_does_not_return_are_not_provided_not_failed(tmp_path, monkeypatch):
    """A target returning a few sites passes on the golden; the others are recorded `not provided` (as a Ling3 replay
    skips a point its target does not produce), not failed."""
    import json
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                   os.environ.get("PYTHONPATH")])))
    r = _pytest("--parity-dump", str(KIMI_DUMPS / KIMI_GOLDEN[1].file), "--parity-target",
                "test_kimi_goldens:PartialKimiTarget", "-k", "layer_0", reports=tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]
    rep = json.loads((tmp_path / KIMI_GOLDEN[1].file.removesuffix(".h5") / "report.json").read_text())
    assert rep["counts"].get("not provided", 0) >= 5 and rep["counts"]["pass"] >= 3, rep["counts"]
    assert rep["first_divergence"] is None


def test_a_dump_without_its_checkpoint_is_one_line(tmp_path):
    r = _pytest("--parity-dump", str(KIMI_DUMPS / KIMI_GOLDEN[1].file), "--parity-ckpt", str(ROOT / "dumps" / "ckpt" /
                                                                                               "tiny"), "-k", "layer_0")
    assert r.returncode == 1
    assert "fingerprint" in r.stdout and "Traceback" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("golden", KIMI_GOLDEN, ids=[g.file for g in KIMI_GOLDEN])
def test_regeneration_gives_the_bundled_dump(golden, tmp_path, monkeypatch):
    import h5py

    from parity.cli.kimi_check import main

    import torch

    out = tmp_path / golden.file
    monkeypatch.chdir(ROOT)  # the command's relative checkpoint path is recorded in the dump's config
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the golden's command (`KimiGolden.command`: OMP_NUM_THREADS=1)
    try:
        assert main(golden.args(out)) == 0
    finally:
        torch.set_num_threads(threads)
    bundled = KIMI_DUMPS / golden.file
    assert structure_differences(dump_structure(bundled), dump_structure(out)) == []
    if machine_kind() != KIMI_MACHINE:
        pytest.skip(f"bit-identity holds on {KIMI_MACHINE}, the CPU kind that made the goldens (this is "
                    f"{machine_kind()}); the structure matched")
    with h5py.File(bundled, "r") as a, h5py.File(out, "r") as b:
        names: list[str] = []
        a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        differ = [n for n in names if not np.array_equal(a[n][()], b[n][()])]
    assert not differ, f"{len(differ)} of {len(names)} datasets differ, e.g. {differ[:3]}"


# The porting-bug catalogue of issue 34 §4 (`parity.targets.kimi_mutants`, planted into `parity.jax_kimi`) on the
# goldens: each fails first at the site its catalogue entry names — the site that computes what it breaks, at the
# first layer of the kind it touches (from the config) — and every site before it passes, in fp32 and in bf16.
@pytest.mark.parametrize("golden", KIMI_GOLDEN, ids=[g.dtype for g in KIMI_GOLDEN])
@pytest.mark.parametrize("name", sorted(m.name for m in CATALOGUE))
def test_catalogue_bug_fails_first_at_its_site(name, golden):
    from parity.jax_kimi.check import decode_verdicts, layer_verdicts
    from parity.model.kimi_family import SITES
    from parity.targets.kimi_mutants import BY_NAME, CLASSES
    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import read_kimi_dump

    ckpt = ROOT / "dumps" / "ckpt" / "kimi-tiny"
    steps, _, _ = read_kimi_dump(KIMI_DUMPS / golden.file, ckpt)
    model = load_kimi_model(ckpt, golden.dtype)
    m = BY_NAME[name]
    if golden.dtype not in m.dtypes:
        pytest.skip(f"{name} is correct code in {golden.dtype} (a precision placement; the catalogue's dtypes)")
    layer = m.first_layer(model.config)
    with CLASSES[name]().planted():  # the target's own patch; eager: it applies to every call
        v = layer_verdicts(model.state_dict(), model.config, steps[0], layer, golden.dtype)[0]
        if m.phase == "decode":  # the prefill passes; the first decode step with a failure fails first at the site
            assert all(r.status != "fail" for r in v.values()), {s: r.status for s, r in v.items()}
            per_step = decode_verdicts(model.state_dict(), model.config, steps, layer, golden.dtype)
            v = next((d for d in per_step if any(r.status == "fail" for r in d.values())), {})
    order = [s.site for s in SITES if s.site in v]
    failing = [s for s in order if v[s].status == "fail"]
    assert failing and failing[0] == m.site, f"{name} ({golden.dtype}): first failing {failing[:3]}, expected {m.site}"


# Porting bugs of the model-level sites (issue 34: the embedding, final norm and head a port writes itself), planted
# into the built-in's weights or config as the reference reads them; each fails first at the site that computes what
# it breaks (`kimi_family.MODEL_SITES` order), the sites before it pass, in fp32 and bf16.
def _tied_head(sd, cfg):  # logits from the embedding table (tie_word_embeddings assumed; the checkpoint has a head)
    return {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}, cfg


def _final_norm_unweighted(sd, cfg):  # the final norm's weight not loaded (left at its init, ones)
    import torch

    return {**sd, "model.norm.weight": torch.ones_like(sd["model.norm.weight"])}, cfg


def _embedding_offset(sd, cfg):  # ids looked up one row off (a vocabulary offset)
    import torch

    return {**sd, "model.embed_tokens.weight": torch.roll(sd["model.embed_tokens.weight"], 1, 0)}, cfg


MODEL_BUGS = {"tied_head": (_tied_head, "logits"), "final_norm_unweighted": (_final_norm_unweighted, "final_norm"),
              "embedding_offset": (_embedding_offset, "embed")}


@pytest.mark.parametrize("golden", KIMI_GOLDEN, ids=[g.dtype for g in KIMI_GOLDEN])
@pytest.mark.parametrize("name", sorted(MODEL_BUGS))
def test_model_level_bug_fails_first_at_its_site(name, golden):
    from parity.jax_kimi.check import model_verdicts
    from parity.model.kimi_family import MODEL_SITES
    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import read_kimi_dump

    ckpt = ROOT / "dumps" / "ckpt" / "kimi-tiny"
    steps, ids, _ = read_kimi_dump(KIMI_DUMPS / golden.file, ckpt)
    model = load_kimi_model(ckpt, golden.dtype)
    plant, want = MODEL_BUGS[name]
    clean = model_verdicts(model.state_dict(), model.config, steps, ids, golden.dtype, "layer")
    assert clean and all(r.status == "pass" for r in clean.values()), {s: r.status for s, r in clean.items()}
    sd, cfg = plant(model.state_dict(), model.config)
    v = model_verdicts(sd, cfg, steps[:1], ids, golden.dtype, "layer")
    order = [s.site for s in MODEL_SITES]
    failing = [s for s in order if v[s].status == "fail"]
    assert failing and failing[0] == want, f"{name} ({golden.dtype}): failing {failing}, expected {want} first"


def _linear_bf16_accumulated(x, w, tile: int = 16):
    """A head GEMM accumulated in the activation dtype across K tiles (each tile's fp32 partial rounded, the running
    sum rounded): a bf16 kernel that keeps no fp32 accumulator between tiles."""
    import jax.numpy as jnp

    acc = None
    for k0 in range(0, w.shape[0], tile):
        part = jnp.matmul(x[..., k0:k0 + tile].astype(jnp.float32), w[k0:k0 + tile].astype(jnp.float32))
        acc = part.astype(x.dtype) if acc is None else (acc.astype(jnp.float32) + part).astype(x.dtype)
    return acc


@pytest.mark.parametrize("mode", ("layer", "isolated"))
def test_a_head_accumulated_in_bf16_fails_at_logits(mode, monkeypatch):
    """Kimi's overlay turns the exactness-rate test off for bf16 logits in isolated mode (a real vocabulary leaves
    every row 1 ULP off somewhere: parity/numerics/kimi_linear.toml); the other criteria still catch a head that
    accumulates in bf16, on the bf16 golden, in layer and isolated mode."""
    from parity.jax_kimi.check import model_verdicts
    from parity.jax_ling3 import ops
    from parity.model import kimi_family
    from parity.numerics.tolerances import default_rules
    from parity.torch_ref.kimi_ckpt import load_kimi_model
    from parity.torch_ref.kimi_dump import read_kimi_dump

    ours, ling3 = (r.rule_for("logits", "isolated", "bfloat16", "bfloat16") for r in (kimi_family.rules(),
                                                                                     default_rules()))
    assert ours.inexact_row_rate is None and ling3.inexact_row_rate is not None
    assert (ours.max_ulps, ours.hard_ulps, ours.allowed_fraction) == (ling3.max_ulps, ling3.hard_ulps,
                                                                      ling3.allowed_fraction)
    ckpt = ROOT / "dumps" / "ckpt" / "kimi-tiny"
    golden = KIMI_GOLDEN[1]
    assert golden.dtype == "bfloat16"
    steps, ids, _ = read_kimi_dump(KIMI_DUMPS / golden.file, ckpt)
    model = load_kimi_model(ckpt, golden.dtype)
    monkeypatch.setattr(ops, "linear", _linear_bf16_accumulated)
    v = model_verdicts(model.state_dict(), model.config, steps[:1], ids, golden.dtype, mode)
    assert {s: r.status for s, r in v.items()} == {"embed": "pass", "final_norm": "pass", "logits": "fail"}


def test_dump_hf_writes_the_same_kimi_dump(tmp_path, monkeypatch, capsys):
    """`tools/dump_hf.py` on a Kimi Linear checkpoint (config.json `model_type: kimi_linear`) dumps transformers'
    built-in with the same capture as `tools/kimi_check.py --dump`: the bf16 golden's arguments give the golden."""
    import h5py

    from parity.cli.dump_hf import main

    golden = next(g for g in KIMI_GOLDEN if g.dtype == "bfloat16")
    out = tmp_path / "k.h5"
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert main(["dumps/ckpt/kimi-tiny", "--out", str(out), "--dtype", "bf16", "--prompt-len", "70",
                 "--decode-steps", "2", "--seed", "0"]) == 0
    assert "replay: pytest parity --parity-dump" in capsys.readouterr().out
    bundled = KIMI_DUMPS / golden.file
    assert structure_differences(dump_structure(bundled), dump_structure(out)) == []
    if machine_kind() == KIMI_MACHINE:
        with h5py.File(bundled, "r") as a, h5py.File(out, "r") as b:
            names: list[str] = []
            a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            assert all(np.array_equal(a[n][()], b[n][()]) for n in names)


def test_dump_hf_refuses_ling3_only_options_for_kimi_in_one_line(tmp_path, capsys):
    from parity.cli.dump_hf import main

    rc = main([str(ROOT / "dumps" / "ckpt" / "kimi-tiny"), "--out", str(tmp_path / "k.h5"), "--layers", "0", "--sites",
               "mlp"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "not with --layers, --sites" in err
    assert not (tmp_path / "k.h5").exists()


def test_a_bf16_checkpoint_dumped_in_fp32_replays_clean(tmp_path):
    """A bf16 checkpoint dumped in fp32 (the built-in upcasts its weights) is replayed with its weights kept bf16
    (`KimiSession.dump`: the narrower dtype; exact in fp32, half the memory — what lets the real-shape preset's fp32
    dump replay on 23 GiB): every layer passes in layer mode."""
    from parity.cli.dump_hf import main
    from parity.torch_ref.kimi_ckpt import make_kimi_checkpoint

    ckpt = make_kimi_checkpoint(tmp_path / "ckpt", "tiny", seed=3, dtype="bf16")
    out = tmp_path / "k32.h5"
    assert main([str(ckpt), "--out", str(out), "--dtype", "fp32", "--prompt-len", "40", "--decode-steps", "1"]) == 0
    r = _pytest("--parity-dump", str(out), "--parity-ckpt", str(ckpt))
    assert r.returncode == 0 and "5 passed" in r.stdout, r.stdout[-3000:]  # four layers and the model-level sites


def test_a_grads_dump_replays_its_backward_and_a_backward_only_bug_fails_there(tmp_path, monkeypatch):
    """`tools/dump_hf.py --grads` on a Kimi checkpoint adds one training step's backward (the next-token loss through
    every layer, `kimi_dump.capture_backward`); `pytest parity` judges each layer's VJP fed the dumped dL/d(output)
    against the dumped input and parameter gradients (in-process here, as the plugin's session does). Every gradient
    passes; with the decay gate detached from the graph (the forward bit-identical) the gate's parameter gradients
    fail and no forward site does."""
    import jax

    from parity.cli.dump_hf import main
    from parity.jax_kimi import kda
    from parity.pytest_plugin.kimi import KimiSession, KimiUnit

    out = tmp_path / "kg.h5"
    assert main([str(ROOT / "dumps" / "ckpt" / "kimi-tiny"), "--out", str(out), "--dtype", "bf16", "--prompt-len",
                 "40", "--decode-steps", "0", "--grads"]) == 0

    class Config:
        def getoption(self, name):
            return {"--parity-ckpt": str(ROOT / "dumps" / "ckpt" / "kimi-tiny")}.get(name)

    def verdicts():
        return KimiSession(Config()).verdicts(KimiUnit(out, "kg", "layer", 0))  # layer 0: KDA + dense

    clean = verdicts()
    backward = {s for s in clean if s.startswith("backward/")}
    assert {"backward/input", "backward/grad.self_attn.A_log", "backward/grad.mlp.down_proj"} <= backward, backward
    assert all(r.status == "pass" for r in clean.values()), [r.message() for r in clean.values() if r.status != "pass"]
    orig = kda.forget_gate
    monkeypatch.setattr(kda, "forget_gate", lambda p, x, spec: jax.lax.stop_gradient(orig(p, x, spec)))
    failed = {s for s, r in verdicts().items() if r.status == "fail"}
    assert {"backward/grad.self_attn.f_a_proj", "backward/grad.self_attn.A_log"} <= failed, failed
    assert all(s.startswith("backward/") for s in failed), failed  # the forward is untouched


@pytest.mark.parametrize("golden", KIMI_GOLDEN, ids=[g.dtype for g in KIMI_GOLDEN])
def test_the_kda_cache_sites_are_the_builtins_cache(golden):
    """The KDA cache sites (`kimi_family.SITES` with `cache`): every KDA layer holds both at the prefill and at each
    decode step, no MLA layer does; the conv history is laid out [3, B, P, W] with q, k, v first — its newest column
    is the step's own q/k/v projection (the short conv's input), bit for bit, which fixes the layout independently of
    the reference."""
    import json

    import h5py

    from parity.torch_ref.kimi_dump import read_kimi_dump

    steps, _, _ = read_kimi_dump(KIMI_DUMPS / golden.file, ROOT / "dumps" / "ckpt" / "kimi-tiny")
    with h5py.File(KIMI_DUMPS / golden.file) as f:
        cfg = json.loads(f.attrs["config_json"])
    kda = [i for i, t in enumerate(cfg["layer_types"]) if t == "linear_attention"]
    H, d, W = cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]
    assert len(steps) == 3 and kda
    for k, sites in enumerate(steps):
        held = {i for (i, s) in sites if s in ("attention.state", "attention.conv_state")}
        assert held == set(kda), (k, held)
        for i in kda:
            state = sites[(i, "attention.state")]
            assert state.shape == (1, H, d, d) and state.dtype == np.float32, (state.shape, state.dtype)
            conv = sites[(i, "attention.conv_state")]
            assert conv.shape == (3, 1, H * d, W), conv.shape
            for j, n in enumerate("qkv"):
                newest = sites[(i, f"attention.{n}_proj")][0, -1]  # the step's last token
                assert np.array_equal(conv[j, 0, :, -1], newest), (k, i, n)


def test_a_kimi_report_gets_a_repro_bundle_that_reproduces_it(tmp_path):
    """`tools/repro.py REPORT_DIR` on a failing Kimi report (a catalogue bug as the target, the bf16 golden): the
    bundle's script, run from another directory without the dump or pytest, prints the same failing point and exits
    1; with the suite's reference it matches (exit 0). A decode point and an isolated-mode point of the same report
    (`--point`, `--mode`) reproduce too; a backward point has no bundle (one line)."""
    import json

    from parity.cli.repro import main as repro_main

    r = _pytest("--parity-dump", str(KIMI_DUMPS / KIMI_GOLDEN[1].file), "--parity-target",
                "parity.targets.kimi_mutants:DecayPerChannelNotPerHead", "-k", "layer_0", reports=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    rdir = tmp_path / KIMI_GOLDEN[1].file.removesuffix(".h5")
    assert json.loads((rdir / "report.json").read_text())["family"] == "kimi_linear"
    assert repro_main([str(rdir)]) == 0
    bundle = rdir / "repro"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(bundle / "repro.py"), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)

    bad = run()
    assert bad.returncode == 1 and bad.stdout.startswith("MISMATCH prefill/L00/attention.gate"), bad.stdout + bad.stderr
    good = run("--target", "parity.targets.kimi:KimiReferenceTarget")
    assert good.returncode == 0 and good.stdout.startswith("MATCH prefill/L00/attention.gate"), \
        good.stdout + good.stderr
    for extra, point in ((["--point", "decode/S002/L00/attention.state"], "decode/S002/L00/attention.state"),
                         (["--point", "prefill/L00/attention", "--mode", "isolated"], "prefill/L00/attention")):
        out = tmp_path / point.replace("/", "_")
        assert repro_main([str(rdir), "--out", str(out), "--target", "parity.targets.kimi:KimiReferenceTarget",
                           *extra]) == 0
        res = subprocess.run([sys.executable, str(out / "repro.py")], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0 and res.stdout.startswith(f"MATCH {point}"), res.stdout + res.stderr
    assert repro_main([str(rdir), "--out", str(tmp_path / "bw"), "--point", "backward/L00/input"]) == 2
