"""Workload benchmarks behind `python -m mlxfun.bench.main --ring` and `--continuous`.

- ring: peak memory of long generations with an unbounded cache and with `max_kv_size`, to show
  that a ring keeps memory flat however long the generation.
- continuous: a workload of many prompts with mixed `max_tokens`, run as consecutive static
  batches (each waits for its slowest row) and through the continuous-batching engine with the
  same number of rows; the ratio of their throughputs.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from mlxfun.bench.models import machine, on_gpu, workload_model
from mlxfun.generate import generate
from mlxfun.model.load import Model, load


@dataclass
class RingRow:
    tokens: int  # generated tokens
    max_kv_size: int | None
    peak_gb: float
    gen_tps: float


def ring_memory(model: Model, lengths: tuple[int, ...] = (512, 4096), max_kv_size: int = 256) -> list[RingRow]:
    """Peak memory of one generation of each length, unbounded and with a ring of `max_kv_size`."""
    rows = []
    prompt = [[1 + i % (model.config.vocab_size - 1) for i in range(16)]]
    generate(model, prompt, max_tokens=8, ignore_eos=True)  # compile
    generate(model, prompt, max_tokens=8, ignore_eos=True, max_kv_size=max_kv_size)
    for n in lengths:
        for bound in (None, max_kv_size):
            mx.clear_cache()
            mx.reset_peak_memory()
            out = generate(model, prompt, max_tokens=n, ignore_eos=True, max_kv_size=bound)
            rows.append(RingRow(n, bound, mx.get_peak_memory() / 1e9, out.stats.generation_tps))
    return rows


def ring_table(rows: list[RingRow]) -> str:
    lines = [f"{'generated':>9} {'max_kv_size':>11} {'peak GB':>8} {'gen tok/s':>9}"]
    for r in rows:
        lines.append(f"{r.tokens:>9} {str(r.max_kv_size):>11} {r.peak_gb:>8.3f} {r.gen_tps:>9.1f}")
    return "\n".join(lines)


@dataclass
class ContinuousResult:
    prompts: int
    rows: int
    tokens: int
    static_s: float
    continuous_s: float
    occupancy: float

    @property
    def ratio(self) -> float:
        return self.static_s / self.continuous_s


def mixed_workload(vocab_size: int, n: int, min_tokens: int, max_tokens: int, seed: int = 0):
    """n random prompts of 8 to 128 tokens, each with max_tokens drawn from [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(8, 129))] for _ in range(n)]
    return prompts, [rng.randint(min_tokens, max_tokens) for _ in range(n)]


