"""Where a server's first request after /health answers spends the time it spends more than a warm
one (diagnostic, issue 52). Each `--sequences` entry starts a fresh `mlxfun serve` and sends
requests one at a time, each timed to its first streamed token over a plain HTTP connection (no
client library: the client's own first-use costs stay out), with the engine's host seconds
admitting it (from /metrics):

  seeded  a seeded request (temperature 0.8, top-p 0.9) of --prompt-tokens
  greedy  a greedy one of 8 other words (a short prompt)
  chat    a greedy chat request of 8 words

e.g. `seeded,seeded,seeded`: the cold one against the same kind warm; `greedy,seeded,seeded`: does
any earlier request take the seeded one's cold cost? A sequence ending in `@thread` runs the
server with --engine-thread (no engine process: the pipe out of the picture).

Run: python benchmarks/serve_cold.py --shape 1B --sequences seeded,seeded,seeded greedy,seeded,seeded
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from serve_load import Server, build_model, engine_counters, first_token_seconds, free_port, make_prompts, mlxfun_argv


def body_for(kind: str, prompt: str, words: str, n: int) -> tuple[str, dict]:
    if kind == "seeded":
        return "/v1/completions", dict(prompt=prompt, max_tokens=8, temperature=0.8, top_p=0.9, seed=7 + n)
    if kind == "greedy":
        return "/v1/completions", dict(prompt=words, max_tokens=8, temperature=0)
    if kind == "chat":
        return "/v1/chat/completions", dict(messages=[{"role": "user", "content": words}], max_tokens=8,
                                            temperature=0)
    raise SystemExit(f"unknown request kind {kind!r} (seeded, greedy, chat)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1B", choices=("tiny", "135M", "1B", "8B"))
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--sequences", nargs="+", default=["seeded,seeded,seeded", "greedy,seeded,seeded"])
    p.add_argument("--mlxfun-args", default="", help="extra arguments for mlxfun serve, space-separated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from mlxfun import save

    model = build_model(args)
    prompts = make_prompts(model, 64, args.prompt_tokens, seed=3)
    words = make_prompts(model, 64, 8, seed=4)
    runs = []
    with tempfile.TemporaryDirectory(prefix="mlxfun-serve-cold-") as tmp:
        folder = save(model, Path(tmp) / "model")
        n = 0
        for sequence in args.sequences:
            kinds, _, where = sequence.partition("@")
            port = free_port()
            t = time.perf_counter()
            argv = mlxfun_argv(folder, port, args.rows, 64, where == "thread", tuple(args.mlxfun_args.split()))
            server = Server(argv, port, Path(tmp) / "server.log")
            up = time.perf_counter() - t
            out = []
            try:
                for kind in kinds.split(","):
                    path, body = body_for(kind, prompts[n], words[n], n)
                    n += 1
                    before = engine_counters(server.url)["admission_seconds_total"]
                    try:
                        ttft = first_token_seconds(port, path, body)
                    except RuntimeError as e:  # a chat request to a model without a chat template, say
                        out.append(dict(kind=kind, error=str(e)))
                        continue
                    admit = engine_counters(server.url)["admission_seconds_total"] - before
                    out.append(dict(kind=kind, ttft_ms=round(1e3 * ttft, 1), admission_ms=round(1e3 * admit, 1)))
            finally:
                server.stop()
            runs.append(dict(sequence=sequence, up_s=round(up, 1), requests=out))
            print(f"{sequence} (up in {up:.1f} s): " + ", ".join(
                f"{r['kind']} {r['ttft_ms']:.1f} ms (admitting {r['admission_ms']:.1f})" if "error" not in r
                else f"{r['kind']} {r['error']}" for r in out), flush=True)
    if args.json:
        from mlxfun.bench.models import machine

        Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "runs": runs}, indent=1))
    return 0 if all("error" not in r for run in runs for r in run["requests"]) else 1


if __name__ == "__main__":
    sys.exit(main())
