"""`EngineServer`: the reference engine over real HTTP on loopback, with vLLM's schema.

Endpoints (request and response JSON as observed on vLLM 0.32.0 with
``--enable-return-routed-experts --enable-scale-out --skip-tokenizer-init``):

* ``POST /inference/v1/generate``: ``{"token_ids", "sampling_params", "model"?, "request_id"?,
  "return_token_ids"?, ...}`` -> ``{"request_id": "generate-tokens-...", "choices": [{"index",
  "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
  "weight_versions", "logprobs"}], "usage", ...}``
* ``POST /v1/completions``: OpenAI completions with ``"prompt": [ids]`` (or a list of them) and
  the sampling parameters at top level; ``choices[i].token_ids`` only with ``"return_token_ids": true``.
* ``GET /health`` (200, empty body), ``GET /v1/models``.

``routed_experts`` is base64 of an ``.npy`` file (``np.save``), ``[P - start + G - 1, L, K]``.
Errors are ``{"error": {"message", "type", "param", "code"}}``. Differences from vLLM
(all stricter): token ids outside the vocabulary are a 400 (vLLM's engine dies on them),
``P + max_tokens > max_model_len`` is a 400 (vLLM silently lowers ``max_tokens``), and
streaming, text prompts and sampling features the tiny model lacks (``top_p`` ...) are a 400
instead of being ignored.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import orjson
import pybase64

from r3arrow.engine.faults import Fault, FaultPlan
from r3arrow.engine.model import EngineRequestError, GenerateResult, ReferenceEngine

_T = TypeVar("_T")

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
_GET_PATHS = ("/health", "/v1/models")
_POST_PATHS = (GENERATE_PATH, COMPLETIONS_PATH)

#: Sampling parameters the tiny model does not implement, with the value that means "off".
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0, None),
    "top_k": (0, -1, None),
    "min_p": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "prompt_logprobs": (None,),
    "stop": (None, [], ""),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "echo": (False, None),
    "best_of": (None, 1),
}


class _HTTPError(Exception):
    """An error answer: vLLM's ``{"error": {...}}`` body with ``status``."""

    def __init__(
        self, status: int, message: str, *, err_type: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, err_type=self.err_type, param=self.param)


def error_body(
    status: int, message: str, *, err_type: str, param: str | None = None
) -> dict[str, Any]:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _status_type(code: int) -> str:
    """vLLM's ``error.type`` for an HTTP status."""
    named = {
        500: "InternalServerError",
        503: "ServiceUnavailableError",
        404: "NotFoundError",
        400: "BadRequestError",
    }
    if code in named:
        return named[code]
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return "Error"


def _schema_error(loc: str, kind: str, msg: str, value: object) -> _HTTPError:
    # vLLM renders pydantic validation errors this way (type "Bad Request", param = loc).
    shown: object = value
    if isinstance(value, list | tuple | dict):
        shown = f"<{type(value).__name__} of {len(value)} items>"
    detail = {"type": kind, "loc": loc, "msg": msg, "input": shown}
    return _HTTPError(400, f"1 validation error:\n  {detail}", err_type="Bad Request", param=loc)


def _bad_request(message: str, param: str | None = None) -> _HTTPError:
    return _HTTPError(400, message, err_type="BadRequestError", param=param)


def encode_npy_b64(arr: np.ndarray) -> str:
    """vLLM's ``numpy2base64``: base64 (ASCII) of the ``.npy`` bytes of ``arr``."""
    with io.BytesIO() as buf:
        np.save(buf, arr, allow_pickle=False)
        return pybase64.b64encode(buf.getbuffer()).decode("ascii")


def _corrupt_routes(arr: np.ndarray, fault: Fault) -> str | None:
    if fault.kind == "no_routes":
        return None
    if fault.kind == "short_routes":
        return encode_npy_b64(arr[: max(0, arr.shape[0] - fault.rows)])
    if fault.kind == "extra_routes":
        extra = np.broadcast_to(
            np.arange(arr.shape[2], dtype=arr.dtype), (fault.rows, *arr.shape[1:])
        )
        return encode_npy_b64(np.concatenate([arr, extra]))
    mode = fault.mode
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
    # "shape"
    return encode_npy_b64(arr.reshape(arr.shape[0], -1))


