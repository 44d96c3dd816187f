"""Deterministic fault injection for `EngineServer`, consumed in order by generation requests.

    plan = FaultPlan().then(Fault.status(503), times=2).then(Fault.short_routes(1))
    with EngineServer(engine, faults=plan) as server:
        ...                       # 1st and 2nd generation requests: 503, 3rd: one row short
    plan.seen("/inference/v1/generate")   # generation requests received on that path

The faults and what the client sees (``docs/design.md``, "Wire formats"):

======================  =================================================================
``delay(s)``            the answer comes ``s`` seconds late (a timeout, or a slow engine)
``trickle(s)``          generated normally, the body sent one byte at a time over ``s``
                        seconds (each read is quick, the whole answer is not)
``respond(body)``       ``body`` answered as is (status and headers as given), nothing
                        generated: any response, a corrupt or hostile one included
``status(code)``        HTTP ``code`` with vLLM's error JSON, nothing generated (429/5xx:
                        retried; other 4xx: refused at once); ``retry_after`` adds the header
``drop_connection()``   the connection closes after the request is read, no response
                        (a transport error: retried)
``malformed_routes(m)`` generated normally, ``routed_experts`` replaced by a corrupt payload
                        of mode ``m`` (a data error: never retried), see below
``short_routes(n)``     the last ``n`` route rows dropped (a row-count error)
``extra_routes(n)``     ``n`` well-formed rows appended (a row-count error)
``no_routes()``         ``routed_experts: null``, as vLLM without route capture
``duplicate_experts()`` one router-layer row names an expert twice (a data error:
                        `DuplicateExpertError`, never retried)
``zero_router_layer()`` a router layer answered all zeros, as if it were dense (with
                        ``K > 1`` its rows repeat expert 0: a `DuplicateExpertError`)
======================  =================================================================

Client-side scenarios are not server faults: `drift_prompt` re-tokenizes a
conversation's history (the chat-template drift that `PrefixMismatchError` catches
before a request is sent).

Modes of ``malformed_routes`` (`corrupt_routes` applies them):

============  ======================================================================
``base64``    not base64 at all
``not_npy``   valid base64 of bytes that are not an ``.npy`` file
``object``    an ``.npy`` header declaring an object array (loading it needs pickle)
``float``     a well-formed ``.npy`` of float32 values
``truncated`` an ``.npy`` whose data is cut short of what its header declares
``shape``     a well-formed 2-D ``[rows, L*K]`` array
============  ======================================================================

On SGLang's wire (``wire="sglang"``: base64 of raw int32, no header) the modes send:
``base64`` not base64; ``not_npy`` the int32 bytes plus one stray byte (not whole rows);
``object`` half a row; ``float`` the rows as float32 bits (ids far out of range);
``truncated`` the last id cut off; ``shape`` the rows as int64 (twice the rows, each id
followed by a zero). Every one is a data error; the rest of the faults apply unchanged.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, deque
from collections.abc import Mapping
from typing import Literal

import numpy as np
import pybase64

from r3arrow._checks import check_choice, check_int, check_optional_int, check_positive_int
from r3arrow.codec import encode_sglang
from r3arrow.testing.engine._protocol import COMPLETIONS_PATH, GENERATE_PATH, encode_npy_b64
from r3arrow.testing.engine._sglang import GENERATE_PATH as SGLANG_GENERATE_PATH

FaultKind = Literal[
    "delay",
    "trickle",
    "respond",
    "status",
    "drop_connection",
    "malformed_routes",
    "short_routes",
    "extra_routes",
    "no_routes",
    "duplicate_experts",
    "zero_router_layer",
]
MalformedMode = Literal["base64", "not_npy", "object", "float", "truncated", "shape"]

#: Paths whose requests consume faults (vLLM's generation endpoints, SGLang's ``/generate``).
GENERATION_PATHS = (GENERATE_PATH, COMPLETIONS_PATH, SGLANG_GENERATE_PATH)
Wire = Literal["npy", "sglang"]
#: Route payload encodings `corrupt_routes` writes: vLLM's base64 ``.npy``, SGLang's raw int32.
WIRES: tuple[Wire, ...] = ("npy", "sglang")
MALFORMED_MODES: tuple[MalformedMode, ...] = (
    "base64",
    "not_npy",
    "object",
    "float",
    "truncated",
    "shape",
)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault; build it with the static constructors."""

    kind: FaultKind
    seconds: float = 0.0
    status_code: int = 0
    retry_after: float | None = None
    rows: int = 0
    mode: MalformedMode = "base64"
    layer: int | None = None
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def delay(seconds: float) -> Fault:
        """Wait ``seconds`` before answering normally."""
        return Fault("delay", seconds=_seconds(seconds, "Fault.delay"))

    @staticmethod
    def trickle(seconds: float) -> Fault:
        """Answer normally, the body's bytes spread evenly over ``seconds``."""
        return Fault("trickle", seconds=_seconds(seconds, "Fault.trickle"))

    @staticmethod
    def respond(
        body: bytes, *, status: int = 200, headers: Mapping[str, str] | None = None
    ) -> Fault:
        """Answer HTTP ``status`` with ``body`` and ``headers`` (content-type default
        ``application/json``; content-length always ``len(body)``), without generating."""
        if not isinstance(body, bytes):
            raise TypeError(f"Fault.respond: expected body as bytes, found {type(body).__name__}")
        code = check_int(status, "Fault.respond: status", minimum=200, maximum=599)
        pairs = tuple((str(k), str(v)) for k, v in (headers or {}).items())
        if any(k.lower() == "content-length" for k, _ in pairs):
            raise ValueError("Fault.respond: content-length is len(body); found it in headers")
        return Fault("respond", status_code=code, body=body, headers=pairs)

    @staticmethod
    def status(code: int, *, retry_after: float | None = None) -> Fault:
        """Answer with HTTP ``code`` (e.g. 503, 429, 500) and vLLM's error JSON, without generating.

        ``retry_after`` (seconds) adds a ``Retry-After`` header.
        """
        code = check_int(code, "Fault.status: HTTP error code", minimum=400, maximum=599)
        if retry_after is not None and not retry_after >= 0:
            raise ValueError(
                f"Fault.status: expected retry_after >= 0 or None, found {retry_after!r}"
            )
        return Fault("status", status_code=code, retry_after=retry_after)

    @staticmethod
    def drop_connection() -> Fault:
        """Close the connection after reading the request, without any response."""
        return Fault("drop_connection")

    @staticmethod
    def malformed_routes(mode: MalformedMode = "base64") -> Fault:
        """Generate normally, then replace every ``routed_experts`` with a corrupt payload.

        ``mode`` is one of `MALFORMED_MODES` (the module docstring says what each sends).
        """
        check_choice(mode, "Fault.malformed_routes: mode", MALFORMED_MODES)
        return Fault("malformed_routes", mode=mode)

    @staticmethod
    def short_routes(n: int = 1) -> Fault:
        """Generate normally, then drop the last ``n`` rows of ``routed_experts``."""
        return Fault("short_routes", rows=check_positive_int(n, "Fault.short_routes: n"))

    @staticmethod
    def extra_routes(n: int = 1) -> Fault:
        """Generate normally, then append ``n`` well-formed rows to ``routed_experts``."""
        return Fault("extra_routes", rows=check_positive_int(n, "Fault.extra_routes: n"))

    @staticmethod
    def no_routes() -> Fault:
        """Generate normally, but answer ``routed_experts: null`` (capture disabled)."""
        return Fault("no_routes")

    @staticmethod
    def duplicate_experts(layer: int | None = None) -> Fault:
        """Generate normally, then make the middle row of a router layer repeat its first expert.

        ``layer``: the layer to corrupt (None: the first layer with a nonzero id, a router
        layer). Needs ``K >= 2``.
        """
        layer = check_optional_int(layer, "Fault.duplicate_experts: layer", minimum=0)
        return Fault("duplicate_experts", layer=layer)

    @staticmethod
    def zero_router_layer(layer: int | None = None) -> Fault:
        """Generate normally, then zero every row of a router layer (None: the first one)."""
        layer = check_optional_int(layer, "Fault.zero_router_layer: layer", minimum=0)
        return Fault("zero_router_layer", layer=layer)


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what}: expected seconds as a number, found {value!r}")
    if not value >= 0:
        raise ValueError(f"{what}: expected seconds >= 0, found {value!r}")
    return float(value)


