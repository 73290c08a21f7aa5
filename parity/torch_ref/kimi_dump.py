"""The built-in Kimi Linear's per-layer sites: captured by hooks, written to and read back from a dump (issue 34).

One forward of transformers' `KimiLinearForCausalLM` on a prompt gives, per decoder layer, the sites that
`parity.model.kimi_family.SITES` names (canonical names, DESIGN §3, Ling3's where the quantity is the same: the
layer's input, the norms, the attention's projections, gate and output, the router's logits and top-k ids in
ascending order per token — only the set carries meaning, DESIGN §4 — the experts' sum, the MLP, the output).

A Kimi dump is a file of the dump schema (`parity.dumpfile`, DESIGN §4) holding those sites as prefill points (and
decode points, one step per token decoded through the built-in's cache, `capture_steps`), with
`family: kimi_linear` among its root attributes and the built-in's config as `config_json`. `pytest parity` replays
it by that attr (`parity.pytest_plugin.kimi`: one test per dump, mode and layer; the bundled ones are in dumps/kimi/),
as `tools/kimi_check.py CKPT --from-dump DUMP` judges the JAX reference against it (`parity.jax_kimi.check`); Ling3's
replay machinery (`DumpReader.config`) refuses it in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def capture_sites(model: Any, ids: Any) -> dict[tuple[int, str], Any]:
    """{(layer, site): torch tensor} of one forward of the built-in: every site of `parity.model.kimi_family.SITES`
    whose module the layer has, and the model-level `MODEL_SITES` under layer None (module doc)."""
    return capture_steps(model, ids, int(ids.shape[-1]))[0]


def capture_steps(model: Any, ids: Any, prompt_len: int) -> list[dict[tuple[int, str], Any]]:
    """[prefill sites, decode step 1 sites, ...]: the prefill of ids[:, :prompt_len], then each following token
    decoded one at a time through the built-in's own cache (`past_key_values`, as generation runs it)."""
    import torch

    from parity.model.kimi_family import MODEL_SITES, SITES, canonical

    steps: list[dict[tuple[int | None, str], Any]] = []
    hooks = []

    def keep(i: int | None, site, args: tuple, kwargs: dict, out: Any) -> None:  # None: the output is unchanged
        if site.io == "input":
            t = args[0] if args else kwargs["hidden_states"]
        else:
            t = out[site.index] if site.index is not None else (out[0] if isinstance(out, tuple) else out)
        t = t.detach()
        steps[-1][(i, site.site)] = torch.sort(t, dim=-1).values if site.sort else t.clone()

    def keep_cache(cache: Any) -> None:  # the cache sites (`KimiSite.cache`) of every layer whose cache has them
        for i in range(len(model.model.layers)):
            for site in (s for s in SITES if s.cache):
                try:
                    t = (cache.get_recurrent_state(i) if site.cache == "recurrent" else cache.get_conv_state(i))
                except ValueError:  # not a linear-attention layer: no such state
                    continue
                if t is not None:
                    t = t.detach().clone()
                    steps[-1][(i, site.site)] = canonical(site.site, t)

    for i, layer in enumerate(model.model.layers):
        for site in SITES:
            if site.cache:
                continue
            try:
                module = layer.get_submodule(site.module) if site.module else layer
            except AttributeError:  # this layer kind has no such module
                continue
            hooks.append(module.register_forward_hook(
                lambda m, a, kw, o, i=i, site=site: keep(i, site, a, kw, o), with_kwargs=True))
    for site in MODEL_SITES:  # the embedding, the final norm, the head: layer None
        hooks.append(model.get_submodule(site.module).register_forward_hook(
            lambda m, a, kw, o, site=site: keep(None, site, a, kw, o), with_kwargs=True))
    try:
        with torch.no_grad():
            steps.append({})
            if prompt_len == ids.shape[-1]:
                model(ids)
            else:
                cache = model(ids[:, :prompt_len], use_cache=True).past_key_values
                keep_cache(cache)
                for t in range(prompt_len, ids.shape[-1]):
                    steps.append({})
                    cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).past_key_values
                    keep_cache(cache)
    finally:
        for h in hooks:
            h.remove()
    return steps


