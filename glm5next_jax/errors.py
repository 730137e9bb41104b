"""The library's own errors: what it refuses before any work starts, each message naming the argument,
the file or the tensor, what was expected and what was found."""

import numpy as np


class InputError(ValueError):
    """An argument, a file's contents or a tensor the library refuses. A ValueError, so that code
    catching ValueError keeps working."""


class MissingFileError(InputError, FileNotFoundError):
    """A file or folder the call needs is not there (or is not what the call reads)."""


def checked_int(name, value, low, high=None):
    """`value` as an int when it is an integer (Python's or numpy's, not a bool) in [low, high], else
    an InputError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InputError(f"{name} must be {bounds}, got {value}")
    return value
