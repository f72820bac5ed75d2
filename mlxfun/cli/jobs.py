"""Jobs of the command line: prompts from flags or a file through the engine, each result handed
out as soon as it finishes.

An input file is text (one prompt per line) or JSONL (`.jsonl`): each line a string or an object
with `prompt` or `messages`, an optional `id` and per-line generation options (`max_tokens`,
`temperature`, `seed`, ...). One id scheme names every prompt (`Item.id`): a line's `id` as given
(a string or an integer, kept so), else its number, 1-based: its line number in the file, or the
order of a `--prompt`. Results go to stdout (one prompt streams its text; several under a header
naming the id), or to a JSONL file, one line per finished request with its `id` (and its `line`,
from a file), appended and flushed whole, so that a job that is stopped keeps what finished and a
rerun skips the ids already there. The first Ctrl-C stops a job at the next step
(`stop_on_interrupt`); a second one interrupts at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence, TextIO

from mlxfun.cli.progress import Progress
from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.engine.events import Event
from mlxfun.engine.options import GenerationConfig, Request, requests
from mlxfun.engine.records import Record
from mlxfun.errors import InputError, is_int
from mlxfun.model.load import Model
from mlxfun.model.tokenizer import Tokenizer

# GenerationConfig fields a line may set for itself (the others apply to the whole run).
LINE_OPTIONS = ("max_tokens", "temperature", "top_p", "min_p", "top_k", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "stop", "logprobs", "ignore_eos", "extra_eos_tokens", "response_format")


class Item(NamedTuple):
    """One prompt of a job and where it came from."""

    id: int | str  # the line's `id` as given, else its number (1-based): its line, or the --prompt's order
    prompt: str | None  # text, or None when `messages` is given
    messages: list | None
    options: dict  # per-line generation options (LINE_OPTIONS)
    where: str  # "in.jsonl:3" or "--prompt 1", for errors
    line: int | None = None  # its line in the file (1-based; blank lines count); None for a --prompt


def key(rid) -> str:
    """An id as a set key: 1 and "1" are different ids."""
    return json.dumps(rid)


# ---- input ----


def prompt_items(prompts: Sequence[str]) -> list[Item]:
    return [Item(i, p, None, {}, f"--prompt {i}") for i, p in enumerate(prompts, 1)]


def read_items(path: str) -> list[Item]:
    """The prompts of a text or JSONL file; blank lines are skipped (ids are line numbers all the same)."""
    items = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                if path.endswith(".jsonl"):
                    items.append(_json_item(line, n, where))
                else:
                    items.append(Item(n, line.rstrip("\r\n").replace("\\n", "\n"), None, {}, where, n))
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not items:
        raise InputError(f"{path} holds no prompts")
    return items


def _json_item(line: str, n: int, where: str) -> Item:
    text = line.rstrip("\r\n")  # parsed without its newline: a fault at the line's end is not "line 2, column 1"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        end = ", the line's end" if e.pos >= len(text) else ""
        raise InputError(f"{where}: not valid JSON: {e.msg} (column {e.colno}{end})") from None
    if isinstance(value, str):
        return Item(n, value, None, {}, where, n)
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a string or an object with 'prompt' or 'messages', got "
                         f"{type(value).__name__}")
    value = dict(value)
    rid = value.pop("id", n)
    if not (isinstance(rid, str) or is_int(rid)):
        raise InputError(f"{where}: 'id' must be a string or an integer, got {rid!r}")
    prompt, messages = value.pop("prompt", None), value.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise InputError(f"{where}: give one of 'prompt' (a string) or 'messages' (a list of role/content objects)")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if messages is not None and not (isinstance(messages, list) and messages):
        raise InputError(f"{where}: 'messages' must be a non-empty list of role/content objects")
    for name, v in value.items():
        if name not in LINE_OPTIONS:
            close = difflib.get_close_matches(name, LINE_OPTIONS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InputError(f"{where}: unknown key {name!r} ({hint}a line holds id, prompt or messages, and "
                             f"generation options: {', '.join(LINE_OPTIONS)})")
        # One value for the line (a list would read as one value per prompt); stop and EOS tokens may be lists,
        # a response_format is an object.
        if isinstance(v, (list, dict)) and not (name in ("stop", "extra_eos_tokens") and isinstance(v, list)
                                                and all(isinstance(x, (str, int)) for x in v)) \
                and not (name == "response_format" and isinstance(v, dict)):
            raise InputError(f"{where}: {name} must be one value, got {v!r:.60}")
    return Item(rid, prompt, messages, value, where, n)


def check_unique(items: Sequence[Item]) -> None:
    seen = {}
    for item in items:
        k = key(item.id)
        if k in seen:
            raise InputError(f"{item.where}: id {item.id!r} is also the id of {seen[k]} (ids must be unique, to "
                             "resume a job)")
        seen[k] = item.where


def finished_ids(path: str) -> set[str]:
    """Keys of the ids already in an output file. A last line cut short (a job killed while writing)
    is removed, so that appending starts a fresh line."""
    if not Path(path).exists():
        return set()
    ids, good = set(), 0
    with open(path, "rb+") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            if line.strip():
                try:
                    ids.add(key(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    raise InputError(f"{path}:{n}: not a result line with an 'id': cannot resume into this file "
                                     "(give another --output)") from None
            good += len(line)
        if f.seek(0, 2) > good:
            print(f"mlxfun: {path}: removed a last line that was cut short", file=sys.stderr)
            f.truncate(good)
    return ids


# ---- requests ----


def chat_messages(item: Item, system_prompt: str | None) -> list[dict]:
    """The item as messages: its own, or its prompt as the user's; the system prompt first unless it has one."""
    messages = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt}]
    if system_prompt is not None and not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def build_requests(model: Model, items: Sequence[Item], config: GenerationConfig, *, template: bool,
                   system_prompt: str | None = None) -> list[Request]:
    """One checked Request per item (`options.requests`, with the line's own options); errors name the line.
    Lines with the same options are checked in one call (one call per line cost ~1 ms here)."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(json.dumps(item.options, sort_keys=True), []).append(i)
    out: list[Request | None] = [None] * len(items)
    for group in groups.values():
        try:
            prompts = [_prompt(model, items[i], template, system_prompt) for i in group]
            reqs = requests(model, prompts, dataclasses.replace(config, **items[group[0]].options))
        except InputError:  # again line by line, to name the line
            reqs = [_request(model, items[i], config, template, system_prompt) for i in group]
        for i, request in zip(group, reqs):
            out[i] = request
    return out


def _prompt(model: Model, item: Item, template: bool, system_prompt: str | None):
    if item.messages is not None and not model.tokenizer.chat_template:
        raise InputError("'messages' need a chat template, and this model has none")
    return chat_messages(item, system_prompt) if template or item.messages is not None else item.prompt


def _request(model: Model, item: Item, config: GenerationConfig, template: bool, system_prompt: str | None
             ) -> Request:
    try:
        (request,) = requests(model, [_prompt(model, item, template, system_prompt)],
                              dataclasses.replace(config, **item.options))
    except InputError as e:
        message = re.sub(r"^prompt 0(: | )", lambda m: "" if m[1] == ": " else "the prompt ", str(e))
        raise InputError(f"{item.where}: {message}") from None
    return request


def load_prompt_cache(model: Model, path: str, reqs: Sequence[Request]):
    """The prompt cache in `path`, with a warning on stderr when no prompt starts with one of its whole
    blocks (a cache only skips whole blocks of a prompt's first tokens, so it would go unused)."""
    from mlxfun.features.prompt_cache import load_prompt_cache as load
    from mlxfun.model.cache import BLOCK

    cache = load(path, model)
    head = tuple(cache.tokens[:BLOCK])
    if len(head) < BLOCK or not any(len(r.prompt) > BLOCK and tuple(r.prompt[:BLOCK]) == head for r in reqs):
        why = (f"it holds {len(cache.tokens)} tokens, less than one block of {BLOCK}" if len(head) < BLOCK else
               f"no prompt starts with its first {BLOCK} tokens")
        print(f"mlxfun: warning: the prompt cache {path} is unused: {why} (cached prompts must begin with the "
              "cached text, through the same chat template)", file=sys.stderr)
    return cache


# ---- running ----


@contextmanager
def stop_on_interrupt() -> Iterator[threading.Event]:
    """Within the block, the first Ctrl-C (SIGINT) only sets the event it yields, so that a job stops
    at the next step with its files whole; a second one raises KeyboardInterrupt as usual."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # only the main thread receives signals
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def run(engine: Engine, reqs: Sequence[Request], stop: threading.Event | None = None,
        where: Sequence[str] | None = None) -> Iterator[tuple[int, Event, Record | None]]:
    """Run `reqs` on `engine`, yielding (index in reqs, event, record) for every event; `record` is
    the released Record on a request's closing event, else None. Requests are submitted as rows
    free up (the engine's queue stays short: its admission scans it). When `stop` is set, every
    request still running or queued is cancelled and closes with finish reason "cancelled"."""
    index: dict[int, int] = {}  # engine id -> index in reqs
    pending = iter(range(len(reqs)))
    cancelled = False

    def feed():
        while not cancelled and len(index) < 2 * engine.rows:
            i = next(pending, None)
            if i is None:
                return
            try:
                index[engine.submit(reqs[i])] = i
            except InputError as e:
                raise InputError(f"{where[i]}: {e}" if where else str(e)) from None

    feed()
    for event in engine.events():
        if stop is not None and stop.is_set() and not cancelled:
            cancelled = True
            for rid in index:
                engine.cancel(rid)
        record = None
        if event.finish_reason is not None:
            record = engine.take(event.index)
            feed()
        yield index.pop(event.index) if record is not None else index[event.index], event, record


# ---- output ----


def result_json(item: Item, request: Request, record: Record, tokenizer: Tokenizer) -> dict:
    """The output line of a finished request: id (and line, from a file), prompt or messages, text,
    finish reason, token counts, the seed of a sampled row, and logprobs (with each token's text)
    when asked for."""
    row = record.row
    out = {"id": item.id} if item.line is None else {"id": item.id, "line": item.line}
    if item.messages is not None:
        out["messages"] = item.messages
    else:
        out["prompt"] = item.prompt
    out.update(text=row.text.final_text, finish_reason=row.finish_reason, prompt_tokens=len(request.prompt),
               completion_tokens=len(row.token_ids))
    if not sampling.all_greedy(request.settings):
        out["seed"] = sampling.seeds(request.settings)[0]
    if request.logprobs >= 0:
        out["logprobs"] = logprobs_json(tokenizer, row.token_ids, row.logprobs, row.top)
    return out


def logprobs_json(tokenizer: Tokenizer, ids: list[int], logprobs: list[float], top: list) -> list[dict]:
    """Per generated token: {"token": text, "id", "logprob", "top_logprobs": [{"token", "id", "logprob"}]}."""
    out = []
    for j, (tid, lp) in enumerate(zip(ids, logprobs)):
        entry = {"token": tokenizer.decode([tid]), "id": tid, "logprob": lp}
        if top:
            entry["top_logprobs"] = [{"token": tokenizer.decode([t]), "id": t, "logprob": v} for t, v in top[j]]
        out.append(entry)
    return out


def write_jsonl(engine: Engine, items: Sequence[Item], reqs: Sequence[Request], path: str, progress: Progress,
                stop: threading.Event | None = None) -> int:
    """Append one JSON line per finished request to `path`, in the order they finish; -> lines written."""
    written = 0
    with open(path, "a", encoding="utf-8") as f:
        for i, event, record in run(engine, reqs, stop, [it.where for it in items]):
            if record is not None and record.finish_reason != "cancelled":
                f.write(json.dumps(result_json(items[i], reqs[i], record, engine.model.tokenizer),
                                   ensure_ascii=False) + "\n")
                f.flush()
                written += 1
            progress.update(engine.stats.generation_tokens, record is not None and record.finish_reason != "cancelled")
    return written


def print_texts(engine: Engine, items: Sequence[Item], reqs: Sequence[Request], out: TextIO, progress: Progress,
                stop: threading.Event | None = None) -> int:
    """Print each result under a header, in prompt order, as soon as it and those before it have
    finished; when stopped, the finished ones not yet printed follow. -> results printed."""
    finished: dict[int, Record] = {}
    printed = 0
    for i, event, record in run(engine, reqs, stop, [it.where for it in items]):
        ok = record is not None and record.finish_reason != "cancelled"
        progress.update(engine.stats.generation_tokens, ok)
        if ok:
            finished[i] = record
        while printed in finished:
            _print_text(out, progress, items[printed].id, finished.pop(printed), engine.model.tokenizer)
            printed += 1
    for i in sorted(finished):
        _print_text(out, progress, items[i].id, finished[i], engine.model.tokenizer)
    return printed + len(finished)


def header(rid: int | str, finish_reason: str | None) -> str:
    """The line above a printed result: the prompt's id and why it ended."""
    return f"==== prompt {rid} ({finish_reason}) ===="


def _print_text(out: TextIO, progress: Progress, rid: int | str, record: Record, tokenizer: Tokenizer) -> None:
    progress.clear()
    out.write(f"{header(rid, record.finish_reason)}\n{record.text.final_text}\n")
    out.write(logprobs_table(tokenizer, record))
    out.flush()


def stream_text(engine: Engine, request: Request, out: TextIO, stop: threading.Event | None = None) -> Record:
    """Print one request's text as it is generated, then its logprobs when asked for; -> its record."""
    done = None
    for _, event, record in run(engine, [request], stop):  # to the end: the engine's stats close then
        out.write(event.text)
        out.flush()
        done = record or done
    out.write("\n")
    if done is not None:
        out.write(logprobs_table(engine.model.tokenizer, done))
    return done


def logprobs_table(tokenizer: Tokenizer, record: Record) -> str:
    """A request's logprobs for the terminal, one line per generated token: its text (JSON-quoted, so
    a newline stays on its line), its logprob, then the top-N alternatives as text=logprob.
    Empty when the request asked for none."""
    if record.request.logprobs < 0:
        return ""
    row = record.row
    entries = logprobs_json(tokenizer, row.token_ids, row.logprobs, row.top)
    lines = [f"---- logprobs of {len(entries)} tokens: token, logprob"
             + (f", top {record.request.logprobs}" if record.request.logprobs else "") + " ----"]
    for e in entries:
        top = "  ".join(f"{_quoted(t['token'])}={t['logprob']:.4f}" for t in e.get("top_logprobs", ()))
        lines.append(f"{_quoted(e['token']):<16} {e['logprob']:9.4f}" + (f"  | {top}" if top else ""))
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
