"""Errors that name the problem, raised before any work reaches MLX, and the checks that raise them."""

from __future__ import annotations

import numbers

import numpy as np


class MlxfunError(ValueError):
    """Base class: bad input to mlxfun (a path, a checkpoint, a prompt or a setting)."""


class ModelError(MlxfunError):
    """A checkpoint that cannot be loaded: missing files, unknown architecture, bad tensors."""


class InputError(MlxfunError):
    """A prompt or generation setting that cannot be honoured."""


def is_int(v) -> bool:
    """An integer that is not a bool (True is not a token count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_int_from(low: int, kind: str, name: str, v, allow_none: bool) -> None:
    if v is None and allow_none:
        return
    if not is_int(v) or v < low:
        raise InputError(f"{name} must be a {kind} integer{' or None' if allow_none else ''}, got {v!r}")


def check_positive_int(name: str, v, allow_none: bool = False) -> None:
    _check_int_from(1, "positive", name, v, allow_none)


def check_non_negative_int(name: str, v, allow_none: bool = False) -> None:
    _check_int_from(0, "non-negative", name, v, allow_none)


def check_bool(name: str, v) -> None:
    if not isinstance(v, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {v!r}")
