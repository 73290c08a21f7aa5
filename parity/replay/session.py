"""A replay session: the dump, the checkpoint it was made from, the target, the tolerance rules and the mode —
built once and validated up front, so a mode the target cannot run is one clear error before anything replays."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.errors import DumpError, ParityError, TargetCallError, TargetError
from parity.model.points import Point

ROOT = Path(__file__).resolve().parents[2]


def _bundled_dir() -> Path:
    """The bundled dumps: `dumps/` of this checkout, else where a non-editable install put them
    (<prefix>/share/ling3-parity/dumps, pyproject `data-files`)."""
    import sys

    here = ROOT / "dumps"
    if here.is_dir():
        return here
    for prefix in (sys.prefix, sys.base_prefix):
        p = Path(prefix) / "share" / "ling3-parity" / "dumps"
        if p.is_dir():
            return p
    return here


BUNDLED_DUMPS = _bundled_dir()
BUNDLED_CKPTS = BUNDLED_DUMPS / "ckpt"

MODES = ("layer", "free", "forced", "isolated")
# Capability a mode needs from the target (DESIGN §7: capabilities decide what can run).
MODE_NEEDS = {"forced": "forced_routing", "isolated": "isolated"}


class ModeError(ParityError):
    """A replay mode the target cannot run (or an unknown mode)."""


def find_checkpoint(fingerprint: str, explicit: str | Path | None = None) -> Path:
    """The checkpoint a dump was made from: `explicit`, else the bundled one with the same fingerprint."""
    from parity.dumpfile import fingerprint_checkpoint

    if explicit:
        return Path(explicit)
    seen = []
    for d in sorted(BUNDLED_CKPTS.iterdir()) if BUNDLED_CKPTS.is_dir() else []:
        if (d / "config.json").is_file():
            fp = fingerprint_checkpoint(d)
            seen.append(f"{d.name}={fp[:12]}")
            if fp == fingerprint:
                return d
    raise DumpError(f"no checkpoint with fingerprint {fingerprint[:12]}… among {BUNDLED_CKPTS} ({', '.join(seen)}); "
                    "pass --parity-ckpt DIR")


def dump_steps(dump) -> list[tuple[str, int]]:
    """The (phase, step) pairs a dump holds, in execution order: prefill, then decode steps 1, 2, ..."""
    out = [("prefill", 0)] if "prefill" in dump.phases() else []
    if "decode" in dump.phases():
        out += [("decode", k) for k in sorted(dump.steps("decode"))]
    return out


def check_mode(mode: str, target) -> None:
    """ModeError (one line) unless `target` can run replay mode `mode`."""
    if mode not in MODES:
        raise ModeError(f"replay mode {mode!r}: expected one of {', '.join(MODES)}")
    need = MODE_NEEDS.get(mode)
    if need and need not in getattr(target, "capabilities", ()):
        raise ModeError(f"replay mode {mode!r} needs target capability {need!r}, which target "
                        f"{getattr(target, 'name', type(target).__name__)!r} does not declare")


@dataclass
class Session:
    """Everything a replay needs, opened and checked once. `dump` is a `parity.dumpfile.DumpReader`, `ckpt` a
    `parity.jax_ling3.weights.CheckpointReader` (anything with `.hf_tensors(i)` / `.hf_global_tensors()`), `target`
    a built `parity.targets.base.Target`, `rules` a `parity.numerics.tolerances.RulesTable`."""

    dump: Any
    ckpt: Any
    target: Any
    rules: Any
    mode: str = "layer"
    dtype: str = "bfloat16"
    watchdog: Any = None  # parity.replay.watchdog.Watchdog; None: the default limit
    semantics: str = "dump"  # which behaviour on the semantic forks the reference follows: "dump" | "intended"
    strict_variants: bool = False  # named implementation variants (parity.numerics.variants) fail instead of passing
    # `--parity-matmul-precision` (None: the default policy, "highest"); every target call runs under the resolved
    # policy (`parity.replay.matmul_policy`), recorded in the report's `replay_env`
    matmul_precision: str | None = None
    # a reason not to compute the backward phase (its points become skipped naming it), None: computed when the dump
    # holds it. The pytest plugin sets it for a run none of whose backward points is among the tests that run.
    backward_off: str | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode, self.target)
        if self.semantics not in SEMANTICS:
            raise ParityError(f"semantics {self.semantics!r}: expected one of {', '.join(SEMANTICS)}")
        if self.watchdog is None:
            from parity.replay.watchdog import Watchdog

            self.watchdog = Watchdog()
        from parity.replay.shadows import ShadowPool

        self.shadows = ShadowPool(self)  # the reference configurations run beside the target
        from parity.replay.matmul_policy import resolve_policy

        self.policy = resolve_policy(self.matmul_precision)

    # -------------------------------------------------------------- semantic forks (parity/model/semantics.py)
    def departures(self) -> list[dict]:
        """Forks where the dump's runtime departs from the model's intended behaviour."""
        from parity.model.semantics import departures

        return departures(self.dump.semantics)

    def fork_options(self, which: str) -> dict:
        """Reference options reproducing the dump's semantics (`which`="dump") or the intended ones."""
        from parity.model.semantics import reference_options

        return reference_options(self.dump.semantics, intended=which == "intended")

    def call(self, what: str, fn, *args, **kwargs):
        """A target call under the session's watchdog: a stall is a StallError naming the dump, what was called
        (layer, phase, step, method) and the file with every thread's stacks; an exception the target raises is a
        TargetCallError naming what was called and the exception's last frame (`what` is "<where>: <method>"). It
        runs under the session's matmul-precision policy (`parity.replay.matmul_policy.under_policy`)."""
        from parity.replay.matmul_policy import under_policy

        try:
            return self.watchdog.call(f"{self.dump.path.name} {what}", under_policy(self.policy["policy"], fn),
                                      *args, **kwargs)
        except ParityError:
            raise
        except Exception as e:  # the adapter's own failure: one line naming the call and where it raised
            raise TargetCallError(what, e) from e

    @classmethod
    def open(cls, dump, ckpt_dir: str | Path | None = None, *, target=None, mode: str = "layer", rules=None,
             mesh=None, layers: list[int] | None = None, watchdog=None, semantics: str = "dump",
             strict_variants: bool = False, matmul_precision: str | None = None) -> "Session":
        """Open a dump (path or DumpReader), find its checkpoint, resolve and build the target ('reference' by
        default; a name as `--parity-target` takes, a Target class or instance), with the default rules unless
        given. `mesh`: a jax Mesh or a `--parity-mesh` spec such as "4x2". The session owns a dump it opened.
        A target that loads from disk (`needs_checkpoint_dir`, protocol v2) is given the checkpoint directory and the
        `layers` the replay will visit (None: all). `matmul_precision`: `--parity-matmul-precision` (None: the
        default policy, `parity.replay.matmul_policy`)."""
        from parity.numerics.tolerances import default_rules, rule_semantics
        from parity.replay.matmul_policy import resolve_policy

        resolve_policy(matmul_precision)  # a bad value is one error before anything is built

        if semantics not in SEMANTICS:
            raise ParityError(f"semantics {semantics!r}: expected one of {', '.join(SEMANTICS)}")
        reader, owned, tgt, ckpt_path, ckpt = prepare(dump, ckpt_dir, target=target, mode=mode)
        try:
            if getattr(tgt, "follows_semantics", False) and not _is_instance_given(target):
                # a reference the replay constructs follows the dump's semantics (or the intended ones); an instance
                # the caller built keeps its own settings
                from parity.model.semantics import reference_options

                tgt.use_semantics(**reference_options(reader.semantics, intended=semantics == "intended"))
            dtype = reader.meta.get("compute_dtype", "bfloat16")
            if isinstance(mesh, str):
                from parity.jax_ling3.sharding import mesh_from_spec

                mesh = mesh_from_spec(mesh)
            try:
                tgt.build(reader.config, dtype, **({"mesh": mesh} if mesh is not None else {}))
                if getattr(tgt, "needs_checkpoint_dir", False):
                    tgt.use_checkpoint_dir(ckpt_path, layers)
            except ParityError:
                raise
            except Exception as e:  # an adapter's own failure: one line naming the target and the call
                raise TargetError(f"target {getattr(tgt, 'name', type(tgt).__name__)!r}: build({reader.path.name} "
                                  f"config, {dtype}) raised {type(e).__name__}: {_first_line(e)}") from None
            # conditional entries (the calibration's sections for recorded semantic forks) resolved for this dump
            # and the real-width section for a dump wider than the calibration corpora (docs/numerics.md)
            rules = (rules or default_rules()).for_semantics(rule_semantics(reader.semantics,
                                                                            reader.config.hidden_size))
            s = cls(dump=reader, ckpt=ckpt, target=tgt, rules=rules, mode=mode, dtype=dtype,
                    watchdog=watchdog, semantics=semantics, strict_variants=strict_variants,
                    matmul_precision=matmul_precision)
        except BaseException:
            if owned:
                reader.close()
            raise
        s._owned = owned
        return s

    @property
    def config(self):
        return self.dump.config

    def steps(self) -> list[tuple[str, int]]:
        return dump_steps(self.dump)

    def layers(self) -> list[int]:
        """Layers the dump holds (by their prefill input)."""
        return [i for i in range(self.config.num_hidden_layers) if self.dump.has(Point("prefill", 0, i, "input"))]

    def close(self) -> None:
        """End the replay: the target's and the semantic shadows' loaded weights are released (`Target.release`),
        a dump the session opened is closed. The session can replay again afterwards (weights load again)."""
        for t in [self.target, *self.shadows.targets()]:
            release = getattr(t, "release", None)  # a duck-typed adapter may lack it
            if release is not None:
                release()  # not through the watchdog: it only drops references, and must run after a stall too
        self.shadows.clear()
        if getattr(self, "_owned", False):
            self.dump.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SEMANTICS = ("dump", "intended")


