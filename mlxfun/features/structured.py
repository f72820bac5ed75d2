"""Structured output: a row's `response_format` as the set of tokens that may come next, step by step.

A response_format is OpenAI's `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}`, or one of the guided-decoding forms vLLM and SGLang offer:
`{"type": "regex", "regex": ...}` (Rust regex syntax, matched whole, \\d and \\w ASCII as in JSON
Schema), `{"type": "choice", "choice": [...]}` (one of these strings) or `{"type": "grammar",
"grammar": ...}` (Lark, or llama.cpp's GBNF). JSON comes out as json.dumps writes it.

llguidance (the `structured` extra) compiles it for a tokenizer; its masks walk the tokenizer's
token trie against an Earley parser, tens of microseconds per row and token on SmolLM2's 49152
tokens (7fbc90b:benchmarks/README.md). A `Constraint` is compiled once per (tokenizer, response_format)
(up to MATCHER_FAMILIES times apart, as its rows need them, so that parallel fills do not queue
on one lexer) and shared;
each request gets its own `Matcher`, which the engine advances by every token its row
takes and asks for the next (W,) uint32 bitmask, W = ceil(V/32); the compiled sampler applies
the masks to the logits (`sampling.apply_mask`).

End of text: a matcher allows its row's EOS tokens exactly where the grammar may end. Once it
`is_finished` (nothing but EOS can follow), the row is complete: ending it there ("stop") gives
the output EOS would give, one step sooner.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import numpy as np

from mlxfun.engine import sampling
from mlxfun.errors import InputError
from mlxfun.model.tokenizer import Tokenizer

# response_format types -> the key each one carries.
FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema", "regex": "regex", "choice": "choice",
           "grammar": "grammar"}

# JSON as json.dumps writes it, a space after ',' and ':' and no other whitespace: with flexible
# whitespace a small model may emit newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose values are sub-schemas, searched for the part of a schema that fails to compile.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def words(vocab_size: int) -> int:
    """uint32 words of one row's bitmask."""
    return -(-vocab_size // 32)


@dataclass(frozen=True, eq=False)
class Constraint:
    """A response_format compiled for one tokenizer, shared by every request that asks for it (only
    its list of start matchers grows, as rows need them). `matcher(eos)` gives one row its own state."""

    kind: str  # "json_schema" (json_object too), "regex", "choice" or "grammar"
    label: str  # for messages: "json_schema 'person'"
    vocab_size: int
    # llguidance LLMatchers in the start state, compiled apart and never advanced: each row gets a
    # copy of one, in turn (copies of one share its lexer's state behind a lock: MATCHER_FAMILIES)
    starts: list[Any]
    grammar_eos: frozenset[int]  # the EOS ids llguidance allows where the grammar may end
    build: Callable[[], Any]  # compiles one more start matcher
    source: tuple[str, str, str]  # (kind, label, payload): what `compiled` compiles again in another process
    turn: Iterator[int] = field(default_factory=itertools.count)  # whose copy the next row gets
    lock: threading.Lock = field(default_factory=threading.Lock)  # rows are added from any thread

    def matcher(self, eos: frozenset[int]) -> Matcher:
        """A fresh row state; `eos`: the row's EOS ids (empty with ignore_eos)."""
        return Matcher(self, eos)

    def start(self) -> Any:
        """The start matcher the next row copies: the families in turn, each compiled when a row
        first needs it, so a constraint only one row asks for compiles once (a small JSON schema
        for SmolLM2: 1.6 ms, against 5.0 ms for all four families at once)."""
        k = next(self.turn) % MATCHER_FAMILIES
        with self.lock:
            while len(self.starts) <= k:
                self.starts.append(self.build())
            return self.starts[k]


class Matcher:
    """One row's place in its constraint. Owned by the engine thread."""

    def __init__(self, constraint: Constraint, eos: frozenset[int]):
        self.constraint = constraint
        self.eos = frozenset(eos)
        self._m = constraint.start().deep_copy()
        # Per mask word holding an EOS id: (word, every EOS bit there, the row's own EOS bits there).
        # llguidance sets its own EOS ids; a row allows its own, and only where the grammar may end.
        bits: dict[int, list[int]] = {}
        for t in constraint.grammar_eos | self.eos:
            if t < constraint.vocab_size:
                b = bits.setdefault(t // 32, [0, 0])
                b[0] |= 1 << (t % 32)
                b[1] |= (1 << (t % 32)) if t in self.eos else 0
        self._eos_words = [(w, every, own) for w, (every, own) in sorted(bits.items())]

    def fill_mask(self, row: np.ndarray) -> None:
        """row (W,) uint32, C-contiguous <- the tokens allowed next."""
        self._compute(row)
        self._fixed(row)

    def _compute(self, row: np.ndarray) -> None:
        """llguidance's mask into row, before `_fixed`."""
        if row.dtype != np.uint32 or row.shape != (words(self.constraint.vocab_size),) or not row.flags.c_contiguous:
            raise ValueError(f"a mask row must be a contiguous ({words(self.constraint.vocab_size)},) uint32 array, "
                             f"got {row.dtype} {row.shape}")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> None:
        """Take the row's next token (not an EOS: the row ends there)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"{self.constraint.label}: token {token} is not allowed here: {self._error()}")

    @property
    def can_end(self) -> bool:
        """The text so far satisfies the constraint: EOS is allowed now."""
        return self._m.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow: the row is complete."""
        return self._m.is_stopped()

    def _error(self) -> str:
        return (self._m.get_error().strip().splitlines() or [""])[0]  # the rest: llguidance's parser dump

    def _fixed(self, row: np.ndarray) -> None:
        """The row's own EOS ids where the grammar may end, no EOS elsewhere; raise if llguidance
        hit an error (a resource limit) computing the mask."""
        _fix_eos([self], row[None], [0])


def _fix_eos(matchers: Sequence[Matcher], masks: np.ndarray, at: Sequence[int]) -> None:
    """masks (B, W) uint32, row at[i] llguidance's mask for matchers[i] <- each such row's EOS bits
    as `Matcher._fixed` says, in one gather and one scatter (NumPy scalar operations row by row
    held the GIL about 10 us a row, beside the engine thread's launch of the forward pass)."""
    rows, cols, every, own = [], [], [], []
    for i, m in zip(at, matchers):
        if m._m.is_error():
            raise RuntimeError(f"{m.constraint.label}: {m._error()}")
        can_end = m._m.is_accepting()
        for w, e, o in m._eos_words:
            rows.append(i)
            cols.append(w)
            every.append(e)
            own.append(o if can_end else 0)
    if rows:  # (row, word) pairs are distinct: a matcher's words are, and so are its rows
        r, c = np.array(rows), np.array(cols)
        masks[r, c] = (masks[r, c] & ~np.array(every, np.uint32)) | np.array(own, np.uint32)


def fill_masks(matchers: Sequence[Matcher | None], out: np.ndarray) -> np.ndarray:
    """out (B, W) uint32, C-contiguous <- row i: what matchers[i] allows next; all ones where
    matchers[i] is None (a free row). The constrained rows run in parallel on llguidance's
    threads, without the GIL."""
    if out.dtype != np.uint32 or out.ndim != 2 or out.shape[0] != len(matchers) or not out.flags.c_contiguous:
        raise ValueError(f"masks must be a contiguous ({len(matchers)}, W) uint32 array, got {out.dtype} {out.shape}")
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    out[[i for i, m in enumerate(matchers) if m is None]] = 0xFFFFFFFF
    if len(rows) == 1:
        rows[0][0]._compute(out[rows[0][1]])
    elif rows:
        width = words(rows[0][0].constraint.vocab_size)
        if out.shape[1] != width or any(m.constraint.vocab_size != rows[0][0].constraint.vocab_size for m, _ in rows):
            raise ValueError(f"masks must be (B, {width}) for every matcher's vocabulary, got {out.shape}")
        _executor().unsafe_compute_mask_ptr([(m._m, i) for m, i in rows], out.ctypes.data, out.shape[1] * 4,
                                            out.shape[0])
    _fix_eos([m for m, _ in rows], out, [i for _, i in rows])  # the rows' own EOS ids; raises a row's error
    return out


# ---- compiling a response_format ----


def constraints(tokenizer: Tokenizer, vocab_size: int, response_format, n: int) -> list[Constraint | None]:
    """One compiled constraint (None: free text) per prompt. `response_format`: None, one format
    for every prompt, or a list with one entry (a format or None) per prompt. Every error is an
    InputError raised here, before any work."""
    if isinstance(response_format, (list, tuple)):
        formats = sampling.per_row("response_format", list(response_format), n)
        return [constraint(tokenizer, vocab_size, f, f"response_format of prompt {i}") for i, f in enumerate(formats)]
    return [constraint(tokenizer, vocab_size, response_format)] * n


def constraint(tokenizer: Tokenizer, vocab_size: int, response_format,
               where: str = "response_format") -> Constraint | None:
    """One response_format compiled for `tokenizer` (and logits of `vocab_size`); None for free text."""
    parsed = _parse(response_format, where)
    if parsed is None:
        return None
    try:
        return _compile(tokenizer, vocab_size, *parsed)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


def _parse(fmt, where: str) -> tuple[str, str, str] | None:
    """A response_format -> (kind, label, payload as JSON text) or None; InputError if malformed."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InputError(f"{where} must be None or a dict with a 'type' ({', '.join(FORMATS)}), got {fmt!r:.100}")
    kind = fmt["type"]
    if kind not in FORMATS:
        close = difflib.get_close_matches(kind, list(FORMATS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(FORMATS)})"
        raise InputError(f"{where} has unknown type {kind!r}{hint}")
    unknown = set(fmt) - {"type", FORMATS[kind]}
    if unknown:
        raise InputError(f"{where} of type {kind!r} has unknown keys {sorted(unknown)}"
                         + (f" (it takes {FORMATS[kind]!r})" if FORMATS[kind] else ""))
    value = fmt.get(FORMATS[kind]) if FORMATS[kind] else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", "json_object", '{"type": "object"}'
    if kind == "json_schema":
        if not isinstance(value, dict) or not isinstance(value.get("schema"), dict):
            raise InputError(f"{where}: 'json_schema' must be a dict with a 'schema' object (and a 'name'), "
                             f"got {value!r:.100}")
        label = f"json_schema {value.get('name', 'schema')!r}"
        try:
            return kind, label, json.dumps(value["schema"])  # key order kept: it is the output's order
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: {label} is not JSON: {e}") from None
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise InputError(f"{where}: 'choice' must be a non-empty list of non-empty strings, got {value!r:.100}")
        return kind, f"choice {list(value)!r:.60}", json.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise InputError(f"{where}: {kind!r} must be a non-empty string, got {value!r:.100}")
    return kind, f"{kind} {value!r:.60}", value


def compiled(tokenizer: Tokenizer, vocab_size: int, source: tuple[str, str, str]) -> Constraint:
    """A Constraint's `source` compiled for `tokenizer` (cached, as for its first compile)."""
    return _compile(tokenizer, vocab_size, *source)


@lru_cache(maxsize=256)
def _compile(tokenizer: Tokenizer, vocab_size: int, kind: str, label: str, payload: str) -> Constraint:
    """Cached per (tokenizer, vocab size, response_format); errors (InputError) are not cached."""
    llg = _llguidance()
    ll = _ll_tokenizer(tokenizer, vocab_size)
    try:
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(payload, defaults=JSON_OPTIONS)
        elif kind == "regex":  # \d and \w ASCII-only, as in JSON Schema patterns (Rust's are Unicode)
            grammar = llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(payload, 'dw')}/")
        else:
            grammar = llg.grammar_from(kind, payload)  # choice, grammar (Lark or GBNF)
    except ValueError as e:
        raise InputError(f"{label}: {e}") from None
    error = _grammar_error(llg, ll, grammar)
    if error is not None and kind == "json_schema":
        path, error = _locate(llg, ll, json.loads(payload), error)
        raise InputError(f"{label} at {path}: {error}")
    if error is not None:
        raise InputError(f"{label}: {error}")
    build = partial(llg.LLMatcher, ll, grammar, log_level=0)
    first = build()
    if first.is_error():
        raise InputError(f"{label}: {first.get_error()}")
    return Constraint(kind, label, vocab_size, [first], frozenset(ll.eos_tokens), build, (kind, label, payload))


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int):
    """llguidance's view of a tokenizer (its token trie): ~0.3 s to build for 49152 tokens, so cached."""
    llg = _llguidance()
    eos = sorted(tokenizer.eos_token_ids) or None
    try:
        return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError) as e:
        raise InputError(f"structured output cannot read this tokenizer ({e}); llguidance takes byte-level BPE "
                         "and byte-fallback tokenizers") from None


