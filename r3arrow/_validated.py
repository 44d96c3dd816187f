"""The one "already validated" mark of this process, by identity of immutable Arrow objects
(weakly held): a rollout table or batch that passed the rollout checks (`is_validated`), or
routes whose ids passed both id rules for a spec (`checked_for`; ``docs/capture.md``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from r3arrow.spec import RouteSpec

T = TypeVar("T")

# Each access is one dict operation (atomic); an entry goes as its object dies, before the id
# can be reused.
_marks: dict[int, tuple[weakref.ref[Any], RouteSpec | None, int]] = {}


def mark_validated(obj: T, *, spec: RouteSpec | None = None, max_id: int = -1) -> T:
    """Record that ``obj`` passed validation (for ``spec``, largest id ``max_id``); return it."""
    key = id(obj)
    _marks[key] = (weakref.ref(obj, lambda _: _marks.pop(key, None)), spec, max_id)
    return obj


def _entry(obj: Any) -> tuple[weakref.ref[Any], RouteSpec | None, int] | None:
    entry = _marks.get(id(obj))
    return entry if entry is not None and entry[0]() is obj else None


def is_validated(obj: Any) -> bool:
    """True if ``obj`` is the very object passed to `mark_validated` (and still alive)."""
    return _entry(obj) is not None


def checked_for(routes: Any, spec: RouteSpec) -> bool:
    """True if ``routes`` was marked for a spec with the same shape, router layers and dtype, and
    its largest id fits ``spec`` (below its experts and storage cap).
    """
    _, own, hi = _entry(routes) or (None, None, -1)
    return (
        own is not None
        and own.same_shape(spec)
        and own.dtype == spec.dtype
        and hi <= spec.storage_cap
        and (spec.num_experts is None or hi < spec.num_experts)
    )