def static_batches(model: Model, prompts: list[list[int]], limits: list[int], rows: int) -> float:
    """Seconds to run the prompts as consecutive static batches of `rows`, each waiting for its slowest row."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), rows):
        generate(model, prompts[i:i + rows], max_tokens=limits[i:i + rows], ignore_eos=True)
    return time.perf_counter() - t0


def continuous_vs_static(model: Model, n: int = 256, rows: int = 16, min_tokens: int = 16,
                         max_tokens: int = 256, seed: int = 0) -> ContinuousResult:
    """Wall time of the same workload as static batches of `rows` and through an engine of `rows`."""
    prompts, limits = mixed_workload(model.config.vocab_size, n, min_tokens, max_tokens, seed)
    warm = prompts[:rows]
    generate(model, warm, max_tokens=4, ignore_eos=True)  # compile both paths
    generate(model, warm + warm[:1], max_tokens=4, ignore_eos=True, batch_size=rows)
    static_s = static_batches(model, prompts, limits, rows)
    t0 = time.perf_counter()
    out = generate(model, prompts, max_tokens=limits, ignore_eos=True, batch_size=rows)
    continuous_s = time.perf_counter() - t0
    return ContinuousResult(n, rows, sum(limits), static_s, continuous_s, out.stats.occupancy)


def continuous_table(r: ContinuousResult) -> str:
    return (f"{r.prompts} prompts, {r.tokens} tokens through {r.rows} rows: static batches {r.static_s:.1f} s "
            f"({r.tokens / r.static_s:.1f} tok/s), continuous {r.continuous_s:.1f} s "
            f"({r.tokens / r.continuous_s:.1f} tok/s, occupancy {r.occupancy:.0%}): {r.ratio:.2f}x")


def as_json(rows) -> list[dict] | dict:
    if isinstance(rows, list):
        return [asdict(r) for r in rows]
    return asdict(rows) | ({} if callable(rows.ratio) else {"ratio": rows.ratio})  # PrefixResult: ratio(field)


# ---- shared prefixes ----

SYSTEM_TEXT = ("You are a careful assistant for a public library. Answer questions about opening hours, loans, "
               "renewals, fines, events for children and adults, the reading rooms, the archive, interlibrary "
               "loans, printing and the wireless network. Be brief and polite, give the exact figure when one is "
               "asked for, and say when you do not know. ")
# A passage to edit and to summarise (prompt lookup drafts from it), with four misspellings to correct.
PASSAGE = ("The town library opened in 1904 in two rooms above the post office. Its first librarian, a retired "
           "teacher, kept the books in order by size, because the shelves were too short for anything else. In "
           "1931 the library moved to its own buiding on the market square, paid for by a collection among the "
           "farmers of the valley. The reading room was heated by a single stove, and in winter readers brought "
           "their own coal. After the war the collection grew quickly: the library lent records from 1952, "
           "opened a childrens room in 1960 and a local history archive in 1975. Today it holds about forty "
           "thousand books, lends e-books and laptops, and runs reading groups for every age. The stove is "
           "still there, in the corner of the reading room, though nobody has lit it since 1968, and the "
           "shelves are now tall enough for any book the libary buys.")
TASKS = {"edit": "Correct the spelling mistakes in this text and write it out in full:\n\n" + PASSAGE,
         "summarize": "Summarize this text in three sentences:\n\n" + PASSAGE}
QUESTIONS = ["When does the library open on Sunday?", "How many books can I borrow at once?",
             "Can I renew a loan online, and how many times?", "What is the fine for a late DVD?",
             "Is there a reading group for teenagers this month?", "How do I print from my laptop?",
             "Can I request a book from another library?", "Where is the local history archive?"]


@dataclass
class PrefixRun:
    reuse: bool
    seconds: float
    generated: int
    ttft_p50: float
    prompt_tokens: int
    computed_tokens: int


@dataclass
class PrefixResult:
    prompts: int
    shared_tokens: int
    rows: int
    max_tokens: int
    runs: list

    def ratio(self, field: str) -> float:
        without, with_ = (next(r for r in self.runs if r.reuse == flag) for flag in (False, True))
        return getattr(without, field) / getattr(with_, field)


def text_prefix_prompts(model: Model, shared_tokens: int) -> tuple[list[list[int]], int]:
    """The real model's workload: one system prompt of about `shared_tokens` tokens (library
    instructions) before each of 8 questions, through the chat template."""
    text = SYSTEM_TEXT
    while len(model.tokenizer.encode(text)) < shared_tokens:
        text += SYSTEM_TEXT
    system = {"role": "system", "content": text}
    prompts = [model.tokenizer.encode_chat([system, {"role": "user", "content": q}]) for q in QUESTIONS]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    return prompts, shared


def random_prefix_prompts(vocab_size: int, n: int, shared_tokens: int, suffix_tokens: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab_size) for _ in range(shared_tokens)]
    return [system + [rng.randrange(1, vocab_size) for _ in range(suffix_tokens)] for _ in range(n)], shared_tokens


def prefix_reuse(model: Model, prompts: list[list[int]], shared: int, rows: int, max_tokens: int,
                 full_warmup: bool = False) -> PrefixResult:
    """The same prompts through an engine of `rows` rows, without and with the prefix cache (after
    a warm-up run of each: 2 prompts and 2 tokens, or with `full_warmup` one wave of `rows` prompts
    and `max_tokens` tokens, which compiles the steps at the measured run's pool and table sizes;
    each first trace costs about a second on an H200)."""
    from mlxfun.engine.core import Engine

    runs = []
    for reuse in (False, True, False, True):
        engine = Engine(model, rows, prefix_cache=reuse)
        warm = len(runs) < 2
        work, tokens = (prompts, max_tokens) if not warm else \
            (prompts[:rows], max_tokens) if full_warmup else (prompts[:2], 2)
        mx.clear_cache()
        t0 = time.perf_counter()
        for p in work:
            engine.add(p, max_tokens=tokens, ignore_eos=True)
        for _ in engine.events():
            pass
        seconds = time.perf_counter() - t0
        if not warm:
            s = engine.stats
            ttft = sorted(s.ttft)
            runs.append(PrefixRun(reuse, seconds, s.generation_tokens, ttft[len(ttft) // 2], s.prompt_tokens,
                                  s.prompt_tokens - s.cached_tokens))
        else:
            runs.append(None)
    return PrefixResult(len(prompts), shared, rows, max_tokens, [r for r in runs if r is not None])


def prefix_table(r: PrefixResult) -> str:
    lines = [f"{r.prompts} prompts sharing {r.shared_tokens} tokens, {r.max_tokens} generated each, {r.rows} rows",
             f"{'prefix cache':>12} {'seconds':>8} {'gen tok/s':>9} {'TTFT p50 s':>10} {'prompt tok':>10} "
             f"{'computed':>9}"]
    for x in r.runs:
        lines.append(f"{'on' if x.reuse else 'off':>12} {x.seconds:8.2f} {x.generated / x.seconds:9.1f} "
                     f"{x.ttft_p50:10.3f} {x.prompt_tokens:10d} {x.computed_tokens:9d}")
    lines.append(f"with reuse: {r.ratio('seconds'):.2f}x less time, TTFT p50 {r.ratio('ttft_p50'):.2f}x lower")
    return "\n".join(lines)


def main(args) -> int:

    model = workload_model(args)
    info = machine()
    print(json.dumps(info))
    if args.ring:
        found = ring_memory(model)
        print(ring_table(found))
    else:
        found = continuous_vs_static(model, n=args.prompts, rows=args.continuous)
        print(continuous_table(found))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "config": asdict(model.config),
                                               "result": as_json(found)}, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0




def main_prefix(args) -> int:

    info = machine()
    print(json.dumps(info))
    if args.shape is None:
        model = load(args.model)
        prompts, shared = text_prefix_prompts(model, args.shared_tokens or 300)
        found = prefix_reuse(model, prompts, shared, rows=len(prompts), max_tokens=args.gen_tokens)
    else:
        model = workload_model(args)
        prompts, shared = random_prefix_prompts(model.config.vocab_size, args.prompts, args.shared_tokens or 2000,
                                                   50)
        found = prefix_reuse(model, prompts, shared, rows=args.rows, max_tokens=args.gen_tokens,
                                full_warmup=on_gpu())
    print(prefix_table(found))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "result": as_json(found) | {
            "time_ratio": found.ratio("seconds"), "ttft_ratio": found.ratio("ttft_p50")}}, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0
