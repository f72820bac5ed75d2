"""A server compiles every step before it takes requests: /health answers 503 until the warm-up
ends, and after it no step traces again through a mixed workload (greedy, sampled, top-p,
logprobs, a schema, penalties, rows that cross table widths, many pools' worth of tokens).
The app runs in this process (Starlette's TestClient) over a tiny model."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers import byte_tokenizer, tiny_config, tiny_params

import mlxfun
from mlxfun.engine.core import Engine
from mlxfun.engine.options import GenerationConfig
from mlxfun.engine.records import fixed_modes
from mlxfun.engine.warmup import masks_available, warm_up
from mlxfun.model.load import Model
from mlxfun.serve import serving
from mlxfun.serve.server import Served, make_app
from mlxfun.serve.serving import Bridge

ROWS = 4


@pytest.fixture(scope="module")
def model() -> Model:
    config = tiny_config(max_position_embeddings=1024)
    params, _ = tiny_params(config, seed=3)
    mx.eval(params)
    return Model(config, params, byte_tokenizer(), "tiny bytes")


def served(model: Model, warm: bool = True, mixed_tokens: int | None = None) -> Served:
    bridge = Bridge(lambda: Engine(model, ROWS, fixed_shapes=True, kv_memory=20_000_000, mixed_tokens=mixed_tokens),
                    64, warm=warm)
    return Served(model, bridge, GenerationConfig(max_tokens=8), "tiny", 0)


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"mlxfun_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def test_health_is_503_until_the_warm_up_ends(model, monkeypatch):
    release = threading.Event()

    def slow(engine):
        assert release.wait(60)
        return warm_up(engine)

    monkeypatch.setattr(serving, "warm_up", slow)
    s = served(model)
    with TestClient(make_app(s)) as client:
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "warming up"})
        early = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert early.status_code == 503 and "warming up" in early.json()["error"]["message"]
        assert early.headers["retry-after"] == "5"
        release.set()
        assert s.bridge.wait_ready(60)
        assert client.get("/health").status_code == 200
        after = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


def test_no_step_traces_after_the_warm_up(model):
    # As on a GPU, prompts ride along decode steps in chunks of 64, 128 or 256 tokens (every prompt
    # here but the 600-token one); longer ones prefill on their own.
    s = served(model, mixed_tokens=256)
    with TestClient(make_app(s)) as client:
        assert s.bridge.wait_ready(120)
        engine = s.bridge.engine
        warm = s.bridge.warmup
        assert engine.chunk_sizes == warm.chunk_sizes == (64, 128, 256)
        # The CPU's split steps (`Runner.split`) warm the lighter sampled modes too.
        assert engine.runner.split
        plain = sum(not m.masked for m in fixed_modes(masks_available(), light=True))
        # On the CPU the rows follow the live requests, in powers of two: each count is warmed up.
        assert warm.rows == (1, 2, 4) and engine.scheduler.widths() == [1, 2, 4]
        assert warm.carrying == plain * len(warm.widths) * 3 * len(warm.rows)
        modes = len(fixed_modes(masks_available(), light=True))
        assert warm.variants == modes * len(warm.widths) * len(warm.rows) and warm.widths == (256, 1024)
        # Its cost by part, as the server prints it: each width's steps, then the rest.
        assert len(warm.width_seconds) == 2 and min(warm.width_seconds) > 0 and warm.rest_seconds > 0
        assert sum(warm.width_seconds) + warm.rest_seconds <= warm.seconds
        traces = metric(client, "step_traces_total")
        assert traces == engine.step_cache.traces >= modes
        pool = engine.scheduler.pool.size
        prompts = ["the quick brown fox " * (1 + i % 12) for i in range(24)]
        bodies = []
        for i, p in enumerate(prompts):
            body = {"prompt": p, "max_tokens": 40 + 10 * (i % 4), "ignore_eos": True}
            kind = i % 6
            if kind == 1:
                body.update(temperature=0.8, top_p=0.9, seed=i)
            elif kind == 2:
                body.update(logprobs=3)
            elif kind == 3:
                body.update(temperature=0.7, top_k=5, frequency_penalty=0.5, seed=i)
            elif kind == 4:
                body.update(response_format={"type": "json_object"}, max_tokens=20, ignore_eos=False)
            elif kind == 5:
                body.update(echo=False, logprobs=0, temperature=1.0, seed=i)
            bodies.append(body)
        # Long rows cross the table widths: 600 tokens of prompt and 420 generated.
        bodies.append({"prompt": "x" * 600, "max_tokens": 420, "ignore_eos": True, "temperature": 0})
        answers = []
        threads = [threading.Thread(target=lambda b=b: answers.append((b, client.post("/v1/completions", json=b))))
                   for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(answers) == len(bodies) and all(r.status_code == 200 for _, r in answers), \
            [r.text for _, r in answers if r.status_code != 200]
        generated = sum(r.json()["usage"]["completion_tokens"] for _, r in answers)
        assert generated > 1200
        assert metric(client, "step_traces_total") == traces  # nothing traced on the request path
        assert engine.scheduler.pool.size == pool
        # Both kinds of admission ran: prompts carried by decode steps and prefills of their own.
        assert 0 < metric(client, "admissions_carried_total") < metric(client, "admissions_total")
        # Answers are the offline ones: the server's modes compute more, never differently.
        for body, r in answers[:8]:
            if body.get("response_format") or body.get("logprobs") is not None:
                continue
            offline = mlxfun.generate(model, [body["prompt"]], max_tokens=body["max_tokens"], ignore_eos=True,
                                      temperature=body.get("temperature", 0.0), top_p=body.get("top_p", 1.0),
                                      top_k=body.get("top_k", 0), seed=body.get("seed"),
                                      frequency_penalty=body.get("frequency_penalty", 0.0))
            assert r.json()["choices"][0]["text"] == offline.texts[0], body


def test_no_warmup_serves_at_once(model):
    s = served(model, warm=False)
    with TestClient(make_app(s)) as client:
        assert client.get("/health").status_code == 200
        assert s.bridge.warmup is None and s.bridge.engine.step_cache.traces == 0
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_where_lengths_are_rounded_the_warm_up_prefills_each_chunk_length_once(model):
    """On a GPU prompt lengths are rounded up to 32 (`pad_multiple`) and each new prefill shape
    costs plans the first time: the warm-up prefills a one-row prompt of each length up to the
    chunk, so a first request of any length meets shapes already seen (run here on the CPU with
    the GPU's rounding)."""
    from mlxfun.engine.step import compiled_steps

    shapes = []

    def steps(config, mode):
        real = compiled_steps(config, mode)
        return real._replace(prefill=lambda params, tokens, *rest: shapes.append(tokens.shape) or
                             real.prefill(params, tokens, *rest))

    engine = Engine(model, ROWS, fixed_shapes=True, kv_memory=20_000_000, pad_multiple=32, prefill_step=128,
                    steps=steps)
    warm = warm_up(engine)
    assert warm.prompt_lengths == (32, 64, 96, 128) and 0 < warm.prompt_seconds <= warm.seconds
    seen = set(shapes)
    assert {(1, 32), (1, 64), (1, 96), (1, 128)} <= seen
    assert engine.stats.admissions == 0 and engine.stats.prompt_tokens == 0  # counters start after it
    shapes.clear()
    rng = np.random.default_rng(0)
    for n in (5, 40, 77, 128, 200):  # 200: a chunk of 128, then one of 72 (96 rounded)
        rid = engine.add(rng.integers(3, 90, n).tolist(), max_tokens=2, ignore_eos=True)
        list(engine.events())
        engine.take(rid)
    assert shapes and set(shapes) <= seen, set(shapes) - seen
    assert warm_up(Engine(model, ROWS, fixed_shapes=True, kv_memory=20_000_000)).prompt_lengths == ()  # CPU: none


def test_health_waits_for_the_servers_own_first_requests_through_http(model, capfd, monkeypatch):
    """A warm server sends itself its first requests over HTTP (the path around the engine costs
    more the first time) before /health answers 200; /metrics then counts from zero."""
    import asyncio
    import socket
    import time
    import urllib.error
    import urllib.request

    import uvicorn

    from mlxfun.serve import first_requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = served(model)
    seen = []  # /health's status while the first requests run, and each first request's status
    post = first_requests.post

    async def watched(host, port_, path, body):
        health = await asyncio.to_thread(status_of, f"http://127.0.0.1:{port}/health")
        seen.append((health, await post(host, port_, path, body)))
        return seen[-1][1]

    def status_of(url):
        try:
            return urllib.request.urlopen(url, timeout=30).status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    monkeypatch.setattr(first_requests, "post", watched)
    server = uvicorn.Server(uvicorn.Config(make_app(s, first=("0.0.0.0", port)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while status_of(f"http://127.0.0.1:{port}/health") != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status_of(f"http://127.0.0.1:{port}/health") == 200
        assert seen == [(503, 200), (503, 200)], seen  # no chat template: a streamed and a whole completion
        assert "sent itself 2 first requests through HTTP in" in capfd.readouterr().err
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert "\nmlxfun_requests_finished_total 0\n" in metrics and "\nmlxfun_generation_tokens_total 0\n" in metrics
    finally:
        server.should_exit = True
        thread.join(60)
        s.bridge.stop()
