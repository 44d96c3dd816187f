"""Argument checks shared by every module; misuse raises builtins (see :mod:`r3arrow.errors`)."""

from __future__ import annotations

import operator
import stat
from pathlib import Path
from typing import Any

from r3arrow.errors import SchemaError

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def check_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (``None``: unbounded), else
    ``ValueError``; ``TypeError`` for a non-int (numpy ints pass; bool, float, str never).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, found {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected an int, found {type(value).__name__} {value!r:.80}"
        ) from None
    if (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        lo = "-inf" if minimum is None else str(minimum)
        hi = "inf" if maximum is None else str(maximum)
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], found {out}")
    return out


def check_positive_int(value: Any, name: str) -> int:
    return check_int(value, name, minimum=1)


def check_nonnegative_int(value: Any, name: str) -> int:
    return check_int(value, name, minimum=0)


def check_optional_int(value: Any, name: str, *, minimum: int | None = None) -> int | None:
    """``None`` passes through; anything else goes through :func:`check_int`."""
    return None if value is None else check_int(value, name, minimum=minimum)


def check_choice(value: Any, name: str, choices: tuple[str, ...] | list[str]) -> str:
    """Return ``value`` if it is one of ``choices``; else raise ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{name}: expected one of {', '.join(map(repr, choices))}, found {value!r}"
        )
    return value


def check_regular(path: Path) -> None:
    """`SchemaError` (``path`` set) unless ``path`` is a regular file: a FIFO blocks, a device
    may be endless. ``FileNotFoundError`` if it does not exist.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise SchemaError(f"{path}: expected a regular file, found {kind}", path=path)