MASK_THREADS = 4  # llguidance's threads for a batch's masks, at most

# Copies of one llguidance matcher share its lexer's lazily built states behind one lock, so the
# threads filling their masks in parallel queue on it, and more threads did not help (1B shape,
# batch 32: 2 to 12 threads within the spread). Each constraint is compiled up to this many times apart
# and its rows spread over them (each family builds its own lexer states, so more costs more work
# in all). 1B shape, batch 32, a JSON schema on every row, H200 host, alternating in one process:
# 1.106x a free step from one start, 1.055x from four (7fbc90b:benchmarks/README.md, seventeenth session).
MATCHER_FAMILIES = 4


@lru_cache(maxsize=1)
def _executor():
    """llguidance's thread pool, made once: a new one per step spawned its threads every step (1B
    shape, batch 32, a JSON schema on every row, H200 host of 16 cores: 1.23-1.33x a free step,
    1.12-1.17x with one pool). 80% of the cores as llguidance chooses, at most MASK_THREADS (with
    one start matcher, 2 to 12 threads were within the runs' spread; with MATCHER_FAMILIES as
    many, 4 families and threads 1.055x, 12 of each 1.041x), so the host's other cores are left to
    the engine thread and MLX's."""
    return _llguidance().LLExecutor(max(1, min(MASK_THREADS, int(0.8 * (os.cpu_count() or 1)))))


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (checks the binary loads)
    except ImportError as e:
        raise InputError(f"response_format needs llguidance ({e}): pip install 'mlxfun[structured]'") from None
    return llguidance


