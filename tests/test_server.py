"""`mlxfun serve` through the real `openai` client: a server started here on a free port of
127.0.0.1, answers equal to offline `generate`, errors that name the field, disconnects, a full
queue and shutdown. Every request is bounded in tokens, and every wait in time."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten

import mlxfun
from mlxfun.bench.models import WORKLOAD_SHAPE, random_params, word_tokenizer
from mlxfun.engine.core import Engine
from mlxfun.engine.options import GenerationConfig, requests
from mlxfun.engine.step import Steps, compiled_steps
from mlxfun.model.load import Model
from mlxfun.serve.serving import Bridge, EngineFailed, NotReady

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m mlxfun serve ARGS` on a free port of 127.0.0.1, up when /health answers.
    `launcher`: the command before serve's flags, in place of `python -m mlxfun serve`."""

    def __init__(self, *args: str, log_path: Path,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "mlxfun", "serve")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*launcher, "--port", str(self.port),
                                      "--log-level", "warning", *args], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {log_path.read_text()}"
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not start: {log_path.read_text()}")

    def client(self, cls=openai.OpenAI):
        return cls(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")}

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The default model, 16 rows."""
    # No warm-up: test_serve_warmup checks it; here it would compile every step variant of 16 rows first.
    server = Server("--rows", "16", "--max-tokens", "8", "--no-warmup",
                    log_path=tmp_path_factory.mktemp("real") / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory) -> Path:
    """A random-weight model of 8 layers (~100 tokens/s here): long streams for load tests, fast to start."""
    config = WORKLOAD_SHAPE
    folder = tmp_path_factory.mktemp("slow-model")
    mlxfun.save(Model(config, random_params(config, mx.float32), word_tokenizer(config.vocab_size), "random"), folder)
    return folder


def words(i: int, n: int = 6) -> str:
    return " ".join(f"t{(i * 37 + k * 11) % 1000 + 1}" for k in range(n))


# ---- the default model: answers equal offline generate ----


def test_chat_and_text_completions_streamed_and_not(real, model_q4):
    client = real.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = mlxfun.generate(model_q4, [messages], max_tokens=4, logprobs=2)
    chat = client.chat.completions.create(model="x", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want.texts[0]
    assert chat.choices[0].finish_reason == want.finish_reasons[0] == "length"
    assert chat.usage.prompt_tokens == len(model_q4.tokenizer.encode_chat(messages))
    assert chat.usage.completion_tokens == 4 and chat.usage.total_tokens == chat.usage.prompt_tokens + 4
    content = chat.choices[0].logprobs.content  # OpenAI's shape: token, logprob, bytes, top_logprobs
    assert [c.logprob for c in content] == pytest.approx(want.logprobs[0], abs=1e-5)
    assert bytes(b for c in content for b in c.bytes).decode() == "".join(c.token for c in content) == want.texts[0]
    for c, top in zip(content, want.top_logprobs[0]):
        assert [t.token for t in c.top_logprobs] == [model_q4.tokenizer.decode([i]) for i, _ in top]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-5)

    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

    prompt = "The capital of France is"
    want = mlxfun.generate(model_q4, prompt, max_tokens=3)
    text = client.completions.create(model="x", prompt=prompt, max_tokens=3)
    assert text.object == "text_completion" and text.choices[0].text == want.texts[0]
    assert want.texts[0].startswith(" Paris")
    assert text.usage.prompt_tokens == 5 and text.usage.completion_tokens == len(want.token_ids[0])
    stream = client.completions.create(model="x", prompt=prompt, max_tokens=3, stream=True)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
    assert "".join(t for t, _ in pieces) == want.texts[0] and pieces[-1][1] == want.finish_reasons[0]


def test_sixteen_concurrent_greedy_streams_equal_each_prompt_alone(real, model_q4):
    prompts = [f"{i} +" if i % 2 else f"Hello {i}" for i in range(16)]

    async def one(client, prompt):
        stream = await client.completions.create(model="x", prompt=prompt, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    async def run():
        async with real.client(openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(run())
    for prompt, (text, n) in zip(prompts, got):
        alone = mlxfun.generate(model_q4, prompt, max_tokens=2)
        assert (text, n) == (alone.texts[0], len(alone.token_ids[0])), prompt


def test_eight_concurrent_seeded_requests_equal_the_same_seeds_offline(real, model_q4):
    prompts = [f"Story {i}:" for i in range(8)]
    client = real.client()
    threads, got = [], [None] * 8

    def one(i):
        got[i] = client.completions.create(model="x", prompt=prompts[i], max_tokens=3, temperature=1.0, top_p=0.95,
                                           seed=1000 + i, logprobs=0)

    for i in range(8):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(got):
        alone = mlxfun.generate(model_q4, prompts[i], max_tokens=3, temperature=1.0, top_p=0.95, seed=1000 + i,
                                logprobs=0)
        assert r.choices[0].text == alone.texts[0]
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(alone.logprobs[0], abs=1e-5)
    assert len({r.choices[0].text for r in got}) > 1  # sampled, not all alike


def test_n_choices_each_its_own_seed(real, model_q4):
    prompt = "Colours:"
    r = real.client().completions.create(model="x", prompt=prompt, n=3, seed=7, temperature=1.0, max_tokens=3,
                                         logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, choice in enumerate(r.choices):
        alone = mlxfun.generate(model_q4, prompt, max_tokens=3, temperature=1.0, seed=7 + j, logprobs=2)
        assert choice.text == alone.texts[0]
        lp = choice.logprobs  # the legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset
        n = len(alone.token_ids[0])
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert lp.token_logprobs == pytest.approx(alone.logprobs[0], abs=1e-5) and lp.text_offset[0] == 0
        for top, want in zip(lp.top_logprobs, alone.top_logprobs[0]):
            assert top == {model_q4.tokenizer.decode([i]): pytest.approx(v, abs=1e-5) for i, v in want}
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


@pytest.mark.parametrize("change, field, words_", [
    ({"top_p": 2}, "top_p", "(0, 1]"),
    ({"max_tokens": -3}, "max_tokens", "positive"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages", "context is 8192"),
    ({"max_completion_tokens": 9000}, "max_completion_tokens", "context is 8192"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"seed": -1}, "seed", "[0, 2**32)"),
    ({"n": 0}, "n", "positive"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
])
def test_bad_requests_get_400_naming_the_field(real, change, field, words_):
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError) as e:
        real.client().chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field and field in e.value.body["message"] and words_ in e.value.body["message"]


def test_non_json_and_bad_prompts_get_400(real):
    status, body = real.post("/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = real.post("/v1/completions", json.dumps({"prompt": [1, "a"]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = real.post("/v1/completions", json.dumps({"prompt": [10**9]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "outside [0, 49152)" in body["error"]["message"]
    models = real.client().models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


# ---- a small random model: disconnects, load, shutdown ----


def test_closed_stream_frees_its_row_and_others_keep_their_tokens(slow_model_dir, tmp_path):
    server = Server("--model", str(slow_model_dir), "--rows", "2", log_path=tmp_path / "log")
    try:
        client = server.client()
        keep = client.completions.create(model="x", prompt=words(1), max_tokens=40, stream=True,
                                         extra_body={"ignore_eos": True})
        drop = client.completions.create(model="x", prompt=words(2), max_tokens=4000, stream=True,
                                         extra_body={"ignore_eos": True})
        for _, _ in zip(range(3), drop):
            pass
        m = server.metrics()
        assert m["mlxfun_requests_running"] == 2 and m["mlxfun_kv_cache_bytes"] > 0
        assert m["mlxfun_generation_tokens_total"] >= 3 and m['mlxfun_time_to_first_token_seconds_count'] == 2
        assert m["mlxfun_admissions_total"] >= 1 and 0 < m["mlxfun_admission_seconds_total"] < 60
        assert 0 < m["mlxfun_device_wait_seconds_total"] < 60  # the CPU: each pool write waits for the one before
        # Rounds: every decode step is one; the plain ones (no admission in them or just before) among them.
        assert m["mlxfun_rounds_total"] >= m["mlxfun_steps_total"] >= 3
        assert 0 < m["mlxfun_plain_rounds_total"] <= m["mlxfun_rounds_total"] - 2 * m["mlxfun_admissions_total"] + 1
        assert 0 < m["mlxfun_plain_round_seconds_total"] < m["mlxfun_round_seconds_total"] < 60
        drop.close()
        deadline = time.monotonic() + 20
        while server.metrics()["mlxfun_requests_running"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metrics()["mlxfun_requests_running"] <= 1
        kept = "".join(c.choices[0].text for c in keep)
        after = client.completions.create(model="x", prompt=words(3), max_tokens=5, extra_body={"ignore_eos": True})
        assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 5
        idle = server.metrics()["mlxfun_idle_seconds_total"]
        time.sleep(0.5)  # nothing running: the engine counts the wait as idle (it polls every 0.05 s)
        assert 0.3 < server.metrics()["mlxfun_idle_seconds_total"] - idle < 5
    finally:
        assert server.stop() == 0
    model = mlxfun.load(str(slow_model_dir))
    assert kept == mlxfun.generate(model, words(1), max_tokens=40, ignore_eos=True).texts[0]


def test_full_queue_answers_429_with_retry_after(slow_model_dir, tmp_path):
    server = Server("--model", str(slow_model_dir), "--rows", "1", "--max-queued", "1", log_path=tmp_path / "log")
    try:
        client = server.client()
        streams = [client.completions.create(model="x", prompt=words(i), max_tokens=3000, stream=True,
                                             extra_body={"ignore_eos": True}) for i in range(2)]
        next(iter(streams[0]))
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="x", prompt=words(5), max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        for s in streams:
            s.close()
    finally:
        assert server.stop() == 0


def test_shutdown_finishes_what_fits_the_grace_period_then_exits_0(slow_model_dir, tmp_path):
    server = Server("--model", str(slow_model_dir), "--rows", "3", "--shutdown-timeout", "8",
                    log_path=tmp_path / "log")  # a row each: none waits in the queue
    client = server.client()
    results = {}

    def read(name, max_tokens):
        stream = client.completions.create(model="x", prompt=words(len(name)), max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True})
        reasons = []
        try:
            for c in stream:
                reasons.append(c.choices[0].finish_reason)
        except Exception as e:  # the stream cut at the end of the grace period
            reasons.append(type(e).__name__)
        results[name] = (len(reasons), reasons[-1])

    def whole():
        try:
            client.completions.create(model="x", prompt=words(9), max_tokens=8000, extra_body={"ignore_eos": True})
            results["whole"] = "answered"
        except openai.APIStatusError as e:
            results["whole"] = (e.status_code, e.body.get("message") if isinstance(e.body, dict) else e.body)

    threads = [threading.Thread(target=read, args=("short", 24)), threading.Thread(target=read, args=("long", 8000)),
               threading.Thread(target=whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["mlxfun_generation_tokens_total"] < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.stop(timeout=30) == 0
    assert time.monotonic() - t0 < 30
    for t in threads:
        t.join(30)
    assert results["short"] == (24, "length")  # finished within the grace period
    # Cut at its end, as OpenAI clients expect: a stream's last chunk has a finish reason (then
    # [DONE]: the client's iteration ends without an error), a whole answer is a JSON 503.
    assert results["long"][1] == "cancelled" and results["long"][0] < 8000
    assert results["whole"][0] == 503 and "shut down" in results["whole"][1]
    log = (tmp_path / "log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-2000:]
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model="x", prompt="t1", max_tokens=1)


def test_a_killed_engine_process_fails_its_requests_then_a_fresh_one_serves(slow_model_dir, tmp_path):
    """The engine runs in a process of its own: when it dies (here SIGKILL, as the OOM killer
    sends), the stream in it ends with an error event, and a fresh engine process, once /health
    answers 200 again, answers the next request as offline `generate` does."""
    log = tmp_path / "log"
    server = Server("--model", str(slow_model_dir), "--rows", "2", "--no-warmup", log_path=log)
    try:
        client = server.client()
        pid = int(re.search(r"the engine runs in process (\d+)", log.read_text()).group(1))
        assert pid != server.proc.pid
        stream = client.completions.create(model="x", prompt=words(1), max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine failed"):
            for _ in chunks:
                pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(server.url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        after = client.completions.create(model="x", prompt=words(3), max_tokens=6, extra_body={"ignore_eos": True})
        assert "the engine process died (exit code -9)" in log.read_text()
        assert server.metrics()["mlxfun_requests_finished_total"] == 1  # the fresh engine's count
    finally:
        assert server.stop() == 0
    model = mlxfun.load(str(slow_model_dir))
    assert after.choices[0].text == mlxfun.generate(model, words(3), max_tokens=6, ignore_eos=True).texts[0]


# The server's own process, printing at its exit what MLX ever held in it.
COUNTING_SERVER = """
import atexit, sys
import mlx.core as mx
atexit.register(lambda: print("HTTP PROCESS MLX PEAK", mx.get_peak_memory(), flush=True))
from mlxfun.serve.server import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_http_process_never_allocates_mlx_memory(model_q4, tmp_path):
    """On a GPU, one MLX array in the server's HTTP process opens a CUDA context beside the
    engine's, and the two processes' work takes turns on the device. So the HTTP process builds
    every request (seeded, constrained, several choices, streamed) on the host: MLX's allocator there
    stays at zero bytes, while the engine's process reports the model's memory in /metrics."""
    server = Server("--rows", "4", "--no-warmup", log_path=tmp_path / "log",
                    launcher=(sys.executable, "-c", COUNTING_SERVER))
    try:
        client = server.client()
        seeded = client.completions.create(model="x", prompt=words(1), max_tokens=3, temperature=0.9, top_p=0.9,
                                           seed=5, n=2, logprobs=2)
        assert [len(c.logprobs.token_logprobs) for c in seeded.choices] == [3, 3]
        chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 3
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
        shaped = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "A number?"}],
                                                max_tokens=40, response_format=fmt)
        assert isinstance(json.loads(shaped.choices[0].message.content)["n"], int)
        m = server.metrics()
        weights = sum(a.nbytes for _, a in tree_flatten(model_q4.params) if a is not None)
        assert m["mlxfun_memory_peak_bytes"] >= m["mlxfun_memory_active_bytes"] > 0.9 * weights > 1e6
    finally:
        assert server.stop() == 0
    assert "HTTP PROCESS MLX PEAK 0\n" in (tmp_path / "log").read_text()


