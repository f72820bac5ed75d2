"""Command line: `mlxfun generate ...`, `mlxfun bench ...`, `mlxfun profile ...`."""

from __future__ import annotations

import argparse
import json
import sys

from mlxfun.errors import MlxfunError


def _read_prompts(path: str) -> list:
    """One prompt per line, or JSONL whose lines are strings, {"prompt": ...} or {"messages": [...]}."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                item = json.loads(line)
                if isinstance(item, dict):
                    item = item.get("messages", item.get("prompt"))
                if item is None:
                    raise MlxfunError(f"{path}:{n}: expected a string, a 'prompt' or a 'messages' entry")
                prompts.append(item)
            else:
                prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise MlxfunError(f"{path} holds no prompts")
    return prompts


def generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, Hugging Face folder or repo id (default: SmolLM2-135M)")
    p.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    p.add_argument("--prompts-file", help="one prompt per line, or .jsonl")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string; repeat for several")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--batch-size", type=int, default=None, help="rows decoded at once (more prompts queue)")
    p.add_argument("--max-kv-size", type=int, default=None, help="bound the KV cache to this many tokens")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the checkpoint's)")
    p.add_argument("--verbose", action="store_true", help="print timings and peak memory")


def run_generate(args: argparse.Namespace) -> None:
    import mlxfun
    from mlxfun.progress import Progress

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += _read_prompts(args.prompts_file)
    if not prompts:
        raise MlxfunError("give a --prompt or a --prompts-file")
    model = mlxfun.load(args.model, dtype=args.dtype)
    progress = Progress(len(prompts), args.max_tokens, enabled=len(prompts) > 1 and sys.stderr.isatty())
    result = mlxfun.generate(model, prompts, max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                             min_p=args.min_p, top_k=args.top_k, seed=args.seed, stop=args.stop, chat=args.chat,
                             batch_size=args.batch_size, max_kv_size=args.max_kv_size, on_event=progress.update)
    progress.close()
    for i, (text, reason) in enumerate(zip(result.texts, result.finish_reasons)):
        if len(prompts) > 1:
            print(f"==== prompt {i} ({reason}) ====")
        print(text)
    if args.verbose:
        print("=" * 10)
        print(result.stats.summary())
        if args.temp > 0:
            print(f"Seeds: {result.seeds}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxfun", description="Batched text generation with MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_parser(sub.add_parser("generate", help="generate text for one or more prompts"))
    sub.add_parser("bench", help="benchmark throughput (see mlxfun bench --help)", add_help=False)
    sub.add_parser("profile", help="profile compile and step latency (see mlxfun profile --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["profile"]):
        import importlib

        return importlib.import_module(f"mlxfun.{argv[0]}").main(argv[1:]) or 0
    args = parser.parse_args(argv)
    try:
        run_generate(args)
    except (MlxfunError, OSError) as e:
        print(f"mlxfun: error: {e}", file=sys.stderr)
        return 2
    return 0
