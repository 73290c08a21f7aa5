"""The official KDA's in-kernel points recovered without the stand-ins' observer (issue 24 item 3).

Under fla's real kernels nothing reports `attention.gate/.beta/.core/.state`; the `official` map then derives them
(`parity.torch_ref.capture._OFFICIAL_KDA_DERIVED`: o_norm's input, b_proj through sigmoid in fp32, f_proj through the
in-kernel lower-bound gate; the state from the cache). Checked here on CPU against the stand-ins' observer, which
reports the tensors the kernel itself computed: same points, bit for bit, and nothing more unavailable. The real
kernels' side (same derivation under TRITON_INTERPRET=1) is exercised by `.ci/run`'s triton step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from parity.dumpfile import DumpReader
from parity.torch_ref import capture, official
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.prompts import builtin_ids

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL_OK, OFFICIAL_WHY = official.available()
KDA_SITES = ("attention.gate", "attention.beta", "attention.core", "attention.state")


@pytest.fixture(scope="module")
def official_ckpt(tmp_path_factory):
    if not OFFICIAL_OK:
        pytest.skip(OFFICIAL_WHY)
    ck = tmp_path_factory.mktemp("kda_derived") / "tiny-flash-official"
    shutil.copytree(ROOT / "dumps" / "ckpt" / "tiny-flash", ck)
    official.install(ck)
    return ck


def _dump(ck: Path, out: Path, T: int, dtype: str) -> DumpReader:
    opts = DumpOptions(dtype=dtype, decode_steps=2, progress=False, trust_remote_code=True, cpu_kernels=True,
                       causality_check=False)
    dump_checkpoint(ck, out, builtin_ids(512, T, seed=1), opts)
    return DumpReader(out)


@pytest.mark.parametrize("T,dtype", [(100, "bfloat16"), (40, "float32")], ids=["chunk-bf16", "recurrent-fp32"])
def test_derived_kda_points_equal_the_observed_ones(official_ckpt, tmp_path, monkeypatch, T, dtype):
    observed = _dump(official_ckpt, tmp_path / "observed.h5", T, dtype)
    monkeypatch.setattr(capture, "_observer_available", lambda: False)  # as under the real kernels
    derived = _dump(official_ckpt, tmp_path / "derived.h5", T, dtype)

    assert set(derived.points()) == set(observed.points())
    assert derived.unavailable() == observed.unavailable()  # the MLA head gate only
    cfg = observed.config
    kda = [p for p in observed.points() if p.site in KDA_SITES and cfg.layer_kind(p.layer) == "kda"]
    kda_layers = {p.layer for p in kda}
    assert kda_layers and len(kda) == len(KDA_SITES) * 3 * len(kda_layers), "every KDA layer, prefill + 2 decode steps"
    for p in kda:
        a, b = observed.read(p), derived.read(p)
        assert a.dtype == b.dtype and a.shape == b.shape, p.key()
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{p.key()}: derived != observed"
    p = next(p for p in kda if p.site == "attention.gate")
    assert derived.attrs(p)["module"].endswith("attention.f_proj -> kda_gate_in_kernel")  # the transform is named
