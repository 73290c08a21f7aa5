"""The model families the suite covers: one registry entry per family, and how a dump or a checkpoint says which one
it is (issue 34 §1: a model family as data).

A family's names live in its description module, and only there: Ling3's site graph and per-runtime module maps in
`parity.model.ling3_family`, Kimi Linear's sites (canonical name <- the built-in's module <- the JAX point) and their
graph in `parity.model.kimi_family`. Its entry here names, as `module:callable` strings (resolved on use, so that
this registry imports nothing of theirs), what works from that description: the config check, the dumper, the rules,
the bundled goldens, the replay module. `tools/dump_hf.py` (a checkpoint's family), `pytest parity` (a dump's) and
`tools/make_ckpt.py --family` ask this module; a family added here with its own config check and dumper is dumped by
them (tests/test_ling3_family.py registers a third one). Its dumps are replayed only once a replay module collects
them (`parity.pytest_plugin.plugin` collects Ling3's, `parity.pytest_plugin.kimi` Kimi's).
"""

from __future__ import annotations

import json
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.errors import ParityError


ENTRIES = ("config", "dump", "rules", "replay")


@dataclass(frozen=True)
class Family:
    """name: a dump's root attr `family` (Ling3 dumps record none: the schema predates a second family).
    model_types: config.json `model_type` values of its checkpoints. description: the module holding its names.
    make_ckpt: `tools/make_ckpt.py --family` value. doc: where it is documented. goldens: its bundled golden dumps'
    folder, under the bundled dumps (`dumps/`; `pytest parity` without --parity-dump replays them).
    The entries (`ENTRIES`, `module:callable`, read by `entry`):
    config:  checkpoint dir -> its validated config (one-line `ConfigError` naming the field), before weights load.
    dump:    `tools/dump_hf.py` for its checkpoints: (parser, args, ckpt, outs, config, argv) -> exit status.
    rules:   () -> `RulesTable`, the calibrated rules its dumps are judged by.
    replay:  the `pytest parity` module that collects and judges its dumps."""

    name: str
    model_types: tuple[str, ...]
    description: str
    make_ckpt: str
    doc: str
    goldens: str
    config: str
    dump: str
    rules: str
    replay: str

    def entry(self, what: str) -> Any:
        """The object an entry names (`what` one of `ENTRIES`), imported now; ParityError if it does not resolve."""
        if what not in ENTRIES:
            raise ParityError(f"family {self.name}: no entry {what!r}; expected one of {', '.join(ENTRIES)}")
        spec = getattr(self, what)
        mod, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(mod)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ParityError(f"family {self.name}: entry {what} = {spec!r} does not resolve ({e})") from None
        return obj


LING3 = Family(
    "ling3", ("bailing_hybrid",), "parity.model.ling3_family", "ling3", "README.md", goldens=".",
    config="parity.model.config:checkpoint_config", dump="parity.cli.dump_hf:dump_ling3",
    rules="parity.numerics.tolerances:default_rules", replay="parity.pytest_plugin.plugin")
KIMI_LINEAR = Family(
    "kimi_linear", ("kimi_linear",), "parity.model.kimi_family", "kimi-linear", "docs/kimi_linear.md",
    goldens="kimi", config="parity.jax_kimi.spec:checkpoint_config", dump="parity.cli.dump_kimi:dump_kimi",
    rules="parity.model.kimi_family:rules", replay="parity.pytest_plugin.kimi")
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
