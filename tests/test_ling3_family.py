"""Ling3's description (`parity.model.ling3_family`, issue 34 §1): its names in one place. A site added there — its
graph entry and the module of the twin that computes it, nothing else — is captured and dumped by `tools/dump_hf.py`,
listed in execution order by the site graph (`parity.model.points`), and listed by the replay, which skips it saying
the target does not produce it (to be judged, a target computes it: the JAX reference taps its points by these
names, as any target does). The families registry (`parity.model.families`) tells a dump's and a checkpoint's
family; Kimi Linear's own test of the same is tests/test_kimi_check.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parity.errors import ParityError
from parity.model import families, ling3_family, points

NEW = "attention.o_norm:in"  # the KDA gated norm's input (the core before o_norm): not a site of the description


@pytest.fixture()
def described(monkeypatch):
    """The description with one site more: its graph entry, after `attention.core`, and the twin's module for it."""
    graph = list(ling3_family.SITE_GRAPH)
    at = next(n for n, s in enumerate(graph) if s.name == "attention.o_norm" and s.kind == "kda")
    site = ling3_family.Site(NEW, "kda", ("attention.core", "attention.g_proj"), "attn_core")
    monkeypatch.setattr(ling3_family, "SITE_GRAPH", tuple(graph[:at] + [site] + graph[at:]))
    tap = ling3_family.TapSpec("model.layers.{i}.attention.o_norm", NEW, io="input", index=0, kind="kda")
    monkeypatch.setitem(ling3_family.RUNTIME_MAPS, "twin", [*ling3_family.RUNTIME_MAPS["twin"], tap])
    points.layer_graph.cache_clear()  # a cache per layer kind
    yield
    points.layer_graph.cache_clear()


def test_a_site_added_to_the_description_is_dumped_ordered_and_listed(described, tmp_path, monkeypatch):
    from parity.cli.dump_hf import main as dump_main
    from parity.dumpfile import DumpReader
    from parity.golden import GOLDEN, ROOT
    from parity.replay import run_replay

    golden = next(g for g in GOLDEN if g.file == "tiny-bf16.h5")  # the twin on dumps/ckpt/tiny, 40 tokens
    out = tmp_path / golden.file
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert dump_main(golden.args(out, None)) == 0
    with DumpReader(out) as d:
        cfg = d.config
        kda = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"]
        held = {p.layer for p in d.points() if p.site == NEW and p.phase == "prefill"}
    assert kda and held == set(kda), (held, kda)
    order = points.sites_for_config(cfg, kda[0], recorded_inputs=True)
    assert order.index("attention.core") < order.index(NEW) < order.index("attention.o_norm")
    rep = run_replay(Path(out), mode="layer", layers=[kda[0]], backward=False)
    layer = [r for r in rep["points"] if r["layer"] == kda[0] and r["phase"] == "prefill"]
    names = [r["site"] for r in layer]
    assert names.index("attention.core") < names.index(NEW) < names.index("attention.o_norm")
    rec = next(r for r in layer if r["site"] == NEW)
    assert rec["status"] == "skipped" and "target" in str(rec.get("reason", "")), rec
    assert all(r["status"] in ("pass", "skipped") for r in layer)


def test_without_the_module_map_entry_the_site_is_not_dumped(monkeypatch, tmp_path):
    """The graph entry alone does not capture the site: the twin's module map names where it is read."""
    from parity.cli.dump_hf import main as dump_main
    from parity.dumpfile import DumpReader
    from parity.golden import GOLDEN, ROOT

    graph = list(ling3_family.SITE_GRAPH)
    at = next(n for n, s in enumerate(graph) if s.name == "attention.o_norm" and s.kind == "kda")
    monkeypatch.setattr(ling3_family, "SITE_GRAPH", tuple(graph[:at] + [ling3_family.Site(
        NEW, "kda", ("attention.core",), "attn_core")] + graph[at:]))
    points.layer_graph.cache_clear()
    try:
        golden = next(g for g in GOLDEN if g.file == "tiny-bf16.h5")
        out = tmp_path / golden.file
        monkeypatch.chdir(ROOT)
        assert dump_main(golden.args(out, None)) == 0
        with DumpReader(out) as d:
            assert not [p for p in d.points() if p.site == NEW]
    finally:
        points.layer_graph.cache_clear()


