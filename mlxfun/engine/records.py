"""What the engine keeps per request and in all: a request's record and the engine's counters.

Host data only. A `Record` is created by `Engine.submit` on any thread, then owned by the
engine thread; `EngineStats` is written by the engine thread and may be read (one step old)
from any other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from mlxfun.engine import sampling
from mlxfun.engine.blocks import chain
from mlxfun.engine.detok import RowText
from mlxfun.engine.events import Stats
from mlxfun.engine.options import Request
from mlxfun.engine.rows import Row
from mlxfun.engine.step import Mode
from mlxfun.features import structured

# Recent samples kept for latency percentiles.
WINDOW = 1024


@dataclass
class Record:
    """A submitted request and, as it runs, its output (`row`). Owned by the engine thread."""

    id: int
    request: Request
    mode: Mode  # what a decode step must compute for this request
    row: Row
    submitted: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed
    matcher: structured.Matcher | None = None  # the row's place in its constraint (structured output)
    error: str | None = None  # why a constrained row had to end early (an error of the grammar engine)
    complete: bool = False  # nothing but EOS may follow in its constraint (as of the last token matched)
    keys: list | None = None  # its prompt's block keys (`blocks.chain`), once a prefix cache needs them
    preemptions: int = 0  # times its row was taken back to make room (it then resumed from `prompt`)

    @property
    def prompt(self) -> Sequence[int]:
        """The tokens its admission prefills: the request's prompt and, after a preemption, the
        tokens it has generated (recomputed, mostly found in the prefix cache)."""
        generated = self.row.text.tokens
        return self.request.prompt if not generated else [*self.request.prompt, *generated]

    def prompt_chain(self, block_size: int) -> list:
        """The `blocks.chain` of `prompt`, computed once per admission (looked up several times)."""
        if self.keys is None:
            self.keys = chain(self.prompt, block_size)
        return self.keys

    @property
    def finish_reason(self) -> str | None:
        return self.row.finish_reason

    @property
    def text(self) -> RowText:
        return self.row.text


@dataclass
class EngineStats(Stats):
    """Counts and bounded windows. `prompt_time` is the time of admissions made while no row was
    decoding (they cannot overlap anything); prefills that overlap decoding count as generation."""

    steps: int = 0
    busy_row_steps: int = 0  # sum over decode steps of the rows holding a live request
    rows: int = 0
    admissions: int = 0  # times new requests were prefilled (each one prefill per length group)
    # Host seconds inside admissions: building and queueing the prefill (the kernels a new chunk
    # shape needs are built here on a GPU, at first sight), and its wait when no row decodes.
    admission_seconds: float = 0.0
    requests: int = 0  # requests finished (any reason)
    queued: int = 0  # waiting for a row, at the last step
    running: int = 0  # holding a row, at the last step
    capacity: int = 0  # slots a row's table spans now
    max_capacity: int = 0
    kv_bytes: int = 0  # bytes of the KV pool now (0 when dropped)
    kv_used_bytes: int = 0  # bytes of the blocks live rows hold
    peak_kv_bytes: int = 0
    peak_kv_used_bytes: int = 0
    verify_rounds: int = 0  # speculative rounds (counted in `steps` too)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    cached_blocks: int = 0  # blocks the prefix cache holds (used by rows or not)
    prefix_hits: int = 0  # prompt blocks found in the prefix cache
    ttft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent times to first token, s
    itl: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # recent gaps between a row's tokens, s
    timed_prompt_tokens: int = 0  # the prompt tokens of the admissions `prompt_time` counts
    preemptions: int = 0  # rows taken back from their requests to make room in a full KV pool
    carried: int = 0  # admissions whose prompts rode along a decode step (`step.mixed_step`), of `admissions`
    # Host seconds spent waiting for the device before queuing a write into the KV pool
    # (`Runner.settle`: a server's engine on a GPU, every engine on the CPU).
    device_wait_seconds: float = 0.0
    # Seconds a serving engine (`Engine.rounds`) waited with no request at all: its clients' time.
    idle_seconds: float = 0.0
    # Rounds (`Engine.step`) and their wall seconds. A round queues a step and waits, one step
    # behind, for the one before (the device's pace shows in its time); a plain round neither
    # admitted nor followed a round that did, so plain rounds time the steady decode step under
    # whatever load ran, and the other rounds' excess over them is what admissions cost.
    rounds: int = 0
    round_seconds: float = 0.0
    plain_rounds: int = 0
    plain_round_seconds: float = 0.0

    def record_memory(self, scheduler, on: bool, block_bytes: int) -> None:
        """The KV pool's sizes after a step (`on`: the device state exists)."""
        pool = scheduler.pool
        self.capacity = scheduler.pages.width * pool.block_size if on else 0
        self.max_capacity = max(self.max_capacity, self.capacity)
        self.kv_bytes = (pool.size if on else 0) * block_bytes
        self.kv_used_bytes = pool.used * block_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes)
        self.peak_kv_used_bytes = max(self.peak_kv_used_bytes, self.kv_used_bytes)
        self.cached_blocks, self.prefix_hits = pool.cached, pool.hits

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens computed per second: reused ones (the prefix cache) and admissions that
        overlapped decoding are in neither count nor time."""
        return self.timed_prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    def time_round(self, seconds: float, admitted: bool, after_admission: bool) -> None:
        """Count a round of `seconds`; plain unless it admitted or followed one that did."""
        self.rounds += 1
        self.round_seconds += seconds
        if not admitted and not after_admission:
            self.plain_rounds += 1
            self.plain_round_seconds += seconds

    @property
    def plain_round_ms(self) -> float:
        return 1e3 * self.plain_round_seconds / self.plain_rounds if self.plain_rounds else 0.0

    @property
    def admission_overhead_seconds(self) -> float:
        """Seconds the rounds took beyond as many plain rounds: admissions' cost to the run."""
        return self.round_seconds - self.rounds * self.plain_round_ms / 1e3 if self.plain_rounds else 0.0

    @property
    def occupancy(self) -> float:
        return self.busy_row_steps / (self.steps * self.rows) if self.steps else 0.0

    def summary(self) -> str:
        ttft = sorted(self.ttft)
        median = ttft[len(ttft) // 2] if ttft else 0.0
        return (f"Prompt: {self.prompt_tokens} tokens ({self.cached_tokens} reused), {self.prompt_tps:.1f} tokens/s "
                f"computed\n"
                f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s\n"
                f"Requests: {self.requests}, prompts {self.prompt_tokens} tokens ({self.cached_tokens} reused), "
                f"generated {self.generation_tokens} tokens; rows busy {self.occupancy:.0%} of {self.steps} steps, "
                f"{self.admissions} admissions; "
                f"median time to first token {median:.3f} s\n"
                f"Peak memory: {self.peak_memory_gb:.3f} GB")


def mode_for(requests: Sequence[Record]) -> Mode:
    """The least a step must compute for these requests (each Mode compiles once)."""
    return Mode(sample=any(r.mode.sample for r in requests), penalties=any(r.mode.penalties for r in requests),
                search=sampling.any_search(r.mode.search for r in requests),
                top_logprobs=max(r.mode.top_logprobs for r in requests),
                masked=any(r.mode.masked for r in requests))


# Top logprobs a fixed-shape engine computes for every request that asks for any (OpenAI's most is 20).
TOP_LOGPROBS_FIXED = 20


def fixed_mode(mode: Mode, light: bool = False) -> Mode:
    """The mode a fixed-shape engine (a server) runs for `mode`, one of few, so all compile at
    start (`Engine.warm_up`): a sampled step also runs penalties and the top-k / top-p search
    (settings that leave them off change nothing), and logprobs come with 20 top ones (each row
    keeps the ones it asked for). `light` (a split step's engine, `Runner.split`, where a mode costs
    only its sampling half to compile): sampled rows without penalties or top-k run a lighter mode,
    the top-p search alone or no search (temperature only, OpenAI's default), as an offline run
    does; on the CPU each search is 32 passes over the logits."""
    top = -1 if mode.top_logprobs < 0 else max(mode.top_logprobs, TOP_LOGPROBS_FIXED)
    if light and mode.sample and not mode.penalties and not mode.search & sampling.Search.TOP_K:
        return Mode(sample=True, penalties=False, search=mode.search, top_logprobs=top, masked=mode.masked)
    search = sampling.Search.ALL if mode.sample else sampling.Search.NONE
    return Mode(sample=mode.sample, penalties=mode.sample, search=search, top_logprobs=top, masked=mode.masked)


def fixed_modes(masks: bool, light: bool = False) -> list[Mode]:
    """Every mode `fixed_mode` gives (`masks`: structured output is available)."""
    searches = (sampling.Search.NONE, sampling.Search.TOP_P) if light else ()
    sampled = [Mode(sample=True, search=search) for search in searches] + [Mode(sample=True, penalties=True)]
    return [fixed_mode(base._replace(top_logprobs=t, masked=m), light)
            for m in ((False, True) if masks else (False,)) for base in [Mode()] + sampled
            for t in (-1, TOP_LOGPROBS_FIXED)]


def request_mode(request: Request) -> Mode:
    s = request.settings
    return Mode(sample=not sampling.all_greedy(s), penalties=sampling.needs_counts(s), search=sampling.needs_search(s),
                top_logprobs=request.logprobs, masked=request.constraint is not None)
