"""The model families the suite covers, and how a dump or a checkpoint says which one it is (issue 34 §1).

A family's names live in its description module, and only there: Ling3's site graph and per-runtime module maps in
`parity.model.ling3_family`, Kimi Linear's sites (canonical name <- the built-in's module <- the JAX point) and their
graph in `parity.model.kimi_family`. Everything that must tell the families apart — `tools/dump_hf.py` for a
checkpoint, `pytest parity` for a dump, `tools/make_ckpt.py --family` — asks this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from parity.errors import ParityError


@dataclass(frozen=True)
class Family:
    """name: a dump's root attr `family` (Ling3 dumps record none: the schema predates a second family).
    model_types: config.json `model_type` values of its checkpoints. description: the module holding its names.
    make_ckpt: `tools/make_ckpt.py --family` value. doc: where it is documented."""

    name: str
    model_types: tuple[str, ...]
    description: str
    make_ckpt: str
    doc: str


LING3 = Family("ling3", ("bailing_hybrid",), "parity.model.ling3_family", "ling3", "README.md")
KIMI_LINEAR = Family("kimi_linear", ("kimi_linear",), "parity.model.kimi_family", "kimi-linear", "docs/kimi_linear.md")
FAMILIES: tuple[Family, ...] = (LING3, KIMI_LINEAR)


def by_name(name: str) -> Family:
    """The family called `name` (a dump's `family` attr); ParityError naming the known ones."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ParityError(f"family {name!r}: expected one of {', '.join(f.name for f in FAMILIES)}")


def by_make_ckpt(flag: str) -> Family:
    """The family of a `tools/make_ckpt.py --family` value."""
    return next(f for f in FAMILIES if f.make_ckpt == flag)


def of_model_type(model_type: str | None) -> Family:
    """The family whose checkpoints have this config.json `model_type`; Ling3 for any other (and for None): its own
    config check then names the field and what it expected (`parity.model.config`)."""
    return next((f for f in FAMILIES if model_type in f.model_types), LING3)


def of_checkpoint(ckpt: str | Path) -> Family:
    """A checkpoint directory's family, by its config.json `model_type` (Ling3 when unreadable: the Ling3 path then
    reports the config in its own line)."""
    try:
        mt = json.loads((Path(ckpt) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        mt = None
    return of_model_type(mt)


def of_dump(path: str | Path) -> Family:
    """A dump's family, by its root attr `family` (absent: Ling3; a file that is not a readable dump: Ling3 too,
    whose replay reports it in its own one line)."""
    try:
        import h5py

        with h5py.File(path, "r") as f:
            fam = f.attrs.get("family")
    except (OSError, ValueError):
        return LING3
    if fam is None:
        return LING3
    return by_name(fam.decode() if isinstance(fam, bytes) else str(fam))
