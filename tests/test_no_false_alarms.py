"""No false alarms: the *correct* reference target must pass the replay with the default tolerance table on every
bundled dump and on dumps of checkpoints made with other random seeds (issue "Replay and report").

Sweep: seeds 1..10, presets alternating tiny (q-LoRA, KKKMKKKM) / tiny-flash (no q-LoRA, clamp, KKKKKMMM), each a
fresh `make_checkpoint`, a twin dump (24-token prompt — recurrent KDA path — and 2 decode steps) and a layer-mode
replay. One seed costs ~30-40 s on this machine (dump ~15 s + replay ~15 s), so the default run takes seeds 1-3;
`LING3_FULL_SWEEP=1` runs all 10. `LING3_SWEEP_DTYPE=bf16` sweeps bf16 dumps (default fp32: the fp32 tier).

Measured with the table calibrated by `tools/calibrate.py --seeds 1,2,3,4 --prompt-lens 40,100,160 --decode-steps 4`
(`LING3_FULL_SWEEP=1 python -m pytest tests/test_no_false_alarms.py -q -n 2`, 99 s, 2 cores): seeds 11-20 all pass
(fp32 tier). The earlier 2-seed table raised a false alarm on seed 5 (fp32 KDA core, one near-zero element) and on the
bundled tiny-flash bf16 dump (one ill-conditioned o_norm row); the larger corpus and dropping per-element hard limits
in the propagating modes (parity/calibration/rules.py `propose_rule`) removed both.
"""

from __future__ import annotations

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = os.environ.get("LING3_FULL_SWEEP") == "1"
# Out of sample: not the bundled checkpoints' seed (0) nor the calibration corpus' seeds (1, 2, tools/calibrate.py).
SEEDS = list(range(11, 21)) if FULL else [11, 12, 13]
DTYPE = "bfloat16" if os.environ.get("LING3_SWEEP_DTYPE", "fp32") in ("bf16", "bfloat16") else "float32"
PROMPT_LEN, DECODE_STEPS = 24, 2
# Modes replayed on every dump: the ones `pytest parity` runs by default (CI); LING3_SWEEP_MODES=layer,isolated,free
# adds free mode (its false-alarm rate, issue 15).
MODES = os.environ.get("LING3_SWEEP_MODES", "layer,isolated").split(",")


def _failures(report: dict, n: int = 5) -> str:
    bad = [p for p in report["points"] if p["status"] in ("fail", "missing")]
    lines = [f"{p['phase']}/S{p.get('step', 0)}/L{p.get('layer')}/{p['site']}: {p['status']} "
             f"max_ulp={p.get('max_ulp')} rel_l2={p.get('rel_l2')}" for p in bad[:n]]
    return f"{len(bad)} failing point(s), counts {report['counts']}; first: " + "; ".join(lines)


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_target_passes_random_seed(seed, tmp_path):
    from parity.model.config import Ling3Config
    from parity.replay import run_replay
    from parity.torch_ref.ckpt import make_checkpoint
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    preset = "tiny" if seed % 2 else "tiny-flash"
    ckpt = make_checkpoint(tmp_path / "ckpt", preset, seed=seed, dtype="bfloat16")
    cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
    dump = tmp_path / "d.h5"
    dump_checkpoint(ckpt, dump, builtin_ids(cfg.vocab_size, PROMPT_LEN, seed),
                    DumpOptions(dtype=DTYPE, decode_steps=DECODE_STEPS, progress=False, seed=seed))
    alarms = []
    for mode in MODES:
        report = run_replay(dump, ckpt, mode=mode)
        assert report["counts"].get("pass", 0) > 100, report["counts"]  # the replay really compared something
        if not report["passed"]:
            alarms.append(f"{mode}: {_failures(report)}")
    assert not alarms, f"seed {seed} ({preset}, {DTYPE}): false alarm — " + " | ".join(alarms)


BUNDLED = sorted(glob.glob(os.path.join(ROOT, "dumps", "*.h5")))


@pytest.mark.skipif(not BUNDLED, reason="no bundled dumps in dumps/*.h5")
@pytest.mark.parametrize("dump", BUNDLED, ids=os.path.basename)
def test_correct_target_passes_bundled_dump(dump):
    from parity.replay import run_replay

    alarms = []
    for mode in MODES:
        report = run_replay(dump, mode=mode)  # checkpoint found by the dump's fingerprint
        assert report["counts"].get("pass", 0) > 100, report["counts"]
        if not report["passed"]:
            alarms.append(f"{mode}: {_failures(report)}")
    assert not alarms, f"{os.path.basename(dump)}: false alarm — " + " | ".join(alarms)


def test_sweep_detects_a_broken_subject(tmp_path):
    """The sweep's assertion can fail: the same replay with a bug injected does not pass (perturbation check)."""
    from parity.replay import run_replay
    from parity.targets.mutants import MutantTarget

    dump = BUNDLED[0] if BUNDLED else pytest.skip("no bundled dump")
    report = run_replay(dump, target=MutantTarget("kda_conv_without_silu"), layers=[0])
    assert not report["passed"]
