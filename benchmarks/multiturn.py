"""Multi-turn conversations through `mlxfun serve`: how many of the prompt tokens sent are computed.

`--conversations` clients (default 32) each hold a 6-turn chat: a shared system prompt, then per
turn a new user message of `--user-tokens` words; each turn sends the whole conversation so far
(the OpenAI API is stateless) and appends the reply (`--reply-tokens`, EOS ignored). The server
reports, per response, `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` (the
tokens whose KV came from its prefix cache); computed = prompt - cached. Run with the prefix cache
and without (`--no-prefix-cache` on the server), the same conversations, greedy.

The model: a random-weight shape (`--shape`, default the CPU workload shape here, 1B on a GPU)
with a word-level tokenizer and a ChatML-like template, saved once to a temporary folder.

Run: python benchmarks/multiturn.py [--shape 1B] [--conversations 32] [--turns 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import Server, free_port  # noqa: E402

TEMPLATE = ("{% for m in messages %}t1 t{{ {'system': 4, 'user': 5, 'assistant': 6}[m['role']] }} "
            "{{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t1 t6 {% endif %}")


def build_model(shape: str | None, folder: Path) -> Path:
    import mlx.core as mx

    import mlxfun
    from mlxfun import bench
    from mlxfun.load import Model

    gpu = mx.default_device() == mx.gpu
    config = bench.SHAPES[shape] if shape else (bench.SHAPES["1B"] if gpu else bench.WORKLOAD_SHAPE)
    params = bench.random_params(config, mx.bfloat16 if gpu else mx.float32)
    tokenizer = bench.word_tokenizer(config.vocab_size)
    tokenizer.chat_template = TEMPLATE
    return mlxfun.save(Model(config, params, tokenizer, f"random {shape or 'workload'}"), folder)


async def conversation(client, system: str, users: list[str], reply_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    out = []
    for user in users:
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        r = await client.chat.completions.create(model="m", messages=messages, max_tokens=reply_tokens,
                                                 temperature=0.0, extra_body={"ignore_eos": True})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        details = r.usage.prompt_tokens_details
        out.append(dict(prompt=r.usage.prompt_tokens, cached=details.cached_tokens if details else 0,
                        seconds=time.perf_counter() - t0))
    return out


async def run_all(url: str, system: str, users: list[list[str]], reply_tokens: int) -> list[list[dict]]:
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600) as client:
        return await asyncio.gather(*(conversation(client, system, u, reply_tokens) for u in users))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default=None)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=100)
    p.add_argument("--user-tokens", type=int, default=30)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--rows", type=int, default=None, help="server rows (default: one per conversation)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)

    def words(n: int) -> str:
        return " ".join(f"t{t}" for t in rng.integers(10, 1000, n))

    system = words(args.system_tokens)
    users = [[words(args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="mlxfun-multiturn-") as tmp:
        folder = build_model(args.shape, Path(tmp) / "model")
        for reuse in (True, False):
            port = free_port()
            argv_ = [sys.executable, "-m", "mlxfun", "serve", "--model", str(folder), "--port", str(port),
                     "--rows", str(args.rows or args.conversations), "--log-level", "warning"]
            server = Server(argv_ + ([] if reuse else ["--no-prefix-cache"]), port, Path(tmp) / "server.log")
            try:
                t0 = time.perf_counter()
                turns = asyncio.run(run_all(server.url + "/v1", system, users, args.reply_tokens))
                wall = time.perf_counter() - t0
            finally:
                server.stop()
            sent = sum(t["prompt"] for c in turns for t in c)
            cached = sum(t["cached"] for c in turns for t in c)
            per_turn = [float(np.mean([c[k]["seconds"] for c in turns])) for k in range(args.turns)]
            results["reuse" if reuse else "no reuse"] = dict(
                sent=sent, cached=cached, computed=sent - cached, computed_share=(sent - cached) / sent,
                wall_s=wall, turn_seconds=per_turn)
            print(f"prefix cache {'on ' if reuse else 'off'}: {sent} prompt tokens sent, {sent - cached} computed "
                  f"({(sent - cached) / sent:.1%}), {wall:.1f} s; mean seconds per turn "
                  f"{', '.join(f'{s:.2f}' for s in per_turn)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
