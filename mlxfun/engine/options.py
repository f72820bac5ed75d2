"""Generation options: the keyword API users know, turned into one checked value in one place.

`GenerationConfig` is what a caller sets: each per-prompt field takes one value for every prompt
or a list with one value per prompt. `requests(model, prompts, config)` checks everything (types,
ranges, list lengths, token ids, the context) before any work starts and expands it into one
`Request` per prompt, the value that the scheduler, the server and the command line all consume.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxfun.engine import sampling
from mlxfun.errors import InputError, check_bool, check_positive_int, is_int
from mlxfun.features import structured
from mlxfun.model.config import SINK_TOKENS
from mlxfun.model.load import Model

# Roles the chat templates of the families we load know.
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class GenerationConfig:
    """Options of `generate` / `stream_generate`, with mlx-lm's names. Per-prompt fields take one
    value or a list of one value per prompt."""

    max_tokens: int | Sequence[int] = 256
    temperature: float | Sequence[float] = 0.0
    top_p: float | Sequence[float] = 1.0
    min_p: float | Sequence[float] = 0.0
    top_k: int | Sequence[int] = 0
    repetition_penalty: float | Sequence[float] = 1.0
    presence_penalty: float | Sequence[float] = 0.0
    frequency_penalty: float | Sequence[float] = 0.0
    seed: int | Sequence[int] | None = None  # None: a fresh seed per row, reported in the result
    stop: str | Sequence[str] | Sequence[Sequence[str] | str | None] | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: and the n most likely
    ignore_eos: bool = False
    extra_eos_tokens: Sequence[str | int] = ()  # more tokens (text or id) that end a row, as mlx-lm's
    # Structured output (mlxfun.features.structured): {"type": "json_object"}, {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}, {"type": "regex", "regex": ...}, {"type": "choice", "choice": [...]},
    # {"type": "grammar", "grammar": Lark or GBNF}, or None; a list gives one (or None) per prompt.
    response_format: dict | Sequence[dict | None] | None = None
    chat: bool = False  # apply the chat template to text prompts
    # Scheduler options, for the whole call.
    batch_size: int | None = None  # rows decoded at once; more prompts wait and refill rows
    prefill_step: int = 512  # prompt tokens per prefill chunk
    max_kv_size: int | None = None  # bound the cache to a ring of this many tokens (and the first 4: sinks)
    prefix_cache: bool = True  # reuse the KV of prompt prefixes already computed (False: compute all)
    prompt_cache: Any = None  # a `prompt_cache.PromptCache` (or its file) whose prefix prompts may start with
    draft_model: Any = None  # speculative decoding: a draft Model (or its path), same tokenizer, or "prompt-lookup"
    num_draft_tokens: int = 4  # tokens each row drafts per verify round
    # A row's tokens and logprobs are the same bits whatever else is in its batch (bf16 / fp16 on
    # CUDA: products and attention whose sums do not depend on the batch; `Engine`).
    batch_invariant: bool = False
    # Data parallel: an mx.distributed.Group whose ranks each generate a share of the prompts and
    # all return the whole result (mlxfun.parallel.distributed). Every rank passes the same prompts.
    group: Any = None

    @classmethod
    def make(cls, config: GenerationConfig | None = None, options: dict[str, Any] | None = None
             ) -> GenerationConfig:
        """`config` (or the defaults) with `options` (keyword name -> value) applied. Unknown names
        are an InputError that suggests the closest known one."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise InputError(f"config must be a GenerationConfig, got {type(config).__name__}")
        options = options or {}
        names = [f.name for f in dataclasses.fields(cls)]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names + list(ALIASES), n=1)
                hint = f" (did you mean {ALIASES.get(close[0], close[0])!r}?)" if close else ""
                raise InputError(f"unknown generation option {name!r}{hint}")
        return dataclasses.replace(config or cls(), **options)


