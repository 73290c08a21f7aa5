"""Schema additions of issue 13 (DESIGN §4): MTP layers' points in their own groups (`/prefill/MTP0/<site>`), kept
apart from the main stack's; the `semantics` root attr; `DumpWriter.set_meta` for facts known after the forward."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from parity.dumpfile import DumpReader, DumpWriter, seal_dump, validate_dump
from parity.errors import DumpError
from parity.model.mtp_points import MtpPoint, mtp_sites
from parity.model.points import Point
from tests.test_dumpfile import make_meta

MAIN = Point("prefill", 0, 3, "attention.core")
MTP = MtpPoint("prefill", 0, 0, "eh_proj")
MTP_DEC = MtpPoint("decode", 1, 0, "mlp.gate.topk_idx")


def _write(path: Path, **meta) -> Path:
    with DumpWriter(path, make_meta(**meta)) as w:
        w.write(MAIN, np.ones((1, 4, 8), np.float32))
        w.write(MTP, np.full((1, 4, 8), 2.0, np.float32))
        w.write(MTP_DEC, np.array([[[0, 3]]], np.int32))
        w.write_stats(MtpPoint("decode", 1, 0, "logits"), {"rms": 1.5})
        w.mark_unavailable("MTP0/attention.gate", "inline sigmoid")
        w.write_tokens(np.array([[5, 6, 7, 8, 9]]), 4)
    return path


def test_mtp_points_live_in_their_own_groups(tmp_path):
    p = _write(tmp_path / "d.h5", semantics={"swiglu_clamp": "ignored"})
    with h5py.File(p, "r") as f:  # the layout of DESIGN §4, read with plain h5py
        assert "prefill/MTP0/eh_proj" in f and "decode/S001/MTP0/mlp.gate.topk_idx" in f
        assert "prefill/L03/attention.core" in f
    with DumpReader(p) as d:
        assert d.points() == [MAIN]  # the main stack is undisturbed
        assert d.mtp_points() == [MTP, MTP_DEC]
        assert d.has(MTP) and d.read(MTP)[0, 0, 0] == 2.0 and d.dtype(MTP_DEC) == "int32"
        assert d.layers("prefill", 0) == [3]
        assert MtpPoint("decode", 1, 0, "logits") in d.stats_points()
        assert d.semantics == {"swiglu_clamp": "ignored"}
        with pytest.raises(DumpError, match=r"prefill/MTP0/attention.gate not in dump .*marked unavailable: "
                                            r"inline sigmoid; the dump has sites eh_proj at prefill/MTP0"):
            d.read(MtpPoint("prefill", 0, 0, "attention.gate"))
        with pytest.raises(DumpError, match="no MTP1 points"):
            d.read(MtpPoint("prefill", 0, 1, "eh_proj"))


def test_old_dumps_have_no_semantics_and_bad_groups_are_refused(tmp_path):
    p = _write(tmp_path / "d.h5")
    with DumpReader(p) as d:
        assert d.semantics is None
    with h5py.File(p, "r+") as f:
        f.create_group("prefill/MTPx").create_dataset("eh_proj", data=np.zeros(2, np.float32)).attrs["dtype"] = \
            "float32"
    seal_dump(p)
    with pytest.raises(DumpError, match=r"MTPx: expected 'model' or a layer group .*or an MTP group MTP0"):
        validate_dump(p)


def test_writer_checks_mtp_points_and_set_meta(tmp_path):
    with pytest.raises(DumpError, match="malformed point"):
        with DumpWriter(tmp_path / "x.h5", make_meta()) as w:
            w.write(MtpPoint("prefill", 0, -1, "eh_proj"), np.zeros(2, np.float32))
    assert not (tmp_path / "x.h5").exists()
    with DumpWriter(tmp_path / "y.h5", make_meta()) as w:
        w.set_meta("guards", {"causality": {"checked": True}})
        w.set_meta("seed", 7)
        with pytest.raises(DumpError, match="set by the writer"):
            w.set_meta("complete", True)
        w.write_tokens(np.array([[1, 2]]), 1)
    with DumpReader(tmp_path / "y.h5") as d:
        assert d.meta["guards"] == {"causality": {"checked": True}} and d.meta["seed"] == 7


def test_mtp_site_list():
    from parity.model.config import Ling3Config, PRESETS

    flash = Ling3Config.from_dict(dict(PRESETS["tiny-flash"]))
    tiny = Ling3Config.from_dict(dict(PRESETS["tiny"]))
    s = mtp_sites(flash)
    assert s[:4] == ("embed", "enorm", "hnorm", "eh_proj") and s[-3:] == ("final_layernorm:in", "final_layernorm",
                                                                         "logits")
    assert "attention.q_proj" in s and "attention.q_a_proj" not in s and "mlp.gate.topk_idx" in s
    assert "attention.q_a_proj" in mtp_sites(tiny) and "input" not in s and "output" not in s
    assert MtpPoint("decode", 2, 0, "mlp").key() == "decode/S002/MTP0/mlp"
