"""Built-in prompts. Short prompts hide RoPE and KDA chunk-boundary bugs, so the default is long and position-sensitive
— the same phrase recurs at many positions, so a wrong RoPE position or a state carried wrongly across a 64-token chunk
boundary changes later tokens' activations — but bounded in tokens of the tokenizer actually used
(`DEFAULT_LONG_TOKENS`, several 64-token KDA chunks): the dump's cost grows with it (a byte-level tokenizer turned the
old ~6000-character text into 5,999 tokens)."""

from __future__ import annotations

import numpy as np

DEFAULT_LONG_TOKENS = 320  # five 64-token KDA chunks (the chunked kernel path, facts §3.10); "a few hundred"
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def builtin_long_text(min_chars: int = 6000) -> str:
    """Numbered lines that repeat a phrase with a position-dependent word; ~6000 chars ≥ 512 tokens of any tokenizer
    that does not merge whole lines (byte-level: 1 token per byte)."""
    lines, i = [], 0
    while sum(len(s) + 1 for s in lines) < min_chars:
        lines.append(f"Line {i:04d}: the {_WORDS[i % 10]} signal repeats after {_WORDS[(i * 7) % 10]} at step {i * 3}.")
        i += 1
    return "\n".join(lines)


def builtin_ids(vocab_size: int, length: int, seed: int = 0, *, batch: int = 1) -> np.ndarray:
    """Deterministic ids: a random walk over the vocabulary with a recurring 17-token motif (positions matter)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    ids = rng.integers(2, vocab_size, size=(batch, length))
    motif = rng.integers(2, vocab_size, size=17)
    for start in range(0, length - 17, 97):
        ids[:, start:start + 17] = motif
    return ids.astype(np.int64)


def builtin_long_ids(tokenizer, n_tokens: int = DEFAULT_LONG_TOKENS) -> list[int]:
    """Exactly `n_tokens` ids of the built-in long text as `tokenizer` encodes it (no special tokens): the text is
    made long enough for any tokenizer that spends at most ~one token per character, then cut."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens = {n_tokens}, expected >= 1")
    chars = 4 * n_tokens
    while True:
        ids = tokenizer(builtin_long_text(chars), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return list(ids[:n_tokens])
        chars *= 2
