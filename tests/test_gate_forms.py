"""Issue 32 item 5: make_ckpt makes both KDA gate forms (facts §3.5: Ling3's lower-bound form and Kimi's softplus form,
`kda_lower_bound: null`), the dump's `semantics` says which, and the reference replays a softplus-gate dump clean in
bf16 and fp32 — while a reference told the wrong form fails it (the check can fail).

Cost: two 2-layer tiny checkpoints (KDA + MLA), one bf16+fp32 dump and one bf16 dump of 8 tokens + 1 decode step on CPU, three
replays of 2 layers (one of 1 layer): 187 s on the 2-core Xeon VM under a load of ~16 (2026-11-27).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from parity.dumpfile import DumpReader
from parity.model.semantics import summarize
from parity.replay import run_replay
from parity.targets.reference import ReferenceTarget
from parity.torch_ref.ckpt import directory_digest, main

REPO = Path(__file__).resolve().parents[1]


def _make(out: Path, *extra: str) -> Path:
    # 2 layers in groups of 2: layer 0 KDA (dense MLP), layer 1 MLA (MoE); tiny's group of 4 would make both MLA
    assert main(["--preset", "tiny", "--seed", "5", "--layers", "2", "--set", "layer_group_size=2", "--out", str(out),
                 *extra]) == 0
    return out


def _dump(ckpt: Path, out: Path, dtype: str) -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(ckpt), "--out", str(out),
                        "--dtype", dtype, "--prompt-len", "8", "--decode-steps", "1", "--no-progress"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate_forms")
    lb = _make(tmp / "lb", "--gate-form", "lower-bound")
    sp = _make(tmp / "sp", "--gate-form", "softplus")
    out_sp = _dump(sp, tmp / "sp.h5", "bf16,fp32")
    out_lb = _dump(lb, tmp / "lb-bf16.h5", "bf16")  # one dtype: the file is named as given
    return {"lb": lb, "sp": sp, "tmp": tmp, "out_sp": out_sp, "out_lb": out_lb}


def test_make_ckpt_writes_both_gate_forms_with_the_same_weights(forms):
    c_lb = json.loads((forms["lb"] / "config.json").read_text())
    c_sp = json.loads((forms["sp"] / "config.json").read_text())
    assert c_lb["kda_lower_bound"] == -5.0 and c_sp["kda_lower_bound"] is None
    d_lb, d_sp = directory_digest(forms["lb"]), directory_digest(forms["sp"])
    # a tensor depends only on (seed, name, shape): the two forms differ by config.json alone
    assert {f for f in d_lb if d_lb[f] != d_sp[f]} == {"config.json"}


def test_the_dumps_semantics_states_the_gate_form(forms):
    tmp = forms["tmp"]
    for name, form, lb in (("sp-bf16", "softplus", None), ("sp-fp32", "softplus", None),
                           ("lb-bf16", "lower-bound", -5.0)):
        with DumpReader(tmp / f"{name}.h5") as d:
            sem = d.semantics
        assert sem["kda_gate_form"] == form and sem["kda_lower_bound"] == lb, (name, sem)
        assert "fused_recurrent_kda" in sem["probes"]["kda_gate_form"]  # observed on the kernel call, not assumed
        assert f"kda_gate_form={form}" in summarize(sem)
    assert "kda_gate_form=softplus" in forms["out_sp"] and "kda_gate_form=lower-bound (lb -5)" in forms["out_lb"]


@pytest.mark.parametrize("tier", ["bf16", "fp32"])
def test_the_reference_replays_a_softplus_gate_dump_clean(forms, tier):
    rep = run_replay(forms["tmp"] / f"sp-{tier}.h5", forms["sp"])
    st = Counter(p["status"] for p in rep["points"])
    assert rep["passed"] and set(st) <= {"pass", "benign"} and st["pass"] > 0, st
    assert any(p["site"] == "attention.gate" and p["status"] == "pass" for p in rep["points"])


class _WrongGateForm(ReferenceTarget):
    """A reference told the other form: Ling3's lower bound on a softplus-gate checkpoint."""

    name = "wrong-gate-form"

    def build(self, config, dtype, mesh=None):
        super().build(dataclasses.replace(config, kda_lower_bound=-5.0), dtype, mesh)


def test_a_reference_told_the_wrong_gate_form_fails_at_the_gate(forms):
    rep = run_replay(forms["tmp"] / "sp-fp32.h5", forms["sp"], target=_WrongGateForm(), layers=[0])
    assert not rep["passed"]
    fd = rep["first_divergence"]
    assert fd["layer"] == 0 and fd["site"] == "attention.gate", fd


@pytest.mark.parametrize("args, expected", [
    (["--set", "kda_lowr_bound=null"], "make_ckpt: error: --set 'kda_lowr_bound' is not a Ling3 config field this "
                                       "suite models; expected one of "),
    (["--set", "kda_lower_bound=soft"], "make_ckpt: error: --set 'kda_lower_bound' = \"soft\", expected a number or "
                                        "null\n"),
    (["--set", "kda_lower_bound=-7"], "make_ckpt: error: checkpoint config: field 'kda_lower_bound' = -7, expected "
                                      "-5 <= lb < 0 or null (facts §3.5)\n"),
    (["--set", "q_lora_rank"], "make_ckpt: error: --set 'q_lora_rank': expected key=value"),
    (["--q-lora-rank", "big"], "make_ckpt: error: --q-lora-rank 'big': expected a positive integer or 'none'\n"),
])
def test_a_bad_fork_option_is_one_line_naming_the_key(tmp_path, capsys, args, expected):
    assert main(["--preset", "tiny", "--seed", "0", "--out", str(tmp_path / "ck"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not (tmp_path / "ck").exists()


def test_fork_options_set_the_config_fields(tmp_path):
    ck = _make(tmp_path / "ck", "--q-lora-rank", "none", "--swiglu-clamp", "2.5", "--set", "routed_scaling_factor=1.5")
    c = json.loads((ck / "config.json").read_text())
    assert c["q_lora_rank"] is None and c["routed_scaling_factor"] == 1.5
    assert c["expert_swiglu_limit_list"] == c["share_expert_swiglu_limit_list"] == [2.5, 2.5]  # cut to --layers 2
    idx = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    assert c["layer_group_size"] == 2 and "model.layers.0.attention.f_proj.weight" in idx  # layer 0 KDA
    for mla in (1, 2):  # layer 1 and the MTP layer 2 are MLA, without q-LoRA
        assert f"model.layers.{mla}.attention.q_proj.weight" in idx
        assert f"model.layers.{mla}.attention.q_a_proj.weight" not in idx
