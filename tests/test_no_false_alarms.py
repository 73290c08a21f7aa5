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

Backward points (issue 26): `--grads` dumps of fresh checkpoints (seeds 11-20, disjoint from the gradient corpus'
seeds, tools/calibrate.py corpus --only grads), fp32 and bf16, both presets, 40-token (recurrent KDA) and 160-token
(chunked KDA) prompts, replayed in layer mode (the teacher-forced backward): 0 failing backward points. Default run:
2 of the 20 cases (tiny fp32 40 tokens, tiny-flash bf16 160 tokens); `LING3_FULL_SWEEP=1` all 20.
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


GRAD_CASES = [(s, d) for s in range(11, 21) for d in ("float32", "bfloat16")] if FULL else \
    [(11, "float32"), (14, "bfloat16")]


def _grads_prompt_len(seed: int) -> int:
    """40 tokens (recurrent KDA backward) or 160 (chunked), alternating in pairs of seeds so both presets get both."""
    return 40 if (seed - 11) // 2 % 2 == 0 else 160


def _backward_alarms(report: dict, n: int = 8) -> tuple[int, list[str]]:
    """(backward points that passed, the failing or missing backward points)."""
    bw = [p for p in report["points"] if p["phase"] == "backward"]
    bad = [f"L{p.get('layer')}/{p['site']}: {p['status']} max_ulp={p.get('max_ulp')} rel_l2={p.get('rel_l2')}"
           for p in bw if p["status"] in ("fail", "missing")]
    return sum(p["status"] == "pass" for p in bw), bad[:n] + ([f"... {len(bad) - n} more"] if len(bad) > n else [])


@pytest.mark.parametrize("seed,dtype", GRAD_CASES)
def test_correct_target_passes_backward_points(seed, dtype, tmp_path):
    """A --grads dump of a fresh checkpoint replayed in layer mode: every backward point passes the calibrated
    gradient rules (and the forward points theirs)."""
    from parity.model.config import Ling3Config
    from parity.replay import run_replay
    from parity.torch_ref.ckpt import make_checkpoint
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    preset, T = ("tiny" if seed % 2 else "tiny-flash"), _grads_prompt_len(seed)
    ckpt = make_checkpoint(tmp_path / "ckpt", preset, seed=seed, dtype="bfloat16")
    cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
    dump = tmp_path / "d.h5"
    dump_checkpoint(ckpt, dump, builtin_ids(cfg.vocab_size, T, seed),
                    DumpOptions(dtype=dtype, decode_steps=0, progress=False, seed=seed, grads=True))
    report = run_replay(dump, ckpt, mode="layer")
    passed, alarms = _backward_alarms(report)
    assert passed > 500, report["counts"]  # the replay really compared the backward phase
    assert not alarms, f"seed {seed} ({preset}, T={T}, {dtype}): backward false alarm — " + "; ".join(alarms)
    assert report["passed"], f"seed {seed} ({preset}, T={T}, {dtype}): forward false alarm — {_failures(report)}"


def test_backward_sweep_detects_a_broken_subject():
    """The backward sweep's assertion can fail: a backward-only bug (the shared expert's gradient scaled twice,
    forward bit-identical) on a bundled --grads dump gives backward alarms."""
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay
    from parity.replay.coverage import has_backward
    from parity.targets.mutants import MutantTarget

    def grads_dump(path: str) -> bool:
        with DumpReader(path) as r:
            return has_backward(r)

    dump = next((d for d in BUNDLED if grads_dump(d)), None) or pytest.skip("no bundled --grads dump")
    with DumpReader(dump) as r:
        moe = next(i for i in range(r.config.num_hidden_layers) if r.config.is_moe(i))
    report = run_replay(dump, target=MutantTarget("bw_shared_expert_grad_twice"), layers=[moe], mode="layer")
    _, alarms = _backward_alarms(report)
    assert any("mlp.shared_experts" in a for a in alarms), alarms


def test_sweep_detects_a_broken_subject(tmp_path):
    """The sweep's assertion can fail: the same replay with a bug injected does not pass (perturbation check)."""
    from parity.replay import run_replay
    from parity.targets.mutants import MutantTarget

    dump = BUNDLED[0] if BUNDLED else pytest.skip("no bundled dump")
    report = run_replay(dump, target=MutantTarget("kda_conv_without_silu"), layers=[0])
    assert not report["passed"]
