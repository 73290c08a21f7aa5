"""One calibration pipeline (issue 27 item 3): the stored corpus measurements give every shipped generated file, the
walk's run plan is the recorded corpus, the walk pairs and orders runs as the recorded walks did, and the old tools
forward to tools/calibrate.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from parity.calibration import corpus as K
from parity.calibration import pipeline as P

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str):
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "tools"))


@pytest.fixture(scope="module")
def stored():
    return P.load(ROOT / P.MEASURED)


@pytest.fixture(scope="module")
def stored_kernels():
    return P.load_kernels(ROOT / P.MEASURED)  # ~200 MB of JSON: read once for the module's tests


def test_shipped_bounds_match_the_corpus_and_the_tool(stored):
    """The safety-bound section of calibration.toml is what the derivation gives on the shipped corpus (no hand
    edits), and every corpus point is within its bound (issue 14; here, not in tests/test_numerics_bounds.py, to read
    the 420 MB corpus once per run: issue 35)."""
    from parity.calibration import bounds as B
    from parity.numerics.tolerances import calibrated_sections

    corpus = stored[0].points
    shipped = calibrated_sections()[B.SECTION]
    safety = B.safety_from_growth(B.tail_growth(corpus))
    assert safety >= 2 * 4  # 2 for a third implementation × at least one doubling of the corpus at growth ≤ 4
    for b in B.derive_bounds(corpus, safety):
        for s in b.sites:
            mode = "free" if b.mode == "free" else "layer"
            assert shipped.value_for("bound_rms", s, mode, b.dtype, b.compute) == b.bound_rms, (b.cls, s, mode)
    ratios = B.check_points(corpus, shipped)
    assert len(ratios) > 100_000 and ratios[0][0] <= 2 / safety, ratios[0]  # nice_up rounds up by < 2×


@pytest.mark.slow
def test_shipped_files_are_what_the_stored_measurements_give(stored, stored_kernels):
    """Every generated file (the one calibration file, calibration.md, measurements.json) is exactly the pipeline's
    output on the stored measurements: nothing edited by hand, nothing stale."""
    meas, noise_meta, ex_meta = stored
    files, _ = P.derive(meas, noise_meta, ex_meta, "python tools/calibrate.py rules", kernels=stored_kernels,
                        grads=P.load_grads(ROOT / P.MEASURED), precision=P.load_precision(ROOT / P.MEASURED))
    assert sorted(map(str, files)) == sorted(map(str, [P.CALIBRATION, P.MEASURED / "calibration.md",
                                                       P.MEASURED / "measurements.json"]))
    stale = [str(rel) for rel, text in files.items() if (ROOT / rel).read_text(encoding="utf-8") != text]
    assert not stale, f"regenerate with `python tools/calibrate.py rules`: {stale}"
    assert not any("after_nonbenign_flip" in p for p in meas.points)  # derive leaves the measurements as stored


def test_run_plan_is_the_recorded_corpus(stored, stored_kernels):
    """noise_runs / exactness_runs of the recorded specs name exactly the corpus entries the stored measurements hold
    (so `corpus` with the recorded options walks the corpus the files were derived from)."""
    meas, noise_meta, ex_meta = stored
    plan = {r.corpus_id for r in K.noise_runs(P.noise_spec(noise_meta))}
    assert plan == {p["corpus"] for p in meas.points if p["mode"] in ("layer", "free", "isolated")}
    native = {r.corpus_id for r in K.noise_runs(P.noise_spec(noise_meta)) if r.native}
    assert native == {p["corpus"] for p in meas.points if p["mode"] == "twin_vs_native"}
    xspec = K.ExactnessSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in ex_meta["corpus"].items()})
    xplan = {f"{r.name}/s{r.seed}/T{r.prompt_len}" for r in K.exactness_runs(xspec)}
    assert xplan == {row["point"].split(":")[0] for row in meas.rows}
    kernels = stored_kernels
    if kernels is not None:  # the real-kernel corpus: its recorded KernelSpecs (its own and each merged walk's)
        kmeas, kmeta = kernels  # name exactly its stored runs
        kplan = [r for spec in K.kernel_specs(kmeta) for r in K.kernel_runs(spec)]
        assert {r.corpus_id for r in kplan} == {p["corpus"] for p in kmeas.points}
        assert {r.label for r in kplan} == {":".join(row["point"].split(":")[:2]) for row in kmeas.rows}


def test_walk_makes_each_checkpoint_once_and_pairs_fp32_with_bf16(monkeypatch, tmp_path):
    """The walk's order and pairing (the recorded noise walk): one checkpoint per folder/name/seed, runs in order,
    the fp32-vs-bf16 comparison right after the last dtype of a (checkpoint, prompt length); exactness runs (own
    folder, bf16 only) are never paired."""
    calls: list[tuple] = []
    import parity.torch_ref.ckpt as ckpt

    monkeypatch.setattr(ckpt, "make_checkpoint", lambda out, cfg, seed, force: calls.append(("ckpt", out.name,
                                                                                              out.parent.name)) or out)
    monkeypatch.setattr(K, "measure_run", lambda run, c, folder, out, log: calls.append(("run", run.corpus_id))
                        or folder / run.dump_name)
    monkeypatch.setattr(K, "measure_dump_pair", lambda a, b, kind, cid, out, grid=None:
                        calls.append(("pair", kind, a.name, b.name, cid, grid)))
    spec = K.CorpusSpec(presets=("tiny",), seeds=(1,), prompt_lens=(40, 160), native_seeds=())
    K.walk(K.noise_runs(spec) + K.exactness_runs(K.ExactnessSpec(seeds=(1,), prompt_lens=(24,))), tmp_path)
    pair = lambda T: ("pair", "twin_fp32_vs_bf16", f"tiny-s1-T{T}-fp32.h5", f"tiny-s1-T{T}-bf16.h5",  # noqa: E731
                      f"tiny/s1/T{T}", "bfloat16")
    assert calls == [("ckpt", "tiny-s1", tmp_path.name), ("run", "tiny/s1/T40/bf16"), ("run", "tiny/s1/T40/fp32"),
                     pair(40), ("run", "tiny/s1/T160/bf16"), ("run", "tiny/s1/T160/fp32"), pair(160),
                     ("ckpt", "tiny-s1", K.EXACTNESS_DIR), ("run", "tiny/s1/T24/bf16")]


def test_load_names_the_missing_key(tmp_path):
    (tmp_path / "measurements.json").write_text(json.dumps({"command": "c", "date": "d", "machine": "m"}))
    (tmp_path / "exactness_corpus.json").write_text("{}")
    with pytest.raises(P.CalibrationError, match=r"measurements.json: missing key 'corpus'"):
        P.load(tmp_path)
    with pytest.raises(P.CalibrationError, match=r"nowhere.*measurements.json: cannot read"):
        P.load(tmp_path / "nowhere")


def test_rules_check_names_a_stale_file(monkeypatch, tmp_path, capsys):
    """`rules --check` writes nothing and exits 1 naming the file that differs from the derivation."""
    cal = _tool("calibrate")
    rel = Path("parity/numerics/x.toml")
    monkeypatch.setattr(cal.P, "load", lambda folder: (K.Measurement(), {}, {}))
    monkeypatch.setattr(cal.P, "derive", lambda *a, **k: ({rel: "derived\n"}, []))
    for corpus in ("load_kernels", "load_grads", "load_precision"):  # what derive (stubbed) would read
        monkeypatch.setattr(cal.P, corpus, lambda folder: None)
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_text("derived\n")
    assert cal.main(["rules", "--check", "--out", str(tmp_path)]) == 0
    (tmp_path / rel).write_text("edited by hand\n")
    assert cal.main(["rules", "--check", "--out", str(tmp_path)]) == 1
    assert f"{rel}: differs" in capsys.readouterr().out
    assert (tmp_path / rel).read_text() == "edited by hand\n"


@pytest.mark.parametrize("tool, argv, forwarded", [
    ("safety_bounds", ["--write"], ["rules"]),
    ("safety_bounds", [], ["rules", "--check"]),
    ("safety_bounds", ["--points", "d/points.json.gz", "--safety", "12", "--write"],
     ["rules", "--from", "d", "--bounds-safety", "12"]),
    ("exactness", ["--from-corpus", "d/exactness_rows.json.gz"], ["rules", "--from", "d"]),
    ("exactness", ["--seeds", "1,2", "--prompt-lens", "24", "--decode-steps", "2", "--workdir", "w"],
     ["corpus", "--only", "exactness", "--exactness-seeds", "1,2", "--exactness-prompt-lens", "24",
      "--exactness-decode-steps", "2", "--workdir", "w"]),
    ("resolution", ["--dump", "a.h5", "--modes", "layer"], ["resolution", "--dump", "a.h5", "--modes", "layer"]),
])
def test_old_tools_say_where_they_moved_and_forward(monkeypatch, capsys, tool, argv, forwarded):
    mod = _tool(tool)
    got = []
    monkeypatch.setattr(mod.calibrate, "main", lambda a: got.append(a) or 0)
    assert mod.main(argv) == 0
    assert got == [forwarded]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tools/{tool}.py moved: running `python tools/calibrate.py")


def test_calibrate_without_subcommand_forwards_the_recorded_commands():
    cal = _tool("calibrate")
    assert cal.legacy(["--seeds", "1,2", "--workdir", "w", "--write-defaults"]) == \
        ["corpus", "--seeds", "1,2", "--workdir", "w"]
    assert cal.legacy(["--from-points", "d", "--write-defaults"]) == ["rules", "--from", "d"]
    assert cal.legacy(["--from-points", "d", "--remeasure", "isolated", "--workdir", "w"]) == \
        ["corpus", "--remeasure", "isolated", "--workdir", "w"]


def test_kernel_sections_hold_only_what_the_real_kernels_widen():
    """The conditional sections of real-kernel bf16 dumps list exactly the per-site rules and bounds that pooling the
    real-kernel corpus changes, and apply only to a dump recording kda_chunk_precision = bfloat16."""
    from parity.calibration import bounds as B
    from parity.calibration import rules as R
    from parity.numerics.tolerances import flatten, parse_calibration
    from tests.test_calibrate import _pt

    def pt(site, need, corpus):
        return dict(_pt(site=site, need_p999=need, corpus=corpus), grid="bfloat16")

    base = [pt("attention.core", 3, "tiny/s1/T40/bf16"), pt("mlp.down_proj", 3, "tiny/s2/T40/bf16")]
    kern = K.Measurement(points=[pt("attention.core", 40, "fla:tiny/s1/T160/bf16"),
                                 pt("mlp.down_proj", 2, "fla:tiny/s1/T160/bf16"),
                                 pt("mlp.down_proj", 900, "fla:tiny/s1/T160/fp32")])  # not a bf16 run: left out
    rules, _ = R.propose_rules(base)
    bounds = B.derive_bounds(base, 8)
    kmeta = {"corpus": {"presets": ["tiny"], "seeds": [1], "prompt_lens": [160]}}
    secs, log = P.derive_kernel_sections(base, rules, bounds, 8, [], kern, kmeta, R.SAFETY)
    assert [name for name, _, _ in secs] == ["kda_chunk_bf16_tolerances", "kda_chunk_bf16_safety_bounds",
                                             "kda_chunk_bf16_exactness_rates"]
    for _, _, entries in secs[:2]:
        assert 'site = "attention.core"' in entries and "mlp.down_proj" not in entries and 'site = "*"' not in entries
    text = P.calibration_toml("# test", secs + [(R.SECTION, "", R.rules_entries(rules, R.SECTION)),
                                                (B.SECTION, "", B.bounds_entries(bounds, B.SECTION))],
                              {name: P.KERNEL_WHEN for name, _, _ in secs})
    table = flatten(parse_calibration(text, "test"))
    kernel, other = table.for_semantics(P.KERNEL_WHEN), table.for_semantics({"kda_chunk_precision": "float32"})
    key = ("layer", "bfloat16", "bfloat16")
    assert kernel.rule_for("attention.core", *key).floor_ulps > other.rule_for("attention.core", *key).floor_ulps
    assert kernel.rule_for("attention.core", *key).bound_rms > other.rule_for("attention.core", *key).bound_rms
    assert other.rule_for("attention.core", *key) == table.rule_for("attention.core", *key)  # base = no dump
    assert kernel.rule_for("mlp.down_proj", *key) == other.rule_for("mlp.down_proj", *key)
    assert any("kda_chunk_bf16 rule attn_core" in line for line in log)


@pytest.mark.parametrize("matches", [True, False])
def test_replay_session_resolves_conditional_rules_for_its_dump(matches):
    """A replay session judges its dump by the conditional entries whose forks the dump records (the calibration of
    real-kernel bf16 dumps), and by the base entries otherwise."""
    from parity.dumpfile import DumpReader
    from parity.numerics.tolerances import flatten, parse_calibration
    from parity.replay import Session

    dump = ROOT / "dumps" / "tiny-bf16.h5"
    with DumpReader(dump) as r:
        recorded = r.semantics["kda_chunk_precision"]
    value = recorded if matches else "no-such-precision"
    text = ('schema = "ling3-parity-calibration"\nversion = 1\nsections = ["k", "base"]\n'
            f'[when.k]\nkda_chunk_precision = "{value}"\n[[k]]\nsite = "attention.state"\nmax_ulps = 64\n'
            '[[base]]\nfloor_ulps = 1\nmax_ulps = 2\nallowed_fraction = 0.001\nhard_ulps = "off"\n')
    with Session.open(dump, ROOT / "dumps" / "ckpt" / "tiny", rules=flatten(parse_calibration(text, "t"))) as s:
        assert s.rules.rule_for("attention.state", "layer", "float32").max_ulps == (64 if matches else 2)
