"""Batched sampling over (B, V) logits, every row with its own settings and seed.

All settings are (B,) arrays, so a compiled step that calls `sample` is traced once whatever
their values. One call applies, in this order:

0. the token mask, when given (structured output): a (B, ceil(V/32)) uint32 bitmask, bit j of word
   w allowing token 32w + j; a masked-out token gets -inf before anything else, so every filter
   and the greedy argmax see only the allowed tokens, and the sample is the model's distribution
   restricted to them and renormalised;
1. penalties, over the row's *generated* tokens only (`counts`, prompt excluded, as OpenAI's
   presence / frequency penalties): repetition divides a seen token's positive logit by
   `repetition_penalty` and multiplies a negative one; presence subtracts `presence_penalty`
   once if seen; frequency subtracts `frequency_penalty * count`;
2. temperature: a row with temperature 0 is greedy (argmax of the penalised logits), whatever
   its other settings; the other rows divide their logits by it;
3. top-k: keep every token whose logit is >= the k-th largest (ties at the boundary kept);
4. top-p, on the distribution renormalised after top-k: keep the smallest prefix of the sorted
   distribution whose mass reaches top_p (cumulative >= top_p), and every token tied with its
   smallest probability; that is, keep logit >= v for the largest logit v such that the tokens
   with logit >= v hold at least top_p of the mass;
5. min-p: keep p >= min_p * p_max (in log space: logit >= max logit + log(min_p)); the ratio
   to the max is the same before or after renormalisation;
6. Gumbel-max: the argmax of the kept logits plus Gumbel noise, an exact categorical sample.

Each filter is a threshold on the temperature-scaled logit, so the kept set is
`logit >= max(thresholds)`. Top-k and top-p find theirs without a sort (a sort over a large
vocabulary is slow on some backends, and compiles for long on first use): each bisects the
float32 values through their order-preserving uint32 keys, 32 halvings of one (B, V) compare and
sum each (an integer count for top-k, a float32 probability mass for top-p, as the cumulative
sum of a sort was), so about 32 (B, V) reductions per filter used, exact whatever the settings.
A step runs only the searches some row needs (`needs_search`); `top_logprobs` finds its n-th
largest value the same way.

The noise is a counter-based hash of (seed, step, token id), no global random state: a row's
tokens depend on its logits, settings, seed and step only, never on its neighbours, its place in
the batch or the batch size.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import operator
import secrets
from typing import Callable, Iterable, NamedTuple

import mlx.core as mx
import numpy as np

from mlxfun.errors import InputError


class Settings(NamedTuple):
    """Per-row sampling settings, each (B,): MLX arrays for the sampling functions
    (`make_settings`), NumPy arrays in a Request (`host_settings`); both validate."""

    temperature: mx.array  # (B,) float32, 0 = greedy
    top_p: mx.array  # (B,) float32 in (0, 1], 1 = off
    top_k: mx.array  # (B,) int32, 0 = off
    min_p: mx.array  # (B,) float32 in [0, 1], 0 = off
    repetition_penalty: mx.array  # (B,) float32 > 0, 1 = off
    presence_penalty: mx.array  # (B,) float32, 0 = off
    frequency_penalty: mx.array  # (B,) float32, 0 = off
    seed: mx.array  # (B,) uint32


# ---- settings, on the host ----


def per_row(name: str, value, batch: int) -> list:
    """`value` for each of `batch` rows: a list must have exactly one entry per row."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise InputError(f"{name} has {len(value)} values for {batch} prompts")
        return list(value)
    return [value] * batch


def _check(name: str, values: list, ok, expected: str, integer: bool = False) -> list:
    for v in values:
        if not _number(v, integer) or not ok(v):
            raise InputError(f"{name} must be {expected}, got {v!r}")
    return values


