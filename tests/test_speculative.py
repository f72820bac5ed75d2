"""Speculative decoding inside the batch: exact for greedy rows, the target's distribution for
sampled rows, a seeded row the same alone and in a batch, and turned off where it would lose."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_config, tiny_model, tiny_tokenizer
from mlx.utils import tree_flatten
from test_sampling import CHI2_999, chi2

from mlxfun.engine import sampling
from mlxfun.engine.core import Engine
from mlxfun.features import speculative
from mlxfun.generate import generate
from mlxfun.model import llama, weights
from mlxfun.model.load import Model
from mlxfun.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(tiny_config(max_position_embeddings=1024))


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; some repeat a phrase, so prompt lookup finds drafts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(1, 97) for _ in range(rng.choice([2, 5, 9]))]
        out.append(phrase * rng.choice([1, 3, 6]) + [rng.randrange(1, 97) for _ in range(rng.choice([0, 1, 7, 30]))])
    return out


def run(model, prompts, *, rows=None, draft=None, k=4, always=True, **options):
    engine = Engine(model, rows or len(prompts), draft=draft, num_draft_tokens=k,
                    policy=speculative.Always() if always else None)
    settings = options.pop("settings", None)
    ids = [engine.add(p, settings=None if settings is None else settings[i], **options) for i, p in enumerate(prompts)]
    list(engine.events())
    return [engine.take(i).row for i in ids], engine


def quantized(model: Model) -> Model:
    return Model(model.config, weights.quantize(model.config, model.params, bits=4, group_size=32), model.tokenizer,
                 "q4 draft")


@pytest.mark.parametrize("draft", ["prompt-lookup", "q4", "random", "itself"])
@pytest.mark.parametrize("rows", [None, 5])
def test_greedy_with_drafts_equals_greedy_without(tiny, draft, rows):
    """12 prompts of mixed lengths, batched (static, or 5 rows refilled): every row's tokens equal
    decoding without speculation, whatever the drafts (a 4-bit copy, an unrelated model, the model
    itself: all accepted)."""
    drafter = {"prompt-lookup": "prompt-lookup", "q4": quantized(tiny), "itself": tiny,
               "random": tiny_model(tiny_config(max_position_embeddings=1024), seed=9)}[draft]
    prompts = mixed_prompts(12)
    plain = generate(tiny, prompts, max_tokens=24, ignore_eos=True).token_ids
    out, engine = run(tiny, prompts, rows=rows, draft=drafter, max_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in out] == plain
    assert engine.stats.verify_rounds > 0 and engine.stats.drafted > 0
    if draft == "itself":
        assert engine.stats.accepted == engine.stats.drafted
        assert engine.stats.generation_tokens >= 3 * engine.stats.busy_row_steps  # k + 1 per row and round, but ends
    if draft == "prompt-lookup":
        assert engine.stats.accepted > 0


class Alternate(speculative.Policy):
    """Two verify rounds, then three decode steps, and again (the modes' hand-overs)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def choose(self, ahead=None, least=1.0, feed=None, share=1.0) -> bool:
        self.calls += 1
        return self.calls % 5 < 2


class Spy(Engine):
    """Records, each time a verify round's tokens are handed out, whether the next round was
    queued already (in flight)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        take = self.speculation.take

        def spy(engine, out, owners, proposed=None):
            self.ahead = getattr(self, "ahead", []) + [any(isinstance(o, speculative.Verdict)
                                                           for o, _ in self._inflight)]
            return take(engine, out, owners, proposed)

        self.speculation.take = spy


@pytest.mark.parametrize("policy", ["always", "alternate"])
def test_draft_model_rounds_are_queued_one_ahead(tiny, policy):
    """A device drafter (the draft model) drafts from the device state, so the engine queues
    round n + 1 before it hands out round n: every round but those that end a run of rounds is
    handed out with the next in flight. Alternating with plain decode steps (the drafter catches
    up on their tokens), and with rows refilled as requests end, the tokens equal decoding
    without speculation."""
    prompts = mixed_prompts(9, seed=7)
    plain = generate(tiny, prompts, max_tokens=20, ignore_eos=True).token_ids
    engine = Spy(tiny, 4, draft=quantized(tiny), num_draft_tokens=3,
                 policy=speculative.Always() if policy == "always" else Alternate())
    ids = [engine.add(p, max_tokens=20, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    ahead = engine.ahead
    assert len(ahead) == engine.stats.verify_rounds > 10
    if policy == "always":
        assert sum(ahead) >= len(ahead) - 4  # the last rounds of the 3 refills and the end may run alone
    else:
        assert engine.stats.verify_rounds < engine.stats.steps  # decode steps ran between
        assert 0 < sum(ahead) < len(ahead)  # the second of each pair was in flight when the first was read


@pytest.mark.parametrize("draft", ["q4", "prompt-lookup"])
def test_rings_verify_synchronously_and_equal_plain_ring_decoding(tiny, draft):
    """With max_kv_size every row is a ring: verify rounds run synchronously (a round queued
    ahead could overwrite slots the round before still reads), and the tokens equal plain
    decoding with the same ring, past the window's wrap."""
    prompts = mixed_prompts(6, seed=11)
    plain = generate(tiny, prompts, max_tokens=40, max_kv_size=24, ignore_eos=True).token_ids
    drafter = quantized(tiny) if draft == "q4" else draft
    engine = Spy(tiny, 3, draft=drafter, num_draft_tokens=3, policy=speculative.Always(), max_kv_size=24)
    ids = [engine.add(p, max_tokens=40, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert engine.stats.verify_rounds > 10 and not any(engine.ahead)


def test_eos_and_stop_strings_inside_an_accepted_run(tiny):
    """A row whose end-of-text token or stop string comes in the middle of a run of accepted
    drafts ends there, with the same tokens and text as without speculation."""
    prompts = mixed_prompts(8, seed=3)
    plain = generate(tiny, prompts, max_tokens=30, ignore_eos=True).token_ids
    eos = plain[0][len(plain[0]) // 2]  # a token the first row emits mid-way
    backend = tiny.tokenizer.backend
    model = Model(tiny.config, tiny.params, Tokenizer(backend, eos_token_ids={eos}, bos_token_id=None, add_bos=False,
                                                      chat_template=None), "eos")
    stop = [tiny.tokenizer.decode(plain[3][5:7])]
    base = generate(model, prompts, max_tokens=30, stop=stop).token_ids
    out, _ = run(model, prompts, draft=model, max_tokens=30, stop=stop)  # all drafts accepted
    assert [r.token_ids for r in out] == base
    assert any(len(b) < 30 for b in base)


def test_seeded_sampled_row_is_the_same_alone_and_in_a_batch(tiny):
    prompts = mixed_prompts(6, seed=5)
    settings = [sampling.make_settings(1, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]
    batched, _ = run(tiny, prompts, draft=quantized(tiny), max_tokens=20, ignore_eos=True, settings=settings)
    for i, p in enumerate(prompts):
        alone, _ = run(tiny, [p], draft=quantized(tiny), max_tokens=20, ignore_eos=True, settings=[settings[i]])
        assert alone[0].token_ids == batched[i].token_ids
    lookup, _ = run(tiny, prompts, draft="prompt-lookup", rows=2, max_tokens=20, ignore_eos=True, settings=settings)
    for i, p in enumerate(prompts):
        alone, _ = run(tiny, [p], draft="prompt-lookup", max_tokens=20, ignore_eos=True, settings=[settings[i]])
        assert alone[0].token_ids == lookup[i].token_ids


@pytest.mark.parametrize("draft_kind", ["model", "lookup"])
def test_speculative_sampling_follows_the_target_distribution(draft_kind):
    """Chi-square: the first and second tokens a round emits follow the target's (filtered,
    temperature-scaled) distribution at their position, for drafts drawn from another
    distribution q (a draft model) or fixed (prompt lookup), over 20,000 rows with their own seeds."""
    V, k, n = 8, 2, 20_000
    rng = np.random.default_rng(0)
    target = rng.normal(size=(k + 1, V)) * 1.5  # logits at each verified position
    draft = rng.normal(size=(k, V)) * 1.5
    settings = sampling.make_settings(n, temperature=0.8, seed=list(range(n)))
    p = np.exp(target / 0.8)
    p /= p.sum(axis=1, keepdims=True)
    if draft_kind == "model":
        q = np.exp(draft / 0.8)
        q /= q.sum(axis=1, keepdims=True)
        drafts = np.stack([rng.choice(V, size=n, p=q[i]) for i in range(k)], axis=1)
        probs = mx.array(np.broadcast_to(q, (n, k, V)).astype(np.float32))
    else:
        drafts = np.tile(np.argmax(target[:k], axis=1), (n, 1))  # the likeliest tokens: often accepted
        probs = None
    logits = mx.array(np.broadcast_to(target, (n, k + 1, V)).astype(np.float32))
    out = speculative.verdict(True, False, -1, logits, mx.array(drafts.astype(np.int32)), mx.ones((n, k), mx.bool_),
                              probs, settings, mx.zeros((n,), mx.int32))
    tokens, count = np.array(out.tokens), np.array(out.count)
    first = np.bincount(tokens[:, 0], minlength=V)
    assert chi2(first, p[0]) < CHI2_999[V - 1]
    second = np.bincount(tokens[count >= 2, 1], minlength=V)
    assert (count >= 2).sum() > 2000 and chi2(second, p[1]) < CHI2_999[V - 1]
    wrong = np.exp(draft[0] / 0.8) / np.exp(draft[0] / 0.8).sum() if draft_kind == "model" else np.full(V, 1 / V)
    assert chi2(first, wrong) > CHI2_999[V - 1], "the test cannot fail"
    assert 1 <= count.min() and count.max() <= k + 1


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    lookup = speculative.PromptLookup(max_ngram=3)
    assert lookup.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    assert lookup.propose([7, 8, 9, 7, 8, 1, 7, 8], 2) == [1, 7]  # the latest occurrence wins
    assert lookup.propose([1, 2, 3], 4) == []
    assert lookup.propose([5, 6, 5], 4) == [6, 5]


def test_the_measured_rule_turns_speculation_off_where_it_loses(tiny):
    """On this CPU (MLX's bundled BLAS) a verified position costs what a decode step does: the
    engine's default never speculates here, and the measured rule, made to try, measures both
    modes and turns speculation off. The tokens are the same either way."""
    prompts = mixed_prompts(8, seed=7)
    plain = generate(tiny, prompts, max_tokens=60, ignore_eos=True).token_ids
    draft = tiny_model(tiny_config(max_position_embeddings=1024), seed=9)
    out, engine = run(tiny, prompts, draft=draft, always=False, max_tokens=60, ignore_eos=True)
    assert [r.token_ids for r in out] == plain and engine.stats.verify_rounds == 0
    assert not speculative.may_pay(8, 4)
    # Made to try with no budget: a draft model as large as the target cannot afford to measure in 60 tokens.
    engine = Engine(tiny, 8, draft=draft, policy=speculative.Policy(enabled=True, budget=None))
    ids = [engine.add(p, max_tokens=60, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert engine.speculation.policy.speedup is not None and engine.speculation.policy.speedup < 1.0
    assert 0 < engine.stats.verify_rounds < engine.stats.steps / 3


def test_a_costly_drafter_measures_only_where_the_work_ahead_pays_for_it(tiny):
    """A draft model's first measure loses about FIRST_ROUNDS x (least - 1) + SWITCH_STEPS decode
    steps: it runs only where that is within BUDGET of the steps the rows may still take. With the
    default budget, a draft model as large as the target (a round costs at least k + 2 steps) never
    speculates in a 60-token run; the rule never began to measure, and the tokens are plain decoding's."""
    prompts = mixed_prompts(4, seed=7)
    plain = generate(tiny, prompts, max_tokens=60, ignore_eos=True).token_ids
    draft = tiny_model(tiny_config(max_position_embeddings=1024), seed=9)
    engine = Engine(tiny, 4, draft=draft, policy=speculative.Policy(enabled=True))
    ids = [engine.add(p, max_tokens=60, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert engine.stats.verify_rounds == 0 and not engine.speculation.policy.started
    least = engine.speculation.drafter.least(4)
    assert least == pytest.approx(1 + 5 * engine.speculation.drafter.cost)  # the verify pass and k + 1 draft steps
    loss = engine.speculation.policy.expected_loss(least, speculative.FIRST_ROUNDS)
    cost = engine.speculation.drafter.cost
    assert loss == pytest.approx(speculative.FIRST_ROUNDS * 5 * cost + speculative.SWITCH_STEPS)
    assert loss > speculative.BUDGET * 60


def test_a_draft_models_catch_up_is_priced_from_the_measured_prefill(tiny):
    """Before its first round a draft model lacks every live row's prompt and the tokens since (all
    but each row's last, which the round feeds); the engine prices them at the draft's cost times
    its own measured prefill time per token, in timed decode steps' time."""
    prompts = mixed_prompts(4, seed=3)
    draft = tiny_model(tiny_config(max_position_embeddings=1024), seed=9)
    engine = Engine(tiny, 4, draft=draft, policy=speculative.Policy(enabled=True, budget=0.0))  # never affords
    for p in prompts:
        engine.add(p, max_tokens=12, ignore_eos=True)
    assert engine.speculation.feed_steps(engine) == 0.0  # nothing timed yet
    for _ in range(6):
        list(engine.step())
    live = [engine.requests[o] for o in engine.scheduler.owner if o is not None]
    lacking = engine.speculation.drafter.lacking(engine)
    assert lacking == sum(len(p) for p in prompts) + sum(len(r.row.text.tokens) for r in live) - len(live)
    assert engine.stats.timed_prompt_tokens == sum(len(p) for p in prompts) and engine.speculation.policy.rate[False]
    per_token = engine.stats.prompt_time / engine.stats.timed_prompt_tokens
    spec = engine.speculation
    assert spec.feed_steps(engine) == pytest.approx(spec.drafter.cost * lacking * per_token * spec.policy.rate[False])
    assert engine.speculation.feed_steps(engine) > 0 and engine.stats.verify_rounds == 0


def test_a_costly_drafters_tries_are_spread_by_their_expected_loss():
    """The first measure runs where the work ahead affords it (and is put off, not given up, where
    it does not yet); later tries of a losing costly drafter come only where their loss, from the
    measured rates, is within BUDGET of the steps around them: skipped tries count as lost (the
    interval doubles). A free drafter (least 1) is never held back."""
    least = 1.68  # a drafter whose round costs at least 1.68 decode steps (k = 4)
    policy = speculative.Policy(interval=32, longest=4096)
    assert not policy.choose(ahead=64, least=least) and not policy.started  # 4.7 steps > 3% of 64
    assert policy.choose(ahead=None, least=least) and policy.started  # unknown work: measure
    free = speculative.Policy(interval=32)
    assert free.choose(ahead=2, least=1.0)
    # Rounds take 4.5 decode steps' time for 2.7 tokens per row: each loses 1.8 steps.
    choices = []
    for _ in range(3000):
        s = policy.choose(ahead=10_000, least=least)
        choices.append(s)
        policy.record(s, 2.7 if s else 1.0, 4.5 if s else 1.0, most=5, least=least if s else 1.0)
    loss = policy.expected_loss(least, speculative.TRY_ROUNDS)
    assert loss == pytest.approx(speculative.TRY_ROUNDS * 1.8 + speculative.SWITCH_STEPS)
    rounds = [i for i, c in enumerate(choices) if c]
    tries = [t for j, t in enumerate(rounds) if j == 0 or t - rounds[j - 1] > 1][1:]  # after the first measure
    assert len(tries) >= 2 and all(b - a >= loss / speculative.BUDGET for a, b in zip(tries, tries[1:]))
    assert tries[0] > 256  # tries at 32, 64 and 128 steps skipped (each under loss / BUDGET = 247 steps)
    assert sum(choices) * 1.8 + len(tries) * speculative.SWITCH_STEPS < 0.02 * len(choices)  # steps lost


class Silent(speculative.Drafter):
    """A host drafter that drafts for some rows (`rows`) and never for the rest."""

    def __init__(self, rows=()):
        self.rows, self.calls = set(rows), 0

    def propose(self, engine, rows, k):
        self.calls += 1
        B = len(engine.scheduler.owner)
        valid = np.zeros((B, k), bool)
        for r in rows:
            valid[r] = engine.scheduler.owner[r] in self.rows
        return mx.zeros((B, k), mx.int32), mx.array(valid), None


def test_rounds_with_no_draft_decode_plainly(tiny):
    """Where prompt lookup finds no n-gram for any row, the round is a decode step (a verify pass
    would cost more for the same one token), and the policy does not time it as a verify round;
    one row with a draft makes it a verify round again."""
    prompts = mixed_prompts(4, seed=3)
    plain = generate(tiny, prompts, max_tokens=12, ignore_eos=True).token_ids
    drafter = Silent()
    out, engine = run(tiny, prompts, draft=drafter, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in out] == plain
    assert engine.stats.verify_rounds == 0 and drafter.calls >= 11 and engine.stats.drafted == 0
    assert engine.speculation.policy.rate[True] is None  # never timed as speculating
    drafter = Silent(rows={0})  # request 0 always has drafts (zeros)
    out, engine = run(tiny, prompts, draft=drafter, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in out] == plain
    assert engine.stats.verify_rounds >= 3 and engine.stats.drafted >= 4 * engine.stats.verify_rounds


def test_policy_follows_the_faster_mode_and_retries_the_other():
    policy = speculative.Policy(interval=4)
    choices = []
    for _ in range(40):
        s = policy.choose()
        choices.append(s)
        policy.record(s, 3.0 if s else 1.0, 1.0)  # verify rounds give 3 tokens per row in the same time
    assert sum(choices[-20:]) >= 17  # speculating, with an occasional decode step
    policy = speculative.Policy(interval=4)
    for _ in range(200):
        s = policy.choose()
        policy.record(s, 1.2 if s else 1.0, 2.0 if s else 1.0)  # verify rounds take twice as long
    assert policy.speedup < 1 and policy.interval > 4  # losing tries back off


class _Shadowed:
    """The parts of an engine `LookupDrafter.shadow` reads: rows' requests, prompts and tokens."""

    def __init__(self, prompts):
        from types import SimpleNamespace as NS

        self.scheduler = NS(owner=list(range(len(prompts))))
        self.requests = {i: NS(request=NS(prompt=p), row=NS(text=NS(tokens=[]), finish_reason=None))
                         for i, p in enumerate(prompts)}

    def give(self, row, tokens):
        self.requests[row].row.text.tokens += tokens


def test_lookup_replays_verify_rounds_on_plain_tokens():
    """While speculation is off, prompt lookup replays the rounds it would have verified: each
    starts where the last ended, drafts from the history there, and gives its matching drafts
    plus one, once the tokens that follow are known. A row with nothing to draft from counts no
    round."""
    drafter, k = speculative.LookupDrafter(), 3
    engine = _Shadowed([[7, 1, 2, 3, 4, 5, 9, 7], [40, 41, 42]])  # row 0 repeats 7: drafts 1 2 3
    assert drafter.shadow(engine, k) == []  # drafts made, nothing after them yet
    engine.give(0, [1, 2])
    engine.give(1, [43, 44])
    assert drafter.shadow(engine, k) == []  # 2 of 3 tokens known
    engine.give(0, [3])  # the round keeps all 3 drafts, and the token after them
    assert drafter.shadow(engine, k) == [4]
    assert drafter.rounds[0] == (4, None)  # the next round drafts once that token is known
    engine.give(0, [4])
    assert drafter.shadow(engine, k) == []  # after 2 3 4 come 5 9 7
    engine.give(0, [5, 8, 8])  # one kept, then a miss: 2 tokens, the next round starts after 5 8
    assert drafter.shadow(engine, k) == [2]
    # Nothing to draft after ... 5 8 (a plain step); after ... 5 8 8 the last 8 repeats: draft 8, pending.
    assert drafter.rounds[0] == (7, [8])
    assert drafter.rounds[1] == (3, None)  # row 1 never had a draft: no round counted


def test_policy_turns_speculation_back_on_when_replayed_rounds_win():
    """After speculation lost and turned off, rounds replayed on plain tokens that would now keep
    most drafts switch it back on at once, rather than at the next try (32 rounds, doubling)."""
    policy = speculative.Policy(interval=32)
    for _ in range(12):
        s = policy.choose()
        policy.record(s, 1.0 if s else 1.0, 1.5 if s else 1.0)  # rounds give 1 token in 1.5x the time
    assert not policy.choose()
    policy.shadow([])  # nothing replayed: no change
    assert not policy.choose()
    policy.shadow([4, 4, 4, 4])  # 4 tokens per 1.5x round
    assert policy.choose() and policy.speedup > 2


def test_policy_stops_trying_rounds_that_cannot_pay():
    """A verify round slower than k + 1 decode steps loses with every draft kept (a draft model
    whose steps cost more than the target's): after measuring it, the policy tries again only
    every `longest` rounds, not every `interval` (doubling)."""
    policy = speculative.Policy(interval=4, longest=60)
    choices = []
    for _ in range(200):
        s = policy.choose()
        choices.append(s)
        policy.record(s, 5.0 if s else 1.0, 6.0 if s else 1.0, most=5 if s else None)  # 5 tokens in 6 steps' time
    assert choices[:2] == [True, True] and policy.interval == 60  # the two rounds that measure it
    tries = [i for i, c in enumerate(choices) if c][2:]
    starts = [t for i, t in enumerate(tries) if i == 0 or t - tries[i - 1] > 1]
    assert len(tries) == 3 * speculative.TRY_ROUNDS  # then one try every 60 or so, each of TRY_ROUNDS rounds
    assert len(starts) == 3 and all(b - a > 50 for a, b in zip(starts, starts[1:]))
    policy = speculative.Policy(interval=4, longest=60)
    choices = []
    for _ in range(200):
        s = policy.choose()
        choices.append(s)
        policy.record(s, 1.0 if s else 1.0, 3.0 if s else 1.0, most=5 if s else None)  # could pay: 5 in 3
    assert sum(choices[2:]) >= 5  # losing now, but tried as before: after 4, 8, 16, 32 rounds, then 60


def test_policy_tries_last_until_a_round_of_them_is_timed():
    """The engine times a round from the one before it, so a try of one round told the policy
    nothing: each try runs TRY_ROUNDS rounds in a row, in either direction."""
    policy = speculative.Policy(interval=4, longest=64)
    choices = []
    for _ in range(80):
        s = policy.choose()
        choices.append(s)
        policy.record(s, 1.5 if s else 1.0, 2.0 if s else 1.0, most=5 if s else None)  # loses: 0.75x
    assert choices[:4] == [True, True, False, False]  # each mode measured (a warm-up round, then a timed one)
    runs = "".join("V" if c else "." for c in choices[4:]).split(".")
    assert {len(r) for r in runs if r} == {speculative.TRY_ROUNDS}


def test_one_slow_decode_step_does_not_make_speculation_win():
    """Rates come from windows of the latest rounds (decoding's: the median step), and decoding
    is compared only once MIN_DECODES steps are timed: on an H200 the first decode step after verify rounds took 1.8x a
    steady one, and a rule that compared it with one verify round speculated at 0.5-0.7x plain."""
    policy = speculative.Policy(interval=32)
    step_times = iter([1.0, 2.0] + [1.0] * 100)  # after the warm-up step, the first timed one is slow
    choices = []
    for _ in range(24):
        s = policy.choose()
        choices.append(s)
        policy.record(s, 2.4 if s else 1.0, 3.4 if s else next(step_times))  # 0.71 tokens/s against 1
    assert choices[:2] == [True, True] and not any(choices[2:])  # measured, then decoding to the next try
    assert abs(policy.rate[False] - 1.0) < 0.2 and policy.speedup < 0.8


def test_a_costly_drafter_must_win_by_more_to_turn_speculation_back_on():
    """Returning to speculation with a draft model drains the pipeline and feeds the draft model
    the plain tokens, so once decoding is the better mode a costly drafter (`least` > 1) must win
    by ENTER, not just `margin`: at 1.06x it stays off (but for its tries), where a free drafter
    (prompt lookup) turns back on."""
    def run(least: float) -> list[bool]:
        policy = speculative.Policy(interval=4, longest=64)
        choices = []
        for i in range(300):
            s = policy.choose()
            choices.append(s)
            tokens = 0.9 if i < 20 else 1.06  # verify rounds lose at first, then win by 6%
            policy.record(s, tokens if s else 1.0, 1.0, most=5, least=least if s else 1.0)
        return choices

    costly, free = run(1.6), run(1.0)
    assert sum(free[-100:]) > 80  # speculating again, decoding only in tries
    assert sum(costly[-100:]) < 20  # decoding, speculating only in tries
    assert 1.03 < 1.06 < speculative.ENTER * 1.03


def test_a_pipelined_first_round_that_kept_nothing_stops_speculation():
    """A pipelined run's first round is not timed; if it kept no draft it lost anyway (a round
    costs at least a decode step): speculation stops there, and the next timed round replaces the bound."""
    policy = speculative.Policy(interval=4)
    assert policy.choose()
    policy.record(True, 1.0, None, most=5)  # nothing kept, time unknown
    assert policy.rate[True] == 0.0 and not policy.choose()
    policy.record(True, 4.0, 1.0, most=5)  # a timed round (a try): measured, not averaged with the bound
    assert policy.rate[True] == 4.0 and not policy.bound
    fresh = speculative.Policy(interval=4)
    fresh.record(True, 2.0, None, most=5)  # kept something: no conclusion without its time
    assert fresh.rate[True] is None and fresh.choose()


def test_an_untimed_round_is_judged_by_the_drafters_least_cost():
    """A draft model's round costs at least a verify pass and its k steps (`Drafter.cost` each):
    an untimed round that gave no more tokens than that lost, though it kept some drafts. It stops
    speculation with the next try after twice the base interval; in a later try of speculation
    it ends the try (a lost try: the interval doubles)."""
    policy = speculative.Policy(interval=4)
    policy.record(True, 1.5, None, most=5, least=1.6)  # 1.5 tokens per row; a round costs >= 1.6 steps
    assert policy.rate[True] == 0.0 and policy.interval == 8 and not policy.choose()
    free = speculative.Policy(interval=4)
    free.record(True, 1.5, None, most=5, least=1.0)  # a free drafter: 1.5 tokens may pay
    assert free.rate[True] is None and free.choose()
    # Decoding measured better; a try of speculation whose untimed first round keeps too little ends it.
    policy = speculative.Policy(interval=4, longest=64)
    for _ in range(3 + speculative.MIN_DECODES):  # speculation: a warm-up and a timed round; decoding the same
        s = policy.choose()
        policy.record(s, 1.2 if s else 1.0, 2.0 if s else 1.0, most=5)
    choices = [policy.choose() for _ in range(4)]  # counts down to the try: its first round speculates
    assert choices == [False, False, False, True] and policy.trying == speculative.TRY_ROUNDS - 1
    interval = policy.interval
    assert policy.choose()  # the try's second round (queued before the first is read, as the engine does)
    policy.record(True, 1.0, None, most=5, least=1.6)
    assert policy.trying == 0 and policy.interval == 2 * interval and not policy.choose()


def test_a_draft_models_cost_is_its_share_of_the_weights_a_step_reads(tiny):
    """`DraftModel.cost`: the draft's weight bytes per step over the target's (1 for the model itself)."""
    from mlxfun.features.drafting import DraftModel

    engine = Engine(tiny, 2)
    assert DraftModel(tiny, engine).cost == 1.0
    small = tiny_model(tiny_config(num_layers=1), seed=4)
    cost = DraftModel(small, engine).cost
    layer = sum(a.nbytes for _, a in tree_flatten(tiny.params.layers[0]) if a is not None)
    assert cost == pytest.approx(1 - layer / sum(a.nbytes for _, a in tree_flatten(tiny.params) if a is not None))
    assert speculative.Drafter().least(4) == 1.0  # a host drafter: the verify pass alone


def test_a_draft_models_cost_on_a_gpu_counts_its_layers_launches_as_well_as_its_weights():
    """On a GPU a draft step is priced as launches per layer as well as weight reads (LAUNCH_SHARE):
    the 1B shape drafting for the 8B is 0.33 of a step (about a third, measured on an H200), where
    its bytes alone say 0.155; and a round of k = 4 then costs at least 2.6 steps, so its first
    measure (FIRST_ROUNDS rounds, a switch there and back) is over BUDGET of a 256-token run at one
    row. At 32 rows the budget's share is 1 - 32 x 5 / 256 (`headroom`) and the prompts' catch-up
    adds its steps: 512 and 1,024 tokens do not afford the measure (the H200 lost 2.6-3.5% at 512
    when it ran). The measure waits for timed decode steps, which price it."""
    from mlxfun.bench import main as bench
    from mlxfun.features.drafting import step_cost

    def params(shape):  # the arrays' sizes are what counts: zeros of each shape, never evaluated
        c = bench.SHAPES[shape]
        E, I, D, H, K = c.hidden_size, c.intermediate_size, c.head_dim, c.num_heads, c.num_kv_heads
        z = lambda *dims: mx.zeros(dims, mx.bfloat16)  # noqa: E731
        layer = llama.Layer(z(E), z((H + 2 * K) * D, E), z(E, H * D), z(E), z(2 * I, E), z(E, I))
        return llama.Params(z(c.vocab_size, E), (layer,) * c.num_layers, z(E),
                            None if c.tie_word_embeddings else z(c.vocab_size, E))

    big, small = params("8B"), params("1B")
    weights = step_cost(small, big, gpu=False)
    assert weights == pytest.approx(0.155, abs=0.01)
    cost = step_cost(small, big, gpu=True)
    assert cost == pytest.approx(0.5 * 16 / 32 + 0.5 * weights) and 0.3 < cost < 0.37
    assert step_cost(big, big, gpu=True) == pytest.approx(1.0)
    least = 1 + 5 * cost

    def timed(policy):
        for _ in range(speculative.MIN_DECODES + 1):  # the first is a warm-up, untimed
            policy.record(False, 1.0, 0.007)
        return policy

    untimed = speculative.Policy()
    assert not untimed.choose(ahead=10_000, least=least) and not untimed.started
    assert timed(untimed).choose(ahead=10_000, least=least) and untimed.started
    one = speculative.headroom(1, 4)
    assert one == pytest.approx(1 - 5 / 256)
    assert not timed(speculative.Policy()).choose(ahead=256, least=least, share=one)
    assert timed(speculative.Policy()).choose(ahead=512, least=least, share=one)
    share = speculative.headroom(32, 4)
    assert share == pytest.approx(1 - 160 / 256)
    for ahead, affords in ((512, False), (1024, False), (2048, True)):
        assert timed(speculative.Policy()).choose(ahead=ahead, least=least, feed=lambda: 5.0, share=share) == affords
    assert speculative.headroom(64, 4) == 0.0 and not speculative.may_pay(64, 4)


def test_a_draft_model_that_keeps_nothing_stops_after_its_first_rounds(tiny):
    """With the rule made to try (this CPU never pays), a draft model whose drafts are never kept
    (a few by chance) is stopped by its first, untimed round: two rounds run (the second was queued before the first
    was read), then plain decoding to the end of a 60-token run, the tokens as plain decoding's."""
    prompts = mixed_prompts(8, seed=7)
    plain = generate(tiny, prompts, max_tokens=60, ignore_eos=True).token_ids
    draft = tiny_model(tiny_config(max_position_embeddings=1024), seed=9)
    engine = Engine(tiny, 8, draft=draft, policy=speculative.Policy(enabled=True, budget=None))
    ids = [engine.add(p, max_tokens=60, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert engine.stats.verify_rounds == 2 and 4 * engine.stats.accepted < engine.stats.drafted  # 97 tokens: some match


def test_a_draft_models_catch_up_never_runs_the_few_row_product(monkeypatch):
    """A draft model catching up on plain steps' tokens prefills them in chunks padded as the
    engine pads its own (32 on a GPU): a few tokens unpadded would run the few-row product at a
    row count of their own, which NVRTC builds per count (seconds each on an H200). With
    stand-ins for the kernels, only the engine's own row counts reach it: its rows (a draft step)
    and rows x (k + 1) (a verify pass). The tokens are plain decoding's."""
    from mlxfun.kernels import attention as kernels
    from mlxfun.kernels import dmv

    # A config of its own: compiled steps are cached per config, and a step traced elsewhere
    # without the stand-ins would not call them.
    tiny = tiny_model(tiny_config(max_position_embeddings=777))
    prompts = mixed_prompts(2, seed=2)
    plain = generate(tiny, prompts, max_tokens=20, ignore_eos=True).token_ids
    rows = []
    monkeypatch.setattr(kernels, "available", lambda dtype: True)
    monkeypatch.setattr(kernels, "attention_fits", lambda *a: False)  # attention: MLX ops here
    monkeypatch.setattr(dmv, "fits", lambda x, w: 2 <= x.shape[0] <= dmv.MAX_ROWS)
    monkeypatch.setattr(dmv, "product", lambda x, w: rows.append(x.shape[0]) or x @ w.T)
    draft = tiny_model(tiny_config(max_position_embeddings=777), seed=9)
    engine = Engine(tiny, 2, draft=draft, num_draft_tokens=3, policy=Alternate(), pad_multiple=32)
    ids = [engine.add(p, max_tokens=20, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert engine.stats.verify_rounds >= 4 and set(rows) == {2, 2 * (3 + 1)}


def test_a_draft_models_pool_takes_the_engines_size_at_admission(tiny):
    """The draft pool is sized once, as the engine's (admission reserved every position the rows
    may reach), not grown as rounds go: each new size traced the draft round and its catch-up
    anew, 35-45 ms of each switch back to speculation on an H200. Tokens as plain decoding's."""
    prompts = mixed_prompts(8, seed=3)
    plain = generate(tiny, prompts, max_tokens=200, ignore_eos=True).token_ids
    engine = Engine(tiny, 8, draft=tiny_model(tiny_config(), seed=9), num_draft_tokens=3, policy=Alternate())
    sizes = []
    round_ = engine.speculation.drafter._round
    engine.speculation.drafter._round = lambda *a: sizes.append(engine.speculation.drafter.pool.size) or round_(*a)
    ids = [engine.add(p, max_tokens=200, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    pool = engine.scheduler.pool
    assert engine.stats.verify_rounds >= 20 and pool.size > 65 and set(sizes) == {pool.size}


def test_lookup_with_the_rule_on_keeps_plain_tokens(tiny):
    """The measured rule with prompt lookup (replaying rounds while off): the same tokens as plain
    decoding, and the replayed rounds reached the policy."""
    prompts = mixed_prompts(6, seed=5)
    plain = generate(tiny, prompts, max_tokens=40, ignore_eos=True).token_ids
    engine = Engine(tiny, 6, draft="prompt-lookup", policy=speculative.Policy(enabled=True, interval=4))
    seen = []
    shadow = engine.speculation.policy.shadow
    engine.speculation.policy.shadow = lambda tokens: seen.extend(tokens) or shadow(tokens)
    ids = [engine.add(p, max_tokens=40, ignore_eos=True) for p in prompts]
    list(engine.events())
    assert [engine.take(i).row.token_ids for i in ids] == plain
    assert seen and all(1 <= t <= engine.speculation.k + 1 for t in seen)


def test_draft_model_with_another_vocabulary_is_refused(tiny):
    import mlxfun

    other = tiny_model(tiny_config(vocab_size=64, max_position_embeddings=1024))
    other = Model(other.config, other.params, tiny_tokenizer(64), "small vocab")
    with pytest.raises(mlxfun.InputError, match="vocabulary"):
        Engine(tiny, 2, draft=other)
    with pytest.raises(mlxfun.ModelError, match="no such model file or folder: ngram"):
        Engine(tiny, 2, draft="ngram")  # neither 'prompt-lookup' nor a model to load
    with pytest.raises(mlxfun.InputError, match="draft_model must be"):
        Engine(tiny, 2, draft=3)
    with pytest.raises(mlxfun.InputError, match="num_draft_tokens"):
        Engine(tiny, 2, draft="prompt-lookup", num_draft_tokens=16)


def test_real_model_float32_target_with_its_4bit_weights_as_draft(model_q4, model_f32):
    """6 prompts of mixed lengths batched: with the 4-bit model drafting, the float32 model's
    greedy tokens are the ones it gives without speculation (prompt lookup: the tiny tests above)."""
    texts = ["Hi", "The capital of France is", "def add(a, b):", "The quick brown fox jumps over the lazy dog. "
             "The quick brown fox", "Water boils at", "A B C D E F G"]
    prompts = [model_f32.tokenizer.encode(t) for t in texts]
    plain = generate(model_f32, prompts, max_tokens=5, ignore_eos=True).token_ids
    out, engine = run(model_f32, prompts, draft=model_q4, k=2, max_tokens=5, ignore_eos=True)
    assert [r.token_ids for r in out] == plain
    assert engine.stats.verify_rounds > 0 and engine.stats.accepted > 0


def test_oracle_drafts_of_a_predictable_model_are_accepted_at_its_rate():
    """The benchmark's oracle: on `predictable` random weights (bf16, as on a GPU) a draft of the
    greedy continuation is always accepted, so alpha sets the acceptance; the continuation is the
    same with and without speculation."""
    from mlxfun.bench import speculative as bs

    raw = tiny_model(tiny_config(vocab_size=512))
    bf16 = Model(raw.config, weights.cast(raw.config, raw.params, mx.bfloat16), raw.tokenizer, raw.source)
    model = bs.predictable(bf16)
    prompts = [[5, 9, 17, 33], [7, 8]]
    plain: dict = {}
    bs._run(model, prompts, 12, ids_out=plain)
    assert all(ids == [p[-1]] * 12 for ids, p in zip(plain.values(), prompts))  # each step echoes its input
    for kind in (bs.Oracle, bs.DeviceOracle):  # host drafts (synchronous rounds), device drafts (pipelined)
        for alpha, low, high in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.05)):  # a random draft may hit (1 in 512)
            drafter = kind(plain, alpha, model.config.vocab_size, seed=1)
            engine, _ = bs._run(model, prompts, 12, draft=drafter, k=3, policy=speculative.Always())
            s = engine.stats
            assert low <= s.accepted / s.drafted <= high
        spec: dict = {}
        bs._run(model, prompts, 12, draft=kind(plain, 0.5, model.config.vocab_size), k=3,
                policy=speculative.Always(), ids_out=spec)
        assert spec == plain


def test_verify_positions_as_rows_of_their_own_equal_the_chunk():
    """`step.verify_hidden` with `flatten` (on CUDA: each verified position a one-token row, so
    attention runs the one-token kernel) gives the hidden states and cache of the (B, k + 1)
    chunk, rows at different positions, one without a request (float32, MLX ops on this CPU)."""
    from mlxfun.engine.step import verify_hidden
    from mlxfun.model import cache as kv
    from mlxfun.model import llama

    config = tiny_config(max_position_embeddings=1024)
    model = tiny_model(config)
    B, T, bs = 3, 5, 16
    pool = 12
    keys, values, positions = kv.pool(config, pool, bs, mx.float32)
    table = mx.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], mx.int32)
    cache = kv.KVCache(keys, values, positions, table)
    rng = np.random.default_rng(0)
    lengths = [20, 7, 0]  # row 2 holds no request
    for r, n in enumerate(lengths[:2]):  # each row's history
        tokens = mx.array(rng.integers(1, 97, size=(1, n)).astype(np.int32))
        _, cache = llama.hidden(config, model.params, tokens, mx.arange(n)[None], None,
                                cache._replace(table=table[r:r + 1]))
        cache = cache._replace(table=table)
    start = mx.array([20, 7, -1], mx.int32)
    pos = mx.where(start[:, None] >= 0, start[:, None] + mx.arange(T)[None], -1)  # (B, T)
    tokens = mx.array(rng.integers(1, 97, size=(B, T)).astype(np.int32))
    h0, c0 = verify_hidden(config, model.params, tokens, pos, cache, flatten=False)
    h1, c1 = verify_hidden(config, model.params, tokens, pos, cache, flatten=True)
    np.testing.assert_allclose(np.array(h1[:2]), np.array(h0[:2]), rtol=1e-4, atol=1e-4)
    assert c1.table.shape == cache.table.shape
    for a, b in zip(c0.keys + c0.values, c1.keys + c1.values):
        np.testing.assert_allclose(np.array(a[bs:]), np.array(b[bs:]), rtol=1e-5, atol=1e-5)  # block 0: scratch
    np.testing.assert_array_equal(np.array(c0.positions[1:]), np.array(c1.positions[1:]))