# Names users bring from elsewhere, for the hint of an unknown option.
ALIASES = {"temp": "temperature", "max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
           "top_logprobs": "logprobs", "stop_strings": "stop"}


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt with everything its row needs; build with `requests` or `make_request`."""

    prompt: tuple[int, ...]
    max_tokens: int
    settings: sampling.Settings  # one row, NumPy arrays (the engine copies them to the device)
    stop: tuple[str, ...] = ()
    logprobs: int = -1  # -1: none; 0: the chosen token's; n: and the n most likely
    eos: frozenset[int] = frozenset()  # tokens that end the row (without being part of its output)
    constraint: structured.Constraint | None = None  # what the row may generate (response_format); None: anything


# ---- checks, each naming the option and the value ----


def check_logprobs(v, vocab_size: int) -> int:
    """-1 for None, else n in [0, vocab_size]."""
    if v is None:
        return -1
    if not is_int(v) or not 0 <= v <= vocab_size:
        raise InputError(f"logprobs must be None or an integer in [0, {vocab_size}] (the vocabulary), got {v!r}")
    return int(v)


def stops(stop, n: int) -> list[tuple[str, ...]]:
    """Stop strings per row: None, one string, one list for every row, or one entry per row."""
    if stop is None or isinstance(stop, str):
        return [(stop,) if stop else ()] * n
    if not isinstance(stop, (list, tuple)):
        raise InputError(f"stop must be a string, a list of strings or one entry per prompt, got {stop!r}")
    if all(isinstance(s, str) for s in stop):
        return [tuple(stop)] * n
    rows = sampling.per_row("stop", list(stop), n)
    out = []
    for s in rows:
        s = (s,) if isinstance(s, str) else tuple(s or ())
        if not all(isinstance(x, str) for x in s):
            raise InputError(f"stop strings must be strings, got {s!r}")
        out.append(s)
    return out


def eos_ids(model: Model, ignore_eos: bool, extra) -> frozenset[int]:
    """The tokens that end a row: none with `ignore_eos`, else the model's and `extra` (token texts or
    ids; a string of digits is an id, as mlx-lm reads it)."""
    extra = [extra] if isinstance(extra, (str, int)) else extra
    if not isinstance(extra, (list, tuple)):
        raise InputError(f"extra_eos_tokens must be a list of tokens (text or id), got {extra!r}")
    ids = set()
    for t in extra:
        tid = int(t) if is_int(t) or (isinstance(t, str) and t.isdigit()) else \
            model.tokenizer.backend.token_to_id(t) if isinstance(t, str) else None
        if tid is None or not 0 <= tid < model.config.vocab_size:
            raise InputError(f"extra_eos_tokens has {t!r}, which is not one token of this model "
                             "(a stop string ends on any text)")
        ids.add(tid)
    return frozenset() if ignore_eos else model.tokenizer.eos_token_ids | ids


# ---- prompts ----


def _token_array(p) -> np.ndarray | None:
    """A NumPy or MLX array of token ids as a NumPy array (None for other values)."""
    if isinstance(p, mx.array):
        p = np.array(p)
    if not isinstance(p, np.ndarray):
        return None
    if p.dtype == np.bool_ or not np.issubdtype(p.dtype, np.integer):
        raise InputError(f"token-id arrays must hold integers, got dtype {p.dtype}")
    return p


def split_prompts(prompts) -> list:
    """One prompt or many -> a list of prompts (each a str, a token-id list or a message list)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict)):
        return [prompts]
    array = _token_array(prompts)
    if array is not None:
        if array.ndim not in (1, 2):
            raise InputError(f"a token-id array must be 1-D (one prompt) or 2-D (one per row), got shape "
                             f"{array.shape}")
        return [array.tolist()] if array.ndim == 1 else array.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"prompts must be a string, token ids, messages or a list of them, got "
                         f"{type(prompts).__name__}")
    if not prompts:
        raise InputError("no prompts given")
    if all(is_int(t) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def check_messages(messages, i: int) -> list[dict]:
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InputError(f"prompt {i}: message {j} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise InputError(f"prompt {i}: message {j} has unknown role {m['role']!r} (known: {', '.join(ROLES)})")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"prompt {i}: message {j} content must be a string, got {type(content).__name__}")
    return list(messages)


def encode(model: Model, prompt, i: int, chat: bool) -> list[int]:
    """Token ids of prompt `i`: text (through the chat template when `chat`), token ids or messages."""
    if isinstance(prompt, str):
        ids = model.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat \
            else model.tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = model.tokenizer.encode_chat(check_messages(prompt, i))
    else:
        array = _token_array(prompt)
        if array is not None:
            if array.ndim != 1:
                raise InputError(f"prompt {i}: a token-id array must be 1-D, got shape {array.shape}")
            prompt = array.tolist()
        # Plain ints checked by type first: isinstance against numbers.Integral costs ~1 us a token.
        if not isinstance(prompt, (list, tuple)) or not all(type(t) is int or is_int(t) for t in prompt):
            raise InputError(f"prompt {i} must be a string, a list of token ids or a list of messages, "
                             f"got {prompt!r:.80}")
        ids = [int(t) for t in prompt]
        vocab = model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InputError(f"prompt {i} has token ids outside [0, {vocab})")
    if not ids:
        raise InputError(f"prompt {i} is empty")
    return ids


def check_context(model: Model, ids: list[int], i: int) -> None:
    limit = model.config.max_position_embeddings
    if len(ids) >= limit:
        raise InputError(f"prompt {i} has {len(ids)} tokens; the model's context is {limit} "
                         "(at least one position must be left to generate)")


# ---- the one place where options become requests ----


def check_scheduler(config: GenerationConfig) -> None:
    check_positive_int("batch_size", config.batch_size, allow_none=True)
    check_positive_int("prefill_step", config.prefill_step)
    check_positive_int("max_kv_size", config.max_kv_size, allow_none=True)
    check_bool("ignore_eos", config.ignore_eos)
    check_bool("chat", config.chat)
    check_bool("prefix_cache", config.prefix_cache)
    check_bool("batch_invariant", config.batch_invariant)
    check_positive_int("num_draft_tokens", config.num_draft_tokens)
    if config.group is not None and not isinstance(config.group, mx.distributed.Group):
        raise InputError(f"group must be an mx.distributed.Group or None, got {type(config.group).__name__}")


def requests(model: Model, prompts, config: GenerationConfig) -> list[Request]:
    """Every prompt as a checked Request: all errors are raised here, before any work."""
    check_scheduler(config)
    items = split_prompts(prompts)
    n = len(items)
    max_tokens = sampling.per_row("max_tokens", config.max_tokens, n)
    for m in max_tokens:
        check_positive_int("max_tokens", m)
    stop = stops(config.stop, n)
    top = check_logprobs(config.logprobs, model.config.vocab_size)
    settings = sampling.host_settings(
        n, temperature=config.temperature, top_p=config.top_p, min_p=config.min_p, top_k=config.top_k,
        repetition_penalty=config.repetition_penalty, presence_penalty=config.presence_penalty,
        frequency_penalty=config.frequency_penalty, seed=config.seed)
    eos = eos_ids(model, config.ignore_eos, config.extra_eos_tokens)
    constraints = structured.constraints(model.tokenizer, model.config.vocab_size, config.response_format, n)
    out = []
    for i, item in enumerate(items):
        ids = encode(model, item, i, config.chat)
        check_context(model, ids, i)
        out.append(Request(tuple(ids), int(max_tokens[i]), sampling.row(settings, i), stop[i], top, eos,
                           constraints[i]))
    return out


def make_request(model: Model, prompt, *, max_tokens: int = 256, settings: sampling.Settings | None = None,
                 stop: Sequence[str] = (), logprobs: int | None = None, ignore_eos: bool = False,
                 extra_eos_tokens: Sequence[str | int] = (), response_format: dict | None = None) -> Request:
    """One checked Request from a prompt and one row's `settings` (`sampling.make_settings(1, ...)`)."""
    check_positive_int("max_tokens", max_tokens)
    check_bool("ignore_eos", ignore_eos)
    settings = sampling.make_settings(1) if settings is None else settings
    if not isinstance(settings, sampling.Settings) or settings.seed.shape != (1,):
        shape = settings.seed.shape if isinstance(settings, sampling.Settings) else type(settings).__name__
        raise InputError(f"settings must be one row's sampling.Settings (make_settings(1, ...)), got {shape}")
    ids = encode(model, prompt, 0, chat=False)
    check_context(model, ids, 0)
    (stop_,) = stops(list(stop) if not isinstance(stop, str) else stop, 1)
    eos = eos_ids(model, ignore_eos, extra_eos_tokens)
    constraint = structured.constraint(model.tokenizer, model.config.vocab_size, response_format)
    # On the host: MLX evaluates an array on the thread (stream) that built its graph, and an engine
    # may run on another thread than this one.
    return Request(tuple(ids), int(max_tokens), sampling.on_host(settings), stop_,
                   check_logprobs(logprobs, model.config.vocab_size), eos, constraint)


def ring_overflow(reqs: Sequence[Request], max_kv_size: int | None, names: Sequence[str] | None = None
                  ) -> str | None:
    """A warning (to follow the option's name) when some prompt alone is longer than the ring
    `max_kv_size` bounds the cache to and its sinks (the prompt's first SINK_TOKENS tokens): part
    of it is then out of every later query's sight. Else None. `names`: each prompt's name (by
    default its index in `reqs`, 0-based)."""
    if max_kv_size is None:
        return None
    long = [i for i, r in enumerate(reqs) if len(r.prompt) > max_kv_size + SINK_TOKENS]
    if not long:
        return None
    shown = ", ".join(f"{names[i] if names else i} ({len(reqs[i].prompt)} tokens)" for i in long[:3])
    return (f"{max_kv_size} is shorter than prompt{'s' if len(long) > 1 else ''} {shown}"
            f"{' ...' if len(long) > 3 else ''}{'' if names else ' (0-based)'}: each token sees only the first "
            f"{SINK_TOKENS} and the last {max_kv_size}, so the answer cannot see all of the prompt")
