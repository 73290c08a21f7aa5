"""The suite's own error types.

Every bad input (config, checkpoint, dump, tolerance file, target) is reported as a subclass of
`ParityError` with a one-line message naming the file / key / field and what was expected
(DESIGN §10), never as a raw traceback from h5py, numpy or jax.
"""


class ParityError(Exception):
    """Base class of every error this suite raises on bad input."""


class ConfigError(ParityError):
    """An HF config.json that is not a (consistent) Ling3 config."""


class CheckpointError(ParityError):
    """A checkpoint directory whose files or keys are not what a Ling3 checkpoint holds."""


class DumpError(ParityError):
    """A dump file that is foreign, truncated, incomplete, of another checkpoint, or malformed."""


class ToleranceError(ParityError):
    """A tolerance-rules file or rule that cannot be used."""


class TargetError(ParityError):
    """A JAX target that is unavailable or does not follow the target protocol."""


class TargetCallError(TargetError):
    """A target method raised while replaying one layer (or the model-level points): one usage error per replay unit
    naming the layer, the call and the exception's last frame, instead of one identical failure per point."""

    def __init__(self, what: str, exc: BaseException) -> None:
        import traceback

        where, _, call = what.rpartition(": ")
        frames = traceback.extract_tb(exc.__traceback__)
        last = frames[-1] if frames else None
        self.where, self.call = where or what, call or what
        self.exception = f"{type(exc).__name__}: {_first_line(exc)}"
        self.frame = "(no frame)" if last is None else f"{last.filename}:{last.lineno} in {last.name}"
        super().__init__(f"{self.where}: target call {self.call} raised {self.exception} (last frame: {self.frame})")

    def to_dict(self) -> dict:
        return {"where": self.where, "call": self.call, "exception": self.exception, "frame": self.frame,
                "message": str(self)}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
