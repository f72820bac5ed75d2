"""Load on `mlxfun serve`, and on `mlx_lm.server` with the same weights and prompts (`--mlx-lm`).

N concurrent streaming clients (`--clients 8,32,128`) send /v1/completions requests of
`--prompt-tokens` tokens asking for `--gen-tokens` tokens, arriving spread evenly over the first
`--arrival` seconds; with `--requests R` (default: one per client) each client sends its share of
the R requests one after another, the next as soon as the last has ended (a closed loop).
Reported: aggregate generated tok/s (usage.completion_tokens over the time
from the first request to the last token), the same while every client was in its loop (from the
last client's first request to the first client's last token: `--arrival` spreads the first
requests, so rows fill gradually, and clients end one by one), time to first token p50 / p99, and inter-token
latency p50 / p99 (gaps between a stream's chunks with text). `--modes greedy,seeded`: seeded
requests sample at temperature 0.8 with top-p 0.9 and a seed each (mlx-lm's server runs those
one at a time). `--offline` times `mlxfun.generate(batch_size=rows)` on the same prompts in the
same run (the engine alone); each server's first sampled request after /health answers is
timed against a warm one, over plain HTTP (not the openai client, whose own first use costs).
`--offline-repeats` keeps the best of that many offline runs (its rate moved 42% between two runs
of one H100 lease). On a GPU, each timed phase also samples the device's utilization
(`nvidia-smi`, the share of time some kernel ran, every 50 ms): a server whose engine leaves the
device idle shows less of it than the offline run. `--mlxfun-also NAME=ARGS` runs more mlxfun
servers with other flags in the same run. For mlxfun
the engine's counters split the run: decode steps and their ms each, with and without the time the
engine sat idle between its clients' requests, and the client processes' CPU share (near 100%, the
clients are the bottleneck, not the server).

The model is saved once with `mlxfun.save` into a temporary folder that both servers load:
the default model (its 4-bit weights), `--model`, or a random-weight Llama shape (`--shape 1B`,
`--shape 8B`, with a word-level tokenizer). Each server is started for each client count with
that many rows (`--rows` fixes it), warmed up with the same schedule, other prompts and 4 tokens,
then measured; `--repeats` alternates which server goes first and keeps each one's best run.
mlx-lm runs from its own interpreter (`--mlx-lm-python`, a venv where mlx-lm is installed: it is
never a dependency of mlxfun), with `--decode-concurrency` = the rows.

Run: python benchmarks/serve_load.py [--shape 1B] [--clients 8,32,128] [--mlx-lm --mlx-lm-python PATH]
         [--modes greedy,seeded] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# How a seeded request samples (mlx-lm's server runs seeded requests one at a time).
SEEDED = {"temperature": 0.8, "top_p": 0.9}
# A shape so small that host work dominates (`--shape tiny`: the CPU check of the serving path).
TINY = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
            head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048)


# ---- the client side (also run in worker processes) ----


async def one_stream(client, url_model: str, prompt: str, start: float, gen_tokens: int, seed: int | None) -> dict:
    """One streaming request sent at wall-clock `start`; chunk times in wall-clock seconds."""
    await asyncio.sleep(max(0.0, start - time.time()))
    body = dict(model=url_model, prompt=prompt, max_tokens=gen_tokens, stream=True,
                stream_options={"include_usage": True}, temperature=0.0 if seed is None else SEEDED["temperature"])
    if seed is not None:
        body.update(seed=seed, top_p=SEEDED["top_p"])
    sent, times, usage, error = time.time(), [], None, None
    try:
        async with client.completions.with_streaming_response.create(**body) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.time())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as e:  # reported, never hidden: a failed request counts as such
        error = f"{type(e).__name__}: {e}"
    return dict(sent=sent, times=times, end=time.time(), error=error,
                tokens=usage["completion_tokens"] if usage else len(times),
                prompt_tokens=usage["prompt_tokens"] if usage else None)


async def one_client(client, jobs: list[tuple[str, float, int, int | None]], index: int) -> list[dict]:
    """A client's requests in turn: the first at its arrival time, each next one when the last ends."""
    return [dict(await one_stream(client, "default_model", *job), client=index) for job in jobs]


async def run_clients(base_url: str, clients: list[tuple[int, list[tuple[str, float, int, int | None]]]]) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600) as client:
        done = await asyncio.gather(*(one_client(client, jobs, c) for c, jobs in clients))
    return [r for results in done for r in results]


