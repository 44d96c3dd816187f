"""The one "already validated" mark of this process (one check per trust boundary).

Arrow arrays, record batches and tables are immutable, so identity is enough: the registry
holds weak references and forgets an object when it dies. Two kinds of proof are recorded:

- a rollout table or batch that passed the rollout checks (`mark_validated`): built by
  `r3arrow.rollout_table`, returned by a validating reader, or derived from such a table;
  writing or collating it does not validate it again (`is_validated`);
- a routes array whose every row passed both id rules (`r3arrow.ids`) for a spec, with the
  largest id seen (``mark_validated(arr, spec=, max_id=)``): `checked_for` says whether those
  rules then hold for another spec, so a table builder references the array without checking
  its ids again (``docs/capture.md``).
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
    """True if ``routes`` was marked with a spec under whose id rules ``spec``'s also hold.

    They do when the shape and router layers match, the storage dtype is ``spec.dtype`` and the
    largest id recorded fits ``spec`` (below ``spec.num_experts`` and the storage cap).
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