def _grammar_error(llg, ll, grammar: str) -> str | None:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll)
    return messages[0].strip() if is_error else None


def _schema_error(llg, ll, schema: dict) -> str | None:
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        return str(e)
    return _grammar_error(llg, ll, grammar)


def _locate(llg, ll, schema, error: str) -> tuple[str, str]:
    """The JSON pointer of the deepest sub-schema that fails to compile on its own ("#": the whole
    schema, which fails with `error`), and its error. Each candidate keeps the root's
    definitions, so its $refs still resolve."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    path, node = "#", schema
    while True:
        for key, child in _children(node):
            child_error = _schema_error(llg, ll, {**defs, **child})
            if child_error is not None:
                path, node, error = f"{path}/{key}", child, child_error
                break
        else:
            return path, error


def _children(node) -> list[tuple[str, dict]]:
    """(pointer step, sub-schema) for each object-valued sub-schema of `node`."""
    if not isinstance(node, dict):
        return []
    out = []
    for k in _SCHEMA_MAPS:
        if isinstance(node.get(k), dict):
            out += [(f"{k}/{_escape(name)}", v) for name, v in node[k].items() if isinstance(v, dict)]
    for k in _SCHEMA_LISTS:
        if isinstance(node.get(k), list):
            out += [(f"{k}/{i}", v) for i, v in enumerate(node[k]) if isinstance(v, dict)]
    return out + [(k, node[k]) for k in _SCHEMA_ONE if isinstance(node.get(k), dict)]


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