def client_process(args: tuple[str, list]) -> tuple[list[dict], float]:
    """A worker's share of the clients -> (results, its CPU seconds)."""
    base_url, jobs = args
    cpu = time.process_time()
    out = asyncio.run(run_clients(base_url, jobs))
    return out, time.process_time() - cpu


def drive(base_url: str, prompts: list[str], clients: int, arrival: float, gen_tokens: int, seeded: bool,
          procs: int, at_start: Callable[[], None] | None = None) -> tuple[list[dict], float]:
    """One request per prompt from `clients` clients (client c sends prompts c, c + clients, ...),
    spread over `procs` processes (so the client side is never the bottleneck). `at_start` runs on
    a thread of its own when the first request is due (the server's counters read then)."""
    t0 = time.time() + (1.0 if procs <= 1 else 5.0)  # every worker is up before the first arrival
    jobs = [(c, [(p, t0 + arrival * c / clients, gen_tokens, 1000 + i if seeded else None)
                 for i, p in list(enumerate(prompts))[c::clients]]) for c in range(clients)]
    timer = threading.Timer(max(0.0, t0 - time.time() - 0.01), at_start) if at_start else None
    if timer:
        timer.start()
    try:
        if procs <= 1:
            return client_process((base_url, jobs))
        shares = [(base_url, jobs[k::procs]) for k in range(procs)]
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            parts = pool.map(client_process, shares)
        return [r for part, _ in parts for r in part], sum(cpu for _, cpu in parts)
    finally:
        if timer:
            timer.join()


class Utilization:
    """The GPU's utilization (percent of time some kernel ran, as NVML reports it) sampled every
    `period_ms` by `nvidia-smi` while the block runs; `mean` is None without nvidia-smi."""

    def __init__(self, period_ms: int = 50):
        self.period_ms, self.mean, self.proc = period_ms, None, None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        except OSError:  # no GPU here
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        # The first sample may cover the time before the block.
        values = [float(x) for x in out.split()[1:] if x.replace(".", "", 1).isdigit()]
        self.mean = float(np.mean(values)) if values else None
        return False


def summarize(results: list[dict], client_cpu_s: float) -> dict:
    ok = [r for r in results if r["error"] is None]  # a request may end at once (EOS first): no text, no failure
    ttft = [r["times"][0] - r["sent"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    start, end = min(r["sent"] for r in results), max(r["end"] for r in results)
    tokens = sum(r["tokens"] for r in ok)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    return dict(requests=len(results), failed=len(results) - len(ok), tokens=tokens, seconds=end - start,
                tok_s=tokens / (end - start), steady_tok_s=steady_rate(results), ttft_p50=pct(ttft, 50),
                ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50), itl_p99=pct(itl, 99), client_cpu_s=client_cpu_s,
                errors=sorted({r["error"] for r in results if r["error"]})[:3])


def steady_rate(results: list[dict]) -> float:
    """Streamed tokens per second while every client was in its loop: from the last client's first
    request to the first client's last token (arrivals spread over `--arrival` seconds fill the
    rows gradually, and clients end one by one: neither is the server's rate under its load).
    NaN where that window is empty (one request per client)."""
    clients: dict[int, list[dict]] = {}
    for r in results:
        clients.setdefault(r["client"], []).append(r)
    start = max(min(r["sent"] for r in rs) for rs in clients.values())
    end = min(max(r["end"] for r in rs) for rs in clients.values())
    if end <= start:
        return float("nan")
    return sum(start <= t < end for r in results if r["error"] is None for t in r["times"]) / (end - start)


# ---- servers ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1, up when /health answers; stopped with SIGTERM."""

    def __init__(self, argv: list[str], port: int, log: Path, timeout: float = 900):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "a")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited with {self.proc.returncode}; see {log}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{argv[:4]} did not start; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def mlxfun_argv(folder: Path, port: int, rows: int, gen_tokens: int, engine_thread: bool = False,
                extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "mlxfun", "serve", "--model", str(folder), "--port", str(port), "--rows", str(rows),
            "--max-tokens", str(gen_tokens), "--log-level", "warning", *(["--engine-thread"] if engine_thread else []),
            *extra]


def mlx_lm_argv(python: str, folder: Path, port: int, rows: int, gen_tokens: int, extra: list[str]) -> list[str]:
    return [python, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port), "--decode-concurrency",
            str(rows), "--max-tokens", str(gen_tokens), "--log-level", "WARNING", *extra]


