"""`tools/kimi_check.py` (`parity.cli.kimi_check`): the JAX Kimi Linear reference against the built-in on a written
checkpoint, as a user runs it — the tiny preset in bf16 passes at every site (measured: bit-exact but for a few
elements of layer 3, docs/kimi_linear.md), a planted porting bug fails at its site, bad input is one line."""

from __future__ import annotations

import pytest

from parity.cli.kimi_check import main
from parity.torch_ref.kimi_ckpt import make_kimi_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_kimi_checkpoint(tmp_path_factory.mktemp("kimi") / "tiny", "tiny", seed=0, dtype="bf16")


def test_tiny_checkpoint_passes_every_site(ckpt, capsys):
    assert main([str(ckpt)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("layer ")]
    # 4 layers x (4 module sites + output + the teacher-forced MLP), the 2 MoE layers' router logits and routing lines
    assert len(lines) == 4 * 6 + 2 * 2, out
    assert all(": pass" in ln for ln in lines if "routing:" not in ln), out
    assert out.rstrip().endswith("every site passed")


def test_planted_bug_fails_at_its_site(ckpt, capsys, monkeypatch):
    """A SiLU between the low-rank gate projections (a porting bug issue 34 names): layer 0's attention fails."""
    from parity.jax_kimi import kda
    from parity.jax_ling3.ops import linear, silu

    monkeypatch.setattr(kda, "low_rank", lambda x, w_a, w_b: linear(silu(linear(x, w_a)), w_b))
    assert main([str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "layer 0 KDA+dense attention: FAIL" in out, out
    assert "layer 0 KDA+dense input_layernorm: pass" in out, out


def test_not_a_checkpoint_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path) in err and "config.json" in err, err
