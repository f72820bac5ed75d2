"""Sampling: exact supports, chi-square frequencies, per-row independence, one trace, validation."""

import mlx.core as mx
import numpy as np
import pytest

from mlxfun.engine import sampling as S
from mlxfun.errors import InputError

# scipy.stats.chi2.ppf(0.999, df), computed once.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
            9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 49: 85.351}
P10 = np.array([0.22, 0.18, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02])
N = 20_000


# ---- a plain numpy reference of the documented order, and a chi-square test ----


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, order="kpm") -> np.ndarray:
    """The filtered, renormalised distribution (float64), filters applied in `order`."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones(x.shape, bool)

    def probs():
        p = np.exp(x - x[keep].max()) * keep
        return p / p.sum()

    for f in order:
        if f == "k" and top_k:
            keep &= x >= np.sort(x)[::-1][top_k - 1]
        if f == "p" and top_p < 1:
            p = probs()
            desc = np.sort(p)[::-1]
            n = int(np.argmax(np.cumsum(desc) >= top_p)) + 1
            keep &= p >= desc[n - 1]
        if f == "m" and min_p:
            p = probs()
            keep &= p >= min_p * p.max()
    return probs()


def chi2(observed: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic; infinite when a token outside p's support was drawn."""
    if observed[p == 0].sum():
        return np.inf
    expected = observed.sum() * p[p > 0]
    return float(((observed[p > 0] - expected) ** 2 / expected).sum())


def draw(logits, n=N, counts=None, seed=1234, temperature=1.0, **settings) -> np.ndarray:
    """Token frequencies (V,) of n draws from one row of logits: n rows, one seed, steps 0..n-1."""
    row = mx.array(np.asarray(logits, np.float32))
    batch = mx.broadcast_to(row[None], (n, row.shape[0]))  # (n, V)
    c = None if counts is None else mx.broadcast_to(mx.array(counts, mx.int32)[None], batch.shape)
    settings = S.make_settings(n, seed=seed, temperature=temperature, **settings)
    tokens = S.sample(batch, settings, mx.arange(n, dtype=mx.int32), c)
    return np.bincount(np.array(tokens), minlength=row.shape[0])


def assert_matches(observed, right, wrong):
    df = int((right > 0).sum()) - 1
    assert np.array_equal(observed > 0, right > 0), "drawn support differs from the filtered support"
    assert chi2(observed, right) < CHI2_999[df]
    assert chi2(observed, wrong) > CHI2_999[max(int((wrong > 0).sum()) - 1, 1)], "the test cannot fail"


# ---- statistics ----


@pytest.mark.parametrize("temperature, wrong", [(0.7, 1.0), (1.0, 0.8), (2.0, 1.5)])
def test_temperature_frequencies(temperature, wrong):
    logits = np.random.default_rng(0).normal(0, 1, 50)  # V = 50
    observed = draw(logits, temperature=temperature)
    assert_matches(observed, reference(logits, temperature), reference(logits, wrong))


def test_top_k_frequencies():
    logits = np.random.default_rng(1).normal(0, 1, 12)
    assert_matches(draw(logits, top_k=5), reference(logits, top_k=5), reference(logits, top_k=6))


def test_top_p_frequencies():
    logits = np.log(P10)
    # cumulative 0.22 0.40 0.55 0.67 0.77: 0.75 keeps five.
    right = reference(logits, top_p=0.75)
    assert (right > 0).sum() == 5
    assert_matches(draw(logits, top_p=0.75), right, reference(logits, top_p=0.6))


def test_min_p_frequencies():
    logits = np.log(P10)
    # p / p_max: 1 .82 .68 .55 .45: min_p 0.5 keeps four.
    right = reference(logits, min_p=0.5)
    assert (right > 0).sum() == 4
    assert_matches(draw(logits, min_p=0.5), right, reference(logits, min_p=0.4))


def test_top_k_then_top_p():
    logits = np.log(P10)
    # top-k 5 renormalised: cumulative .29 .52 .71 -> three; top-p first keeps five, then top-k five.
    right, wrong = reference(logits, top_k=5, top_p=0.7), reference(logits, top_k=5, top_p=0.7, order="pk")
    assert ((right > 0).sum(), (wrong > 0).sum()) == (3, 5)
    assert_matches(draw(logits, top_k=5, top_p=0.7), right, wrong)


