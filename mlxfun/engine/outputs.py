"""Handing out a step's tokens: each row's token becomes its request's event, in order.

A step's outputs are read one step behind (the device runs the next step meanwhile), so each
carries the request every row held when it was queued: a row refilled since still hands its
token to the request that asked for it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mlxfun.engine.events import Event
from mlxfun.engine.rows import host_values
from mlxfun.engine.step import StepOut

if TYPE_CHECKING:
    from mlxfun.engine.core import Engine


def hand_out(engine: Engine, out: StepOut, owners: list, values=None, matched: bool = False) -> list[Event]:
    """One step's tokens as events: `owners[i]` is the request that row i held when it ran.
    `values`: the step's `host_values`, when read already; `matched`: whether the constrained
    rows' matchers have taken these tokens (the mask worker). A request that ends leaves its row."""
    tokens, logprob, top = values or host_values(out)
    now = time.perf_counter()
    # Per row of every step: names looked up once (a 1B step at 128 rows is host-bound on an H200).
    events, requests, stats, context = [], engine.requests, engine.stats, engine.config.max_position_embeddings
    owner, constraints = engine.scheduler.owner, engine.constraints
    generated = 0
    for i, rid in enumerate(owners):
        record = requests.get(rid) if rid is not None else None
        if record is None:
            continue
        row = record.row
        if row.finish_reason is not None:
            continue
        if record.first_token_time is None:
            record.first_token_time = now
            stats.ttft.append(now - record.submitted)
        else:
            stats.itl.append(now - record.last_token_time)
        record.last_token_time = now
        held = row.text.tokens
        before = len(held)
        event = row.accept(rid, tokens[i], record.request.eos, context, None if logprob is None else logprob[i],
                           None if top is None else top[i])
        if record.matcher is not None:
            event = constraints.advance(record, event, matched)
        generated += len(held) - before  # a closing EOS is not output
        if event.finish_reason is not None:
            stats.requests += 1
            if rid in owner:
                engine.release(owner.index(rid), record)
        events.append(event)
    stats.generation_tokens += generated
    return events
