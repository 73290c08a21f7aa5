"""The Kimi Linear corpus of correct pairs (`parity.jax_kimi.corpus`, tools/kimi_corpus.py; issue 34 item 3) with
its gradients (`--grads`): on a fresh seed outside the bundled golden's, every forward and backward row of the
reference against transformers' built-in passes under the family's rules, and each layer's input gradient and the
gradients of its parameters are among the rows. docs/kimi_linear.md "The family's rules" has the 8-seed run."""

from __future__ import annotations


def test_one_seed_with_gradients_passes_and_covers_every_layer():
    from parity.jax_kimi.corpus import corpus_rows, summary

    rows = list(corpus_rows([9], ("bfloat16",), ("layer",), T=40, decode_steps=1, grads=True))
    bad = [r for r in rows if r["status"] not in ("pass", "variant")]
    assert not bad, bad[:3]
    back = [r for r in rows if r["site"].startswith("backward/")]
    layers = {r["layer"] for r in rows}
    assert {r["layer"] for r in back if r["site"] == "backward/input"} == layers
    for i in layers:
        assert any(r["layer"] == i and r["site"].startswith("backward/grad.") for r in back), i
    assert any(s["site"].startswith("backward/grad.mlp.experts") for s in summary(rows))


def test_the_conv_history_is_judged_as_the_projections_it_holds():
    """Kimi's overlay judges `attention.conv_state` (the q/k/v projections' own outputs, cached) in fp32 layer mode by
    the projections' rule: its floor and bound stay those of Ling3's calibrated `attention.k_proj` rule (if the
    calibration moves them, the overlay's entry must move too)."""
    from parity.model import kimi_family
    from parity.numerics.tolerances import default_rules

    ours = kimi_family.rules().rule_for("attention.conv_state", "layer", "float32", "float32")
    proj = default_rules().rule_for("attention.k_proj", "layer", "float32", "float32")
    assert (ours.floor_ulps, ours.bound_rms) == (proj.floor_ulps, proj.bound_rms), (ours, proj)
    ling3 = default_rules().rule_for("attention.conv_state", "layer", "float32", "float32")
    assert ling3.floor_ulps < ours.floor_ulps  # the entry is in force (Ling3's own is the tiny-width calibration)
