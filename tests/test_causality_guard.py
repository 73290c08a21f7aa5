"""The dump's causality guard (official_remote_code.md §2) on the prefill's own recorded inputs: it passes a causal
model, names the layer of a leaking one, covers every MLA layer (MTP included) and the first KDA layer, and is cheap
(one batched call per checked layer on the first GUARD_MAX_TOKENS positions, no extra forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import numpy as np
import torch

from parity.errors import ParityError
from parity.torch_ref.dump import GUARD_MAX_TOKENS, causality_guard, record_guarded_calls
from parity.torch_ref.loader import load_model
from parity.torch_ref.prompts import builtin_ids

CKPT = Path(__file__).resolve().parents[1] / "dumps" / "ckpt"
T = 100


@pytest.fixture(scope="module")
def recorded():
    lm = load_model(CKPT / "tiny-flash", "remote", dtype="float32")  # twin, MTP layer run (num_nextn 1)
    ids = torch.as_tensor(builtin_ids(512, T, seed=4))
    calls, hooks = record_guarded_calls(lm.model, lm.config)
    pos = torch.arange(T)
    with torch.no_grad():
        lm.model(input_ids=ids, position_ids=pos[None], cache_position=pos, use_cache=True,
                 attention_mask=torch.ones(1, T, dtype=torch.long))
    for h in hooks:
        h.remove()
    yield lm, ids, calls
    lm.release()


def test_guard_passes_a_causal_model_and_checks_the_right_layers(recorded):
    lm, ids, calls = recorded
    with torch.no_grad():
        g = causality_guard(lm.model, ids, cfg=lm.config, recorded=calls)
    assert g["causal"] and g["inputs"] == "the dump's prefill" and g["prompt_length"] == GUARD_MAX_TOKENS
    # MLA layers 5, 6, 7 (ragged tail), the MTP layer 8, and the first KDA layer
    assert g["layers"] == [0, 5, 6, 7, 8]
    # exactly 0 on AVX-512 (the batched call sums each row as the single one does); under the AVX2 caps torch's GEMM
    # blocks the stacked batch otherwise and a row moves by ~1 fp32 ULP (2^-24 = 6e-8 measured): a summation order,
    # so at most a few fp32 ULPs of the output's scale (8 here, far tighter than the guard's own rtol; a causality
    # leak moves earlier rows by orders of magnitude more)
    assert g["max_abs_diff"] == 0.0 or g["max_abs_diff"] <= 8 * np.finfo(np.float32).eps * g["output_scale"], g
    with torch.no_grad():
        g2 = causality_guard(lm.model, ids, cfg=lm.config)  # no recording: its own base-model prefill
    assert g2["causal"] and g2["inputs"] == "a base-model prefill"


def test_guard_names_a_leaking_layer(recorded):
    """The MLA of layer 6 made bidirectional (its recorded causal mask replaced by zeros): the guard must fail."""
    lm, ids, calls = recorded
    args, kwargs = calls[6]
    leaky = dict(calls)
    leaky[6] = (args, {**kwargs, "attention_mask": torch.zeros_like(kwargs["attention_mask"])})
    with torch.no_grad(), pytest.raises(ParityError, match=r"not causal .*layer 6's BailingMoeV3MultiLatentAttention"):
        causality_guard(lm.model, ids, cfg=lm.config, recorded=leaky)
