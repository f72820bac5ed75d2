"""The server's HTTP layer alone: CPU time of its process per streamed chunk, without an engine.

`mlxfun serve`'s app (`make_app`, the SSE rendering, the queues items reach the event loop by) in
a process of its own, over a stand-in engine that hands out one token to every open request each
`--step` seconds, in one call into the loop per step as the engine process' reader does
(`to_loops`). `--clients` streaming clients each send `--requests` requests of `--tokens` tokens.
Each `--loops` entry (LOOP/HTTP, uvicorn's names) runs in turn, alternating `--repeats` times:
`auto/auto` is what the `[server]` extra gives (uvloop and httptools when they import), and
`asyncio/h11` what uvicorn falls back to without them. The engine's own host time is not in it:
this is the share of a served token that the HTTP process spends, which caps its tokens/s at
about 1 / (µs per chunk) per core.

Run: python benchmarks/http_layer.py --clients 64 --tokens 128 --loops auto/auto,asyncio/h11
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# The stand-in engine's token: one word of the tiny shape's word tokenizer.
TEXT = " t7"


def _server(port: int, step: float, loop: str, http_impl: str) -> None:
    """The child: the app over the stand-in engine, until SIGINT."""
    import uvicorn
    from serve_load import TINY  # the tiny shape's config (its word tokenizer is all the app reads)

    from mlxfun.bench.models import word_tokenizer
    from mlxfun.engine.events import Event
    from mlxfun.engine.options import GenerationConfig
    from mlxfun.model.config import ModelConfig
    from mlxfun.model.load import Model
    from mlxfun.serve.server import Served, make_app
    from mlxfun.serve.serving import to_loops

    class Outcome:  # what a finished request's last item carries (the fields the SSE path reads)
        def __init__(self, n: int):
            self.token_ids, self.cached_tokens, self.text, self.finish_reason = [7] * n, 0, TEXT * n, "length"

    class Engine:
        """The Bridge's interface, handing out a token per open request every `step` s."""

        def __init__(self, model: Model):
            self.model, self.rows, self.max_queued = model, 1024, 4096
            self.alive, self.ready, self.cut_off = True, True, False
            self._ids, self._open, self._lock = itertools.count(), {}, threading.Lock()
            threading.Thread(target=self._run, daemon=True).start()

        async def submit(self, reqs):
            target, ids = (asyncio.get_running_loop(), asyncio.Queue()), []
            with self._lock:
                for r in reqs:
                    ids.append(next(self._ids))
                    self._open[ids[-1]] = [target, r.max_tokens, 0]
            return ids, target[1]

        def cancel(self, rid: int) -> None:
            with self._lock:
                self._open.pop(rid, None)

        async def metrics(self) -> str:
            return ""

        def start(self) -> None:
            pass

        def stop(self, timeout: float | None = None) -> None:
            pass

        def _run(self) -> None:
            while True:
                time.sleep(step)
                sends = []
                with self._lock:
                    for rid, row in list(self._open.items()):
                        row[2] += 1
                        last = row[2] >= row[1]
                        sends.append((row[0], (Event(rid, 7, TEXT, "length" if last else None),
                                               Outcome(row[2]) if last else None)))
                        if last:
                            del self._open[rid]
                if sends:
                    to_loops(sends)

    config = ModelConfig(**TINY)
    model = Model(config, None, word_tokenizer(config.vocab_size), "stand-in")
    served = Served(model, Engine(model), GenerationConfig(max_tokens=16), "stand-in", 0)
    uvicorn.run(make_app(served), host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http_impl)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(loops: str, args: argparse.Namespace) -> dict:
    """One server process with `loops` (LOOP/HTTP) under the clients' load -> its figures."""
    loop, http_impl = loops.split("/")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step", str(args.step),
                             "--loops", loops])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                conn.getresponse().read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the server ({loops}) did not start")
                time.sleep(0.1)
        chunks = [0] * args.clients

        def client(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = json.dumps({"prompt": "t1 t2 t3", "max_tokens": args.tokens, "stream": True})
            for _ in range(args.requests):
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                chunks[i] += sum(1 for line in conn.getresponse() if line.startswith(b"data: {"))

        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    n = sum(chunks)
    if n != args.clients * args.requests * args.tokens:
        raise RuntimeError(f"{loops}: {n} chunks, expected {args.clients * args.requests * args.tokens}")
    return {"loops": loops, "chunks": n, "seconds": seconds, "cpu_s": cpu, "us_per_chunk": 1e6 * cpu / n,
            "core_share": cpu / seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (one chunk each)")
    p.add_argument("--step", type=float, default=0.004, help="seconds between the stand-in engine's steps")
    p.add_argument("--loops", default="auto/auto,asyncio/h11", help="LOOP/HTTP entries, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child's port
    args = p.parse_args(argv)
    if args.serve is not None:
        loop, http_impl = args.loops.split("/")
        _server(args.serve, args.step, loop, http_impl)
        return 0
    for name in ("clients", "requests", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    rows = []
    for _ in range(args.repeats):
        for loops in args.loops.split(","):
            rows.append(run(loops, args))
            r = rows[-1]
            print(f"{loops:12s} {r['chunks']} chunks in {r['seconds']:.2f} s: {r['us_per_chunk']:.1f} us of the "
                  f"server's CPU per chunk, {100 * r['core_share']:.0f}% of a core", flush=True)
    for loops in args.loops.split(","):
        best = min(r["us_per_chunk"] for r in rows if r["loops"] == loops)
        print(f"{loops:12s} best {best:.1f} us per chunk")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
