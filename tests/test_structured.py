"""Structured output: each constraint's masks allow exactly its language, the mask is applied
before every sampler (so a constrained row samples the model's distribution restricted to the
allowed tokens), and the split decode step (forward, then masked sampling) equals the fused one."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import sys
import threading
from statistics import NormalDist, median

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from helpers import byte_tokenizer, run_engine, tiny_config, tiny_model

from mlxfun.engine import sampling
from mlxfun.engine.options import GenerationConfig, make_request, requests
from mlxfun.engine.step import Mode, choose, make_steps
from mlxfun.errors import InputError
from mlxfun.features import structured


def allowed_ids(row: np.ndarray) -> set[int]:
    """The token ids a (W,) uint32 mask row allows (host-side, independent of MLX's unpacking)."""
    return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist())


def random_masks(rng, batch: int, vocab: int, keep: float) -> np.ndarray:
    """(B, V) bool, each row with at least one allowed token."""
    allowed = rng.random((batch, vocab)) < keep
    allowed[np.arange(batch), rng.integers(0, vocab, batch)] = True
    return allowed


# ---- the packed mask ----


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 97, 1000])
def test_pack_then_unpack_is_identity_at_any_vocab_size(vocab):
    rng = np.random.default_rng(vocab)
    allowed = random_masks(rng, 3, vocab, 0.4)
    packed = sampling.pack_mask(allowed)
    assert packed.dtype == np.uint32 and packed.shape == (3, structured.words(vocab))
    assert np.array_equal(np.array(sampling.unpack_mask(mx.array(packed), vocab)), allowed)
    # Token t is bit t % 32 of word t // 32; bits past the vocabulary stay clear.
    one = np.zeros((1, vocab), bool)
    one[0, vocab - 1] = True
    word = sampling.pack_mask(one)[0]
    assert word[(vocab - 1) // 32] == 1 << ((vocab - 1) % 32) and word.sum() == word[(vocab - 1) // 32]


def test_llguidance_mask_layout_is_the_one_the_sampler_reads():
    tokenizer = byte_tokenizer()  # 97 tokens: the last word of a mask row is partly past the vocabulary
    c = structured.constraint(tokenizer, 97, {"type": "choice", "choice": ["ab!", "b a"]})
    row = np.zeros(structured.words(97), np.uint32)
    c.matcher(tokenizer.eos_token_ids).fill_mask(row)
    expected = {tokenizer.encode(t)[0] for t in ("a", "b", "ab")}
    assert allowed_ids(row) == expected
    unpacked = np.array(sampling.unpack_mask(mx.array(row[None]), 97))[0]
    assert set(np.nonzero(unpacked)[0].tolist()) == expected


# ---- the masked sampler ----


def test_greedy_under_a_mask_is_the_argmax_over_allowed_tokens():
    rng = np.random.default_rng(0)
    B, V = 16, 97
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    allowed = random_masks(rng, B, V, 0.2)
    mask = mx.array(sampling.pack_mask(allowed))
    expected = np.argmax(np.where(allowed, logits, -np.inf), axis=-1)
    assert not np.array_equal(expected, np.argmax(logits, axis=-1))  # the mask matters here
    steps = mx.zeros((B,), mx.int32)
    greedy = sampling.make_settings(B, seed=1)
    assert np.array_equal(np.array(choose(Mode(), mx.array(logits), greedy, steps, None, mask).tokens), expected)
    # The sampling path: temperature 0 rows, and top-1 rows at temperature 1 (top-1 sampling is greedy).
    top1 = sampling.make_settings(B, temperature=[0.0, 1.0] * (B // 2), top_k=1, seed=2)
    out = choose(Mode(sample=True), mx.array(logits), top1, steps, None, mask)
    assert np.array_equal(np.array(out.tokens), expected)


def test_mask_comes_before_penalties():
    """A repetition penalty on the best allowed token hands the choice to the next allowed one."""
    rng = np.random.default_rng(1)
    B, V = 8, 97
    logits = np.abs(rng.standard_normal((B, V))).astype(np.float32) + 0.1  # positive: the penalty divides
    allowed = random_masks(rng, B, V, 0.3)
    best = np.argmax(np.where(allowed, logits, -np.inf), axis=-1)
    counts = np.zeros((B, V), np.int32)
    counts[np.arange(B), best] = 1
    settings = sampling.make_settings(B, repetition_penalty=1e6, seed=3)
    out = choose(Mode(sample=True, penalties=True), mx.array(logits), settings, mx.zeros((B,), mx.int32),
                 mx.array(counts), mx.array(sampling.pack_mask(allowed)))
    penalised = np.where(counts > 0, logits / 1e6, logits)
    expected = np.argmax(np.where(allowed, penalised, -np.inf), axis=-1)
    assert np.all(allowed[np.arange(B), np.array(out.tokens)])
    assert np.array_equal(np.array(out.tokens), expected)


def chi_square_critical(df: int, p: float) -> float:
    """Wilson-Hilferty: the chi-square quantile at 1 - p, within a few percent for df >= 3."""
    z = NormalDist().inv_cdf(1 - p)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` (cells expecting fewer than 5 pooled) -> (stat, df)."""
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    keep = wanted > 0
    return float(np.sum((observed[keep] - wanted[keep]) ** 2 / wanted[keep])), int(keep.sum()) - 1


def restricted(logits: np.ndarray, allowed: np.ndarray, temperature: float) -> np.ndarray:
    p = np.exp(logits / temperature - np.max(logits / temperature)) * allowed
    return p / p.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_masked_sampling_is_the_model_distribution_restricted_and_renormalised(temperature):
    """N rows with the same logits and mask and seeds 0..N-1 are N independent draws."""
    rng = np.random.default_rng(7)
    V, N = 97, 20000
    logits = (rng.standard_normal(V) * 1.5).astype(np.float32)
    allowed = np.zeros(V, bool)
    allowed[rng.choice(V, 12, replace=False)] = True
    settings = sampling.make_settings(N, temperature=temperature, seed=list(range(N)))
    mask = mx.array(np.broadcast_to(sampling.pack_mask(allowed[None]), (N, structured.words(V))))
    tokens = np.array(sampling.sample(mx.broadcast_to(mx.array(logits), (N, V)), settings,
                                      mx.zeros((N,), mx.int32), mask=mask))
    counts = np.bincount(tokens, minlength=V)
    assert counts[~allowed].sum() == 0
    stat, df = chi_square(counts, restricted(logits, allowed, temperature))
    assert df >= 8 and stat < chi_square_critical(df, 1e-4), stat
    # The test has the power to see a 15% error in the temperature.
    stat, df = chi_square(counts, restricted(logits, allowed, temperature * 1.15))
    assert stat > chi_square_critical(df, 1e-4), stat


# ---- the split decode step ----


def split_steps(constrain: dict[int, set[int]] | None = None):
    """A steps factory whose decode is the split step (forward, then masked sampling), masks all
    ones except rows in `constrain` (row -> allowed ids), and the number of traces."""
    traces, made = [0], {}

    def count():
        traces[0] += 1

    def steps(config, mode):
        if mode not in made:
            split = make_steps(config, mode._replace(masked=True), on_trace=count)

            def decode(params, state, settings):
                allowed = np.ones((state.tokens.shape[0], config.vocab_size), bool)
                for row, ids in (constrain or {}).items():
                    allowed[row] = np.isin(np.arange(config.vocab_size), list(ids))
                logits, state = split.forward(params, state)
                return split.sample(logits, mx.array(sampling.pack_mask(allowed)), state, settings)

            made[mode] = split._replace(decode=decode)
        return made[mode]

    return steps, traces


PROMPTS = [[5, 9, 2, 7], [3, 3, 8, 1], [11, 4, 6, 2]]  # one length: rows in prompt order


@pytest.mark.parametrize("options", [dict(), dict(temperature=0.9, top_p=0.9, seed=5, repetition_penalty=1.2)])
def test_split_step_equals_fused_step_and_traces_once(options):
    model = tiny_model()
    fused, _ = run_engine(model, PROMPTS, max_tokens=24, logprobs=2, ignore_eos=True, **options)
    steps, traces = split_steps()
    split, _ = run_engine(model, PROMPTS, steps=steps, max_tokens=24, logprobs=2, ignore_eos=True, **options)
    assert split.token_ids == fused.token_ids
    assert np.allclose(np.array(split.logprobs), np.array(fused.logprobs), atol=1e-5)
    assert traces[0] == 2  # forward once, sample once, over 23 decode steps


@pytest.mark.parametrize("options", [dict(), dict(temperature=0.8, seed=11)])
def test_a_constrained_row_leaves_the_free_rows_unchanged(options):
    model = tiny_model()
    free, _ = run_engine(model, PROMPTS, max_tokens=16, ignore_eos=True, **options)
    steps, _ = split_steps({1: {7, 40}})
    mixed, _ = run_engine(model, PROMPTS, steps=steps, max_tokens=16, ignore_eos=True, **options)
    assert mixed.token_ids[0] == free.token_ids[0] and mixed.token_ids[2] == free.token_ids[2]
    assert set(mixed.token_ids[1][1:]) <= {7, 40}  # its first token comes from prefill, unmasked here
    assert mixed.token_ids[1] != free.token_ids[1]


# ---- constraints on the real tokenizer ----


def walk(tokenizer, c: structured.Constraint, rng, max_steps: int = 400, eos_p: float = 0.3) -> str:
    """A random path through the constraint's masks: uniformly among allowed tokens, EOS with
    probability `eos_p` where allowed. Checks at every step that EOS is allowed exactly where
    the grammar may end. -> the text."""
    m = c.matcher(tokenizer.eos_token_ids)
    row = np.zeros(structured.words(c.vocab_size), np.uint32)
    ids = []
    for _ in range(max_steps):
        m.fill_mask(row)
        allowed = allowed_ids(row)
        eos = allowed & tokenizer.eos_token_ids
        assert eos == (set(tokenizer.eos_token_ids) if m.can_end else set())
        if m.is_finished:
            assert allowed == eos
            return tokenizer.decode(ids)
        if eos and rng.random() < eos_p:
            return tokenizer.decode(ids)
        token = int(rng.choice(sorted(allowed - eos)))
        m.advance(token)
        ids.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(ids)!r}")


def accepts(tokenizer, c: structured.Constraint, text: str) -> bool:
    """Whether driving the matcher with `text`'s tokens stays within the masks and may end there."""
    m = c.matcher(tokenizer.eos_token_ids)
    row = np.zeros(structured.words(c.vocab_size), np.uint32)
    for token in tokenizer.encode(text, add_special_tokens=False):
        m.fill_mask(row)
        if token not in allowed_ids(row):
            return False
        m.advance(token)
    return m.can_end


WORDS = ["red", "green", "blue", "yellow", "purple"]


def test_choice_allows_exactly_the_tokens_that_start_a_word(model_q4):
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    c = structured.constraint(tok, V, {"type": "choice", "choice": WORDS})
    row = np.zeros(structured.words(V), np.uint32)
    c.matcher(tok.eos_token_ids).fill_mask(row)
    texts = [tok.decode([i]) for i in range(V)]
    expected = {i for i, t in enumerate(texts) if t and any(w.startswith(t) for w in WORDS)}
    assert allowed_ids(row) == expected and len(expected) > 5


def test_choice_accepts_exactly_its_words(model_q4):
    """Every path through the masks (depth first), to every point where EOS is allowed."""
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    c = structured.constraint(tok, V, {"type": "choice", "choice": WORDS})
    ends, stack, nodes = set(), [[]], 0
    row = np.zeros(structured.words(V), np.uint32)
    while stack:
        ids = stack.pop()
        nodes += 1
        m = c.matcher(tok.eos_token_ids)
        for t in ids:
            m.advance(t)
        m.fill_mask(row)
        allowed = allowed_ids(row)
        if allowed & tok.eos_token_ids:
            ends.add(tok.decode(ids))
        stack += [ids + [t] for t in allowed - tok.eos_token_ids]
    assert ends == set(WORDS) and nodes < 2000


REGEXES = {
    "date": (r"\d{4}-(0[1-9]|1[0-2])-\d{2}", ["2024-01-05", "1999-12-31"], ["2024-1-05", "2024-13-05", "x2024-01-05",
                                                                            "2024-01-05x", "2024-01"]),
    "email": (r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", ["bob@example.com", "a@b.org"], ["Bob@x.com", "bob@site.net",
                                                                                    "bob@@x.com", "bob@x.com."]),
}


@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_masks_allow_exactly_the_pattern(model_q4, name):
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    pattern, good, bad = REGEXES[name]
    c = structured.constraint(tok, V, {"type": "regex", "regex": pattern})
    assert all(accepts(tok, c, s) for s in good)
    assert not any(accepts(tok, c, s) for s in bad)
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = walk(tok, c, rng)
        assert re.fullmatch(pattern, text), text


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": WORDS},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}
GOOD = {"name": "Ada", "age": 36, "color": "blue", "tags": ["x", "math"], "score": 0.5,
        "address": {"city": "London", "zip": "12345"}}


def test_json_schema_accepts_valid_documents_and_every_path_validates(model_q4):
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    c = structured.constraint(tok, V, {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert accepts(tok, c, json.dumps(GOOD))
    for bad in ({**GOOD, "age": 17}, {**GOOD, "color": "black"}, {k: v for k, v in GOOD.items() if k != "address"},
                {**GOOD, "tags": ["a", "b", "c", "d"]}, {**GOOD, "address": {"city": "Rome", "zip": "1234"}}):
        jsonschema.validate(GOOD, SCHEMA)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
        assert not accepts(tok, c, json.dumps(bad)), bad
    rng = np.random.default_rng(1)
    for _ in range(8):
        jsonschema.validate(json.loads(walk(tok, c, rng, eos_p=1.0)), SCHEMA)


def test_json_object_is_any_object_and_ignore_eos_never_allows_eos(model_q4):
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    c = structured.constraint(tok, V, {"type": "json_object"})
    assert accepts(tok, c, '{"a": [1, 2.5, "x"], "b": {"c": null}}') and not accepts(tok, c, "[1, 2]")
    m = c.matcher(frozenset())  # ignore_eos: the row's EOS set is empty
    for t in tok.encode("{}", add_special_tokens=False):
        m.advance(t)
    row = np.zeros(structured.words(V), np.uint32)
    m.fill_mask(row)
    assert m.can_end and m.is_finished and not allowed_ids(row)


def test_batched_masks_equal_each_row_alone(model_q4):
    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    formats = [{"type": "json_schema", "json_schema": {"schema": SCHEMA}}, None, {"type": "regex", "regex": r"\d+"},
               {"type": "choice", "choice": WORDS}]
    matchers = [None if f is None else structured.constraint(tok, V, f).matcher(tok.eos_token_ids) for f in formats]
    for m, text in zip(matchers, ['{"name": "A', None, "12", "gr"]):
        for t in tok.encode(text, add_special_tokens=False) if m is not None else []:
            m.advance(t)
    batch = structured.fill_masks(matchers, np.zeros((4, structured.words(V)), np.uint32))
    assert np.all(batch[1] == 0xFFFFFFFF)
    for i in (0, 2, 3):
        alone = np.zeros(structured.words(V), np.uint32)
        matchers[i].fill_mask(alone)
        assert np.array_equal(batch[i], alone)


def test_batched_masks_reuse_one_small_thread_pool(model_q4, monkeypatch):
    """Each step's masks go through one llguidance pool made once per process (a pool per step
    spawned its threads every step: 1.23-1.33x a free step against 1.12-1.17x, 1B at batch 32 on
    an H200), of at most MASK_THREADS threads."""
    import llguidance

    made = []
    real = llguidance.LLExecutor

    def counted(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(llguidance, "LLExecutor", counted)
    structured._executor.cache_clear()
    try:
        tok, V = model_q4.tokenizer, model_q4.config.vocab_size
        c = structured.constraint(tok, V, {"type": "regex", "regex": r"[a-z]{1,8}"})
        matchers = [c.matcher(tok.eos_token_ids) for _ in range(3)]
        out = np.zeros((3, structured.words(V)), np.uint32)
        steps = tok.encode("abcdefgh", add_special_tokens=False)
        assert len(steps) >= 3
        for t in steps:  # a step of three rows per token
            structured.fill_masks(matchers, out)
            assert all(t in allowed_ids(row) for row in out)
            for m in matchers:
                m.advance(t)
        assert len(made) == 1 and 1 <= made[0][0] <= structured.MASK_THREADS
    finally:
        structured._executor.cache_clear()  # later tests make the real pool again


def test_rows_spread_over_start_matchers_compiled_apart(model_q4):
    """Copies of one llguidance matcher share its lexer behind a lock, so parallel fills queued on
    it: a constraint is compiled MATCHER_FAMILIES times apart and its rows take the copies in
    turn. Each copy still masks exactly as its row alone would."""

    class Counted:  # one start matcher, counting the rows copied from it
        def __init__(self, start):
            self.start, self.copies = start, 0

        def deep_copy(self):
            self.copies += 1
            return self.start.deep_copy()

    tok, V = model_q4.tokenizer, model_q4.config.vocab_size
    c = structured.constraint(tok, V, {"type": "regex", "regex": r"[a-z]{1,9}"})  # a pattern no other test compiles
    assert len(c.starts) == 1  # the others are compiled when rows need them
    counted = dataclasses.replace(c, starts=[], build=lambda: Counted(c.build()), turn=itertools.count(),
                                  lock=threading.Lock())
    rows = 3 * structured.MATCHER_FAMILIES
    matchers = [counted.matcher(tok.eos_token_ids) for _ in range(rows)]
    assert len(counted.starts) == structured.MATCHER_FAMILIES > 1
    assert len({id(s.start) for s in counted.starts}) == len(counted.starts)  # compiled apart, not copies of one
    assert [s.copies for s in counted.starts] == [3] * structured.MATCHER_FAMILIES
    out = np.zeros((rows, structured.words(V)), np.uint32)
    for t in tok.encode("abcd", add_special_tokens=False):
        structured.fill_masks(matchers, out)
        assert (out == out[0]).all() and t in allowed_ids(out[0])
        for m in matchers:
            m.advance(t)


# ---- compiling: errors before any work, naming the schema path ----


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("schema, path, message", [
    ({"type": "object", "properties": {"address": {"type": "object", "properties": {
        "zip": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["zip"]}}, "required": ["address"]},
     "#/properties/address/properties/zip", "minimum (5) is greater than maximum (1)"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "strng"}}}},
     "#/properties/a/items", "strng"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a", "not"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "string", "pattern": "[a-"}]}}},
     "#/properties/a/anyOf/1", "regex"),
    ({"type": "object", "properties": {"a/b": {"$ref": "#/$defs/missing"}}}, "#/properties/a~1b", "missing"),
])
def test_schema_errors_name_the_path(schema, path, message):
    tok = byte_tokenizer()
    with pytest.raises(InputError, match=re.escape(f"json_schema 's' at {path}: ")) as err:
        structured.constraint(tok, 97, schema_format(schema))
    assert message in str(err.value)


@pytest.mark.parametrize("fmt, message", [
    ("json", "must be None or a dict with a 'type'"),
    ({"type": "json_schemas"}, "did you mean 'json_schema'"),
    ({"type": "json_schema", "schema": {}}, "unknown keys ['schema']"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "'schema' object"),
    ({"type": "regex", "regex": "[a-"}, "unclosed character class"),
    ({"type": "choice", "choice": []}, "non-empty list"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"type": "grammar", "grammar": 'root ::= "a" | ('}, "GBNF"),
])
def test_malformed_response_formats_are_input_errors(fmt, message):
    with pytest.raises(InputError, match=re.escape(message)):
        structured.constraint(byte_tokenizer(), 97, fmt)


def test_requests_compile_each_row_before_any_work(model_q4):
    person = schema_format(SCHEMA)
    reqs = requests(model_q4, ["a", "b", "c"], GenerationConfig(response_format=[person, None, person]))
    assert reqs[1].constraint is None and reqs[0].constraint is reqs[2].constraint  # compiled once, cached
    assert [r.constraint is None for r in requests(model_q4, ["a", "b"], GenerationConfig())] == [True, True]
    gbnf = {"type": "grammar", "grammar": 'root ::= ("yes" | "no") "!"'}
    assert accepts(model_q4.tokenizer, make_request(model_q4, "q", response_format=gbnf).constraint, "no!")
    with pytest.raises(InputError, match=r"response_format of prompt 1: json_schema 's' at #/properties/a"):
        requests(model_q4, ["a", "b"], GenerationConfig(
            response_format=[None, schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})]))
    with pytest.raises(InputError, match="response_format has 2 values for 3 prompts"):
        requests(model_q4, ["a", "b", "c"], GenerationConfig(response_format=[person, None]))


def test_without_llguidance_a_response_format_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(InputError, match=re.escape("pip install 'mlxfun[structured]'")):
        structured.constraint(byte_tokenizer(), 97, {"type": "regex", "regex": "only-here-[0-9]"})
    assert structured.constraint(byte_tokenizer(), 97, None) is None  # free text needs nothing


def test_the_structured_benchmark_alternates_runs_and_reports_medians(tmp_path, capsys, monkeypatch):
    """`mlxfun bench --structured` (a random shape, a byte-level tokenizer written here): free and
    constrained runs alternate after a warm-up pair, and the JSON holds every timed run, their
    medians, and both ratios (tok/s with the admission, ms per decode step after it)."""
    from mlxfun.bench import main as bench
    from mlxfun.model.tokenizer import save_folder

    monkeypatch.setitem(bench.SHAPES, "135M", tiny_config(num_layers=2))  # the bench's logic at a test's size

    (tmp_path / "tok").mkdir()
    save_folder(byte_tokenizer(), tmp_path / "tok")
    out = tmp_path / "s.json"
    assert bench.main(["--structured", "--shape", "135M", "--tokenizer", str(tmp_path / "tok"), "--batch-sizes", "2",
                       "--gen-tokens", "5", "--repeats", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["batch"] == 2 and len(row["runs"]["false"]) == len(row["runs"]["true"]) == 2
    for kind in ("free", "constrained"):
        runs = row["runs"]["true" if kind == "constrained" else "false"]
        assert row[kind]["tps"] == pytest.approx(median(r["tps"] for r in runs))
        assert row[kind]["step_ms"] == pytest.approx(median(r["step_ms"] for r in runs))
        assert all(r["steps"] >= 2 and math.isfinite(r["step_ms"]) and r["step_ms"] > 0 for r in runs)
    assert row["free"]["tokens"] == 2 * 5  # EOS ignored: every free row runs to max_tokens
    assert row["tps_ratio"] == pytest.approx(row["free"]["tps"] / row["constrained"]["tps"])
    assert row["step_ratio"] == pytest.approx(row["constrained"]["step_ms"] / row["free"]["step_ms"])
    assert "per step; host masks" in capsys.readouterr().out
