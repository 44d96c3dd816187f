"""Argument checks shared by every module.

Argument misuse raises builtins (see :mod:`r3arrow.errors`).
"""

from __future__ import annotations

import operator
import stat
from pathlib import Path
from typing import Any


def check_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` as an ``int`` after checking it is one, within ``[minimum, maximum]``.

    Parameters
    ----------
    value:
        The argument. ``bool`` is refused; numpy integers are accepted; floats,
        strings and other types are never coerced.
    name:
        The parameter's name, used in the message.
    minimum, maximum:
        Inclusive bounds, or ``None`` for unbounded.

    Raises
    ------
    TypeError
        ``value`` is not an integer (or is a ``bool``).
    ValueError
        ``value`` is outside the bounds.
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
    """``check_int(value, name, minimum=1)``."""
    return check_int(value, name, minimum=1)


def check_nonnegative_int(value: Any, name: str) -> int:
    """``check_int(value, name, minimum=0)``."""
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
    """Raise `SchemaError` (``path`` set) unless ``path`` is a regular file (after symlinks).

    Opening a FIFO blocks until a writer appears and a device can be endless, so
    readers refuse them up front. ``FileNotFoundError`` if it does not exist.
    """
    from r3arrow.errors import SchemaError

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise SchemaError(f"{path}: expected a regular file, found {kind}", path=path)
