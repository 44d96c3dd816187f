"""What a trace covers: the token ids of the turns it recorded, with a rolling digest.

Private home of `r3arrow.capture._trace`'s `as_token_ids`, `CoveredTokens` and
`prefix_mismatch_error` (re-exported there; see its docstring, "What a trace covers").
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from r3arrow.errors import PrefixMismatchError


def as_token_ids(ids: Any, name: str = "prompt_ids") -> np.ndarray:
    """Token ids as a flat int32 numpy array (a read-only array of that kind is not copied).

    Raises ``ValueError`` (argument misuse) for a non-flat or non-integer sequence, or ids
    outside ``[0, 2**31)``.
    """
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1:
        arr = ids
    else:
        raw = np.asarray(ids)
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise ValueError(
                f"{name}: expected a flat sequence of int token ids, found shape "
                f"{list(raw.shape)} of dtype {raw.dtype}"
            )
        if raw.size and (int(raw.min()) < 0 or int(raw.max()) > np.iinfo(np.int32).max):
            raise ValueError(
                f"{name}: expected token ids in [0, 2**31), found [{int(raw.min())}, "
                f"{int(raw.max())}]"
            )
        arr = raw.astype(np.int32)
    if arr.flags.writeable:
        arr = arr.copy()  # the caller may reuse its buffer: keep what was checked
        arr.flags.writeable = False
    return arr


class CoveredTokens:
    """The token ids a trace has covered, with a rolling blake2b digest; O(new tokens) per turn.

    The ids live in one growable int32 buffer (doubling: appending a turn never re-copies
    what is covered, amortised); the digest is blake2b over the int32 (native byte order)
    bytes of ``tokens[:length]``, updated with each turn's new tokens only.
    """

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.int32)
        self._len = 0
        self._hash = hashlib.blake2b(digest_size=16)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The covered ids ``[length]`` int32 (a read-only view)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    @property
    def digest(self) -> str:
        """Hex blake2b-128 of the covered ids' int32 bytes."""
        return self._hash.hexdigest()

    def first_difference(self, ids: np.ndarray) -> int:
        """First position where ``ids`` does not extend the covered ids, or -1 if it does.

        A prompt shorter than the covered ids differs at its own length. One vectorised
        comparison over the overlap.
        """
        n = self._len
        m = min(n, ids.shape[0])
        diff = np.flatnonzero(self._buf[:m] != ids[:m])
        if diff.size:
            return int(diff[0])
        return m if m < n else -1

    def extended(
        self, prompt: np.ndarray, tail: np.ndarray | None = None
    ) -> tuple[np.ndarray, Any]:
        """(buffer, digest) covering ``prompt`` then ``tail``; changes nothing.

        ``prompt`` must extend the covered ids (checked by the caller). The buffer is this
        one when it has room (the new ids are written past ``length``, where no reader
        looks), else a doubled copy; only the new ids are hashed.
        """
        n, p = self._len, prompt.shape[0]
        m = p + (0 if tail is None else tail.shape[0])
        buf = self._buf
        if m > buf.shape[0]:
            buf = np.empty(max(m, 2 * buf.shape[0], 64), dtype=np.int32)
            buf[:n] = self._buf[:n]
        buf[n:p] = prompt[n:]
        if tail is not None:
            buf[p:m] = tail
        digest = self._hash.copy()
        digest.update(buf[n:m].tobytes())
        return buf, digest

    def commit(self, buf: np.ndarray, digest: Any, length: int) -> None:
        """Adopt what `extended` returned."""
        self._buf, self._hash, self._len = buf, digest, length


def prefix_mismatch_error(
    covered: CoveredTokens,
    ids: np.ndarray,
    pos: int,
    *,
    name: str,
    trajectory_id: str | None,
) -> PrefixMismatchError:
    """The `PrefixMismatchError` for ``ids`` first differing from ``covered`` at ``pos``."""
    n = len(covered)
    if pos >= ids.shape[0]:
        found = f"a prompt of {ids.shape[0]} tokens that ends at token {pos}"
    else:
        found = (
            f"token id {int(ids[pos])} at position {pos} where the trace has "
            f"{int(covered.tokens[pos])}"
        )
    where = f"trajectory {trajectory_id!r}: " if trajectory_id is not None else ""
    return PrefixMismatchError(
        f"{where}{name}: expected the prompt to extend the {n} tokens the trace covers, found "
        f"{found} (re-tokenized history? keep the token ids the engine saw and generated)",
        token=pos,
        trajectory_id=trajectory_id,
    )


__all__ = ["CoveredTokens", "as_token_ids", "prefix_mismatch_error"]
