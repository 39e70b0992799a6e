"""The OpenAI-compatible HTTP front of the engine: FastAPI on uvicorn, in the front process.

    POST /v1/completions         prompt: a string (or one-element list, or token ids)
    POST /v1/chat/completions    messages through the tokenizer's chat template
        both: max_tokens (chat also max_completion_tokens), temperature, top_p, stop, seed, stream
        (server-sent events `data: {chunk}\\n\\n` ending with `data: [DONE]`), stream_options.include_usage,
        speculative (false: no draft token kept); `usage.speculation`: the request's verify rounds,
        draft tokens proposed and accepted, accept length and mean k (sglang's meta_info spec_*)
    GET  /v1/models, /health, /metrics (Prometheus text)

Processes: the ASGI app runs on uvicorn's event loop in the front process; all torch work runs on the
engine process's scheduler thread, across the pipe of engine/serve/link.py. A request is one `_Flight`:
it submits a `Submission` and reads its `TokenEvent`s from an asyncio queue (the engine's events come
one message per engine pass), and the handler turns them into text deltas with `TextStream`
(incremental detokenization, stop strings). A handler that ends early (the client disconnected
mid-stream: Starlette cancels the response; a stop string matched) cancels its request, which frees
the slot before the next round; a non-streaming handler polls for its client (there is no write to
fail on) and does the same.

The request schema and the error shape: engine/serve/protocol.py; uvicorn and stopping: engine/serve/http.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serve.detokenize import TextStream
from engine.serve.guard import Guard, GuardLimits, body_limit
from engine.serve.link import RemoteEngine, Submission, speculation
from engine.serve.metrics import ServeMetrics
from engine.serve.protocol import (
    ApiError,
    ApiLimits,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    extra_field_error,
    shutting_down_error,
)
from engine.serve.requests import QueueFull, ShuttingDown, TokenEvent
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # a non-streaming request checks this often whether its client is still there
OPEN_WHILE_DRAINING = ("/health", "/metrics")  # answered while draining: a balancer and a scraper still look


class _RefuseWhileDraining:
    """ASGI middleware: while the server drains, a new request (but OPEN_WHILE_DRAINING) is a 503 with
    Retry-After and `Connection: close`, instead of a refused connection. Plain ASGI, not Starlette's
    BaseHTTPMiddleware, so streaming responses and disconnects pass through untouched."""

    def __init__(self, app, api: "OpenAIApp"):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            self.api.metrics.rejected.labels("503").inc()
            response = shutting_down_error().response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# top_p below this keeps the most likely token alone, as any smaller one does (its probability is at least
# 1 / vocab); far smaller ones vanish in float32 and the nucleus would come out empty
MIN_TOP_P = 1e-6


def _unicode(text: str, param: str) -> str:
    """`text`, or a 400 when it cannot be encoded (a lone surrogate such as "\\ud800" in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: not valid Unicode ({e.reason} at index {e.start})", param) from None
    return text


OFF_LOOP_JSON_BYTES = 64 << 10  # bodies from this size are parsed on a worker thread: /health stays answered


class _OffLoopJsonRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = (
                json.loads(body) if len(body) < OFF_LOOP_JSON_BYTES else await run_in_threadpool(json.loads, body)
            )
        return self._json


class _OffLoopJsonRoute(APIRoute):
    """FastAPI's route, reading a large JSON body off the event loop (the guard bounds its size first)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_OffLoopJsonRequest(request.scope, request.receive))

        return route


# ------------------------------------------------------------------------------------------ one request
@dataclass(frozen=True)
class _Params:
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: tuple[str, ...]
    ignore_eos: bool
    speculative: bool


class _Flight:
    """One request between the event loop and the engine (engine/serve/link.py)."""

    def __init__(self, engine: RemoteEngine, tokenizer: Tokenizer, prompt: list[int], p: _Params):
        self.engine, self.prompt = engine, prompt
        self.text = TextStream(tokenizer, p.stop)
        self.submission = Submission(
            prompt,
            p.max_tokens,
            p.temperature,
            p.top_p,
            p.seed,
            frozenset() if p.ignore_eos else tokenizer.eos_token_ids,
            p.speculative,
        )
        self.rid: Optional[int] = None
        self.events: Optional[asyncio.Queue] = None  # (TokenEvent, counts), from the engine
        self.completion_tokens = 0
        self.counts = (0, 0, 0)  # verify rounds, draft tokens proposed and accepted (engine/serve/link.py)
        self.finished = False
        self.t0 = time.perf_counter()
        self.t_first: Optional[float] = None

    async def submit(self) -> "_Flight":
        try:
            self.rid, self.events = await self.engine.submit(self.submission)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full", type_="rate_limit_error") from None
        except ShuttingDown:
            raise shutting_down_error() from None
        except ValueError as e:
            raise ApiError(400, str(e), "prompt", "context_length_exceeded") from None
        return self

    @property
    def usage(self) -> dict:
        n, m = len(self.prompt), self.completion_tokens
        return {
            "prompt_tokens": n,
            "completion_tokens": m,
            "total_tokens": n + m,
            "speculation": speculation(*self.counts),
        }

    async def deltas(
        self, disconnected: Optional[Callable[[], Awaitable[bool]]] = None
    ) -> AsyncIterator[list[tuple[str, Optional[str]]]]:
        """Per wake-up, the text deltas of every event that arrived: [(text delta, None), ...] while
        generating; the last list ends with (last delta, "stop" | "length"). A front that falls behind
        the engine finds several passes' events queued and hands them on together (one write).

        disconnected: polled every DISCONNECT_POLL_S for a client that went away (a non-streaming
        response has no write to fail on); the request is then cancelled."""
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                if disconnected is None:
                    item = await self.events.get()
                else:
                    try:
                        item = await asyncio.wait_for(self.events.get(), max(0.0, next_poll - time.monotonic()))
                    except asyncio.TimeoutError:
                        item = None
                    if time.monotonic() >= next_poll:
                        next_poll = time.monotonic() + DISCONNECT_POLL_S
                        if await disconnected():
                            return
                    if item is None:
                        continue
                pending = deque([item])
                while not self.events.empty():
                    pending.append(self.events.get_nowait())
                out = []
                while pending:
                    ev, self.counts = pending.popleft()
                    try:
                        delta, finish = self._text(ev, pending)
                    except ApiError:
                        if out:  # what came before the error goes out first
                            yield out
                        raise
                    if finish is not None:
                        out.append((delta, finish))
                        yield out
                        return
                    if delta:
                        out.append((delta, None))
                if out:
                    yield out
        finally:  # finished, or the client is gone (the response task was cancelled)
            if not self.finished:
                self.engine.cancel(self.rid)

    def _text(self, ev: TokenEvent, pending: deque) -> tuple[str, Optional[str]]:
        """One event's text delta and finish reason ("stop" for a stop string). pending: the events
        taken from the queue after it, read for the engine's own finish when a stop string ends it."""
        self.finished = ev.finish_reason is not None
        if ev.finish_reason in ("error", "abort"):
            raise ApiError(
                500 if ev.finish_reason == "error" else 503,
                ev.error or "the request was aborted (server shutting down)",
                type_="server_error",
                code=ev.finish_reason,
            )
        self.completion_tokens += len(ev.tokens)
        self.t_first = self.t_first or time.perf_counter()
        delta = self.text.push(ev.tokens)
        if ev.finish_reason is not None and not self.text.stopped:
            delta += self.text.finish()  # the held-back tail: a stop string may end in it
        if self.text.stopped:  # a stop string: the engine may stop now, or may have ended it already
            ended = ev.finish_reason
            while ended is None and self.rid not in self.engine.queues:  # its last event is queued
                ended = (pending.popleft() if pending else self.events.get_nowait())[0].finish_reason
            self.engine.stop(self.rid, ended)
            self.finished = True
            return delta, "stop"
        return delta, ev.finish_reason


# ------------------------------------------------------------------------------------------ the app
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_MARK = "\0"  # stands for the delta in a stream's rendered text event (`OpenAIApp._stream`)


class OpenAIApp:
    def __init__(
        self,
        engine: RemoteEngine,
        tokenizer: Tokenizer,
        limits: ApiLimits,
        api_key: Optional[str] = None,
        loopback: bool = True,
    ):
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        self.guard = GuardLimits(api_key, loopback, body_limit(limits.max_seq_len))
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self.draining = False  # set on the first Ctrl-C (engine/serve/http.py): new requests get 503
        self.app = self._build()

    # -- validation -------------------------------------------------------------------------------
    def _params(
        self, body: SamplingRequest, prompt: list[int], max_tokens: Optional[int], key: str, prompt_key: str
    ) -> _Params:
        lim = self.limits
        if body.model != lim.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {lim.model_name!r}",
                "model",
                "model_not_found",
            )
        if body.n != 1:
            raise ApiError(400, f"n={body.n}: one choice per request (valid: 1)", "n")
        if (err := extra_field_error(body.model_extra or {})) is not None:
            raise err
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        room = lim.max_seq_len - len(prompt) - lim.draft_tokens
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's context is "
                f"{lim.max_seq_len} tokens ({lim.draft_tokens} reserved for draft tokens), "
                "which leaves no room to generate",
                prompt_key,
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(lim.default_max_tokens, room)
        elif max_tokens < 1 or max_tokens > lim.max_tokens_limit:
            raise ApiError(400, f"{key}={max_tokens}: must be in [1, {lim.max_tokens_limit}]", key)
        elif max_tokens > room:
            raise ApiError(
                400,
                f"this model's context is {lim.max_seq_len} tokens; the prompt has {len(prompt)} "
                f"and {key}={max_tokens} asks for {max_tokens} more ({lim.draft_tokens} reserved for "
                f"draft tokens): at most {room}",
                key,
                "context_length_exceeded",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise ApiError(400, f"stop: {len(stop)} strings (valid: up to 4 non-empty strings)", "stop")
        if any(not s for s in stop):
            raise ApiError(400, f"stop={body.stop!r}: an empty string (valid: up to 4 non-empty strings)", "stop")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed with stream=true", "stream_options")
        temperature = body.temperature if body.temperature is not None else lim.default_temperature
        return _Params(
            max_tokens,
            temperature,
            max(body.top_p, MIN_TOP_P) if body.top_p is not None else 1.0,
            body.seed,
            tuple(stop),
            body.ignore_eos,
            body.speculative,
        )

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(
                    400,
                    f"a batch of {len(p)} prompts: send one prompt per request (requests are batched by the server)",
                    "prompt",
                )
            p = p[0]
        if isinstance(p, str):
            return self.tokenizer.encode(_unicode(p, "prompt")) if p else []
        if len(p) > self.limits.max_seq_len:  # before looking at each id
            raise ApiError(
                400,
                f"the prompt has {len(p)} tokens; this model's context is {self.limits.max_seq_len} tokens",
                "prompt",
                "context_length_exceeded",
            )
        bad = [t for t in p if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise ApiError(
                400, f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.limits.vocab_size})", "prompt"
            )
        return list(p)

    # -- responses --------------------------------------------------------------------------------
    async def _run(self, request: Request, kind: str, prompt: list[int], p: _Params, body: SamplingRequest):
        flight = await _Flight(self.engine, self.tokenizer, prompt, p).submit()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.limits.model_name,
        }
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._stream(flight, kind, head, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        parts, finish = [], None
        async for batch in flight.deltas(request.is_disconnected):
            parts += [delta for delta, _ in batch]
            finish = batch[-1][1]
        if finish is None:  # the client went away: nobody to answer
            return Response(status_code=499)
        self._observe(flight)
        text = "".join(parts)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
            if kind == "chat"
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        )
        return {
            **head,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": [choice],
            "usage": flight.usage,
        }

    def _chunk(self, head: dict, kind: str, delta: Optional[str], finish: Optional[str], first=False) -> dict:
        if kind == "chat":
            d = {"role": "assistant", "content": delta or ""} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice]}

    async def _stream(self, flight: _Flight, kind: str, head: dict, usage: bool) -> AsyncIterator[str]:
        try:
            if kind == "chat":
                yield _sse(self._chunk(head, kind, "", None, first=True))
            # a text delta's event, rendered once around a mark: an event is then its delta's JSON string
            # between the two halves (what `_sse(self._chunk(head, kind, delta, None))` writes, for less)
            before, _, after = _sse(self._chunk(head, kind, _MARK, None)).rpartition(json.dumps(_MARK))
            async for batch in flight.deltas():  # one write per wake-up
                parts = [before + json.dumps(delta) + after for delta, _ in batch if delta]
                if (finish := batch[-1][1]) is not None:
                    parts.append(_sse(self._chunk(head, kind, None, finish)))
                yield "".join(parts)
            self._observe(flight)
            if usage:
                yield _sse({**head, "choices": [], "usage": flight.usage})
        except ApiError as e:  # the status line is gone: report in the stream
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    def _observe(self, flight: _Flight) -> None:
        now = time.perf_counter()
        self.metrics.latency.observe(now - flight.t0)
        if flight.t_first is not None:
            self.metrics.ttft.observe(flight.t_first - flight.t0)
        spec = speculation(*flight.counts)
        if spec["verify_rounds"]:
            self.metrics.accept_length.observe(spec["accept_length"])
            self.metrics.mean_k.observe(spec["mean_k"])

    # -- routes -----------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="specpipe", docs_url=None, redoc_url=None)  # /openapi.json: `_openapi`
        app.router.route_class = _OffLoopJsonRoute
        app.add_middleware(_RefuseWhileDraining, api=self)
        metrics = self.metrics
        app.add_middleware(Guard, limits=self.guard, count=lambda status: metrics.rejected.labels(str(status)).inc())

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError):
            metrics.rejected.labels(str(e.status)).inc()
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, e: RequestValidationError):
            errs = e.errors()
            first = errs[0] if errs else {}
            if first.get("type") == "json_invalid":
                err = ApiError(
                    400,
                    f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                    code="invalid_json",
                )
            else:
                loc = [str(x) for x in first.get("loc", ()) if x != "body"]
                param = loc[0] if loc else None
                where = ".".join(loc) or "body"
                err = ApiError(
                    422,
                    f"{where}: {first.get('msg', 'invalid')}"
                    + (f" (got {repr(first['input'])[:200]})" if "input" in first and loc else ""),
                    param,
                )
            metrics.rejected.labels(str(err.status)).inc()
            return err.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
            metrics.rejected.labels(str(e.status_code)).inc()
            return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

        @app.exception_handler(Exception)  # whatever else: a 500 in OpenAI's shape, counted (and logged by uvicorn)
        async def internal_error(request: Request, e: Exception):
            metrics.rejected.labels("500").inc()
            err = ApiError(500, f"internal error ({type(e).__name__})", code="internal_error", type_="server_error")
            return err.response()

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            prompt = self._completion_prompt(body)
            params = self._params(body, prompt, body.max_tokens, "max_tokens", "prompt")
            return await self._run(request, "completion", prompt, params, body)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            messages = [{"role": m.role, "content": _unicode(m.text(), "messages")} for m in body.messages]
            prompt = self.tokenizer.encode_messages(messages)
            key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            return await self._run(
                request, "chat", prompt, self._params(body, prompt, max_tokens, key, "messages"), body
            )

        @app.get("/v1/models")
        async def models():
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.limits.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "specpipe",
                        "max_model_len": self.limits.max_seq_len,
                    }
                ],
            }

        @app.get("/health")
        async def health():
            snap = await self.engine.snapshot() if self.engine.alive else None
            ok = snap is not None and snap.alive and not self.draining
            status = "ok" if ok else ("draining" if self.draining else "unavailable")
            return JSONResponse(
                {
                    "status": status,
                    "running": snap.running if snap else 0,
                    "waiting": snap.queue_depth if snap else 0,
                },
                status_code=200 if ok else 503,
            )

        @app.get("/metrics")
        async def prometheus():
            snap = await self.engine.snapshot() if self.engine.alive else None
            return Response(metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")

        app.openapi = lambda: self._openapi(app)
        return app

    def _openapi(self, app: FastAPI) -> dict:
        """FastAPI's schema of the routes, with what this server accepts that the pydantic models leave to
        the handlers (their 400s stay the handlers'): the served model's name, max_tokens in [1,
        serve.max_tokens_limit], token ids in the vocabulary, up to 4 non-empty stop strings, no field
        beyond the modelled ones. A client generator (or a fuzzer: tests/test_reliability.py) writes
        requests that can be served from it."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            lim, schemas = self.limits, doc["components"]["schemas"]
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                body = schemas[name]
                props, body["additionalProperties"] = body["properties"], False
                props["model"] = {**props["model"], "enum": [lim.model_name]}
                for key in ("max_tokens", "max_completion_tokens"):
                    if key in props:
                        props[key]["anyOf"][0].update(minimum=1, maximum=lim.max_tokens_limit)
                props["stop"]["anyOf"][0]["minLength"] = 1
                props["stop"]["anyOf"][1].update(maxItems=4, items={"type": "string", "minLength": 1})
            prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
            prompt[0].update(maxLength=self.guard.max_body_bytes)  # the body limit bounds it first
            prompt[1].update(minItems=1, maxItems=1)  # one prompt per request
            prompt[2].update(
                minItems=1,
                maxItems=lim.max_seq_len,
                items={"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1},
            )
            app.openapi_schema = doc
        return app.openapi_schema