def test_all_filters_in_documented_order():
    logits, s = np.log(P10), dict(temperature=1.6, top_k=7, top_p=0.7, min_p=0.5)
    right = reference(logits, **s)
    other_orders = [reference(logits, **s, order=o) for o in ("pkm", "kmp")]  # supports 6 and 4
    assert [(q > 0).sum() for q in [right, *other_orders]] == [5, 6, 4]
    observed = draw(logits, **s)
    for wrong in other_orders:
        assert_matches(observed, right, wrong)


def test_penalised_frequencies():
    logits = np.log(P10)
    counts = np.array([2, 0, 1, 0, 0, 0, 0, 0, 3, 0])
    s = dict(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.1)
    penalised = np.array(S.penalize(mx.array(logits[None], mx.float32), S.make_settings(1, **s),
                                    mx.array(counts[None], mx.int32)))[0]
    observed = draw(logits, counts=counts, **s)
    assert_matches(observed, reference(penalised), reference(logits))


def test_top_k_then_top_p_frequencies_at_a_real_vocabulary():
    # A head of 50 above a heavy tail (2% of the mass): top-k 50 keeps the head, and top-p, on the
    # head renormalised, stops at its 16th token; top-p first would keep past the head (then top-k 50).
    rng = np.random.default_rng(8)
    logits = np.concatenate([5 - 0.04 * np.arange(50), rng.normal(1, 0.3, 49152 - 50)])
    rng.shuffle(logits)
    head = np.sort(reference(logits, top_k=50))[::-1][:50]
    top_p = float(head[:15].sum() + head[15] / 2)  # halfway through the 16th: a clear boundary
    right, wrong = reference(logits, top_k=50, top_p=top_p), reference(logits, top_k=50, top_p=top_p, order="pk")
    assert ((right > 0).sum(), (wrong > 0).sum()) == (16, 50)
    assert_matches(draw(logits, n=300, top_k=50, top_p=top_p), right, wrong)


# ---- exact supports ----


def support(logits, **settings) -> set[int]:
    masked = S.filter_logits(mx.array([logits], mx.float32), S.make_settings(1, temperature=1.0, **settings))
    return set(np.flatnonzero(np.isfinite(np.array(masked)[0])).tolist())


def test_top_k_keeps_ties_at_the_boundary():
    logits = [3.0, 2.0, 2.0, 2.0, 1.0, 0.0]
    assert support(logits, top_k=1) == {0}
    assert support(logits, top_k=2) == {0, 1, 2, 3}
    assert support(logits, top_k=4) == {0, 1, 2, 3}
    assert support(logits, top_k=5) == {0, 1, 2, 3, 4}
    assert support(logits, top_k=100) == set(range(6))


def test_top_p_support_and_ties():
    logits = np.log([0.5, 0.2, 0.2, 0.1]).tolist()
    assert support(logits, top_p=0.45) == {0}
    assert support(logits, top_p=0.6) == {0, 1, 2}  # the prefix ends inside a tie: keep the tie
    assert support(logits, top_p=0.95) == {0, 1, 2, 3}
    assert support(logits, top_p=1.0) == {0, 1, 2, 3}


def test_min_p_support_and_ties():
    logits = np.log([0.4, 0.25, 0.15, 0.15, 0.05]).tolist()
    assert support(logits, min_p=0.5) == {0, 1}  # 0.25 / 0.4 = 0.625 kept, 0.375 dropped
    assert support(logits, min_p=0.3) == {0, 1, 2, 3}
    assert support([1.0, 3.0, 3.0, 2.0], min_p=1.0) == {1, 2}  # p = p_max: ties with the max


def test_all_equal_logits_keep_everything():
    flat = [0.5] * 7
    for settings in [dict(top_k=1), dict(top_k=3), dict(top_p=0.1), dict(min_p=1.0),
                     dict(top_k=2, top_p=0.2, min_p=0.9)]:
        assert support(flat, **settings) == set(range(7)), settings
    observed = draw(flat, n=7000, top_k=1, top_p=0.1)
    assert observed.min() > 0 and chi2(observed, np.full(7, 1 / 7)) < CHI2_999[6]


