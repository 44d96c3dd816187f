"""`EngineServer`: the reference engine over real HTTP on loopback (vLLM's and SGLang's schemas).

This module is the HTTP side only: a threaded HTTP/1.1 server (keep-alive, ``TCP_NODELAY``,
bounded bodies), dispatch by path, fault injection at the HTTP level, and the request log.
What the endpoints accept and answer lives in `r3arrow.testing.engine._protocol` (vLLM's
``/inference/v1/generate`` and ``/v1/completions``) and `r3arrow.testing.engine._sglang` (SGLang's
``/generate``, ``docs/sglang.md``); the corrupt payloads of route faults in
`r3arrow.testing.engine.faults`; the model in `r3arrow.testing.engine.model`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson

from r3arrow._checks import check_int, check_optional_int, check_positive_int
from r3arrow.codec import encode_sglang
from r3arrow.errors import EngineRequestError
from r3arrow.testing.engine import _protocol as proto
from r3arrow.testing.engine import _sglang as sgl
from r3arrow.testing.engine._protocol import ErrorResponse, error_body
from r3arrow.testing.engine.faults import Fault, FaultPlan, corrupt_routes
from r3arrow.testing.engine.model import GenerateResult, ReferenceEngine

_T = TypeVar("_T")
_POST_PATHS = (*proto.POST_PATHS, sgl.GENERATE_PATH)


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
    _trickle = 0.0

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
        if body and self._trickle:  # one byte per write (TCP_NODELAY: one segment each)
            pause = self._trickle / len(body)
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                time.sleep(pause)
        elif body:
            self.wfile.write(body)

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, orjson.dumps(payload), "application/json", headers)

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        self._trickle = 0.0  # seconds to spread the answer's body over (Fault.trickle)
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
                err_type = proto.status_type(code)
                extra = (
                    {"retry-after": f"{fault.retry_after:g}"}
                    if fault.retry_after is not None
                    else None
                )
                message = f"injected fault: HTTP {code}"
                err: dict[str, Any] = (
                    sgl.value_error(message, code).payload
                    if path == sgl.GENERATE_PATH
                    else error_body(code, message, err_type=err_type)
                )
                self._send_json(code, err, extra)
                return
            elif fault.kind == "drop_connection":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            elif fault.kind == "respond":
                headers = dict(fault.headers)
                typed = any(k.lower() == "content-type" for k in headers)
                self._send(
                    fault.status_code, fault.body, None if typed else "application/json", headers
                )
                return
            elif fault.kind == "trickle":
                self._trickle = fault.seconds
        route_fault = (
            fault if fault is not None and fault.kind not in ("delay", "trickle") else None
        )

        if path in proto.GET_PATHS or path in _POST_PATHS:
            allowed = "GET" if path in proto.GET_PATHS else "POST"
            if path == sgl.GENERATE_PATH:
                allowed = "POST, PUT"  # SGLang routes both methods to generate_request
            if method not in allowed.split(", "):
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
        if path == sgl.GENERATE_PATH:
            self._dispatch_sglang(body, json_error, route_fault)
            return
        try:
            if not (self.headers.get("content-type") or "").lower().startswith("application/json"):
                raise ErrorResponse(
                    400,
                    "1 validation error:\n  Unsupported Media Type: "
                    "Only 'application/json' is allowed",
                    err_type="Bad Request",
                )
            if json_error is not None:
                raise proto.schema_error("body", "json_invalid", "JSON decode error", json_error)
            if not isinstance(body, dict):
                raise proto.schema_error(
                    "body",
                    "model_attributes_type",
                    "Input should be a valid dictionary or object to extract fields from",
                    body,
                )
            handler: Callable[[dict[str, Any], Fault | None], dict[str, Any]] = (
                app.handle_generate if path == proto.GENERATE_PATH else app.handle_completions
            )
            payload = handler(body, route_fault)
        except ErrorResponse as exc:
            self._send_json(exc.status, exc.body())
            return
        except Exception as exc:  # a bug in the engine: answer like vLLM, keep serving
            self._send_json(
                500, error_body(500, f"{type(exc).__name__}: {exc}", err_type="InternalServerError")
            )
            return
        self._send_json(200, payload)

    def _dispatch_sglang(self, body: Any, json_error: str | None, fault: Fault | None) -> None:
        """``POST /generate``: SGLang's answer, or its error JSON."""
        try:
            ctype = (self.headers.get("content-type") or "").lower()
            if ctype and not ctype.startswith("application/json"):
                raise sgl.validation_error(f"expected an application/json body, found {ctype!r}")
            if json_error is not None:
                raise sgl.validation_error(f"JSON decode error: {json_error}")
            if not isinstance(body, dict):
                raise sgl.contract_error(
                    "invalid type: " + sgl.unexpected(body) + ", expected struct GenerateRequest"
                )
            payload = self.server.app.handle_sglang_generate(body, fault)
        except sgl.SGLangError as exc:
            self._send_json(exc.status, exc.payload)
            return
        except Exception as exc:  # a bug in the engine: an error answer, keep serving
            self._send_json(500, sgl.value_error(f"{type(exc).__name__}: {exc}", 500).payload)
            return
        self._send_json(200, payload)