@dataclasses.dataclass
class _Entry:
    fault: Fault
    remaining: int | None  # None: forever
    endpoint: str | None


class FaultPlan:
    """A thread-safe queue of faults consumed by generation requests, in order.

    Each generation request takes the first queued entry whose endpoint matches
    (``None`` matches both generation paths); requests to other paths never take
    faults. An entry added with ``times=None`` applies to every later request.
    `seen` counts every request the server received, by path, faulted or not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[_Entry] = deque()
        self._seen: Counter[str] = Counter()
        self._injected: list[tuple[str, Fault]] = []

    def then(
        self, fault: Fault, *, times: int | None = 1, endpoint: str | None = None
    ) -> FaultPlan:
        """Queue ``fault`` for the next ``times`` matching requests (``None``: all); return self."""
        if not isinstance(fault, Fault):
            raise TypeError(f"FaultPlan.then: expected a Fault, found {type(fault).__name__}")
        times = check_optional_int(times, "FaultPlan.then: times", minimum=1)
        if endpoint is not None:
            check_choice(endpoint, "FaultPlan.then: endpoint (or None)", GENERATION_PATHS)
        with self._lock:
            self._queue.append(_Entry(fault, times, endpoint))
        return self

    def take(self, path: str) -> Fault | None:
        """Record a request on ``path``; return the fault it must suffer (if any), consuming it."""
        with self._lock:
            self._seen[path] += 1
            if path not in GENERATION_PATHS:
                return None
            for entry in self._queue:
                if entry.endpoint is None or entry.endpoint == path:
                    if entry.remaining is not None:
                        entry.remaining -= 1
                        if entry.remaining == 0:
                            self._queue.remove(entry)
                    self._injected.append((path, entry.fault))
                    return entry.fault
            return None

    def seen(self, path: str | None = None) -> int:
        """Requests received on ``path`` (``None``: on every path)."""
        with self._lock:
            return sum(self._seen.values()) if path is None else self._seen[path]

    @property
    def injected(self) -> list[tuple[str, Fault]]:
        """(path, fault) of every fault applied so far, in order."""
        with self._lock:
            return list(self._injected)

    @property
    def pending(self) -> int:
        """Faults still queued (an entry with ``times=None`` counts as one)."""
        with self._lock:
            return sum(1 if e.remaining is None else e.remaining for e in self._queue)


def corrupt_routes(arr: np.ndarray, fault: Fault, *, wire: Wire = "npy") -> str | None:
    """The ``routed_experts`` value a response carries under ``fault`` instead of ``arr``.

    ``wire``: the payload encoding, ``"npy"`` (vLLM) or ``"sglang"`` (raw int32).

    ``arr`` is the engine's ``[rows, L, K]`` rows; returns the payload string (base64), or
    None for ``no_routes``. Only the route faults (``malformed_routes``, ``short_routes``,
    ``extra_routes``, ``no_routes``, ``duplicate_experts``, ``zero_router_layer``) belong
    here. Raises ``ValueError`` for another fault, or a corruption the rows cannot take
    (``duplicate_experts`` with ``K == 1``, a ``layer`` out of range, no router layer).
    """
    check_choice(wire, "corrupt_routes: wire", WIRES)
    encode = encode_sglang if wire == "sglang" else encode_npy_b64
    if fault.kind == "no_routes":
        return None
    if fault.kind in ("duplicate_experts", "zero_router_layer"):
        return encode(_corrupt_layer(arr, fault))
    if fault.kind == "short_routes":
        return encode(arr[: max(0, arr.shape[0] - fault.rows)])
    if fault.kind == "extra_routes":
        extra = np.broadcast_to(
            np.arange(arr.shape[2], dtype=arr.dtype), (fault.rows, *arr.shape[1:])
        )
        return encode(np.concatenate([arr, extra]))
    if fault.kind != "malformed_routes":
        raise ValueError(f"corrupt_routes: expected a route fault, found {fault.kind!r}")
    mode = fault.mode
    if wire == "sglang":
        return _corrupt_sglang(arr, mode)
    if mode == "base64":
        return "!!not base64: routed experts lost in transit!!"
    if mode == "not_npy":
        return pybase64.b64encode(b"this is not an .npy file" + arr.tobytes()).decode("ascii")
    if mode == "object":
        # An .npy header declaring an object array: loading it would need pickle.
        header = b"{'descr': '|O', 'fortran_order': False, 'shape': (%d,), }" % arr.shape[0]
        header = header.ljust(118) + b"\n"
        return pybase64.b64encode(
            b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 16
        ).decode("ascii")
    if mode == "float":
        return encode_npy_b64(arr.astype(np.float32))
    if mode == "truncated":
        full = pybase64.b64decode(encode_npy_b64(arr))
        return pybase64.b64encode(full[: len(full) - max(1, arr.nbytes // 2)]).decode("ascii")
    return encode_npy_b64(arr.reshape(arr.shape[0], -1))  # "shape"


def _corrupt_sglang(arr: np.ndarray, mode: MalformedMode) -> str:
    """A corrupt SGLang payload (raw int32) of ``mode`` for the rows ``arr``."""
    raw = np.ascontiguousarray(arr, dtype="<i4").tobytes()
    row = arr.shape[1] * arr.shape[2] * 4
    if mode == "base64":
        return "!!not base64: routed experts lost in transit!!"
    if mode == "not_npy":
        data = raw + b"\x01"
    elif mode == "object":
        data = raw[: row // 2] if row > 4 else raw + b"\x01"
    elif mode == "float":
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    elif mode == "truncated":
        data = raw[:-4] if row > 4 else raw + b"\x01"
    else:  # "shape"
        data = np.ascontiguousarray(arr, dtype="<i8").tobytes()
    return pybase64.b64encode(data).decode("ascii")


def _corrupt_layer(arr: np.ndarray, fault: Fault) -> np.ndarray:
    """A copy of ``arr`` with one router layer corrupted as ``fault`` says."""
    rows, layers, k = arr.shape
    if fault.layer is not None:
        if fault.layer >= layers:
            raise ValueError(
                f"{fault.kind}: expected a layer in [0, {layers}), found {fault.layer}"
            )
        layer = fault.layer
    else:
        routed = np.flatnonzero(arr.any(axis=(0, 2)))
        if routed.size == 0:
            raise ValueError(f"{fault.kind}: expected a router layer (a nonzero id), found none")
        layer = int(routed[0])
    out = arr.copy()
    if fault.kind == "zero_router_layer":
        out[:, layer, :] = 0
        return out
    if k < 2 or rows == 0:
        raise ValueError(f"duplicate_experts: expected rows with K >= 2, found shape {arr.shape}")
    out[rows // 2, layer, 1] = out[rows // 2, layer, 0]
    return out


def drift_prompt(conversation: list[int], position: int, vocab_size: int) -> list[int]:
    """``conversation`` re-tokenized differently at ``position``: that token split into two.

    Models a chat template that renders the history back to text and tokenizes it again:
    the ids from ``position`` on no longer match what the engine saw. Returns a new list
    (one token longer); raises ``ValueError`` for a position outside the conversation.
    """
    position = check_int(position, "drift_prompt: position", minimum=0)
    if position >= len(conversation):
        raise ValueError(
            f"drift_prompt: expected a position < {len(conversation)}, found {position}"
        )
    tok = conversation[position]
    split = [(tok + 1) % vocab_size, (tok + 2) % vocab_size]
    return [*conversation[:position], *split, *conversation[position + 1 :]]


__all__ = [
    "GENERATION_PATHS",
    "MALFORMED_MODES",
    "WIRES",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "MalformedMode",
    "Wire",
    "corrupt_routes",
    "drift_prompt",
]
