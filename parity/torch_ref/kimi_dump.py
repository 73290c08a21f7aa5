"""The built-in Kimi Linear's per-layer sites: captured by hooks, written to and read back from a dump (issue 34).

One forward of transformers' `KimiLinearForCausalLM` on a prompt gives, per decoder layer, the sites (canonical
names, DESIGN §3, as Ling3's): `input`, `input_layernorm`, `attention` (the `self_attn` module's output),
`post_attention_layernorm`, `mlp:in`, `mlp`, `output` and, for a MoE layer, `mlp.gate.logits` and
`mlp.gate.topk_idx` (the router's output, ids in ascending order per token: only the set carries meaning, DESIGN §4).

A Kimi dump is a file of the dump schema (`parity.dumpfile`, DESIGN §4) holding those sites as prefill points, with
`family: kimi_linear` among its root attributes and the built-in's config as `config_json`. `pytest parity` replays
Ling3 dumps only and refuses a Kimi dump in one line; `tools/kimi_check.py CKPT --from-dump DUMP` judges the JAX
reference against it (`parity.jax_kimi.check`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FAMILY = "kimi_linear"
# the built-in's module names (relative to a decoder layer) -> the canonical site of its output
MODULE_SITES = {"input_layernorm": "input_layernorm", "self_attn": "attention",
                "post_attention_layernorm": "post_attention_layernorm", "mlp": "mlp"}


def capture_sites(model: Any, ids: Any) -> dict[tuple[int, str], Any]:
    """{(layer, site): torch tensor} of one forward of the built-in (module doc)."""
    import torch

    got: dict[tuple[int, str], Any] = {}
    hooks = []

    def keep(i: int, site: str, t: Any) -> None:  # returns None: a hook's non-None result replaces the output
        got[(i, site)] = (t[0] if isinstance(t, tuple) else t).detach().clone()

    def keep_layer(i: int, args: tuple, kwargs: dict, out: Any) -> None:
        keep(i, "input", args[0] if args else kwargs["hidden_states"])
        keep(i, "output", out)

    def keep_router(i: int, out: tuple) -> None:  # KimiLinearTopkRouter -> (logits, weights, ids)
        keep(i, "mlp.gate.logits", out[0])
        keep(i, "mlp.gate.topk_idx", torch.sort(out[2], dim=-1).values)

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, kw, o, i=i: keep_layer(i, a, kw, o), with_kwargs=True))
        for name, site in MODULE_SITES.items():
            hooks.append(layer.get_submodule(name).register_forward_hook(
                lambda m, a, o, i=i, site=site: keep(i, site, o)))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: keep(i, "mlp:in", a[0])))
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: keep_router(i, o)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def _numpy(t: Any) -> np.ndarray:
    """A torch tensor as numpy, bf16 as numpy's bfloat16 (ml_dtypes) bit for bit, ids as int32."""
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if not t.is_floating_point():
        return t.numpy().astype(np.int32)
    return t.numpy()


def write_kimi_dump(path: str | Path, model: Any, ckpt_dir: str | Path, ids: Any, sites: dict[tuple[int, str], Any],
                    *, seed: int, force: bool = False) -> Path:
    """Write `sites` (`capture_sites` of `model` on `ids` [1, T]) as a Kimi dump at `path` (module doc); an existing
    file is refused unless `force`. Returns the path."""
    from parity.dumpfile import DumpWriter, fingerprint_checkpoint
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
        w.write_tokens(np.asarray(ids), int(np.shape(ids)[-1]))
        for (i, site), t in sorted(sites.items()):
            w.write(Point("prefill", 0, i, site), _numpy(t), io="input" if site.endswith(":in") else "output")
    return Path(path)


def read_kimi_dump(path: str | Path, ckpt_dir: str | Path) -> tuple[dict[tuple[int, str], np.ndarray], np.ndarray]:
    """({(layer, site): array}, input ids) of a Kimi dump, checked to be one (`family`) and to come from `ckpt_dir`
    (its checkpoint fingerprint); anything else is a one-line `DumpError`."""
    from parity.dumpfile import DumpReader, fingerprint_checkpoint
    from parity.errors import DumpError

    with DumpReader(path, expect_fingerprint=fingerprint_checkpoint(ckpt_dir)) as d:
        if d.meta.get("family") != FAMILY:
            raise DumpError(f"{path}: root attr family {d.meta.get('family')!r}, expected {FAMILY!r} (a dump of "
                            f"tools/kimi_check.py --dump; Ling3 dumps are replayed by pytest parity)")
        sites = {(p.layer, p.site): d.read(p) for p in d.points() if p.phase == "prefill" and p.layer is not None}
        return sites, d.input_ids