class EngineServer:
    """Serves a `ReferenceEngine` over HTTP/1.1 (keep-alive) on ``host:port`` (0: a free port).

    Use as a context manager or call `start`/`stop`. ``url`` is ``http://host:port``.
    ``faults`` injects failures into generation requests; ``log`` records every request.
    ``return_routed_experts=False`` answers ``routed_experts: null`` (vLLM without capture);
    request bodies over ``max_body_bytes`` get a 413; an idle keep-alive connection is closed
    after ``idle_timeout`` seconds. A request asking for more than ``max_n`` samples or more
    than ``max_tokens_limit`` tokens (None: only ``max_model_len`` bounds it) gets an HTTP 400
    in vLLM's error JSON naming the limit and the value, before anything is generated; a
    request without ``max_tokens`` generates up to ``min(remaining context,
    max_tokens_limit)`` tokens. Model calls run one at a time on one worker thread;
    parsing and encoding run concurrently on the connection threads. Argument misuse raises
    `TypeError`/`ValueError`.
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
        max_n: int = 16,
        max_tokens_limit: int | None = None,
    ) -> None:
        if engine is not None and not isinstance(engine, ReferenceEngine):
            raise TypeError(
                f"engine: expected a ReferenceEngine or None, found {type(engine).__name__}"
            )
        if faults is not None and not isinstance(faults, FaultPlan):
            raise TypeError(f"faults: expected a FaultPlan or None, found {type(faults).__name__}")
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, int | float):
            raise TypeError(f"idle_timeout: expected seconds as a number, found {idle_timeout!r}")
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout: expected seconds > 0, found {idle_timeout!r}")
        max_body_bytes = check_positive_int(max_body_bytes, "max_body_bytes")
        self.max_n = check_positive_int(max_n, "max_n")
        self.max_tokens_limit = check_optional_int(max_tokens_limit, "max_tokens_limit", minimum=1)
        port = check_int(port, "port", minimum=0, maximum=65535)
        self.engine = engine if engine is not None else ReferenceEngine()
        self.host = host
        self.faults = faults
        self.model_name = model_name
        self.return_routed_experts = return_routed_experts
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = float(idle_timeout)
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
        """Bind and serve in a daemon thread; return self. RuntimeError if already started."""
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
        """The ``GET /v1/models`` answer."""
        return proto.models_response(
            self.model_name, self._created, self.engine.config.max_model_len
        )

    def _prompt(self, value: object, loc: str) -> list[int]:
        prompt = proto.prompt_ids(value, loc)
        try:
            self.engine.check_token_ids(prompt, "token_ids")
        except EngineRequestError as exc:
            raise proto.bad_request(str(exc), "token_ids") from exc
        return prompt

    def _check_limits(self, sp: proto.Sampling) -> None:
        """HTTP 400 (vLLM's error JSON) for ``n`` or ``max_tokens`` past this server's limits."""
        if sp.n > self.max_n:
            raise proto.bad_request(
                f"n must be at most {self.max_n} (this engine's max_n), got {sp.n}. "
                f"(parameter=n, value={sp.n})",
                "n",
            )
        cap = self.max_tokens_limit
        if cap is not None and sp.max_tokens is not None and sp.max_tokens > cap:
            raise proto.bad_request(
                f"max_tokens must be at most {cap} (this engine's max_tokens_limit), got "
                f"{sp.max_tokens}. (parameter=max_tokens, value={sp.max_tokens})",
                "max_tokens",
            )

    def _run(self, prompt: list[int], sp: proto.Sampling) -> list[GenerateResult]:
        """``sp.n`` generations of ``prompt``; sample i uses seed ``seed + i`` (as vLLM does)."""
        max_tokens = sp.max_tokens
        if max_tokens is None:
            max_tokens = self.engine.config.max_model_len - len(prompt)
            if self.max_tokens_limit is not None:
                max_tokens = min(max_tokens, self.max_tokens_limit)
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
                raise proto.bad_request(str(exc), exc.param) from exc
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
            return proto.encode_npy_b64(res.routed_experts)
        return corrupt_routes(res.routed_experts, fault)

    def handle_generate(self, body: dict[str, Any], fault: Fault | None) -> dict[str, Any]:
        """``POST /inference/v1/generate``: vLLM's token-in/token-out response.

        Raises `r3arrow.testing.engine._protocol.ErrorResponse` for a request vLLM would refuse.
        """
        if "token_ids" not in body:
            raise proto.schema_error("body.token_ids", "missing", "Field required", body)
        prompt = self._prompt(body["token_ids"], "body.token_ids")
        sp_obj = body.get("sampling_params")
        if not isinstance(sp_obj, dict):
            kind, msg = (
                ("missing", "Field required")
                if sp_obj is None
                else ("is_instance_of", "Input should be an instance of SamplingParams")
            )
            raise proto.schema_error(
                "body.sampling_params", kind, msg, body if sp_obj is None else sp_obj
            )
        proto.reject_streaming(body)
        if body.get("output_mode", "tokens") != "tokens":
            raise proto.bad_request(
                f"output_mode={body['output_mode']!r} needs a tokenizer; the r3arrow reference "
                "engine answers output_mode='tokens' only",
                "output_mode",
            )
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise proto.schema_error(
                "body.request_id", "string_type", "Input should be a valid string", request_id
            )
        proto.check_model(body, self.model_name)
        sp = proto.parse_sampling(sp_obj, "body.sampling_params", default_max_tokens=None)
        self._check_limits(sp)
        return_token_ids = proto.get_bool(body, "return_token_ids", "body", False)
        results = self._run(prompt, sp)
        choices = [
            proto.generate_choice(i, res, self._routes(res, fault), sp.logprobs)
            for i, res in enumerate(results)
        ]
        return proto.generate_response(
            request_id=request_id,
            model_name=self.model_name,
            prompt=prompt,
            return_token_ids=return_token_ids,
            choices=choices,
            completion_tokens=sum(len(r.token_ids) for r in results),
        )

    def handle_sglang_generate(
        self, body: dict[str, Any], fault: Fault | None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """``POST /generate``: SGLang's native answer (a list for ``n > 1``).

        Raises `r3arrow.testing.engine._sglang.SGLangError` for a request SGLang would refuse (and
        for what the reference engine does not implement, see that module).
        """
        began = time.perf_counter()
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise sgl.contract_error("invalid type: " + sgl.unexpected(rid) + ", expected a string")
        prompt = sgl.prompt_ids(body)
        sp = sgl.parse_request(body)
        want = body.get("return_routed_experts", False)
        if not isinstance(want, bool):
            raise sgl.validation_error(
                f"return_routed_experts: Input should be a valid boolean, found {want!r}"
            )
        try:
            self.engine.check_token_ids(prompt, "input_ids")
            self._check_limits(sp)
        except EngineRequestError as exc:
            raise sgl.value_error(str(exc)) from exc
        except proto.ErrorResponse as exc:
            raise sgl.value_error(exc.message) from exc
        limit = self.engine.config.max_model_len
        sp = dataclasses.replace(
            sp, max_tokens=sgl.max_new_tokens(sp.max_tokens, len(prompt), limit)
        )
        if want:
            sgl.check_start(sp.start, len(prompt))
        else:  # SGLang ignores routed_experts_start_len unless routes are asked
            sp = dataclasses.replace(sp, start=0)
        try:
            results = self._run(prompt, sp)
        except proto.ErrorResponse as exc:
            raise sgl.value_error(exc.message) from exc
        out = []
        for i, res in enumerate(results):
            routes = None
            if want and res.routed_experts is not None:
                routes = (
                    encode_sglang(res.routed_experts)
                    if fault is None
                    else corrupt_routes(res.routed_experts, fault, wire="sglang")
                )
            out.append(
                sgl.response(
                    rid=None if rid is None else (rid if len(results) == 1 else f"{rid}-{i}"),
                    prompt_tokens=len(prompt),
                    token_ids=res.token_ids,
                    finish=sgl.finish_reason(res.finish_reason, res.token_ids, res.stop_reason),
                    routes=routes,
                    latency=time.perf_counter() - began,
                )
            )
        return out[0] if len(out) == 1 else out

    def handle_completions(self, body: dict[str, Any], fault: Fault | None) -> dict[str, Any]:
        """``POST /v1/completions`` with token-id prompts.

        Raises `r3arrow.testing.engine._protocol.ErrorResponse` for a request vLLM would refuse.
        """
        proto.check_model(body, self.model_name)
        prompt_obj = body.get("prompt")
        if prompt_obj is None:
            raise proto.bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "prompt",
            )
        if isinstance(prompt_obj, str) or (
            isinstance(prompt_obj, list) and any(isinstance(p, str) for p in prompt_obj)
        ):
            raise proto.bad_request(
                "Tokenizer not available when `skip_tokenizer_init=True`: the r3arrow reference "
                "engine takes prompts as token ids",
                "prompt",
            )
        if isinstance(prompt_obj, list) and not prompt_obj:
            raise proto.bad_request("You must pass at least one prompt", None)
        batch = isinstance(prompt_obj, list) and all(isinstance(p, list) for p in prompt_obj)
        prompts = [self._prompt(p, "body.prompt") for p in (prompt_obj if batch else [prompt_obj])]
        proto.reject_streaming(body)
        if body.get("logprobs") is not None:
            raise proto.bad_request(
                "Unable to get tokenizer because `skip_tokenizer_init=True`: completions logprobs "
                "need token strings; use /inference/v1/generate for token-id logprobs",
                "logprobs",
            )
        sp = proto.parse_sampling(body, "body", default_max_tokens=16)
        self._check_limits(sp)
        return_token_ids = proto.get_bool(body, "return_token_ids", "body", False)
        # all prompts are validated before any is generated
        for prompt in prompts:
            if sp.start > len(prompt):
                raise proto.bad_request(
                    "routed_experts_prompt_start must be between 0 and the prompt length "
                    f"({len(prompt)}), inclusive. "
                    f"(parameter=routed_experts_prompt_start, value={sp.start})",
                    "routed_experts_prompt_start",
                )
        choices: list[dict[str, Any]] = []
        n_prompt = n_completion = 0
        for prompt in prompts:
            results = self._run(prompt, sp)
            n_prompt += len(prompt)
            for res in results:
                n_completion += len(res.token_ids)
                routes = self._routes(res, fault)
                choices.append(
                    proto.completion_choice(len(choices), res, prompt, routes, return_token_ids)
                )
        return proto.completions_response(
            model_name=self.model_name,
            choices=choices,
            prompt_tokens=n_prompt,
            completion_tokens=n_completion,
        )


__all__ = ["EngineServer", "RequestLog"]
