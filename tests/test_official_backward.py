"""Issue 26 acceptance, the official file: a --grads dump of `make_ckpt --modeling official` tiny and tiny-flash
checkpoints replays clean (forward and backward) against the JAX reference.

- tiny: 100-token prompt (> 64: the official file takes its chunked KDA path, so the chunk backward of its stand-ins
  runs), fp32; tiny-flash: 40 tokens (its recurrent KDA path), bf16. The bundled golden
  dumps/tiny-flash-official-bf16.h5 (tiny-flash, 100 tokens, bf16) is replayed by `pytest parity` by default.
- The checkpoints are written by the CLI entry point `tools/make_ckpt.py` calls (`parity.torch_ref.ckpt.main`) with
  `--modeling official`, seed 0, the goldens' shard size; the dump runs the official remote code on CPU.
- Clean: 0 failed and 0 missing points; the backward phase compared (dL/d input of every layer, every weight gradient
  of every layer and of the embedding / final norm / LM head) and passing; skipped points only where the dump
  declares them unavailable (the official MLA's inline head gate) — never for lack of a target capability.

Gated like tests/test_official.py: skips with one line saying how to provide the file when it is absent.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from parity.torch_ref import official

OFFICIAL_OK, OFFICIAL_WHY = official.available()
CASES = [("tiny", 100, "float32"), ("tiny-flash", 40, "bfloat16")]


@pytest.mark.skipif(not OFFICIAL_OK, reason=OFFICIAL_WHY)
@pytest.mark.parametrize("preset,T,dtype", CASES, ids=[f"{p}-{t}-{d}" for p, t, d in CASES])
def test_official_grads_dump_replays_clean(tmp_path: Path, preset, T, dtype):
    from parity.dumpfile import DumpReader
    from parity.model.points import backward_param_sites
    from parity.model.semantics import reference_options
    from parity.replay import run_replay
    from parity.targets.reference import ReferenceTarget
    from parity.torch_ref.ckpt import main as make_ckpt
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    ck = tmp_path / preset
    assert make_ckpt(["--preset", preset, "--seed", "0", "--out", str(ck), "--max-shard-mb", "1",
                      "--modeling", "official"]) == 0
    dump = tmp_path / f"{preset}-official-grads.h5"
    dump_checkpoint(ck, dump, builtin_ids(512, T, seed=0),
                    DumpOptions(dtype=dtype, decode_steps=1, trust_remote_code=True, progress=False, grads=True))
    with DumpReader(dump) as d:
        assert d.meta["capture_map"] == "official" and d.meta["backward"]["loss"] == "next_token_ce_mean_fp32"
        cfg, opts = d.config, reference_options(d.semantics)
    rep = run_replay(dump, ck, target=ReferenceTarget(clamp=opts["clamp"]))
    pts = rep["points"]
    status = Counter((p["phase"], p["status"]) for p in pts)
    bad = [f"{p['phase']}/L{p['layer']}/{p['site']}: {p['status']} {(p.get('message') or p.get('reason') or '')[:200]}"
           for p in pts if p["status"] in ("fail", "missing")]
    assert not bad, f"{len(bad)} point(s):\n" + "\n".join(bad[:20])
    bw = {(p["layer"], p["site"]): p["status"] for p in pts if p["phase"] == "backward"}
    for i in range(cfg.num_hidden_layers):
        assert bw.get((i, "input")) == "pass", (i, bw.get((i, "input")))
        for s in backward_param_sites(cfg, i):
            assert bw.get((i, s)) == "pass", (i, s, bw.get((i, s)))
    for s in ("grad.model.word_embeddings.weight", "grad.model.norm.weight", "grad.lm_head.weight", "logits"):
        assert bw.get((None, s)) == "pass", (s, bw.get((None, s)))
    skipped = [p for p in pts if p["status"] == "skipped"]
    assert all("lacks capability" not in p["reason"] for p in skipped), skipped[:3]
    print(preset, T, dtype, dict(status))
