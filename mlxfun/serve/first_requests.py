"""A server's first requests, sent to itself over HTTP once its engine is warm and before /health
answers 200.

The engine's warm-up compiles every step, but the path a request takes around the engine also
costs more the first time: the HTTP handlers, the request's checks and tokenization, the pipe to
the engine's process and the events back, the streamed response. On an H100 (random 1B, 32 rows,
`benchmarks/serve_cold.py`) a fresh server's first seeded request took 54 ms to its first token
against 16 ms for the next ones, with the engine's own admission the same (8.6 and 8.2 ms); one
earlier request of any kind took most of the difference. So the server sends itself a few small
requests of the kinds clients send (streamed and not, sampled and greedy, chat where the model has
a template), and only then reports itself ready.
"""

from __future__ import annotations

import asyncio
import json
import time

from mlxfun.model.load import Model

# A request that has not ended by then is given up on (the server reports itself ready anyway).
TIMEOUT = 60.0


def bodies(model: Model) -> list[tuple[str, dict]]:
    """(path, JSON body) of each first request: two tokens each, on a prompt of the model's own
    words (any vocabulary encodes them)."""
    words = model.tokenizer.decode(list(range(1, 9)))
    out = [("/v1/completions", {"prompt": words, "max_tokens": 2, "temperature": 0.8, "top_p": 0.9, "seed": 0,
                                "stream": True}),
           ("/v1/completions", {"prompt": words, "max_tokens": 2, "temperature": 0.0})]
    if model.tokenizer.chat_template:
        out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 2,
                                             "temperature": 0.0, "stream": True}))
    return out


def loopback(host: str) -> str:
    """The address this machine reaches a server listening on `host` at."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


async def post(host: str, port: int, path: str, body: dict) -> int:
    """POST `body` as JSON and read the response to its end -> the HTTP status."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status = (await reader.readline()).split()
        await reader.read()  # the response, streamed or not, to the connection's close
    finally:
        writer.close()
    return int(status[1]) if len(status) > 1 and status[1].isdigit() else 0


async def send(requests: list[tuple[str, dict]], host: str, port: int) -> tuple[float, list[str]]:
    """Send `requests` (`bodies`) one at a time -> (seconds, a line per request that did not answer
    200). The socket may not be listening yet (the engine warmed up first): connections are retried."""
    t = time.perf_counter()
    problems = []
    address = loopback(host)
    for path, body in requests:
        for _ in range(50):
            try:
                status = await asyncio.wait_for(post(address, port, path, body), TIMEOUT)
                break
            except ConnectionRefusedError:
                await asyncio.sleep(0.1)
            except (OSError, asyncio.TimeoutError) as e:
                status = f"{type(e).__name__}: {e}"
                break
        else:
            status = "connection refused"
        if status != 200:
            problems.append(f"{path}: {status}")
    return time.perf_counter() - t, problems
