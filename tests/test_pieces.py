"""Serving-path self-consistency (parity.pieces): chunked prefill and prefill + decode against one dumped prefill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _ctx(dump: str, target):
    from parity.replay import Session

    return Session.open(REPO / "dumps" / dump, target=target)


def _targets():
    from parity.targets.reference import ReferenceTarget

    out = [pytest.param(ReferenceTarget, id="reference")]
    try:
        import flax  # noqa: F401

        from parity.targets.portlike import PortlikeTarget

        out.append(pytest.param(PortlikeTarget, id="portlike"))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("target_cls", _targets())
@pytest.mark.parametrize("layer,pieces", [(1, "40+60"), (1, "96+decode"), (3, "64+36"), (3, "97+decode")])
def test_pieces_match_one_prefill(target_cls, layer, pieces):
    """tiny-fp32 has a 100-token prompt: the official KDA ran its chunked kernel over all of it; here pieces of
    <= 64 tokens run the recurrent kernel and carry state, and must land on the same points and final state."""
    from parity.replay.pieces import parse_pieces, replay_layer_pieces

    ctx = _ctx("tiny-fp32.h5", target_cls())
    recs = replay_layer_pieces(ctx, layer, parse_pieces(pieces, int(ctx.dump.prompt_len)))
    bad = [(r["site"], r["status"], r.get("max_ulp")) for r in recs if r["status"] != "pass"]
    assert not bad, bad
    sites = {r["site"] for r in recs}
    assert "output" in sites and ("attention.state" in sites) == (layer == 1)


def test_pieces_catch_a_target_that_drops_state_between_pieces():
    """The mode can fail: a target that starts every piece from an empty state diverges from the second piece."""
    from parity.replay.pieces import replay_layer_pieces
    from parity.targets.reference import ReferenceTarget

    class Forgetful(ReferenceTarget):
        def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
            return super().layer_forward(i, hidden, positions, None, forced_topk)

    ctx = _ctx("tiny-fp32.h5", Forgetful())
    recs = {r["site"]: r for r in replay_layer_pieces(ctx, 1, [40, 60])}
    assert recs["attention.q_conv1d"]["status"] == "fail"  # conv history lost at the piece boundary
    assert recs["attention.core"]["status"] == "fail" and recs["output"]["status"] == "fail"
    assert recs["attention.q_proj"]["status"] == "pass"  # token-local sites are unaffected
    assert np.isfinite(recs["output"]["max_ulp"])


def test_parse_pieces():
    from parity.replay.pieces import parse_pieces

    assert parse_pieces("40+60", 100) == [40, 60]
    assert parse_pieces("98+decode", 100) == [98, 1, 1]
    with pytest.raises(ValueError, match="adding up to the prompt length 100"):
        parse_pieces("40+50", 100)


def test_pieces_against_self_isolates_the_serving_path():
    """A target that is wrong in one piece (the softplus-gate variant) still carries its state correctly: against
    its own one-shot prefill it passes, against the dump it fails."""
    pytest.importorskip("flax")
    from parity.replay.pieces import replay_layer_pieces
    from parity.targets.portlike import PortlikeTarget

    ctx = _ctx("tiny-fp32.h5", PortlikeTarget("softplus_gate"))
    own = replay_layer_pieces(ctx, 1, [40, 60], against="self")
    assert {r["status"] for r in own} == {"pass"}, [(r["site"], r["status"]) for r in own if r["status"] != "pass"]
    dump = {r["site"]: r["status"] for r in replay_layer_pieces(ctx, 1, [40, 60], against="dump")}
    assert dump["attention.gate"] == "fail"
