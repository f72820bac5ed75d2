"""`mlxfun serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

POST /v1/chat/completions and /v1/completions (server-sent events with `"stream": true`),
GET /v1/models, /health and /metrics (Prometheus). Both endpoints take `response_format`
(mlxfun.features.structured); chat takes `tools` and `tool_choice` (mlxfun.serve.tools), its answers carry
`tool_calls` (streamed as deltas). The HTTP layer only translates: pydantic
schemas in (`mlxfun.serve.openai_api`), `options.requests` for every check (errors name the request
field), the engine on a thread of its own (`mlxfun.serve.serving`), OpenAI JSON out. Each of `n`
choices is its own row; with a `seed`, choice i samples with seed + i. A seeded request is
batched like any other (its tokens depend on its seed, never on its neighbours).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from pathlib import Path
from typing import AsyncIterator, NamedTuple

try:
    import uvicorn
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:  # pragma: no cover
    raise ImportError(f'mlxfun serve needs its extra: pip install "mlxfun[server]" ({e})') from None

from mlxfun.cli.main import add_generation_flags, add_model_flags, flag_message, generation_config
from mlxfun.engine.options import GenerationConfig, Request, requests
from mlxfun.engine.riding import MIXED_TOKENS, check_mixed_tokens
from mlxfun.errors import InputError, MlxfunError, check_non_negative_int, check_positive_int
from mlxfun.model.load import Model
from mlxfun.serve import first_requests, tools
from mlxfun.serve import openai_api as api
from mlxfun.serve.engine_process import EngineProcess, EngineSpec
from mlxfun.serve.openai_api import ChatRequest, Common, CompletionRequest
from mlxfun.serve.serving import Bridge, Busy, EngineFailed, NotReady, Outcome

SHUT_DOWN = "the server shut down before the request finished (--shutdown-timeout ran out)"
ENGINE_FAILED = "the engine failed while generating (the server's log has the details); a fresh engine takes the " \
    "next requests"

# Rows decoded together when neither --rows nor --batch-size is given (mlx-lm's server decodes 32).
DEFAULT_ROWS = 32


class Served(NamedTuple):
    model: Model
    bridge: Bridge | EngineProcess
    defaults: GenerationConfig  # the command's generation flags; request fields override them
    name: str  # the model id clients see
    created: int


# ---- requests -> engine Requests ----


def request_config(defaults: GenerationConfig, body: Common, chat: bool) -> GenerationConfig:
    """The defaults with every field the request sets; logprobs in mlxfun's terms (None, 0 or n)."""
    given = body.model_fields_set
    fields = {name: getattr(body, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                     "presence_penalty", "frequency_penalty", "repetition_penalty",
                                                     "seed", "stop", "ignore_eos", "response_format")
              if getattr(body, name) is not None}
    if chat:
        if body.max_completion_tokens is not None:
            fields["max_tokens"] = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        if "logprobs" in given:
            fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    elif "logprobs" in given:
        fields["logprobs"] = body.logprobs
    return dataclasses.replace(defaults, **fields, chat=False)