# ------------------------------------------------------------------ parsing
def _get_int(obj: dict[str, Any], key: str, loc: str, default: int | None) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _schema_error(f"{loc}.{key}", "int_parsing", "Input should be a valid integer", value)
    return value


def _get_float(obj: dict[str, Any], key: str, loc: str, default: float) -> float:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _schema_error(
            f"{loc}.{key}", "float_parsing", "Input should be a valid number", value
        )
    return float(value)


def _get_bool(obj: dict[str, Any], key: str, loc: str, default: bool) -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _schema_error(
            f"{loc}.{key}", "bool_parsing", "Input should be a valid boolean", value
        )
    return value


def _get_int_list(obj: dict[str, Any], key: str, loc: str) -> list[int] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise _schema_error(
            f"{loc}.{key}", "list_type", "Input should be a valid list of integers", value
        )
    return value


@dataclasses.dataclass(frozen=True)
class _Sampling:
    n: int
    max_tokens: int | None
    temperature: float
    seed: int | None
    start: int
    stop_token_ids: list[int] | None
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None


def _parse_sampling(obj: dict[str, Any], loc: str, *, default_max_tokens: int | None) -> _Sampling:
    for key, allowed in _UNSUPPORTED_DEFAULTS.items():
        if key in obj and obj[key] not in allowed:
            raise _bad_request(
                f"{key}={obj[key]!r} is not supported by the r3arrow reference engine "
                f"(supported: the default, {allowed[0]!r})",
                key,
            )
    start = _get_int(obj, "routed_experts_prompt_start", loc, 0)
    assert start is not None
    if start < 0:
        raise _schema_error(
            f"{loc}.routed_experts_prompt_start",
            "greater_than_equal",
            "Input should be greater than or equal to 0",
            str(start),
        )
    n = _get_int(obj, "n", loc, 1)
    assert n is not None
    if n < 1:
        raise _bad_request(f"n must be at least 1, got {n}. (parameter=n, value={n})", "n")
    min_tokens = _get_int(obj, "min_tokens", loc, 0)
    assert min_tokens is not None
    logprobs = _get_int(obj, "logprobs", loc, None)
    if logprobs is not None and logprobs < -1:
        raise _bad_request(
            f"logprobs must be non-negative or -1, got {logprobs}. (parameter=logprobs, value={logprobs})",
            "logprobs",
        )
    return _Sampling(
        n=n,
        max_tokens=_get_int(obj, "max_tokens", loc, default_max_tokens),
        temperature=_get_float(obj, "temperature", loc, 1.0),
        seed=_get_int(obj, "seed", loc, None),
        start=start,
        stop_token_ids=_get_int_list(obj, "stop_token_ids", loc),
        ignore_eos=_get_bool(obj, "ignore_eos", loc, False),
        min_tokens=min_tokens,
        logprobs=logprobs,
    )


def _reject_unsupported_mode(obj: dict[str, Any]) -> None:
    if obj.get("stream"):
        raise _bad_request("stream=true is not supported by the r3arrow reference engine", "stream")


class RequestLog:
    """Thread-safe record of the requests a server received: counts per path, recent bodies."""

    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._bodies: collections.deque[tuple[str, Any]] = collections.deque(maxlen=keep)

    def record(self, path: str, body: Any) -> None:
        with self._lock:
            self._counts[path] += 1
            self._bodies.append((path, body))

    def count(self, path: str | None = None) -> int:
        """Requests received on ``path`` (``None``: all paths)."""
        with self._lock:
            return sum(self._counts.values()) if path is None else self._counts[path]

    def bodies(self, path: str) -> list[Any]:
        """Parsed JSON bodies (None if unparsable) of the most recent requests on ``path``."""
        with self._lock:
            return [b for p, b in self._bodies if p == path]


