"""Built-in prompts. Short prompts hide RoPE and KDA chunk-boundary bugs, so the default is long (≥ 512 tokens) and
position-sensitive: the same phrase recurs at many positions, so a wrong RoPE position or a state carried wrongly
across a 64-token chunk boundary changes later tokens' activations."""

from __future__ import annotations

import numpy as np

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