def test_bad_flags_exit_2_naming_the_flag(slow_model_dir):
    run = subprocess.run([sys.executable, "-m", "mlxfun", "serve", "--model", str(slow_model_dir), "--top-p", "2",
                          "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--top-p must be in (0, 1], got 2" in run.stderr


def test_a_negative_admit_wait_or_mixed_tokens_exits_2_naming_the_flag_before_loading_anything(capsys):
    from mlxfun.serve.server import main

    assert main(["--admit-wait", "-1", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mlxfun: error: --admit-wait must be a non-negative integer, got -1"
    assert main(["--mixed-tokens", "-5", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mlxfun: error: --mixed-tokens must be a non-negative integer, got -5"
    assert main(["--mixed-tokens", "100000", "--port", "0"]) == 2
    assert "--mixed-tokens must be at most 8192" in capsys.readouterr().err


# ---- the bridge alone: an engine failure ends the requests in it, and a fresh engine serves on ----


def test_engine_failure_fails_requests_in_flight_then_serves_again():
    from helpers import tiny_model

    model = tiny_model()
    mx.eval(model.params)  # MLX streams are per thread: the engine thread may only read evaluated arrays
    calls = []

    def steps(config, mode) -> Steps:
        real = compiled_steps(config, mode)

        def decode(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return real.decode(*args)

        return real._replace(decode=decode)

    made, seen = [], []

    def make() -> Engine:
        seen.append([r() is not None for r in made])  # the engines made before: still alive?
        engine = Engine(model, 2, steps=steps)
        made.append(weakref.ref(engine))
        return engine

    bridge = Bridge(make, max_queued=4)
    bridge.start()
    reqs = requests(model, [[5, 6, 7]], GenerationConfig(max_tokens=6, ignore_eos=True))

    async def run():
        out = []
        for _ in range(2):
            while True:  # while the failed engine is replaced, a request is refused (503) for a moment
                try:
                    ids, q = await bridge.submit(reqs)
                    break
                except NotReady:
                    await asyncio.sleep(0.01)
            while True:
                event, record = await asyncio.wait_for(q.get(), 30)
                if isinstance(event, EngineFailed) or record is not None:
                    out.append(event if record is None else record.token_ids)
                    break
        return out

    try:
        failed, served = asyncio.run(run())
    finally:
        bridge.stop()
    assert isinstance(failed, EngineFailed) and "device lost" in str(failed)
    assert served == mlxfun.generate(model, [[5, 6, 7]], max_tokens=6, ignore_eos=True).token_ids[0]
    # The failed engine (its KV pool with it) was freed before the fresh one was made.
    assert seen == [[], [False]] and bridge.rows == 2


def test_serve_takes_rows_once(capsys):
    """`--rows` is the server's one flag for its rows (no `--batch-size` beside it)."""
    from mlxfun.serve.server import parse_args

    assert parse_args(["--rows", "4"]).rows == 4 and parse_args([]).rows is None
    with pytest.raises(SystemExit) as stop:
        parse_args(["--batch-size", "4"])
    assert stop.value.code == 2 and "unrecognized arguments: --batch-size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--batch-size" not in capsys.readouterr().out


def test_a_text_chunk_is_the_bytes_json_would_write():
    """Most streamed chunks carry text alone and are written without serializing their dicts
    (`sse_text_chunk`): the same bytes as the general path, whatever the text holds."""
    import mlxfun.serve.openai_api as api
    from mlxfun.serve.server import sse_chunk, sse_text_chunk

    texts = [" tok", "a", 'say "hi"', "back\\slash", "new\nline\ttab", "\x00\x1f\x7f", "é 漢字 🙂", "\u2028\u2029",
             "</script>", "{\"choices\": [0]}"]
    for chat, kind in ((False, "text_completion"), (True, "chat.completion.chunk")):
        for usage in (False, True):
            env = api.envelope("cmpl-1", 7, "m\"odel", kind, [0]) | ({"usage": None} if usage else {})
            head, _, tail = json.dumps(env, ensure_ascii=False).partition('"choices": [0]')
            for i, text in enumerate(texts):
                choice = api.chat_delta_choice(i, {"content": text}, None, None) if chat else \
                    api.completion_choice(i, text, None, None)
                fast = sse_text_chunk(head, tail, chat, i, text)
                assert fast == sse_chunk(head, tail, [choice]), (chat, text)
                parsed = json.loads(fast.removeprefix("data: "))
                assert parsed["choices"][0] == choice and parsed["object"] == kind and ("usage" in parsed) == usage