def prompts_of(body: Common) -> list:
    """A completion request's prompts."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    return [p] if p and isinstance(p[0], int) else list(p)


def chat_plan(model: Model, body: ChatRequest, config: GenerationConfig) -> tuple[tools.Plan, GenerationConfig]:
    """The conversation through the template with the request's tools, and the config with the
    grammar that tool_choice "required" or a named function asks for."""
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, api.NamedToolChoice) else body.tool_choice
    plan = tools.prepare(model.tokenizer, model.config.vocab_size, [m.as_dict() for m in body.messages],
                         None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools],
                         choice, body.parallel_tool_calls)
    if plan.response_format is None:
        return plan, config
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise InputError("tool_choice: a required tool call is the answer's format; it cannot be combined with "
                         "response_format")
    return plan, dataclasses.replace(config, response_format=plan.response_format)


def build(model: Model, prompts: list, config: GenerationConfig, n: int, explicit_max: bool) -> list[Request]:
    """n Requests per prompt (choice j of a seeded request samples with seed + j), all checked."""
    check_positive_int("n", n)
    if n > api.MAX_N:
        raise InputError(f"n must be at most {api.MAX_N}, got {n}")
    if config.seed is not None and n > 1:  # an int: the request's (strict) or the --seed flag's
        # Seeds wrap at 2**32 (seed 2**32 - 1's second choice samples with 0); one out of range stays
        # as it is, for its error to show the value sent.
        wrap = 2**32 if 0 <= config.seed < 2**32 else None
        config = dataclasses.replace(config, seed=[(config.seed + j) % wrap if wrap else config.seed + j
                                                   for _ in prompts for j in range(n)])
    reqs = requests(model, [p for p in prompts for _ in range(n)], config)
    context = model.config.max_position_embeddings
    for r in reqs:
        if explicit_max and len(r.prompt) + r.max_tokens > context:
            raise InputError(f"max_tokens is {r.max_tokens} and the prompt has {len(r.prompt)} tokens; the model's "
                             f"context is {context} tokens (at most {context - len(r.prompt)} can be generated)")
    return reqs


# ---- responses ----


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_chunk(head: str, tail: str, choices: list[dict]) -> str:
    """A streamed chunk: the envelope serialized once per stream (`head`, `tail`) around its choices."""
    return f'data: {head}"choices": {json.dumps(choices, ensure_ascii=False)}{tail}\n\n'


def sse_text_chunk(head: str, tail: str, chat: bool, index: int, text: str) -> str:
    """`sse_chunk` of one choice carrying text alone (no logprobs, no finish reason), the same bytes
    built without serializing its dicts (`benchmarks/http_layer.py`, this CPU: 2-14% less of the
    HTTP process' CPU per streamed chunk, in four alternations)."""
    t = json.dumps(text, ensure_ascii=False)
    if chat:
        return f'data: {head}"choices": [{{"index": {index}, "delta": {{"content": {t}}}, "logprobs": null, ' \
               f'"finish_reason": null}}]{tail}\n\n'
    return f'data: {head}"choices": [{{"index": {index}, "text": {t}, "logprobs": null, "finish_reason": null}}]' \
           f'{tail}\n\n'


def _json_error(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect is left)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _records(served: Served, ids: list[int], q: asyncio.Queue, http: HTTPRequest) -> dict[int, Outcome] | None:
    """Every request's Outcome, or None when the client disconnects first (its rows are freed)."""
    records: dict[int, Outcome] = {}
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        while len(records) < len(ids):
            get = asyncio.ensure_future(q.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return None
            event, record = get.result()
            if isinstance(event, EngineFailed):
                raise event
            if record is not None:
                records[event.index] = record
        return records
    finally:
        gone.cancel()
        for rid in ids:
            if rid not in records:
                served.bridge.cancel(rid)


def _whole(served: Served, chat: bool, body: Common, reqs: list[Request], ids: list[int],
           records: dict[int, Outcome], fmt: tools.Format | None) -> dict:
    tk = served.model.tokenizer
    choices, completion = [], 0
    for i, rid in enumerate(ids):
        record = records[rid]
        tokens, lps, top = record.token_ids, record.logprobs, record.top
        completion += len(tokens)
        text, reason = record.text, record.finish_reason
        if chat:
            lp = api.chat_logprobs(tk, tokens, lps, top) if reqs[i].logprobs >= 0 else None
            content, calls = tools.parse(fmt, text) if fmt is not None else (text, [])
            choices.append(api.chat_message_choice(i, content, "tool_calls" if calls and reason == "stop" else reason,
                                                   lp, calls))
        else:
            lp = api.completion_logprobs(tk, tokens, lps, top) if reqs[i].logprobs >= 0 else None
            choices.append(api.completion_choice(i, text, reason, lp))
    out = api.envelope(api.new_id("chatcmpl" if chat else "cmpl"), api.now(), served.name,
                   "chat.completion" if chat else "text_completion", choices)
    out["usage"] = api.usage(sum(len(r.prompt) for r in reqs[:: body.n]), completion,
                         sum(records[rid].cached_tokens for rid in ids[:: body.n]))
    return out


async def _stream(served: Served, chat: bool, body: Common, reqs: list[Request], ids: list[int],
                  q: asyncio.Queue, fmt: tools.Format | None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token with text (or tool-call pieces, or logprobs), the
    finish reasons, then usage when asked (`stream_options.include_usage`) and [DONE]. Leaving
    early (the client went away: Starlette cancels this generator) frees the rows."""
    tk = served.model.tokenizer
    rid_, created, kind = api.new_id("chatcmpl" if chat else "cmpl"), api.now(), "chat.completion.chunk" if chat \
        else "text_completion"
    choice = {rid: i for i, rid in enumerate(ids)}
    open_, offsets, counts = set(ids), [0] * len(ids), {"completion": 0, "cached": 0}
    parsers = [tools.reader(fmt) if fmt is not None else None for _ in ids]
    want_usage = body.stream_options is not None and body.stream_options.include_usage

    # Every chunk shares its envelope: serialized once, only the choices per token (the event loop's
    # JSON is a large part of a streamed token's host time).
    head, _, tail = json.dumps(api.envelope(rid_, created, served.name, kind, [0]) | (
        {"usage": None} if want_usage else {}), ensure_ascii=False).partition('"choices": [0]')

    def chunk(choices: list[dict]) -> str:
        return sse_chunk(head, tail, choices)

    def render(event, record: Outcome | None) -> str:
        """One token's chunk ("" when it brings neither text nor logprobs nor the end)."""
        i = choice[event.index]
        lp = None
        if event.logprob is not None:
            top = [event.top_logprobs] if event.top_logprobs else None
            lp = api.chat_logprobs(tk, [event.token], [event.logprob], top) if chat else \
                api.completion_logprobs(tk, [event.token], [event.logprob], top, offsets[i])
        offsets[i] += len(event.text)
        if record is not None:
            open_.discard(event.index)
            counts["completion"] += len(record.token_ids)
            counts["cached"] += record.cached_tokens if i % body.n == 0 else 0
        reason = event.finish_reason
        if chat and parsers[i] is not None:
            delta = api.chat_delta(parsers[i].feed(event.text) + (parsers[i].close() if reason else []))
            reason = "tool_calls" if parsers[i].calls and reason == "stop" else reason
        else:
            if lp is None and reason is None and event.text:  # most of a stream: text alone
                return sse_text_chunk(head, tail, chat, i, event.text)
            delta = {"content": event.text} if event.text else {}
        if not (delta or lp or reason):
            return ""
        if chat:
            return chunk([api.chat_delta_choice(i, delta, reason, lp)])
        return chunk([api.completion_choice(i, event.text, event.finish_reason, lp)])

    try:
        if chat:
            yield chunk([api.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None)
                         for i in range(len(ids))])
        while open_:
            items = [await q.get()]
            while not q.empty():  # tokens that arrived while the last write went out: one write, a chunk each
                items.append(q.get_nowait())
            out = []
            for event, record in items:
                if isinstance(event, EngineFailed):  # its text is in the server's log, not for clients
                    yield "".join(out) + _sse(api.error(ENGINE_FAILED, None, "server_error"))
                    return
                out.append(render(event, record))
            if any(out):
                yield "".join(out)
        if want_usage:
            last = api.envelope(rid_, created, served.name, kind, [])
            last["usage"] = api.usage(sum(len(r.prompt) for r in reqs[:: body.n]), counts["completion"],
                                      counts["cached"])
            yield _sse(last)
        yield _sse("[DONE]")
    finally:
        for rid in open_:
            served.bridge.cancel(rid)


async def complete(served: Served, body: Common, chat: bool, http: HTTPRequest):
    """One request of either endpoint: check, submit, then stream or wait for the whole answer."""
    bad = body.unsupported()
    if bad is not None:
        return _json_error(400, api.error(bad[1], bad[0]))
    fmt = None
    try:
        config = request_config(served.defaults, body, chat)
        explicit = body.max_tokens is not None or (chat and body.max_completion_tokens is not None)
        if chat:
            plan, config = chat_plan(served.model, body, config)
            prompts, fmt = [plan.prompt], plan.format
        else:
            prompts = prompts_of(body)
        reqs = build(served.model, prompts, config, body.n, explicit)
    except InputError as e:
        return _json_error(400, api.field_error(str(e), chat, body))
    capacity = served.bridge.rows + served.bridge.max_queued
    if len(reqs) > capacity:  # more than the rows and the queue hold: it would never fit, so no 429 to retry
        param = "n" if body.n > 1 else "messages" if chat else "prompt"
        return _json_error(400, api.error(f"{param}: the request asks for {len(reqs)} choices ({len(prompts)} prompts, "
                                          f"n={body.n}); this server takes {capacity} at once", param))
    try:
        ids, q = await served.bridge.submit(reqs)
    except NotReady as e:
        return _json_error(503, api.error(str(e), None, "server_error"), {"Retry-After": "5"})
    except Busy as e:
        return _json_error(429, api.error(str(e), None, "rate_limit_error"), {"Retry-After": "1"})
    except InputError as e:  # the KV cache could never fit beside nothing: too large for this server
        param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        return _json_error(413, api.error(f"{param}: {e}", param))
    if body.stream:
        return StreamingResponse(_stream(served, chat, body, reqs, ids, q, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        records = await _records(served, ids, q, http)
    except EngineFailed:  # its text (the engine's exception) is in the server's log, not for clients
        return _json_error(500, api.error(ENGINE_FAILED, None, "server_error"))
    if records is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    if served.bridge.cut_off and any(r.finish_reason == "cancelled" for r in records.values()):
        return _json_error(503, api.error(SHUT_DOWN, None, "server_error"))
    return JSONResponse(_whole(served, chat, body, reqs, ids, records, fmt))


# ---- the app ----


def make_app(served: Served, shutdown_timeout: float = 30.0, first: tuple[str, int] | None = None) -> FastAPI:
    """The app. `first`: the (host, port) it listens on, to send itself its first requests
    (`first_requests`) once the engine is warm; /health answers 200 only after them."""
    first_done = [first is None]

    async def send_first() -> None:
        bridge = served.bridge
        while not bridge.ready and bridge.alive:
            await asyncio.sleep(0.05)
        if bridge.ready:
            bodies = first_requests.bodies(served.model)
            seconds, problems = await first_requests.send(bodies, *first)
            bridge.reset_stats()  # /metrics counts the clients' requests
            print(f"mlxfun serve: sent itself {len(bodies)} first requests through HTTP in {seconds:.2f} s"
                  + (f" ({'; '.join(problems)})" if problems else "") + "; ready", file=sys.stderr, flush=True)
        first_done[0] = True

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not served.bridge.alive:
            served.bridge.start()
        task = asyncio.create_task(send_first()) if first is not None else None
        yield
        if task is not None:
            task.cancel()
        # Uvicorn has stopped accepting and waited up to its grace period for running requests.
        await asyncio.to_thread(served.bridge.stop, shutdown_timeout)

    app = FastAPI(title="mlxfun", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        return JSONResponse(api.schema_error(list(exc.errors())), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body": not UTF-8
            return JSONResponse(api.error(f"the body is not valid JSON: {exc.__cause__}"), status_code=400)
        return JSONResponse(api.error(str(exc.detail), None, "not_found_error" if exc.status_code == 404
                                  else "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        # Starlette raises the exception again after this answer, so the server's log has its traceback;
        # its text may name MLX internals, so the client gets none of it.
        return JSONResponse(api.error("internal error (the server's log has the details)", None, "server_error"),
                            status_code=500)

    @app.post("/v1/chat/completions", responses=api.COMPLETION_RESPONSES)
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        return await complete(served, body, True, http)

    @app.post("/v1/completions", responses=api.COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await complete(served, body, False, http)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "mlxfun"}]}

    @app.get("/health", responses={503: {"description": "Warming up (compiling its steps) or stopping."}})
    async def health():
        bridge = served.bridge
        ready = bridge.ready and first_done[0]
        status = "ok" if ready else "warming up" if bridge.alive else "unavailable"
        return JSONResponse({"status": status}, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        kind = "text/plain; version=0.0.4"
        text = await served.bridge.metrics()
        if text is None:  # a failed engine is being replaced: its counters went with it
            return PlainTextResponse("# the engine is restarting\n", status_code=503, media_type=kind)
        return PlainTextResponse(text, media_type=kind)

    return app


# ---- the command ----


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlxfun serve", description="An OpenAI-compatible HTTP server (chat and text "
                                "completions, streamed or not) on mlxfun's continuous-batching engine")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    p.add_argument("--rows", type=int, default=None, dest="rows",
                   help=f"rows decoded together; more requests queue (default: {DEFAULT_ROWS})")
    p.add_argument("--max-queued", type=int, default=1024,
                   help="requests waiting for a row before new ones get 429 (default: 1024)")
    p.add_argument("--served-model-name", default=None, help="the model id clients see (default: the file's name)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                   help="GB of KV cache, allocated at start (default: 75%% of the GPU's memory beside the weights; "
                        "on the CPU an eighth of the RAM), never more than every row at full context needs")
    p.add_argument("--admit-wait", type=int, default=None, metavar="STEPS",
                   help="decode steps a new request may wait for more rows to free, so that one prefill admits "
                        "several (default: 8 on a GPU, 0 on the CPU; 0 admits each request at once); prompts that "
                        "ride along a decode step (--mixed-tokens) never wait")
    p.add_argument("--mixed-tokens", type=int, default=None, metavar="TOKENS",
                   help="new prompts of up to this many tokens in all ride along a decode step rather than "
                        f"prefill on their own (default: {MIXED_TOKENS} on a GPU, in chunks of a quarter, a half or "
                        "all of it, past 512 of each power of two from 128; each length compiles at start; at most "
                        "8192; 0 on the CPU; 0: never; off with a draft model or a bounded cache)")
    p.add_argument("--no-warmup", action="store_true",
                   help="take requests at once, without compiling every step first (tests; the first requests "
                        "of each kind then wait for their compile)")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process, not in a process of its own (one "
                        "GIL for HTTP and the engine: about half the tokens/s under load; for debugging)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may finish after Ctrl-C / SIGTERM before they are cut (default: 30)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_generation_flags(p, batch_size=False)
    return p.parse_args(argv)


# Seconds uvicorn waits, past --shutdown-timeout, for the requests cut then to send their endings.
CUT_GRACE = 5.0


def _uvicorn_server(app: FastAPI, args: argparse.Namespace, bridge: Bridge | EngineProcess) -> uvicorn.Server:
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Uvicorn raises a caught signal again after its graceful shutdown (exit 130 / 143); a
            # server stopped on purpose and cleanly exits 0. A second Ctrl-C still forces the exit.
            # Requests still running when --shutdown-timeout ends are cut by the engine (`Bridge.cut`),
            # so each ends as OpenAI clients expect, before uvicorn would cancel its task.
            def stop(sig, _frame):
                self.force_exit = self.should_exit and sig == signal.SIGINT
                if not self.should_exit:
                    timer = threading.Timer(args.shutdown_timeout, bridge.cut)
                    timer.daemon = True
                    timer.start()
                self.should_exit = True

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                 timeout_graceful_shutdown=args.shutdown_timeout + CUT_GRACE))


def kv_memory_flag(gb: float | None) -> int | None:
    """--kv-memory in bytes; None: the engine's budget on a GPU, an eighth of the RAM on the CPU
    (a server allocates its whole KV pool at start)."""
    import mlx.core as mx

    from mlxfun.engine.strategy import memory_limit

    if gb is None:
        return memory_limit() // 8 if mx.default_device() == mx.cpu else None
    if not 0 < gb < float("inf"):
        raise InputError(f"--kv-memory must be a positive number of GB, got {gb}")
    return int(gb * 1e9)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import mlx.core as mx

    rows = DEFAULT_ROWS if args.rows is None else args.rows
    bridge: Bridge | EngineProcess | None = None
    try:
        check_positive_int("rows", rows)
        check_positive_int("max_queued", args.max_queued)
        if args.admit_wait is not None:
            check_non_negative_int("--admit-wait", args.admit_wait)
        check_mixed_tokens("--mixed-tokens", args.mixed_tokens)
        # The engine's model is made where it runs (MLX streams are per thread), with the flags'
        # scheduler options: the prefix cache, a prompt cache, a draft model.
        spec = EngineSpec(args.model, args.dtype, rows, generation_config(args), kv_memory_flag(args.kv_memory),
                          args.admit_wait, args.mixed_tokens)
        if args.engine_thread:
            bridge = Bridge(spec.maker(), args.max_queued, warm=not args.no_warmup)
        else:
            # This process only checks requests and builds settings: on the CPU, so that the device
            # (a GPU's memory) is the engine process' alone.
            mx.set_default_device(mx.cpu)
            bridge = EngineProcess(spec, args.max_queued, warm=not args.no_warmup)
        bridge.start()
        model = bridge.model
        requests(model, [[0]], dataclasses.replace(spec.defaults, max_tokens=1))  # the flags, checked now
    except (MlxfunError, OSError) as e:
        print(f"mlxfun: error: {flag_message(str(e))}", file=sys.stderr)
        if bridge is not None:
            bridge.stop()
        return 2
    defaults = spec.defaults
    if isinstance(bridge, EngineProcess):
        print(f"mlxfun serve: the engine runs in process {bridge.pid}", file=sys.stderr, flush=True)
    served = Served(model, bridge, defaults, args.served_model_name or Path(model.source).name or "mlxfun", api.now())
    first = None if args.no_warmup else (args.host, args.port)
    server = _uvicorn_server(make_app(served, args.shutdown_timeout, first), args, bridge)
    server.run()
    bridge.stop(args.shutdown_timeout)  # already stopped at the app's shutdown, unless uvicorn failed to start
    return 0 if server.started else 1  # not started: the socket failed (logged)


if __name__ == "__main__":
    sys.exit(main())
