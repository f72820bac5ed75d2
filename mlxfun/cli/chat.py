"""`mlxfun chat`: an interactive conversation with the model, turn by turn, streamed.

Each turn is one request on an engine of one row, whose prompt is the whole conversation through
the chat template. The engine's prefix cache (when it has one) reuses the KV of the turns before,
so a turn computes only its new tokens: each turn's prompt tokens and how many of them were
reused (`record.cached_tokens`) show with `/stats` or `--verbose`.

Commands: /reset (forget the conversation), /stats (the last turn's numbers), /help, /quit (or
Ctrl-D). Ctrl-C stops a reply (what was said stays in the conversation); at the prompt it clears
the line.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple

from mlxfun.cli import main as cli
from mlxfun.errors import MlxfunError

HELP = "/reset: forget the conversation   /stats: the last turn's numbers   /quit or Ctrl-D: leave"


class Turn(NamedTuple):
    prompt_tokens: int  # the whole conversation so far, through the template
    cached_tokens: int  # of which reused from the turns before (computed: the difference)
    generated: int
    ttft: float  # seconds from submission to the first token
    seconds: float  # the whole turn
    finish_reason: str

    def line(self) -> str:
        rate = (self.generated - 1) / (self.seconds - self.ttft) if self.generated > 1 and self.seconds > self.ttft \
            else 0.0
        return (f"[prompt {self.prompt_tokens} tokens, {self.cached_tokens} cached, "
                f"{self.prompt_tokens - self.cached_tokens} computed; generated {self.generated} tokens, "
                f"{rate:.1f} tokens/s; first token after {self.ttft:.2f} s; {self.finish_reason}]")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlxfun chat", formatter_class=cli.HelpFormatter,
                                description="Chat with the model, turn by turn. " + HELP)
    cli.add_model_flags(p)
    p.add_argument("--system-prompt", metavar="TEXT", help="the conversation's system message")
    p.add_argument("--verbose", action="store_true", help="print each turn's token counts and speed")
    cli.add_generation_flags(p, batch=False)  # one streamed reply at a time: no --batch-size, no --logprobs
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return repl(args)
    except MlxfunError as e:
        print(f"mlxfun: error: {cli.flag_message(str(e))}", file=sys.stderr)
        return 2


def repl(args: argparse.Namespace) -> int:
    from mlxfun.engine.core import Engine
    from mlxfun.model.load import load

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    model = load(args.model, dtype=args.dtype)
    if not model.tokenizer.chat_template:
        raise MlxfunError(f"{model.source} has no chat template; use mlxfun generate for plain text")
    config = cli.generation_config(args)
    cli.check_flags(model, config)
    engine = Engine(model, 1, prefill_step=config.prefill_step, max_kv_size=config.max_kv_size)
    start = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    history, last = list(start), None
    print(f"mlxfun chat with {model.source}. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        command = line.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command == "/reset":
            history = list(start)
            print("(the conversation is forgotten)", file=sys.stderr)
        elif command == "/stats":
            print(last.line() if last else "(no turn yet)", file=sys.stderr)
        elif command in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        elif command.startswith("/"):
            print(f"unknown command {command}; {HELP}", file=sys.stderr)
        elif command:
            messages = history + [{"role": "user", "content": line}]
            try:
                last, reply = turn(engine, model, messages, config)
            except MlxfunError as e:  # e.g. the conversation outgrew the context
                print(f"mlxfun: error: {cli.flag_message(str(e))} (/reset starts over)", file=sys.stderr)
                continue
            history = messages + [{"role": "assistant", "content": reply}]
            if args.verbose:
                print(last.line(), file=sys.stderr)


def turn(engine, model, messages: list[dict], config) -> tuple[Turn, str]:
    """Stream one reply to stdout; -> (its numbers, its text)."""
    from mlxfun.cli import jobs
    from mlxfun.engine.options import requests

    (request,) = requests(model, [messages], config)
    t0 = time.perf_counter()
    with jobs.stop_on_interrupt() as stop:
        record = jobs.stream_text(engine, request, sys.stdout, stop)
    first = record.first_token_time if record.first_token_time is not None else time.perf_counter()
    stats = Turn(len(request.prompt), record.cached_tokens, len(record.row.token_ids), first - t0,
                 time.perf_counter() - t0, record.finish_reason)
    return stats, record.text.final_text