def _number(v, integer: bool) -> bool:
    """A real number (an integer if asked), finite, and not a bool."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral if integer else numbers.Real):
        return False
    try:
        return integer or math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def make_settings(batch: int, *, temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, seed=None) -> Settings:
    """Settings for `batch` rows. Each argument is one value for every row or a list with one
    value per row. `seed`: an int gives every row that seed (so a prompt samples the same
    alone or in any batch); a list gives one per row; None draws a fresh seed per row, readable
    from `seeds(settings)` so the run can be repeated."""
    return on_device(host_settings(
        batch, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed))


def host_settings(batch: int, *, temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, seed=None) -> Settings:
    """`make_settings` as NumPy arrays: what a Request carries. A server's HTTP process builds its
    requests with these and never touches the device (on CUDA an MLX array there would open a
    second context on the engine's GPU)."""
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise InputError(f"batch must be a positive integer, got {batch!r}")

    def floats(name, value, ok, expected):
        return np.array(_check(name, per_row(name, value, batch), ok, expected), np.float32)

    if seed is None:
        seed = [secrets.randbits(32) for _ in range(batch)]
    seeds_ = _check("seed", per_row("seed", seed, batch), lambda v: 0 <= v < 2**32,
                    "an integer in [0, 2**32)", integer=True)
    top_k_ = _check("top_k", per_row("top_k", top_k, batch), lambda v: v >= 0,
                    "a non-negative integer (0 = off)", integer=True)
    return Settings(
        temperature=floats("temperature", temperature, lambda v: v >= 0, "a non-negative number"),
        top_p=floats("top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=np.array([min(int(k), 2**31 - 1) for k in top_k_], np.int32),
        min_p=floats("min_p", min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=floats("repetition_penalty", repetition_penalty, lambda v: v > 0,
                                  "a positive number (1 = off)"),
        presence_penalty=floats("presence_penalty", presence_penalty, lambda v: True, "a finite number"),
        frequency_penalty=floats("frequency_penalty", frequency_penalty, lambda v: True, "a finite number"),
        seed=np.array([int(s) for s in seeds_], np.uint32),
    )


def on_host(settings: Settings) -> Settings:
    """Settings as NumPy arrays (MLX ones are evaluated on the calling thread)."""
    return Settings(*(np.asarray(f) for f in settings))


def on_device(settings: Settings) -> Settings:
    """Settings as MLX arrays copied from host memory: no graph, so any thread's stream may use them."""
    return Settings(*(mx.array(np.asarray(f)) for f in settings))


def row(settings: Settings, i: int) -> Settings:
    """Row i of `settings`, as one row's Settings."""
    return Settings(*(f[i:i + 1] for f in settings))


def seeds(settings: Settings) -> list[int]:
    """The per-row seeds, to report with a result."""
    return [int(s) for s in np.array(settings.seed)]


def needs_counts(settings: Settings) -> bool:
    """Host-side, once per generation: whether any row has a penalty, so needs `counts`."""
    return bool(np.any(np.array(settings.repetition_penalty) != 1)
                or np.any(np.array(settings.presence_penalty) != 0)
                or np.any(np.array(settings.frequency_penalty) != 0))


class Search(enum.IntFlag):
    """The threshold searches a sampling step runs: a static choice, each its own compiled graph."""

    NONE = 0
    TOP_K = 1
    TOP_P = 2
    ALL = 3


def needs_search(settings: Settings) -> Search:
    """Host-side, once per generation: the searches some sampled row uses (greedy rows need none)."""
    sampled = np.array(settings.temperature) > 0
    top_k = bool(np.any(sampled & (np.array(settings.top_k) > 0)))
    top_p = bool(np.any(sampled & (np.array(settings.top_p) < 1)))
    return (Search.TOP_K if top_k else Search.NONE) | (Search.TOP_P if top_p else Search.NONE)


def any_search(searches: Iterable[Search]) -> Search:
    """The searches that any of several requests needs, for a step that serves them all."""
    return functools.reduce(operator.or_, searches, Search.NONE)


def all_greedy(settings: Settings) -> bool:
    """Host-side, once per generation: every row greedy and unpenalised, so `greedy(logits)`
    gives the same tokens as `sample` and the fast path may be used."""
    return bool(np.all(np.array(settings.temperature) == 0)) and not needs_counts(settings)


# ---- counter-based random numbers ----


def _mix(x: mx.array) -> mx.array:
    """lowbias32 (Chris Wellons): a bijective uint32 mixer with good avalanche; multiplies wrap."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def uniform(seed: mx.array, step: mx.array, vocab: int) -> mx.array:
    """seed (B,) uint32, step (B,) -> (B, V) float32 in (0, 1), a function of
    (seed[b], step[b], token id) alone. 23 random bits, centred: (m + 0.5) / 2**23."""
    key = _mix(_mix(seed.astype(mx.uint32)) ^ step.astype(mx.uint32))  # (B,)
    token = _mix(mx.arange(vocab, dtype=mx.uint32) * 0x9E3779B9)  # (V,)
    bits = _mix(_mix(key[:, None] ^ token[None, :]))  # (B, V)
    return ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / 2**23)  # (B, V)


def gumbel(seed: mx.array, step: mx.array, vocab: int) -> mx.array:
    """(B, V) standard Gumbel noise, -log(-log(u))."""
    return -mx.log(-mx.log(uniform(seed, step, vocab)))


# ---- the sampling step: pure array ops over (B, V) ----


def penalize(logits: mx.array, settings: Settings, counts: mx.array) -> mx.array:
    """logits (B, V), counts (B, V) int32 of each token in the row's generated history -> (B, V)."""
    seen = counts > 0  # (B, V)
    rep = settings.repetition_penalty[:, None]  # (B, 1)
    x = mx.where(seen, mx.where(logits > 0, logits / rep, logits * rep), logits)  # (B, V)
    x = x - settings.presence_penalty[:, None] * seen.astype(mx.float32)  # (B, V)
    return x - settings.frequency_penalty[:, None] * counts.astype(mx.float32)  # (B, V)


def _scale(logits: mx.array, temperature: mx.array) -> mx.array:
    """(B, V) logits / temperature; rows with temperature 0 are left as they are. Temperatures
    below 1e-6 act as 1e-6 (already greedy in effect), so no logit overflows to inf."""
    t = mx.where(temperature > 0, mx.maximum(temperature, 1e-6), 1.0)  # (B,)
    return logits / t[:, None]  # (B, V)


# ---- exact thresholds by bisection over the float32 order ----

# The key of -inf: no key of a number is below it (only NaNs'), so it starts every search.
# On a GPU, top-k and top-p take their cuts from a sort (`_sorted_threshold`), measured faster there
# than the search of MLX ops; the search serves the CPU (0.89x the sort's time at 32 rows, 49K).
SEARCH_ON_GPU = False

_LOWEST = 0x007FFFFF


def _key(x: mx.array) -> mx.array:
    """float32 -> uint32 in the same order (-0 just below +0): sign bit set for the non-negative,
    every bit flipped for the negative."""
    b = x.view(mx.uint32)
    return mx.where(b >= 0x80000000, ~b, b | 0x80000000)


def _value(key: mx.array) -> mx.array:
    """The inverse of `_key`: uint32 -> float32."""
    return mx.where(key >= 0x80000000, key & 0x7FFFFFFF, ~key).view(mx.float32)


def _largest(lo: mx.array, hi: mx.array, ok: Callable[[mx.array], mx.array]) -> mx.array:
    """The largest key t in [lo, hi] (B, 1) uint32 with ok(t), for ok true at lo and true up to
    some key, false above it. 32 halvings narrow any uint32 range to one key; the count is fixed
    (one graph for every setting), so a narrower start would save no pass."""
    for _ in range(32):
        d = hi - lo  # (B, 1)
        mid = lo + (d >> 1) + (d & 1)  # (B, 1) the upper middle, so lo moves even when d = 1; no overflow
        good = (d == 0) | ok(mid)  # (B, 1) a found key stays found, even were ok(lo) to round false
        lo = mx.where(good, mid, lo)  # (B, 1)
        hi = mx.where(good, hi, mid - 1)  # (B, 1)
    return lo


def _nth_largest(x: mx.array, n: mx.array) -> mx.array:
    """x (B, V) float32, n (B, 1) int32 in [1, V] -> (B, 1) uint32: the key of the n-th largest value,
    the largest t with count(x >= t) >= n."""
    lo = mx.full(n.shape, _LOWEST, mx.uint32)  # (B, 1): count(x >= -inf) = V >= n
    hi = _key(mx.max(x, axis=-1, keepdims=True))  # (B, 1)
    return _largest(lo, hi, lambda t: mx.sum(x >= _value(t), axis=-1, keepdims=True) >= n)


def _top_k(x: mx.array, top_k: mx.array) -> mx.array:
    """x (B, V) -> (B, 1) uint32: the key of the k-th largest logit (of the smallest, k = 0 or > V)."""
    vocab = x.shape[-1]
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab)  # (B,)
    return _nth_largest(x, k[:, None])


def _top_p(x: mx.array, top: mx.array, top_p: mx.array, floor: mx.array) -> mx.array:
    """x (B, V), its max top (B, 1), top_p (B,), floor (B, 1) uint32 (the key of top-k's cut, or of
    -inf) -> (B, 1) uint32: the largest t >= floor with mass(x >= t) >= top_p * mass(x >= floor), the
    smallest logit of the sorted prefix reaching top_p of the distribution renormalised after top-k."""
    e = mx.exp(x - top)  # (B, V) unnormalised probabilities

    def mass(t: mx.array) -> mx.array:
        return mx.sum(mx.where(x >= _value(t), e, 0.0), axis=-1, keepdims=True)  # (B, 1)

    # The same `mass` at floor on both sides, so ok(floor) holds exactly (top_p <= 1).
    target = top_p[:, None] * mass(floor)  # (B, 1)
    return _largest(floor, _key(top), lambda t: mass(t) >= target)


def _sorted_threshold(x: mx.array, settings: Settings, search: Search, top: mx.array) -> mx.array:
    """`_threshold`'s top-k and top-p cuts (B, 1) from one sort of x (B, V): the same kept sets.
    On CUDA the sort is one library kernel, where each of the search's 64 passes is a launch:
    at 128 rows of a 128K vocabulary (H200) 1.9 ms against 5.8 for the search."""
    vocab, off = x.shape[-1], mx.array(-mx.inf, mx.float32)
    desc = -mx.sort(-x, axis=-1)  # (B, V) descending
    by_k = off
    if search & Search.TOP_K:
        k = mx.clip(settings.top_k, 1, vocab) - 1  # (B,)
        kth = mx.take_along_axis(desc, k[:, None], axis=-1)  # (B, 1)
        by_k = mx.where(settings.top_k[:, None] > 0, kth, off)  # (B, 1)
    if not search & Search.TOP_P:
        return by_k
    probs = mx.softmax(mx.where(desc >= by_k, desc - top, -mx.inf), axis=-1)  # (B, V) renormalised after top-k
    before = mx.cumsum(probs, axis=-1, inclusive=False)  # (B, V) mass strictly before each
    n = mx.sum(before < settings.top_p[:, None], axis=-1)  # (B,) >= 1: the prefix reaching top_p
    last = mx.take_along_axis(desc, (n - 1)[:, None].astype(mx.int32), axis=-1)  # (B, 1)
    return mx.maximum(by_k, mx.where(settings.top_p[:, None] < 1, last, off))  # (B, 1)


def _threshold(x: mx.array, settings: Settings, search: Search) -> mx.array:
    """x (B, V) scaled logits -> (B, 1): the smallest logit kept by top-k, top-p and min-p."""
    top = mx.max(x, axis=-1, keepdims=True)  # (B, 1)
    by_min_p = top + mx.log(settings.min_p[:, None])  # (B, 1), -inf when min_p = 0
    if search and mx.default_device() == mx.gpu and not SEARCH_ON_GPU:
        return mx.maximum(_sorted_threshold(x, settings, search, top), by_min_p)  # (B, 1)
    off = mx.array(-mx.inf, mx.float32)
    by_k = by_p = off
    floor = mx.full(top.shape, _LOWEST, mx.uint32)  # (B, 1) top-p's search starts at top-k's cut
    if search & Search.TOP_K:
        floor = _top_k(x, settings.top_k)  # (B, 1)
        by_k = mx.where(settings.top_k[:, None] > 0, _value(floor), off)  # (B, 1)
    if search & Search.TOP_P:
        by_p = mx.where(settings.top_p[:, None] < 1, _value(_top_p(x, top, settings.top_p, floor)), off)  # (B, 1)
    return mx.maximum(mx.maximum(by_k, by_p), by_min_p)  # (B, 1)


def filter_logits(logits: mx.array, settings: Settings, *, search: Search = Search.ALL) -> mx.array:
    """(B, V) temperature-scaled logits, -inf outside the kept support (steps 2-5; no penalties).
    Rows with temperature 0 are filtered unscaled; `sample` takes their argmax instead.
    `search` may leave out top-k or top-p only where no row uses it (see `needs_search`)."""
    x = _scale(logits, settings.temperature)  # (B, V)
    return mx.where(x >= _threshold(x, settings, search), x, -mx.inf)  # (B, V)


def unpack_mask(mask: mx.array, vocab: int) -> mx.array:
    """mask (B, W) uint32, W = ceil(V/32), bit j of word w for token 32w + j -> (B, V) bool."""
    shifts = mx.arange(32, dtype=mx.uint32)  # (32,)
    bits = (mask[:, :, None] >> shifts) & 1  # (B, W, 32)
    return bits.reshape(mask.shape[0], -1)[:, :vocab] != 0  # (B, V)


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    """logits (B, V), mask (B, W) uint32 -> (B, V): -inf wherever the mask does not allow the token."""
    return mx.where(unpack_mask(mask, logits.shape[-1]), logits, -mx.inf)  # (B, V)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """Host side: allowed (B, V) bool -> (B, ceil(V/32)) uint32, the layout `unpack_mask` reads."""
    b, v = allowed.shape
    padded = np.zeros((b, -(-v // 32) * 32), np.uint8)  # (B, 32W)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view("<u4").astype(np.uint32)  # (B, W)


def greedy(logits: mx.array) -> mx.array:
    """(B, V) -> (B,) int32: the most likely token (the first, in a tie)."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def sample(logits: mx.array, settings: Settings, step: mx.array, counts: mx.array | None = None, *,
           search: Search = Search.ALL, mask: mx.array | None = None) -> mx.array:
    """logits (B, V), step (B,) int32 (the row's own token counter, so its noise is fresh each
    step), counts (B, V) int32 or None for no penalties, mask (B, W) uint32 or None -> tokens (B,) int32.

    `counts` and `search` are static choices, made once per generation with `needs_counts` and
    `needs_search`: leaving out what no row uses saves a (B, V) pass, or a search's 32 (most of the cost).
    Every row of a `mask` must allow at least one token."""
    x = logits.astype(mx.float32)  # (B, V)
    if mask is not None:
        x = apply_mask(x, mask)  # (B, V)
    if counts is not None:
        x = penalize(x, settings, counts)  # (B, V)
    noisy = filter_logits(x, settings, search=search) + gumbel(settings.seed, step, x.shape[-1])  # (B, V)
    return mx.where(settings.temperature > 0, greedy(noisy), greedy(x))  # (B,)


def update_counts(counts: mx.array, tokens: mx.array) -> mx.array:
    """counts (B, V) int32 plus one for each row's new token, tokens (B,)."""
    hit = mx.arange(counts.shape[-1], dtype=mx.int32)[None, :] == tokens[:, None]  # (B, V)
    return counts + hit.astype(counts.dtype)  # (B, V)


# ---- log-probabilities, of the raw model distribution (before penalties and temperature) ----


def logprobs(logits: mx.array) -> mx.array:
    """(B, V) -> (B, V) float32 log-softmax of the model's logits, before penalties, temperature
    and filters: the model's own distribution, as research and RL use needs."""
    x = logits.astype(mx.float32)  # (B, V)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)  # (B, V)


def top_logprobs(logp: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """logp (B, V), 1 <= n <= V -> ids (B, n) int32 and values (B, n), most likely first, the lower
    id first among equal values. No sort: the n-th largest by bisection, then a gather of n."""
    vocab = logp.shape[-1]
    nth = _value(_nth_largest(logp, mx.full((logp.shape[0], 1), n, mx.int32)))  # (B, 1)
    above = logp > nth  # (B, V) fewer than n
    tied = logp == nth  # (B, V) with `above`, at least n: keep the first few in id order
    room = n - mx.sum(above, axis=-1, keepdims=True)  # (B, 1) >= 1
    chosen = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))  # (B, V) n per row
    slot = mx.where(chosen, mx.cumsum(chosen.astype(mx.int32), axis=-1) - 1, n)  # (B, V) id order; n: dropped
    every = mx.broadcast_to(mx.arange(vocab, dtype=mx.int32), logp.shape)  # (B, V)
    ids = mx.put_along_axis(mx.zeros((logp.shape[0], n + 1), mx.int32), slot, every, axis=-1)[:, :n]  # (B, n)
    return _by_value(ids, mx.take_along_axis(logp, ids, axis=-1))


def _by_value(ids: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """ids (B, n) ascending, values (B, n) -> both most likely first, the lower id first in a tie:
    each one's rank is the count of those before it in that order, an (n, n) comparison per row."""
    n = ids.shape[-1]
    first = mx.arange(n)[:, None] < mx.arange(n)[None, :]  # (n, n) j before i by id
    v_i, v_j = values[:, None, :], values[:, :, None]  # (B, 1, n), (B, n, 1)
    rank = mx.sum((v_j > v_i) | ((v_j == v_i) & first[None]), axis=1)  # (B, n)
    at = mx.argmax(rank[:, None, :] == mx.arange(n)[None, :, None], axis=-1)  # (B, n) which one has rank r
    return mx.take_along_axis(ids, at, axis=-1), mx.take_along_axis(values, at, axis=-1)


def chosen_logprob(logp: mx.array, tokens: mx.array) -> mx.array:
    """logp (B, V), tokens (B,) -> (B,): the log-probability of each row's chosen token."""
    return mx.take_along_axis(logp, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]  # (B,)