def test_support_follows_the_scaled_distribution():
    # At temperature 2, p / p_max = sqrt(0.25 / 0.4) = 0.79: kept by min_p 0.7, dropped at temperature 1.
    logits = np.log([0.4, 0.25, 0.35]).tolist()
    masked = S.filter_logits(mx.array([logits, logits], mx.float32),
                             S.make_settings(2, temperature=[1.0, 2.0], min_p=0.7))
    assert np.isfinite(np.array(masked)).tolist() == [[True, False, True], [True, True, True]]


def test_filtered_logits_are_scaled():
    logits = mx.array([[1.0, 2.0, 4.0]])
    masked = S.filter_logits(logits, S.make_settings(1, temperature=2.0, top_k=2))
    assert np.array(masked).tolist() == [[-np.inf, 1.0, 2.0]]


def test_without_search_same_tokens_when_no_row_needs_it():
    rng = np.random.default_rng(6)
    logits = mx.array(rng.normal(0, 2, (6, 64)).astype(np.float32))
    counts = mx.array(rng.integers(0, 2, (6, 64)), mx.int32)
    settings = S.make_settings(6, temperature=[0.0, 0.5, 1.0, 1.0, 2.0, 0.0], min_p=[0, 0, 0.1, 0.3, 0, 0],
                               top_k=[0, 0, 0, 0, 0, 3], top_p=[1, 1, 1, 1, 1, 0.5], presence_penalty=0.5, seed=3)
    assert not S.needs_search(settings)  # the greedy row's top-k and top-p do not count
    assert S.needs_search(S.make_settings(2, temperature=1.0, top_k=[0, 3])) == S.Search.TOP_K
    assert S.needs_search(S.make_settings(2, temperature=[0.0, 1.0], top_p=0.9)) == S.Search.TOP_P
    for t in range(10):
        step = mx.full((6,), t, mx.int32)
        assert S.sample(logits, settings, step, counts, search=S.Search.NONE).tolist() == \
            S.sample(logits, settings, step, counts).tolist()
    sampled = S.Settings(*(a[1:5] for a in settings))
    assert np.array_equal(np.array(S.filter_logits(logits[1:5], sampled, search=S.Search.NONE)),
                          np.array(S.filter_logits(logits[1:5], sampled)))


def test_any_search_is_the_union():
    assert S.any_search([S.Search.TOP_K, S.Search.NONE, S.Search.TOP_P]) == S.Search.ALL
    assert S.any_search([S.Search.TOP_P, S.Search.TOP_P]) == S.Search.TOP_P
    assert S.any_search([]) == S.Search.NONE


# ---- the threshold search against a sort, at real vocabulary sizes ----