def capture_backward(model: Any, ids: Any) -> dict[tuple[int, str], Any]:
    """The built-in's backward of one training step on the prompt `ids` [1, T] (issue 34 item 2, `--grads`): the mean
    next-token cross-entropy of its logits (fp32), back through every layer. Per decoder layer i:
    (i, "output") = dL/d(its output), the cotangent a teacher-forced layer VJP is fed; (i, "input") = dL/d(its input);
    (i, "grad.<name>") = dL/d(parameter `model.layers.{i}.<name>`) for every trainable parameter (the router's
    `e_score_correction_bias` buffer only selects: left out). Ling3's `--grads` dumps hold the same quantities
    (DESIGN §4 `backward` phase), there under Ling3's site names."""
    import torch

    outs: dict[int, Any] = {}
    ins: dict[int, Any] = {}
    hooks = []

    def pre(i, m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if x.requires_grad:
            x.retain_grad()
        ins[i] = x

    def post(i, m, args, kwargs, out):
        o = out[0] if isinstance(out, tuple) else out
        o.retain_grad()
        outs[i] = o

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, kw, i=i: pre(i, m, a, kw), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, kw, o, i=i: post(i, m, a, kw, o), with_kwargs=True))
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            logits = model(ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    got: dict[tuple[int, str], Any] = {}
    for i, layer in enumerate(model.model.layers):
        got[(i, "output")] = outs[i].grad.detach().clone()
        if ins[i].grad is not None:  # layer 0's input is the embedding's output: a leaf of the graph only if trained
            got[(i, "input")] = ins[i].grad.detach().clone()
        for name, t in layer.named_parameters():
            got[(i, f"grad.{name}")] = (t.grad if t.grad is not None else torch.zeros_like(t)).detach().clone()
    model.zero_grad(set_to_none=True)
    return got


def _numpy(t: Any) -> np.ndarray:
    """A torch tensor as numpy (`capture.to_numpy`: bf16 bit for bit as ml_dtypes'), ids as int32."""
    from parity.torch_ref.capture import to_numpy

    a = to_numpy(t)
    return a.astype(np.int32) if a.dtype.kind in "iu" else a


def write_kimi_dump(path: str | Path, model: Any, ckpt_dir: str | Path, ids: Any,
                    steps: list[dict[tuple[int, str], Any]], *, seed: int, force: bool = False,
                    backward: dict[tuple[int, str], Any] | None = None) -> Path:
    """Write `steps` (`capture_steps` of `model` on `ids` [1, T]: the prefill, then decode steps 1, 2, ...) as a Kimi
    dump at `path` (module doc), and `backward` (`capture_backward`, optional) as its backward phase; an existing
    file is refused unless `force`. Returns the path."""
    from parity.dumpfile import DumpWriter, fingerprint_checkpoint
    from parity.model.kimi_family import FAMILY
    from parity.model.points import Point
    from parity.torch_ref.dump import runtime_versions

    meta = {
        **runtime_versions(),
        "family": FAMILY,
        "runtime": "transformers-builtin",
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config_json": model.config.to_dict(),
        "checkpoint_fingerprint": fingerprint_checkpoint(ckpt_dir),
        "checkpoint_dir": str(ckpt_dir),
        "device": "cpu",
        "compute_dtype": str(model.dtype).removeprefix("torch."),
        "seed": seed,
    }
    with DumpWriter(path, meta, force=force) as w:
        w.write_tokens(np.asarray(ids), int(np.shape(ids)[-1]) - (len(steps) - 1))
        for k, sites in enumerate(steps):
            for (i, site), t in sorted(sites.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1])):
                w.write(Point("prefill" if k == 0 else "decode", k, i, site), _numpy(t),
                        io="input" if site.endswith(":in") else "output")
        for (i, site), t in sorted((backward or {}).items()):
            w.write(Point("backward", 0, i, site), _numpy(t), io="output")
    return Path(path)


def read_kimi_dump(path: str | Path, ckpt_dir: str | Path) -> tuple[list[dict[tuple[int, str], np.ndarray]], np.ndarray,
                                                                    int]:
    """([prefill sites, decode step 1 sites, ...], input ids, prompt length) of a Kimi dump, checked to be one
    (`family`) and to come from `ckpt_dir` (its checkpoint fingerprint); anything else is a one-line `DumpError`."""
    from parity.dumpfile import DumpReader, fingerprint_checkpoint
    from parity.errors import DumpError
    from parity.model.kimi_family import FAMILY

    with DumpReader(path, expect_fingerprint=fingerprint_checkpoint(ckpt_dir)) as d:
        if d.meta.get("family") != FAMILY:
            raise DumpError(f"{path}: root attr family {d.meta.get('family')!r}, expected {FAMILY!r} (a dump of "
                            f"tools/kimi_check.py --dump; Ling3 dumps are replayed by pytest parity)")
        steps = [{(p.layer, p.site): d.read(p) for p in d.points()
                  if p.phase == ("prefill" if k == 0 else "decode") and p.step == k}
                 for k in range(1 + len(d.steps("decode")))]
        return steps, d.input_ids, d.prompt_len


def read_kimi_backward(path: str | Path) -> dict[tuple[int, str], np.ndarray]:
    """The backward phase of a Kimi dump ({(layer, "output" | "input" | "grad.<name>"): array}; empty without
    `--grads`)."""
    from parity.dumpfile import DumpReader

    with DumpReader(path) as d:
        return {(p.layer, p.site): d.read(p) for p in d.points() if p.phase == "backward" and p.layer is not None}
