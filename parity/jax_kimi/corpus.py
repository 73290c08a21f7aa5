"""A corpus of correct Kimi Linear pairs (issue 34 item 3): the JAX reference against transformers' built-in on
fresh seeded checkpoints, every site, mode and dtype, with the statistics a rule is calibrated from.

Ling3's rules are per site class and carry over to the family where the maths is the same; where Kimi's built-in
computes a site another way (its KDA gate's `log(1 + exp(x))` softplus, `parity.jax_kimi.kda.builtin_softplus`) the
correct pairs say how far apart two correct evaluations are there, and `parity/numerics/kimi_linear.toml` (the family's
rule overlay, `parity.model.kimi_family.rules`) is set from this corpus. `tools/kimi_corpus.py` is the CLI.
"""

from __future__ import annotations

from typing import Any, Iterator


def corpus_rows(seeds: list[int], dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                modes: tuple[str, ...] = ("layer", "isolated", "free"), T: int = 70, decode_steps: int = 2,
                preset: str = "tiny", rules: Any = None, grads: bool = False) -> Iterator[dict[str, Any]]:
    """One row per (seed, dtype, mode, layer, site) of the reference judged against the built-in (`check`'s
    verdicts, under `rules`: default the family's, `kimi_family.rules()`): status, largest |Δ| / RMS of its row,
    greatest ULP distance after the rule's floor, rel-L2. Decode steps are judged in layer mode (site
    `decode k/site`); with `grads`, one training step's backward too (sites `backward/input`,
    `backward/grad.<param>`: the reference's layer VJP fed the built-in's output cotangent, as a `--grads` dump is
    judged, `check.dumped_grad_verdicts`)."""
    import torch

    from parity.jax_kimi.check import (decode_verdicts, dumped_grad_verdicts, free_verdicts, isolated_verdicts,
                                       layer_verdicts)
    from parity.torch_ref.kimi_ckpt import kimi_model
    from parity.torch_ref.kimi_dump import _numpy, capture_backward, capture_steps

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for seed in seeds:
        base = kimi_model(preset, seed)
        cfg = base.config
        ids = torch.randint(3, cfg.vocab_size, (1, T + decode_steps), generator=torch.Generator().manual_seed(seed))
        for dtype in dtypes:
            model = base.to(tdt[dtype])
            steps = capture_steps(model, ids, T)
            sd = model.state_dict()
            backward = {k: _numpy(v) for k, v in capture_backward(model, ids[:, :T]).items()} \
                if grads and "layer" in modes else None
            free = iter(free_verdicts(sd, cfg, steps[0], dtype, jit=True, rules=rules)) if "free" in modes else None
            for i in range(cfg.num_hidden_layers):
                for mode in modes:
                    if mode == "layer":
                        verdicts = layer_verdicts(sd, cfg, steps[0], i, dtype, jit=True, rules=rules)[0]
                        for k, step in enumerate(decode_verdicts(sd, cfg, steps, i, dtype, rules=rules), start=1):
                            verdicts = verdicts | {f"decode {k}/{s}": r for s, r in step.items()}
                        if backward is not None:
                            verdicts = verdicts | dumped_grad_verdicts(sd, cfg, steps[0], backward, i, dtype,
                                                                       rules=rules)
                    elif mode == "isolated":
                        verdicts = isolated_verdicts(sd, cfg, steps[0], i, dtype, rules=rules)
                    else:
                        verdicts = next(free)[0]
                    for site, res in verdicts.items():
                        v = res.verdict
                        yield {"seed": seed, "dtype": dtype, "mode": mode, "layer": i, "site": site,
                               "status": res.status, "max_diff_rms": v.max_diff_rms, "max_ulp": v.max_ulp,
                               "rel_l2": v.rel_l2}
            base = base.float()


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (site class, mode, dtype) — a decode step's site counted with its prefill site — the worst largest
    |Δ| / row RMS and rel-L2 over the rows, how many rows and how many did not pass."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        site = r["site"].split("/", 1)[1] if r["site"].startswith("decode ") else r["site"]  # backward/... kept
        k = (site, r["mode"], r["dtype"])
        s = out.setdefault(k, {"site": site, "mode": r["mode"], "dtype": r["dtype"], "n": 0, "not_passed": 0,
                               "worst_diff_rms": 0.0, "worst_rel_l2": 0.0, "worst_at": ""})
        s["n"] += 1
        s["not_passed"] += r["status"] not in ("pass", "variant")
        d = r["max_diff_rms"] or 0.0
        if d > s["worst_diff_rms"]:
            s["worst_diff_rms"], s["worst_at"] = d, f"s{r['seed']}/L{r['layer']}/{r['site']}"
        s["worst_rel_l2"] = max(s["worst_rel_l2"], r["rel_l2"] or 0.0)
    return sorted(out.values(), key=lambda s: (s["dtype"], s["mode"], s["site"]))
