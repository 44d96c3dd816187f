"""The one message for a missing optional dependency: what needs it and the extra to install.

``with require(extra="stats", feature="r3arrow.stats"): import polars`` turns a third-party
package missing inside the block into ``ImportError("r3arrow.stats needs polars: pip install
'r3arrow[stats]'")``, chained from the original (extras: ``pyproject.toml``). The first
guard that sees the package missing words the message; guards around it let it through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def require(*, extra: str, feature: str) -> Iterator[None]:
    """Imports in the block that miss a third-party package raise the extra's `ImportError`
    (a missing ``r3arrow`` module is a bug: raised as it is)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "r3arrow":
            raise
        raise ImportError(
            f"{feature} needs {missing}: pip install 'r3arrow[{extra}]'", name=missing
        ) from exc


__all__ = ["require"]