def kept_by_sort(x: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """x (V,) scaled logits -> the (V,) support of top-k then top-p, by a float64 sort of the
    documented definitions, and how far top_p is from the mass on either side of its boundary."""
    x = np.asarray(x, np.float64)
    keep = np.ones(x.shape, bool)
    if top_k:
        keep &= x >= np.sort(x)[::-1][min(top_k, x.size) - 1]
    room = np.inf
    if top_p < 1:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        p /= p.sum()
        cumulative = np.cumsum(np.sort(p[keep])[::-1])
        last = np.sort(x[keep])[::-1][int(np.argmax(cumulative >= top_p))]  # the prefix reaching top_p ends here
        keep &= x >= last
        above = p[x > last].sum()
        room = min(p[x >= last].sum() - top_p, top_p - above if above else np.inf)
    return keep, room


def boundary_rows(vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """(9, V) float32 logits and their settings: ties at the top-k and top-p boundaries, top_k 1, V and
    beyond, top_p near 0 and 1, rows with a filter off, a greedy row."""
    smooth = rng.normal(0, 5, vocab)
    grid = np.round(rng.normal(0, 6, vocab)) / 4  # quarter steps: hundreds of ties at each boundary
    tied_kth = rng.normal(0, 2, vocab)
    order = np.argsort(-tied_kth)
    tied_kth[order[35:45]] = tied_kth[order[39]]  # the 36th to 45th largest tie with the 40th
    two_max = rng.normal(0, 1, vocab)
    two_max[[7, vocab - 1]] = two_max.max() + 1
    # A head, then a plateau at -3 and one at -9 holding under 0.1% of the mass: top-p 0.999 ends in -3.
    half = vocab - vocab // 2
    plateaus = np.concatenate([rng.normal(2, 1, 1000), np.full(vocab - half - 1000, -3.0), np.full(half, -9.0)])
    rng.shuffle(plateaus)
    logits = np.stack([smooth, grid, tied_kth, two_max, plateaus, smooth, grid, rng.normal(0, 4, vocab), grid])
    settings = dict(temperature=[0.7, 1.0, 1.3, 1.0, 1.0, 0.5, 1.3, 1.1, 0.0],
                    top_k=[50, 1000, 40, 1, vocab, 10**9, 0, 0, 3],
                    top_p=[0.9, 0.6, 1.0, 0.5, 0.999, 1e-6, 1.0, 0.7, 0.8])
    return logits.astype(np.float32), settings


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_search_keeps_what_a_sort_keeps(vocab):
    logits, kw = boundary_rows(vocab, np.random.default_rng(vocab))
    settings = S.make_settings(len(logits), **kw)
    kept = np.isfinite(np.array(S.filter_logits(mx.array(logits), settings)))  # (B, V)
    sizes = []
    for i, (t, k, p) in enumerate(zip(kw["temperature"], kw["top_k"], kw["top_p"])):
        x = logits[i] / np.float32(t) if t > 0 else logits[i]  # float32, as the sampler scales
        expected, room = kept_by_sort(x, k, p)
        assert room > 1e-4, f"row {i}: the data leaves float32 sums no room"
        assert np.array_equal(kept[i], expected), f"row {i}"
        sizes.append(int(expected.sum()))
    half = vocab - vocab // 2
    assert sizes[2:7] == [45, 2, vocab - half, 1, vocab]  # ties kept; top-p 0.999 stops above -9
    assert sizes[0] < 50 and sizes[1] < 1000 and 1 < sizes[7] < vocab  # top-p binds: after top-k, alone


def test_each_search_alone_equals_both():
    logits, kw = boundary_rows(4096, np.random.default_rng(9))
    x = mx.array(logits)
    only_k = S.make_settings(len(logits), temperature=kw["temperature"], top_k=kw["top_k"])
    only_p = S.make_settings(len(logits), temperature=kw["temperature"], top_p=kw["top_p"])
    for settings, search in [(only_k, S.Search.TOP_K), (only_p, S.Search.TOP_P)]:
        assert S.needs_search(settings) == search
        assert np.array_equal(np.array(S.filter_logits(x, settings, search=search)),
                              np.array(S.filter_logits(x, settings)))


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_top_logprobs_equal_a_sort(vocab):
    logits, _ = boundary_rows(vocab, np.random.default_rng(vocab + 1))
    logp = S.logprobs(mx.array(logits))
    lp = np.array(logp)  # (B, V)
    by_value_then_id = np.lexsort((np.broadcast_to(np.arange(vocab), lp.shape), -lp), axis=-1)  # (B, V)
    for n in (1, 7, 20):
        ids, values = S.top_logprobs(logp, n)
        assert ids.shape == values.shape == (len(logits), n) and ids.dtype == mx.int32
        assert np.array_equal(np.array(ids), by_value_then_id[:, :n]), n
        assert np.array_equal(np.array(values), np.take_along_axis(lp, by_value_then_id[:, :n], -1))
    ids, _ = S.top_logprobs(logp, 1)
    assert np.array(ids)[3, 0] == 7  # two equal maxima: the lower id


def test_top_logprobs_ties_and_whole_vocabulary():
    logp = mx.array([[0.5] * 7, [1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    ids, values = S.top_logprobs(logp, 3)
    assert ids.tolist() == [[0, 1, 2], [1, 3, 2]] and values.tolist() == [[0.5] * 3, [3.0, 3.0, 2.0]]
    ids, _ = S.top_logprobs(logp, 7)
    assert ids.tolist() == [list(range(7)), [1, 3, 2, 4, 5, 0, 6]]


def test_no_sort_in_the_sampling_graph(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a sort in the sampling graph")

    for name in ("sort", "argsort", "argpartition", "partition", "topk"):
        monkeypatch.setattr(mx, name, refuse)

    def step(logits, settings, steps):
        ids, values = S.top_logprobs(S.logprobs(logits), 5)
        return S.sample(logits, settings, steps), ids, values

    logits = mx.array(np.random.default_rng(10).normal(0, 2, (3, 1000)).astype(np.float32))
    settings = S.make_settings(3, temperature=1.0, top_k=[0, 20, 50], top_p=[0.9, 1.0, 0.5], min_p=0.01)
    assert S.needs_search(settings) == S.Search.ALL
    mx.eval(mx.compile(step)(logits, settings, mx.zeros((3,), mx.int32)))


# ---- greedy ----


def test_top_k_one_and_temperature_zero_equal_greedy():
    logits = mx.array(np.random.default_rng(2).normal(0, 3, (64, 100)).astype(np.float32))
    expected = np.argmax(np.array(logits), axis=-1)
    step = mx.arange(64, dtype=mx.int32)
    seeds = list(range(64))
    top1 = S.sample(logits, S.make_settings(64, temperature=1.5, top_k=1, seed=seeds), step)
    zero = S.sample(logits, S.make_settings(64, temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=seeds), step)
    assert np.array_equal(np.array(top1), expected)
    assert np.array_equal(np.array(zero), expected)
    assert np.array_equal(np.array(S.greedy(logits)), expected)
    assert S.greedy(logits).dtype == mx.int32 and top1.dtype == mx.int32


def test_tiny_temperature_stays_finite():
    logits = mx.array(np.random.default_rng(7).normal(0, 3, (8, 100)).astype(np.float32))
    s = S.make_settings(8, temperature=1e-30, top_p=0.9, min_p=0.1, top_k=[0, 5] * 4)
    assert np.isfinite(np.array(S.filter_logits(logits, s))).sum(-1).tolist() == [1] * 8
    assert S.sample(logits, s, mx.zeros((8,), mx.int32)).tolist() == S.greedy(logits).tolist()


def test_greedy_row_uses_penalised_logits():
    logits = mx.array([[2.0, 1.9, 0.0]])
    counts = mx.array([[1, 0, 0]], mx.int32)
    s = S.make_settings(1, temperature=0.0, repetition_penalty=2.0)
    assert S.sample(logits, s, mx.array([0], mx.int32), counts).tolist() == [1]


# ---- per-row independence and seeds ----


def take(settings: S.Settings, rows) -> S.Settings:
    idx = mx.array(rows)
    return S.Settings(*(a[idx] for a in settings))


def test_row_alone_equals_row_in_any_batch():
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(0, 2, (5, 64)).astype(np.float32))  # (5, V)
    counts = mx.array(rng.integers(0, 3, (5, 64)), mx.int32)
    settings = S.make_settings(5, temperature=[0.0, 1.0, 0.8, 1.2, 1.0], top_k=[0, 5, 0, 0, 0],
                               top_p=[1.0, 1.0, 0.9, 1.0, 0.95], min_p=[0.0, 0.0, 0.0, 0.05, 0.0],
                               repetition_penalty=[1.0, 1.0, 1.0, 1.3, 1.0],
                               presence_penalty=[0.0, 0.5, 0.0, 0.0, 0.2], frequency_penalty=[0, 0, 0.1, 0, 0.2],
                               seed=[7, 7, 8, 9, 10])
    for t in range(20):
        step = mx.array([t, t + 3, t, 2 * t, t + 1], mx.int32)
        alone = [S.sample(logits[i:i + 1], take(settings, [i]), step[i:i + 1], counts[i:i + 1]).item()
                 for i in range(5)]
        whole = S.sample(logits, settings, step, counts).tolist()
        order = [3, 1, 4, 0, 2]
        shuffled = S.sample(logits[mx.array(order)], take(settings, order), step[mx.array(order)],
                            counts[mx.array(order)]).tolist()
        assert whole == alone
        assert shuffled == [alone[i] for i in order]


def test_same_seed_and_step_repeat_different_seeds_differ():
    logits = mx.zeros((64, 1000))  # uniform over 1000 tokens
    step = mx.zeros((64,), mx.int32)
    same = S.make_settings(64, temperature=1.0, seed=42)
    first = np.array(S.sample(logits, same, step))
    assert len(set(first.tolist())) == 1  # every row: same seed, same step, same logits
    assert np.array_equal(first, np.array(S.sample(logits, same, step)))
    by_seed = np.array(S.sample(logits, S.make_settings(64, temperature=1.0, seed=list(range(64))), step))
    by_step = np.array(S.sample(logits, same, mx.arange(64, dtype=mx.int32)))
    assert len(set(by_seed.tolist())) > 55 and len(set(by_step.tolist())) > 55


def test_uniform_bits():
    u = np.array(S.uniform(mx.array([1, 2], mx.uint32), mx.array([0, 5], mx.int32), 1 << 18))  # (2, V)
    assert u.dtype == np.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.002 and abs(u.var() - 1 / 12) < 0.001
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.01
    # Seed and step do not trade off: (s, t + 1), (s + 1, t) and (t, s) are unrelated streams.
    pairs = mx.array([1, 2, 0, 5, 7], mx.uint32), mx.array([1, 0, 5, 0, 7], mx.int32)
    streams = np.array(S.uniform(*pairs, 64))  # (5, 64)
    assert len({row.tobytes() for row in streams}) == 5 and (streams[0] != streams[1]).all()
    # uint32 products wrap in MLX as in numpy: the mixer matches a numpy lowbias32.
    x = np.array([0, 1, 2**31, 2**32 - 1, 123456789], np.uint32)
    y = x ^ (x >> 16)
    y = y * np.uint32(0x7FEB352D)
    y = y ^ (y >> 15)
    y = y * np.uint32(0x846CA68B)
    y = y ^ (y >> 16)
    assert np.array_equal(np.array(S._mix(mx.array(x))), y)


# ---- penalties, counts, log-probabilities ----


def test_penalties_exact():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5]])
    counts = mx.array([[1, 1, 0, 3]], mx.int32)

    def pen(**s):
        return np.array(S.penalize(logits, S.make_settings(1, **s), counts))[0].tolist()

    assert pen(repetition_penalty=2.0) == [1.0, -4.0, 1.0, 0.25]
    assert pen(presence_penalty=0.5) == [1.5, -2.5, 1.0, 0.0]
    assert pen(frequency_penalty=0.25) == [1.75, -2.25, 1.0, -0.25]
    assert pen(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25) == [0.25, -4.75, 1.0, -1.0]
    assert pen() == [2.0, -2.0, 1.0, 0.5]


def test_repetition_penalty_in_the_filtered_logits():
    # Penalty 2 halves a seen positive logit: softmax([1, 1]) -> softmax([0.5, 1]).
    logits = mx.array([[1.0, 1.0]])
    s = S.make_settings(1, temperature=1.0, repetition_penalty=2.0)
    x = S.filter_logits(S.penalize(logits, s, mx.array([[1, 0]], mx.int32)), s)
    assert np.array(x).tolist() == [[0.5, 1.0]]


def test_update_counts():
    counts = S.update_counts(mx.zeros((2, 4), mx.int32), mx.array([1, 3], mx.int32))
    counts = S.update_counts(counts, mx.array([1, 0], mx.int32))
    assert counts.tolist() == [[0, 2, 0, 0], [1, 0, 0, 1]] and counts.dtype == mx.int32


def test_logprobs():
    raw = np.random.default_rng(4).normal(0, 2, (3, 20)).astype(np.float32)
    logp = S.logprobs(mx.array(raw).astype(mx.bfloat16))
    assert logp.dtype == mx.float32
    assert np.allclose(np.exp(np.array(logp)).sum(-1), 1, atol=1e-5)
    logp = S.logprobs(mx.array(raw))
    ids, values = S.top_logprobs(logp, 4)
    expected = np.argsort(-raw, axis=-1)[:, :4]
    assert np.array_equal(np.array(ids), expected) and ids.dtype == mx.int32
    assert np.allclose(np.array(values), np.take_along_axis(np.array(logp), expected, -1))
    tokens = mx.array([0, 5, 19], mx.int32)
    assert np.allclose(np.array(S.chosen_logprob(logp, tokens)), np.array(logp)[[0, 1, 2], [0, 5, 19]])


# ---- compilation ----


def test_compiled_sample_traces_once():
    traces = []

    def step_fn(logits, settings, step, counts):
        traces.append(1)
        return S.sample(logits, settings, step, counts)

    compiled = mx.compile(step_fn)
    rng = np.random.default_rng(5)
    logits = mx.array(rng.normal(0, 2, (4, 32)).astype(np.float32))
    counts = mx.array(rng.integers(0, 2, (4, 32)), mx.int32)
    for i, (t, p, m, k) in enumerate([(0.0, 1.0, 0.0, 0), (1.0, 0.9, 0.1, 5), ([0.5, 0, 2, 1], 0.5, 0.3, [0, 1, 2, 3]),
                                      (1.3, [1, 0.2, 0.7, 0.99], [0, 0, 1, 0.5], 40)]):
        settings = S.make_settings(4, temperature=t, top_p=p, min_p=m, top_k=k, repetition_penalty=1.0 + i / 4,
                                   seed=[i, 1, 2, 3])
        step = mx.full((4,), i, mx.int32)
        assert compiled(logits, settings, step, counts).tolist() == S.sample(logits, settings, step, counts).tolist()
    assert len(traces) == 1


# ---- settings ----


@pytest.mark.parametrize("name, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", None), ("min_p", -0.1), ("min_p", 1.1), ("top_k", -1),
    ("top_k", 2.5), ("top_k", True), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", float("nan")), ("frequency_penalty", "a lot"), ("seed", -1), ("seed", 2**32),
    ("seed", 1.5), ("temperature", [0.5, -1.0, 0.5, 0.5]),
])
def test_invalid_settings_are_named(name, value):
    with pytest.raises(InputError, match=name) as err:
        S.make_settings(4, **{name: value})
    bad = value[1] if isinstance(value, list) else value
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "top_k", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty", "seed"])
def test_list_length_checked(name):
    with pytest.raises(InputError, match=f"{name} has 3 values for 4 prompts"):
        S.make_settings(4, **{name: [1, 1, 1]})