def test_families_tell_dumps_and_checkpoints_apart():
    from parity.golden import DUMPS, KIMI_DUMPS, KIMI_GOLDEN

    root = Path(__file__).resolve().parents[1]
    assert families.of_dump(DUMPS / "tiny-bf16.h5") == families.LING3  # Ling3 dumps record no family
    assert families.of_dump(KIMI_DUMPS / KIMI_GOLDEN[0].file) == families.KIMI_LINEAR
    assert families.of_checkpoint(root / "dumps" / "ckpt" / "tiny") == families.LING3
    assert families.of_checkpoint(root / "dumps" / "ckpt" / "kimi-tiny") == families.KIMI_LINEAR
    with pytest.raises(ParityError, match="family 'gla': expected one of ling3, kimi_linear"):
        families.by_name("gla")
    for f in families.FAMILIES:  # each family's description module holds its names
        mod = __import__(f.description, fromlist=["FAMILY"])
        assert mod.FAMILY == f.name
    assert os.path.isfile(root / families.KIMI_LINEAR.doc)


def test_every_family_entry_resolves():
    """Each registry entry names an importable object (a typo would surface only when that family is used)."""
    for f in families.FAMILIES:
        for what in families.ENTRIES:
            obj = f.entry(what)
            assert callable(obj) or what == "replay", (f.name, what, obj)
    with pytest.raises(ParityError, match="entry rules = 'parity.nowhere:rules' does not resolve"):
        families.Family(**{**families.LING3.__dict__, "rules": "parity.nowhere:rules"}).entry("rules")


# A third family, registered as data: the dumper reaches it by its checkpoint's model_type alone.
TOY_CALLS: list = []


def toy_config(ckpt):
    TOY_CALLS.append(("config", Path(ckpt).name))
    return {"layers": 1}


def toy_dump(parser, args, ckpt, outs, cfg, argv):
    TOY_CALLS.append(("dump", cfg, [Path(o).name for o in outs]))
    return 0


def test_a_registered_family_is_dumped_by_its_own_entries(monkeypatch, tmp_path):
    from parity.cli.dump_hf import main as dump_main

    toy = families.Family("toy", ("toy_hybrid",), __name__, "toy", "README.md", goldens="toy",
                          config=f"{__name__}:toy_config", dump=f"{__name__}:toy_dump",
                          rules=families.LING3.rules, replay=families.LING3.replay)
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (toy,))
    ckpt = tmp_path / "toy-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "toy_hybrid"}')
    TOY_CALLS.clear()
    assert dump_main([str(ckpt), "--out", str(tmp_path / "d.h5")]) == 0
    assert TOY_CALLS == [("config", "toy-ckpt"), ("dump", {"layers": 1}, ["d.h5"])]
    (ckpt / "config.json").write_text('{"model_type": "bailing_hybrid"}')  # Ling3's config check: one line, status 2
    TOY_CALLS.clear()
    assert dump_main([str(ckpt), "--out", str(tmp_path / "d.h5")]) == 2 and not TOY_CALLS


def test_a_bad_kimi_config_is_refused_before_the_model_loads(tmp_path, capsys):
    """Kimi Linear's config check (`parity.jax_kimi.spec.checkpoint_config`, the family's `config` entry) names the
    field, before any weight is read (the directory holds no weights at all)."""
    import json

    from parity.cli.dump_hf import main as dump_main
    from parity.golden import ROOT

    cfg = json.loads((ROOT / "dumps" / "ckpt" / "kimi-tiny" / "config.json").read_text())
    cfg["topk_group"] = cfg["num_expert_group"] + 1  # the file's name for n_group (the published config's)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert dump_main([str(tmp_path), "--out", str(tmp_path / "d.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KimiLinearConfig.topk_group" in err[0] and "expected an int in [1, n_group" in err[0], err