# ------------------------------------------------------------------ server
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], app: EngineServer) -> None:
        self.app = app
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (timeout, dropped pool) is not a server error.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "r3arrow-reference-engine"
    sys_version = ""
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without NODELAY, Nagle's algorithm holds
        # the body until the client's delayed ACK (~40 ms per request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.settimeout(self.server.app.idle_timeout)
        self.server.app._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.app._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # silence the stdlib's per-request stderr line

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, orjson.dumps(payload), "application/json", headers)

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        path = urlsplit(self.path).path
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            self.close_connection = True
            self._send_json(
                411,
                error_body(
                    411, "send a content-length, not a chunked body", err_type="Length Required"
                ),
            )
            return
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            bad = self.headers.get("content-length")
            self._send_json(
                400,
                error_body(
                    400,
                    f"expected a non-negative content-length, found {bad!r}",
                    err_type="Bad Request",
                ),
            )
            return
        if length > app.max_body_bytes:
            self.close_connection = True
            self._send_json(
                413,
                error_body(
                    413,
                    f"request body of {length} bytes exceeds {app.max_body_bytes}",
                    err_type="Payload Too Large",
                ),
            )
            return
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        json_error: str | None = None
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            json_error = str(exc)
        app.log.record(path, body)
        fault = app.faults.take(path) if app.faults is not None else None
        if fault is not None:
            if fault.kind == "delay":
                time.sleep(fault.seconds)
            elif fault.kind == "status":
                code = fault.status_code
                err_type = _status_type(code)
                extra = (
                    {"retry-after": f"{fault.retry_after:g}"}
                    if fault.retry_after is not None
                    else None
                )
                self._send_json(
                    code, error_body(code, f"injected fault: HTTP {code}", err_type=err_type), extra
                )
                return
            elif fault.kind == "drop_connection":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
        route_fault = fault if fault is not None and fault.kind != "delay" else None

        if path in _GET_PATHS or path in _POST_PATHS:
            allowed = "GET" if path in _GET_PATHS else "POST"
            if method != allowed:
                self._send_json(405, {"detail": "Method Not Allowed"}, {"allow": allowed})
                return
        else:
            self._send_json(404, {"detail": "Not Found"})
            return
        if path == "/health":
            self._send(200, b"", None)
            return
        if path == "/v1/models":
            self._send_json(200, app.models_payload())
            return
        try:
            if not (self.headers.get("content-type") or "").lower().startswith("application/json"):
                raise _HTTPError(
                    400,
                    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    err_type="Bad Request",
                )
            if json_error is not None:
                raise _schema_error("body", "json_invalid", "JSON decode error", json_error)
            if not isinstance(body, dict):
                raise _schema_error(
                    "body",
                    "model_attributes_type",
                    "Input should be a valid dictionary or object to extract fields from",
                    body,
                )
            handler: Callable[[dict[str, Any], Fault | None], dict[str, Any]] = (
                app.handle_generate if path == GENERATE_PATH else app.handle_completions
            )
            payload = handler(body, route_fault)
        except _HTTPError as exc:
            self._send_json(exc.status, exc.body())
            return
        except Exception as exc:  # a bug in the engine: answer like vLLM, keep serving
            self._send_json(
                500, error_body(500, f"{type(exc).__name__}: {exc}", err_type="InternalServerError")
            )
            return
        self._send_json(200, payload)