def _is_instance_given(target) -> bool:
    return target is not None and not isinstance(target, (str, type))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _target(target):
    from parity.targets import resolve

    if target is None:
        target = "reference"
    name = target if isinstance(target, str) else getattr(target, "__name__", type(target).__name__)
    if isinstance(target, str):
        target = resolve(target)
    if isinstance(target, type):
        try:
            target = target()
        except ParityError:
            raise
        except Exception as e:  # an adapter's constructor: one line, not a traceback per test
            raise TargetError(f"target {name!r}: constructing {target.__name__}() raised {type(e).__name__}: "
                              f"{_first_line(e)}") from None
    if not hasattr(target, "layer_forward"):
        raise TargetError(f"target {target!r} is not a parity.targets.base.Target")
    return target


def check_tokens(reader) -> None:
    """The dump's token ids must lie in its model's vocabulary (else every replay blames the target's embedding)."""
    ids = np.asarray(reader.input_ids)
    V = reader.config.vocab_size
    bad = ids[(ids < 0) | (ids >= V)]
    if bad.size:
        raise DumpError(f"{reader.path}: /tokens/input_ids holds {bad.size} id(s) outside the vocabulary 0..{V - 1} of "
                        f"its config, e.g. {sorted(set(bad.tolist()))[:5]}")


