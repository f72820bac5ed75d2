"""Errors that name the problem, raised before any work reaches MLX."""


class MlxfunError(ValueError):
    """Base class: bad input to mlxfun (a path, a checkpoint, a prompt or a setting)."""


class ModelError(MlxfunError):
    """A checkpoint that cannot be loaded: missing files, unknown architecture, bad tensors."""


class InputError(MlxfunError):
    """A prompt or generation setting that cannot be honoured."""