class EngineServer:
    """Serves a `ReferenceEngine` over HTTP/1.1 (keep-alive) on ``host:port`` (0: a free port).

    Use as a context manager or call `start`/`stop`. ``url`` is ``http://host:port``.
    ``faults`` injects failures into generation requests; ``log`` records every request.
    Model calls run one at a time on one worker thread; parsing and encoding run concurrently
    on the connection threads.
    """

    def __init__(
        self,
        engine: ReferenceEngine | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        model_name: str = "r3arrow-tiny-moe",
        return_routed_experts: bool = True,
        max_body_bytes: int = 64 << 20,
        idle_timeout: float = 60.0,
    ) -> None:
        self.engine = engine if engine is not None else ReferenceEngine()
        self.host = host
        self.faults = faults
        self.model_name = model_name
        self.return_routed_experts = return_routed_experts
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.log = RequestLog()
        self._requested_port = port
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._peak_conns = 0
        self._accepted = 0
        self._created = int(time.time())

    # -------------------------------------------------------------- lifecycle
    def start(self) -> EngineServer:
        """Bind and serve in a daemon thread; returns self. Raises RuntimeError if already started."""
        if self._httpd is not None:
            raise RuntimeError(f"EngineServer already serving on {self.url}")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="r3arrow-engine-model")
        self._httpd = _Server((self.host, self._requested_port), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="r3arrow-engine",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close every open connection (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        httpd.server_close()
        if self._thread is not None:
            self._thread.join()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conns_lock:
            if add:
                self._conns.add(conn)
                self._accepted += 1
                self._peak_conns = max(self._peak_conns, len(self._conns))
            else:
                self._conns.discard(conn)

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted so far (keep-alive reuses one for many requests)."""
        with self._conns_lock:
            return self._accepted

    @property
    def peak_connections(self) -> int:
        """Most connections open at the same time so far."""
        with self._conns_lock:
            return self._peak_conns

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError(
                "EngineServer is not running: call start() or use it as a context manager"
            )
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -------------------------------------------------------------- endpoints
    def models_payload(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "r3arrow",
                    "root": self.model_name,
                    "parent": None,
                    "max_model_len": self.engine.config.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": self._created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise _HTTPError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.model_name}",
                err_type="NotFoundError",
                param="model",
            )

    def _prompt(self, value: object, loc: str) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise _schema_error(loc, "list_type", "Input should be a valid list of integers", value)
        if not value:
            raise _schema_error(
                loc, "too_short", "List should have at least 1 item after validation, not 0", value
            )
        if any(t < 0 for t in value):
            raise _schema_error(
                loc, "value_error", "Value error, token_ids must not contain negative values", value
            )
        try:
            self.engine.check_token_ids(value, "token_ids")
        except EngineRequestError as exc:
            raise _bad_request(str(exc), "token_ids") from exc
        return value

    def _run(self, prompt: list[int], sp: _Sampling) -> list[GenerateResult]:
        """``sp.n`` generations of ``prompt``; sample i uses seed ``seed + i`` (as vLLM does)."""
        max_tokens = (
            sp.max_tokens
            if sp.max_tokens is not None
            else self.engine.config.max_model_len - len(prompt)
        )
        top = 0
        if sp.logprobs is not None:
            top = self.engine.config.vocab_size if sp.logprobs == -1 else max(sp.logprobs, 1)
        results = []
        for i in range(sp.n):
            kwargs: dict[str, Any] = {
                "max_tokens": max_tokens,
                "temperature": sp.temperature,
                "seed": None if sp.seed is None else sp.seed + i,
                "routed_experts_prompt_start": sp.start,
                "return_routed_experts": self.return_routed_experts,
                "stop_token_ids": sp.stop_token_ids,
                "ignore_eos": sp.ignore_eos,
                "logprobs": sp.logprobs is not None,
                "top_logprobs": top,
                "min_tokens": sp.min_tokens,
            }
            try:
                results.append(self._model_call(self.engine.generate, prompt, **kwargs))
            except EngineRequestError as exc:
                raise _bad_request(str(exc), exc.param) from exc
        return results

    def _model_call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        # Every model call runs on one dedicated thread: serialised, and torch keeps a single
        # OpenMP pool (a pool per handler thread would oversubscribe the cores and crawl).
        executor = self._executor
        if executor is None:
            raise RuntimeError("EngineServer is not running")
        return executor.submit(fn, *args, **kwargs).result()

    @staticmethod
    def _routes(res: GenerateResult, fault: Fault | None) -> str | None:
        if res.routed_experts is None:
            return None
        if fault is None:
            return encode_npy_b64(res.routed_experts)
        return _corrupt_routes(res.routed_experts, fault)

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    @staticmethod
    def _generate_logprobs(res: GenerateResult, num: int) -> dict[str, Any]:
        # vLLM's GenerateLogProbs: per token the sampled entry, then top_logprobs = the first
        # max(num, 1) of {sampled, top-1, top-2, ...} (a dict: the sampled token appears once).
        assert (
            res.logprobs is not None
            and res.logprob_ranks is not None
            and res.top_logprobs is not None
        )
        content = []
        for tok, lp, rank, top in zip(
            res.token_ids, res.logprobs, res.logprob_ranks, res.top_logprobs, strict=True
        ):
            entries = [{"token_id": tok, "logprob": lp, "rank": rank}]
            for j, (tid, tlp) in enumerate(top):
                if tid != tok:
                    entries.append({"token_id": tid, "logprob": tlp, "rank": j + 1})
            content.append({**entries[0], "top_logprobs": entries[: max(num, 1)]})
        return {"content": content}

    def handle_generate(self, body: dict[str, Any], fault: Fault | None) -> dict[str, Any]:
        """``POST /inference/v1/generate``: vLLM's token-in/token-out response (raises `_HTTPError`)."""
        if "token_ids" not in body:
            raise _schema_error("body.token_ids", "missing", "Field required", body)
        prompt = self._prompt(body["token_ids"], "body.token_ids")
        sp_obj = body.get("sampling_params")
        if not isinstance(sp_obj, dict):
            kind, msg = (
                ("missing", "Field required")
                if sp_obj is None
                else ("is_instance_of", "Input should be an instance of SamplingParams")
            )
            raise _schema_error(
                "body.sampling_params", kind, msg, body if sp_obj is None else sp_obj
            )
        _reject_unsupported_mode(body)
        if body.get("output_mode", "tokens") != "tokens":
            raise _bad_request(
                f"output_mode={body['output_mode']!r} needs a tokenizer; the r3arrow reference engine "
                "answers output_mode='tokens' only",
                "output_mode",
            )
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise _schema_error(
                "body.request_id", "string_type", "Input should be a valid string", request_id
            )
        self._check_model(body)
        sp = _parse_sampling(sp_obj, "body.sampling_params", default_max_tokens=None)
        return_token_ids = _get_bool(body, "return_token_ids", "body", False)
        results = self._run(prompt, sp)
        choices: list[dict[str, Any]] = []
        for i, res in enumerate(results):
            choices.append(
                {
                    "index": i,
                    "finish_reason": res.finish_reason,
                    "stop_reason": res.stop_reason,
                    "token_ids": res.token_ids,
                    "routed_experts": self._routes(res, fault),
                    "sampling_mask": None,
                    "weight_versions": [
                        {"version": "default", "start": 0, "end": len(res.token_ids)}
                    ],
                    "logprobs": None
                    if sp.logprobs is None
                    else self._generate_logprobs(res, sp.logprobs),
                }
            )
        return {
            "request_id": f"generate-tokens-{request_id if request_id is not None else secrets.token_hex(8)}",
            "model": self.model_name,
            "created": int(time.time()),
            "usage": self._usage(len(prompt), sum(len(r.token_ids) for r in results)),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }

    def handle_completions(self, body: dict[str, Any], fault: Fault | None) -> dict[str, Any]:
        """``POST /v1/completions`` with token-id prompts (raises `_HTTPError`)."""
        self._check_model(body)
        prompt_obj = body.get("prompt")
        if prompt_obj is None:
            raise _bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "prompt",
            )
        if isinstance(prompt_obj, str) or (
            isinstance(prompt_obj, list) and any(isinstance(p, str) for p in prompt_obj)
        ):
            raise _bad_request(
                "Tokenizer not available when `skip_tokenizer_init=True`: the r3arrow reference "
                "engine takes prompts as token ids",
                "prompt",
            )
        if isinstance(prompt_obj, list) and not prompt_obj:
            raise _bad_request("You must pass at least one prompt", None)
        batch = isinstance(prompt_obj, list) and all(isinstance(p, list) for p in prompt_obj)
        prompts = [self._prompt(p, "body.prompt") for p in (prompt_obj if batch else [prompt_obj])]
        _reject_unsupported_mode(body)
        if body.get("logprobs") is not None:
            raise _bad_request(
                "Unable to get tokenizer because `skip_tokenizer_init=True`: completions logprobs "
                "need token strings; use /inference/v1/generate for token-id logprobs",
                "logprobs",
            )
        sp = _parse_sampling(body, "body", default_max_tokens=16)
        return_token_ids = _get_bool(body, "return_token_ids", "body", False)
        choices: list[dict[str, Any]] = []
        n_prompt = n_completion = 0
        # all prompts are validated before any is generated
        for prompt in prompts:
            if sp.start > len(prompt):
                raise _bad_request(
                    "routed_experts_prompt_start must be between 0 and the prompt length "
                    f"({len(prompt)}), inclusive. (parameter=routed_experts_prompt_start, value={sp.start})",
                    "routed_experts_prompt_start",
                )
        for prompt in prompts:
            results = self._run(prompt, sp)
            n_prompt += len(prompt)
            for res in results:
                n_completion += len(res.token_ids)
                choices.append(
                    {
                        "index": len(choices),
                        "text": "",
                        "logprobs": None,
                        "finish_reason": res.finish_reason,
                        "stop_reason": res.stop_reason,
                        "token_ids": res.token_ids if return_token_ids else None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt if return_token_ids else None,
                        "routed_experts": self._routes(res, fault),
                    }
                )
        return {
            "id": f"cmpl-{secrets.token_hex(8)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": "r3arrow-reference-engine",
            "usage": self._usage(n_prompt, n_completion),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