def check_checkpoint(reader, ckpt_path: Path, explicit: bool):
    """Open the checkpoint (config.json, shard index) and, for one named by the user, check that it is the one the
    dump was made from (fingerprint: config.json + every safetensors header, DESIGN §4)."""
    from parity.dumpfile import fingerprint_checkpoint
    from parity.jax_ling3.weights import CheckpointReader

    ckpt = CheckpointReader(ckpt_path)
    if explicit:
        fp = fingerprint_checkpoint(ckpt_path)
        if fp != reader.fingerprint:
            raise DumpError(f"{ckpt_path}: not the checkpoint {reader.path.name} was made from (fingerprint "
                            f"{fp[:12]}…, the dump records {reader.fingerprint[:12]}…: config.json or a safetensors "
                            "header differs); pass the dump's checkpoint")
    return ckpt


def prepare(dump, ckpt_dir=None, *, target=None, mode: str = "layer"):
    """Everything `Session.open` checks before building the target: the dump (path or DumpReader), its token ids,
    the target resolved and constructed, the mode, the checkpoint opened and matched. Returns
    (reader, owned, target, ckpt_path, ckpt); closes a reader it opened when a check fails."""
    from parity.dumpfile import DumpReader

    owned = not isinstance(dump, DumpReader)
    reader = DumpReader(dump) if owned else dump
    try:
        tgt = _target(target)
        check_mode(mode, tgt)  # before building: a mode error costs nothing
        ckpt_path = find_checkpoint(reader.fingerprint, ckpt_dir)
        ckpt = check_checkpoint(reader, ckpt_path, explicit=bool(ckpt_dir))
        check_tokens(reader)
    except BaseException:
        if owned:
            reader.close()
        raise
    return reader, owned, tgt, ckpt_path, ckpt


def dump_identity(reader) -> dict:
    """Report keys that tell which dumps can be triaged together (parity.reporting.triage): the checkpoint fingerprint and the
    dump's compute dtype."""
    return {"checkpoint_fingerprint": reader.meta.get("checkpoint_fingerprint"),
            "dump_dtype": reader.meta.get("compute_dtype")}


def target_info(target) -> dict:
    """`target.describe()` for the report header (protocol v2); a failing describe() is said, never loses the report."""
    try:
        return target.describe()
    except Exception as e:  # noqa: BLE001
        return {"error": f"describe() failed: {e}"}