def test_settings_shapes_and_host_helpers():
    s = S.make_settings(3, temperature=[0.0, 0.5, 1.0], top_k=[0, 1, 10**12], seed=[1, 2, 2**32 - 1])
    assert all(a.shape == (3,) for a in s)
    assert [a.dtype for a in s] == [mx.float32, mx.float32, mx.int32, mx.float32, mx.float32, mx.float32,
                                    mx.float32, mx.uint32]
    assert S.seeds(s) == [1, 2, 2**32 - 1]
    assert not S.all_greedy(s) and not S.needs_counts(s)
    assert S.all_greedy(S.make_settings(2)) and not S.all_greedy(S.make_settings(2, presence_penalty=0.1))
    assert S.needs_counts(S.make_settings(2, repetition_penalty=[1.0, 1.1]))
    fresh = [S.seeds(S.make_settings(4)) for _ in range(2)]
    assert fresh[0] != fresh[1] and all(0 <= x < 2**32 for x in fresh[0] + fresh[1])
    assert S.seeds(S.make_settings(3, seed=5)) == [5, 5, 5]
    with pytest.raises(InputError, match="batch"):
        S.make_settings(0)


@pytest.mark.parametrize("vocab", [97, 49152])
def test_the_sorted_cut_a_gpu_takes_keeps_what_the_search_keeps(vocab):
    """On a GPU the cuts come from one sort (`_sorted_threshold`, measured faster there): the same
    kept sets as the search, ties at the boundaries included."""
    rows = 6
    x = mx.round(mx.random.normal((rows, vocab), key=mx.random.key(vocab)) * 8) / 4  # (B, V) many ties
    settings = S.make_settings(rows, temperature=1.0, top_k=[0, 1, 5, 40, vocab + 3, 7],
                               top_p=[0.9, 1.0, 0.5, 0.95, 0.3, 1e-6], seed=0)
    top = mx.max(x, axis=-1, keepdims=True)
    for search in (S.Search.TOP_K, S.Search.TOP_P, S.Search.ALL):
        by_min_p = top + mx.log(settings.min_p[:, None])
        sorted_cut = mx.maximum(S._sorted_threshold(x, settings, search, top), by_min_p)
        kept_sorted = np.array(x >= sorted_cut)
        kept_search = np.array(x >= S._threshold(x, settings, search))
        assert (kept_sorted == kept_search).all(), search
        assert kept_search.sum(axis=1).min() >= 1
