"""The one "already validated" mark of this process, by identity of immutable Arrow objects
(weakly held): a rollout table or batch that passed the rollout checks (`is_validated`), or
routes whose ids passed both id rules for a spec (`checked_for`; ``docs/capture.md``).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from r3arrow.spec import RouteSpec

T = TypeVar("T")

_lock = threading.Lock()
_marks: dict[int, tuple[weakref.ref[Any], RouteSpec | None, int]] = {}


def mark_validated(obj: T, *, spec: RouteSpec | None = None, max_id: int = -1) -> T:
    """Record that ``obj`` passed validation (for ``spec``, largest id ``max_id``); return it."""
    key = id(obj)

    def forget(_: weakref.ref[Any], key: int = key) -> None:
        with _lock:
            _marks.pop(key, None)

    with _lock:
        _marks[key] = (weakref.ref(obj, forget), spec, max_id)
    return obj


def _entry(obj: Any) -> tuple[weakref.ref[Any], RouteSpec | None, int] | None:
    with _lock:
        entry = _marks.get(id(obj))
    return entry if entry is not None and entry[0]() is obj else None


def is_validated(obj: Any) -> bool:
    """True if ``obj`` is the very object passed to `mark_validated` (and still alive)."""
    return _entry(obj) is not None


def checked_for(routes: Any, spec: RouteSpec) -> bool:
    """True if ``routes`` was marked for a spec with the same shape, router layers and dtype, and
    its largest id fits ``spec`` (below its experts and storage cap).
    """
    entry = _entry(routes)
    if entry is None or entry[1] is None:
        return False
    own, hi = entry[1], entry[2]
    return (
        own.same_shape(spec)
        and own.dtype == spec.dtype
        and hi <= spec.storage_cap
        and (spec.num_experts is None or hi < spec.num_experts)
    )
