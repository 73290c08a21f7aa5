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
