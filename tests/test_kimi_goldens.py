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


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "parity", "-p", "no:cacheprovider", "-n", "0", "-q",
                           "-k", "kimi", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_goldens_replay_clean_in_every_mode():
    r = _pytest("--parity-mode", "layer,isolated,free")
    n = 2 * 3 * 4  # two goldens, three modes, four layers
    assert r.returncode == 0 and f"{n} passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert "kimi-tiny-bf16/isolated/layer_3" in _pytest("--parity-mode", "layer,isolated,free", "--co").stdout


@pytest.mark.parametrize("golden", [g.file for g in KIMI_GOLDEN])
def test_a_planted_bug_fails_at_its_site(golden):
    """A SiLU between the low-rank gate projections (`parity.targets.kimi.KimiPlantedGateActivation`, a porting bug
    issue 34 names): layer 0 (KDA) fails at `attention.gate`; layer 1 (MLA, untouched) passes."""
    r = _pytest("--parity-dump", str(KIMI_DUMPS / golden), "--parity-target",
                "parity.targets.kimi:KimiPlantedGateActivation", "-k", "layer_0 or layer_1")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-3000:]
    assert f"{golden.removesuffix('.h5')} (layer mode) layer 0 attention.gate: Tensor-likes are not close!" in r.stdout, \
        r.stdout[-3000:]


def test_a_dump_without_its_checkpoint_is_one_line(tmp_path):
    r = _pytest("--parity-dump", str(KIMI_DUMPS / KIMI_GOLDEN[1].file), "--parity-ckpt", str(ROOT / "dumps" / "ckpt" /
                                                                                               "tiny"), "-k", "layer_0")
    assert r.returncode == 1
    assert "fingerprint" in r.stdout and "Traceback" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("golden", KIMI_GOLDEN, ids=[g.file for g in KIMI_GOLDEN])
def test_regeneration_gives_the_bundled_dump(golden, tmp_path, monkeypatch):
    import h5py

    from parity.cli.kimi_check import main

    out = tmp_path / golden.file
    monkeypatch.chdir(ROOT)  # the command's relative checkpoint path is recorded in the dump's config
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert main(golden.args(out)) == 0
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
