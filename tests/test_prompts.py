"""The built-in prompts: the default long prompt is bounded in tokens of the tokenizer actually used (issue 13)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from parity.cli.dump_hf import build_parser, collect_ids
from parity.torch_ref.prompts import DEFAULT_LONG_TOKENS, builtin_long_ids

CKPT = Path(__file__).resolve().parents[1] / "dumps" / "ckpt" / "tiny"


def test_long_prompt_has_exactly_the_requested_tokens():
    tok = AutoTokenizer.from_pretrained(str(CKPT))  # byte-level: one token per byte
    for n in (1, 65, DEFAULT_LONG_TOKENS, 3000):
        ids = builtin_long_ids(tok, n)
        assert len(ids) == n
    assert 64 < DEFAULT_LONG_TOKENS <= 512  # the chunked KDA path, "a few hundred"
    assert tok.decode(builtin_long_ids(tok, 12)) == "Line 0000: t"


def test_default_prompt_is_printed_and_bounded(capsys):
    args = build_parser().parse_args([str(CKPT), "--out", "x.h5"])
    seqs = collect_ids(args, CKPT, 512)
    assert [len(s) for s in seqs] == [DEFAULT_LONG_TOKENS]
    assert f"prompt: built-in long text, {DEFAULT_LONG_TOKENS} tokens" in capsys.readouterr().out