# ---- the workload ----


TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. Its legions built roads, aqueducts and fortifications across Europe, North Africa and the "
        "Middle East, and its law, language and institutions shaped the societies that followed. Trade moved grain, "
        "wine, oil and metals along its sea lanes, while cities grew around markets, temples and baths. ")


def make_prompts(model, n: int, length: int, seed: int = 0) -> list[str]:
    """n different prompts of about `length` tokens: random words for a word-level tokenizer,
    windows of an English text for a real one, each opening with its own number, so that no two
    share more than a token or two (mlx-lm's server reuses the KV of a cached prompt prefix)."""
    rng = np.random.default_rng(seed)
    if model.tokenizer.token(1) == "t1":  # mlxfun.bench.models.word_tokenizer
        return [" ".join(f"t{t}" for t in rng.integers(1, model.config.vocab_size, length)) for _ in range(n)]
    ids = model.tokenizer.encode(TEXT * (1 + 4 * length // 60), add_special_tokens=False)
    starts = rng.integers(0, len(ids) - length, n)
    return [f"{i}. " + model.tokenizer.decode(ids[s:s + length - 4]) for i, s in enumerate(starts)]


def build_model(args):
    import mlx.core as mx

    import mlxfun
    from mlxfun.bench.models import DTYPES, SHAPES, random_params, word_tokenizer
    from mlxfun.model.load import Model

    if args.shape is None:
        return mlxfun.load(args.model)
    if args.shape == "tiny":
        from mlxfun.model.config import ModelConfig

        config = ModelConfig(**TINY)
    else:
        config = SHAPES[args.shape]
    dtype = DTYPES[args.dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")]
    return Model(config, random_params(config, dtype), word_tokenizer(config.vocab_size), f"random {args.shape}")


def measure(name: str, argv_for, n: int, procs: int, modes: list[str], prompts: list[str], args, log: Path
            ) -> list[dict]:
    """Start one server for n clients, warm it up and measure each mode; stop it."""
    port = free_port()
    t = time.perf_counter()
    server = Server(argv_for(port, args.rows or n), port, log)
    print(f"{name}: up in {time.perf_counter() - t:.1f} s ({n} clients, {procs} client processes)", flush=True)
    out = []
    try:
        # The first sampled request after /health answers, against one after the load (warm); on
        # mlxfun, the engine's host seconds admitting it too (is a cold request's time the engine's?).
        mlxfun = name.startswith("mlxfun")
        cold, cold_admit = sampled_alone(server.url, prompts[-1], mlxfun)
        for mode in modes:
            requests = args.requests or n
            warm = prompts[len(prompts) // 2:][:n]  # other prompts: nothing of the measured ones is cached
            drive(server.url + "/v1", warm, n, args.arrival, 4, mode == "seeded", procs)
            before: dict[str, float] = {}  # the engine's counters when the first request is due
            threads = server_cpu(server.proc.pid)
            with Utilization() as util:
                results, cpu = drive(server.url + "/v1", prompts[:requests], n, args.arrival, args.gen_tokens,
                                     mode == "seeded", procs,
                                     (lambda: before.update(engine_counters(server.url))) if mlxfun else None)
            row = dict(server=name, mode=mode, rows=args.rows or n, clients=n, client_procs=procs,
                       **summarize(results, cpu), gpu_utilization=util.mean)
            # The client processes' CPU over theirs and the run's time: near 1, the clients are the bottleneck.
            row["client_cpu_share"] = cpu / (procs * row["seconds"]) if row["seconds"] else None
            row["server_cpu_us_per_token"] = cpu_per_token(threads, server_cpu(server.proc.pid), row["tokens"])
            row["gpu_mib_by_process"] = gpu_processes(server.proc.pid)
            print(f"  {name} {mode}: server CPU us per token by thread {row['server_cpu_us_per_token']}; GPU MiB "
                  f"by process {row['gpu_mib_by_process']}; GPU utilization {_pct(util.mean)}", flush=True)
            if before:
                row.update(occupancy(before, engine_counters(server.url), args.rows or n, row))
                if row.get("admissions"):
                    full, each = 100 * (row["row_occupancy"] or 0), 1e3 * (row["admission_s"] or 0) / row["admissions"]
                    print(f"  {name} {mode}: rows {full:.0f}% full, {row['engine_steps']:.0f} steps "
                          f"({row['ms_per_step'] or 0:.2f} ms each, {row['busy_ms_per_step'] or 0:.2f} without the "
                          f"engine's idle time, {row['wait_ms_per_step'] or 0:.2f} waiting for the device), "
                          f"idle {100 * (row['idle_share'] or 0):.1f}% of the run, {row['admissions']:.0f} "
                          f"admissions, {each:.1f} ms of host time each, {row['traces']:.0f} traces; client "
                          f"processes {100 * (row['client_cpu_share'] or 0):.0f}% busy; {split_text(row)}",
                          flush=True)
            row["first_sampled_ttft"], row["first_sampled_admission_s"] = cold, cold_admit
            row["warm_sampled_ttft"], row["warm_sampled_admission_s"] = sampled_alone(server.url, prompts[-2], mlxfun)
            out.append(row)
            print(f"  {name} {mode} {n} clients: {row['tok_s']:.1f} tok/s ({row['steady_tok_s']:.1f} while every "
                  f"client was in its loop), TTFT p50/p99 {row['ttft_p50']:.3f}/"
                  f"{row['ttft_p99']:.3f} s, ITL p50/p99 {row['itl_p50']:.4f}/{row['itl_p99']:.4f} s, "
                  f"{row['tokens']} tokens, {row['failed']} failed; a sampled request alone: TTFT "
                  f"{row['first_sampled_ttft']:.3f} s first, {row['warm_sampled_ttft']:.3f} s warm"
                  + (f" (the engine admitting it {1e3 * cold_admit:.1f} / "
                     f"{1e3 * row['warm_sampled_admission_s']:.1f} ms)" if mlxfun else ""), flush=True)
    finally:
        server.stop()
    return out


def engine_counters(url: str) -> dict[str, float]:
    """The mlxfun server's step counters from /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    names = ("steps_total", "busy_row_steps_total", "admissions_total", "admission_seconds_total", "step_traces_total",
             "preemptions_total", "device_wait_seconds_total", "idle_seconds_total", "rounds_total",
             "round_seconds_total", "plain_rounds_total", "plain_round_seconds_total")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("mlxfun_") in names:
            out[name.removeprefix("mlxfun_")] = float(value)
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process `pid`, summed by thread name (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def server_cpu(pid: int) -> dict[str, float]:
    """`thread_cpu` of the server's process and its children's (mlxfun's engine process)."""
    out, children = thread_cpu(pid), Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        for name, seconds in thread_cpu(int(child)).items():
            out[f"child:{name}"] = out.get(f"child:{name}", 0.0) + seconds
    return out


def gpu_processes(pid: int) -> dict[str, float] | None:
    """MiB of GPU memory held by the server's process ("server") and its children ("child"), as
    nvidia-smi lists them; a process absent holds no CUDA context (None without nvidia-smi)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = set(children.read_text().split()) if children.exists() else set()
    out: dict[str, float] = {}
    for line in listed.splitlines():
        p, _, mib = line.partition(",")
        who = "server" if p.strip() == str(pid) else "child" if p.strip() in kids else None
        if who:
            out[who] = out.get(who, 0.0) + float(mib.strip() or 0)
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """Each server thread's CPU microseconds per generated token over a run: where the host's time
    goes (the engine thread launching steps, the event loop's HTTP and JSON, MLX's own threads)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    return {k: round(1e6 * v / max(tokens, 1), 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0}


def occupancy(before: dict, after: dict, rows: int, row: dict) -> dict:
    """What the engine did during a measured run: decode steps per second of the run's wall time,
    the share of rows holding a request (busy row-steps over steps x rows), admissions, and traces
    (none once warm). Served tok/s is about rows x occupancy x steps per second."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d.get("steps_total", 0.0)
    return {"engine_steps": steps, "steps_per_s": steps / row["seconds"] if row.get("seconds") else None,
            "ms_per_step": 1e3 * row["seconds"] / steps if steps and row.get("seconds") else None,
            # of which the engine waited for the device (the rest is host time the device may have waited for)
            "wait_ms_per_step": 1e3 * d["device_wait_seconds_total"] / steps
            if steps and "device_wait_seconds_total" in d else None,
            # the engine idle, no request in it: the time between the clients' requests
            "idle_share": d["idle_seconds_total"] / row["seconds"] if row.get("seconds") and "idle_seconds_total" in d
            else None,
            "busy_ms_per_step": 1e3 * (row["seconds"] - d["idle_seconds_total"]) / steps
            if steps and row.get("seconds") and "idle_seconds_total" in d else None,
            "row_occupancy": d.get("busy_row_steps_total", 0.0) / (steps * rows) if steps else None,
            "admissions": d.get("admissions_total"), "admission_s": d.get("admission_seconds_total"),
            "traces": d.get("step_traces_total"),
            "preemptions": d.get("preemptions_total"), **round_split(d)}


def round_split(d: dict) -> dict:
    """The engine's rounds split (`EngineStats.time_round`): the plain ones' ms each (the steady
    step under the load), and the seconds the others took beyond as many plain rounds (what
    admissions cost the run); from /metrics deltas or an offline run's stats alike."""
    rounds, plain = d.get("rounds_total", 0.0), d.get("plain_rounds_total", 0.0)
    if not rounds or not plain:
        return {"rounds": rounds, "plain_rounds": plain, "plain_round_ms": None, "admission_overhead_s": None}
    each = d["plain_round_seconds_total"] / plain
    return {"rounds": rounds, "plain_rounds": plain, "plain_round_ms": 1e3 * each,
            "admission_overhead_s": d["round_seconds_total"] - rounds * each}


def offline_run(model, prompts: list[str], n: int, args, mode: str) -> dict:
    """`mlxfun.generate(batch_size=rows)` on the requests a load run sends: generated tok/s over its
    wall time, after a warm-up on other prompts (the same as the servers get)."""
    import mlxfun

    rows, requests = args.rows or n, args.requests or n
    sampling = dict(temperature=SEEDED["temperature"], top_p=SEEDED["top_p"],
                    seed=[1000 + i for i in range(requests)]) if mode == "seeded" else {}
    warm = prompts[len(prompts) // 2:][:n]
    mlxfun.generate(model, warm, max_tokens=4, batch_size=rows,
                    **({**sampling, "seed": sampling["seed"][:len(warm)]} if sampling else {}))
    runs = []
    for _ in range(args.offline_repeats):
        with Utilization() as util:
            t = time.perf_counter()
            out = mlxfun.generate(model, prompts[:requests], max_tokens=args.gen_tokens, batch_size=rows, **sampling)
            seconds = time.perf_counter() - t
        tokens = sum(len(ids) for ids in out.token_ids)
        steps = out.stats.steps  # decode steps, beside the servers' engine_steps and row_occupancy
        ms = 1e3 * seconds / max(steps, 1)
        print(f"  offline generate {mode} {requests} prompts, {rows} rows: {tokens / seconds:.1f} tok/s, {steps} "
              f"steps ({ms:.2f} ms each, prefills included), rows {out.stats.occupancy:.0%} full, GPU utilization "
              f"{_pct(util.mean)}", flush=True)
        st = out.stats
        split = round_split({"rounds_total": st.rounds, "round_seconds_total": st.round_seconds,
                             "plain_rounds_total": st.plain_rounds,
                             "plain_round_seconds_total": st.plain_round_seconds})
        print(f"    its rounds: {split_text(split)}", flush=True)
        runs.append(dict(mode=mode, clients=n, rows=rows, requests=requests, tokens=tokens, seconds=seconds,
                         tok_s=tokens / seconds, engine_steps=steps, ms_per_step=ms,
                         row_occupancy=out.stats.occupancy, gpu_utilization=util.mean, **split))
    best = max(runs, key=lambda r: r["tok_s"])
    return {**best, "tok_s_runs": [r["tok_s"] for r in runs]}


def split_text(split: dict) -> str:
    if split["plain_round_ms"] is None:
        return f"{split['rounds']:.0f} rounds, none plain"
    return (f"{split['rounds']:.0f} rounds, {split['plain_rounds']:.0f} plain ({split['plain_round_ms']:.2f} ms "
            f"each), the others {split['admission_overhead_s']:.2f} s beyond as many plain ones")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def sampled_alone(url: str, prompt: str, mlxfun: bool) -> tuple[float, float | None]:
    """TTFT of one seeded request of 8 tokens sent alone over plain HTTP (a client library's own
    first use stays out: the openai client's first request in this process took about 50 ms more),
    and on mlxfun the engine's host seconds admitting it (from /metrics)."""
    before = engine_counters(url) if mlxfun else {}
    body = dict(prompt=prompt, max_tokens=8, temperature=SEEDED["temperature"], top_p=SEEDED["top_p"], seed=7)
    ttft = first_token_seconds(int(url.rsplit(":", 1)[1]), "/v1/completions", body)
    after = engine_counters(url) if mlxfun else {}
    return ttft, (after["admission_seconds_total"] - before["admission_seconds_total"]) if mlxfun else None


def first_token_seconds(port: int, path: str, body: dict) -> float:
    """Seconds from sending a streamed request to its first token's chunk; the stream read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t = time.perf_counter()
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = None
    for line in response:
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - t
    conn.close()
    if response.status != 200 or first is None:
        raise RuntimeError(f"{path}: status {response.status}")
    return first


def best_runs(runs: list[dict]) -> list[dict]:
    """Per (server, mode, clients), the run with the most tok/s (repeats on a shared machine)."""
    best: dict[tuple, dict] = {}
    for r in runs:
        key = (r["server"], r["mode"], r["clients"])
        if key not in best or r["tok_s"] > best[key]["tok_s"]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["clients"], r["mode"], r["server"] != "mlxfun"))


def table(rows: list[dict]) -> str:
    head = (f"{'server':14s} {'mode':7s} {'clients':>7s} {'tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
            f"{'ITL p50':>8s} {'ITL p99':>8s} {'failed':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['server']:14s} {r['mode']:7s} {r['clients']:7d} {r['tok_s']:9.1f} {r['ttft_p50']:9.3f} "
                     f"{r['ttft_p99']:9.3f} {r['itl_p50']:8.3f} {r['itl_p99']:8.3f} {r['failed']:6d}")
    pairs = {(r["mode"], r["clients"]): r for r in rows if r["server"] == "mlx-lm"}
    for r in rows:
        other = pairs.get((r["mode"], r["clients"]))
        if r["server"] == "mlxfun" and other and other["tok_s"]:
            ratio = r["tok_s"] / other["tok_s"]
            lines.append(f"mlxfun / mlx-lm, {r['mode']}, {r['clients']} clients: tok/s {ratio:.2f}x, "
                         f"TTFT p99 {r['ttft_p99']:.3f} vs {other['ttft_p99']:.3f} s")
    return "\n".join(lines)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: the default model)")
    p.add_argument("--shape", choices=("tiny", "135M", "1B", "8B"), default=None,
                   help="random-weight Llama shape instead (tiny: 1 layer, 64 wide, where host work dominates)")
    p.add_argument("--dtype", default=None, help="dtype of random weights (default: bfloat16 on a GPU, else float32)")
    p.add_argument("--clients", default="8,32,128", help="comma-separated concurrent clients (default: 8,32,128)")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: one per client)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--arrival", type=float, default=1.0, help="arrivals spread over this many seconds (default 1)")
    p.add_argument("--modes", default="greedy", help="greedy, seeded or both (comma-separated)")
    p.add_argument("--rows", type=int, default=None, help="rows of both servers (default: the client count)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes (default: 1 per 8 clients, at most half the cores)")
    p.add_argument("--mlx-lm", action="store_true", help="also run mlx_lm.server on the same weights and prompts")
    p.add_argument("--mlx-lm-python", default="python", help="the interpreter that has mlx-lm (its own venv)")
    p.add_argument("--mlxfun-args", default="", help="extra arguments for mlxfun serve, space-separated")
    p.add_argument("--mlx-lm-args", default="", help="extra arguments for mlx_lm.server, space-separated")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per server and client count, the servers' order alternating; the best is kept")
    p.add_argument("--offline", action="store_true",
                   help="also time mlxfun.generate(batch_size=rows) on the same prompts (the engine alone)")
    p.add_argument("--offline-repeats", type=int, default=2,
                   help="offline runs per client count and mode; the best is kept (default 2)")
    p.add_argument("--engine-thread-too", action="store_true",
                   help="also run `mlxfun serve --engine-thread` (the engine on a thread of the server's process, "
                        "sharing its GIL), reported as mlxfun-thread")
    p.add_argument("--mlxfun-also", action="append", default=[], metavar="NAME=ARGS",
                   help="also run mlxfun serve with these extra arguments (space-separated), reported as NAME "
                        "(e.g. mlxfun-wait0='--admit-wait 0'); may be repeated")
    p.add_argument("--mlxfun-ref", action="append", default=[], metavar="NAME=DIR",
                   help="also run mlxfun serve from the package in DIR (a folder holding mlxfun/, say "
                        "`git archive REV mlxfun | tar -x -C DIR`), reported as NAME: this tree against another")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")

    from mlxfun import save
    from mlxfun.bench.models import machine

    info = machine()
    # uvicorn serves with uvloop and httptools (the [server] extra) when they import, else asyncio and h11.
    info["uvloop"], info["httptools"] = (_version(name) for name in ("uvloop", "httptools"))
    if args.mlx_lm:
        v = subprocess.run([args.mlx_lm_python, "-c", "import mlx_lm, mlx.core as mx; print(mlx_lm.__version__, "
                            "mx.__version__)"], capture_output=True, text=True)
        if v.returncode:
            print(f"mlx-lm is not importable by {args.mlx_lm_python}: {v.stderr.strip()[-300:]}")
            return 2
        info["mlx_lm"], info["mlx_lm_mlx"] = v.stdout.split()
    print(json.dumps(info))
    model = build_model(args)
    # the second half warms up
    prompts = make_prompts(model, 2 * max(clients + [args.requests or 0]), args.prompt_tokens)
    offline = [offline_run(model, prompts, n, args, mode) for n in clients for mode in modes] if args.offline else []
    if offline:
        import mlx.core as mx

        mx.clear_cache()  # the servers size their KV cache by the memory free when they start
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="mlxfun-serve-load-") as tmp:
        folder = save(model, Path(tmp) / "model")
        del model
        log = Path(tmp) / "server.log"
        ours = tuple(args.mlxfun_args.split())
        servers = [("mlxfun", lambda port, r: mlxfun_argv(folder, port, r, args.gen_tokens, extra=ours))]
        if args.engine_thread_too:
            servers.append(("mlxfun-thread", lambda port, r: mlxfun_argv(folder, port, r, args.gen_tokens, True, ours)))
        for also in args.mlxfun_also:
            name, _, extra = also.partition("=")
            servers.append((name, lambda port, r, x=tuple(extra.split()): mlxfun_argv(folder, port, r, args.gen_tokens,
                                                                                   extra=x)))
        for ref in args.mlxfun_ref:
            name, _, where = ref.partition("=")
            # `python -m` puts its working folder first on the path: the server runs in DIR.
            servers.append((name, lambda port, r, d=str(Path(where).resolve()): ["env", "-C", d] + mlxfun_argv(
                folder, port, r, args.gen_tokens, extra=ours)))
        if args.mlx_lm:
            servers.append(("mlx-lm", lambda port, r: mlx_lm_argv(args.mlx_lm_python, folder, port, r, args.gen_tokens,
                                                                  args.mlx_lm_args.split())))
        try:
            for n in clients:
                # One client process per 8 clients: one process of 32 streams was 90% busy (H200).
                procs = args.client_procs or max(1, min(n // 8, (os.cpu_count() or 2) // 2))
                for rep in range(args.repeats):
                    # Alternate which server goes first, so a machine's drift does not favour one.
                    for name, argv_for in (servers if rep % 2 == 0 else servers[::-1]):
                        rows += measure(name, argv_for, n, procs, modes, prompts, args, log)
        except BaseException:
            print(f"the servers' log: {log.read_text()[-6000:]}", flush=True)
            raise
        finally:
            if args.json:  # the servers' log beside the results, also when a run failed
                Path(args.json).with_suffix(".server.log").write_text(log.read_text())
        runs = rows
        rows = best_runs(runs)
        if any(r["failed"] for r in rows):
            print(f"some requests failed; the servers' log: {log.read_text()[-3000:]}")
    print()
    print(table(rows))
    for o in offline:
        served = next((r for r in rows if r["server"] == "mlxfun" and r["mode"] == o["mode"]
                       and r["clients"] == o["clients"]), None)
        if served:
            o["served_ratio"] = served["tok_s"] / o["tok_s"]
            o["steady_ratio"] = served["steady_tok_s"] / o["tok_s"]
            print(f"served / offline generate(batch_size={o['rows']}), {o['mode']}, {o['clients']} clients: "
                  f"{served['tok_s']:.1f} / {o['tok_s']:.1f} tok/s = {o['served_ratio']:.2f} (while every client "
                  f"was in its loop: {served['steady_tok_s']:.1f}, {o['steady_ratio']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows, "runs": runs,
                                               "offline": offline}, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
