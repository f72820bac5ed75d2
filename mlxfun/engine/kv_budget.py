"""How much KV cache an engine holds, and from what size its writes wait for the one before.

A pool allocated once (a server's engine, fixed shapes) is sized here: the budget (`kv_budget`),
at most every row at full context (`fixed_pool_blocks`). `settle_bytes` says from what pool size
`Runner.settle` waits.
"""

from __future__ import annotations

import mlx.core as mx

from mlxfun.engine.strategy import WeightStrategy, free_memory, memory_limit

# Device memory a server's process leaves to what MLX does not count (CUDA's context, library
# workspaces, graph instantiations) and to other processes' growth, below what it found free.
UNCOUNTED_BYTES = 2 << 30


def kv_budget(kv_memory: int | None, strategy: WeightStrategy, fixed_shapes: bool) -> int:
    """Bytes the KV cache may take: `kv_memory`, else the strategy's share of the device's memory
    beside what is in use now (the weights); a pool allocated at once (`fixed_shapes`) must also fit
    beside other processes' memory."""
    if kv_memory:
        return kv_memory
    budget = max(0, int(strategy.memory_fraction * memory_limit()) - mx.get_active_memory())
    free = free_memory() if fixed_shapes else None  # None where the device cannot say
    return budget if free is None else min(budget, int(strategy.memory_fraction * free))


def settle_bytes(fixed_shapes: bool) -> int | None:
    """From what KV pool size a pool write waits for the one queued before (`Runner.settle`).
    The CPU: always (a write queued behind work in flight copies the pool there). A server's GPU
    engine, whose pool is allocated at once: from 1 GB. On H100s, servers lost requests to
    out-of-memory errors in prefills in 2 of 4 load runs without the wait (one perhaps because the
    server before it was still exiting) and in none of 4 with it; under a closed loop without HTTP
    the engine ran 4,523 tok/s waiting against 5,028 pipelined (one run each,
    `benchmarks/closed_loop.py`, 2026-12-06). Requests kept are worth a tenth of the rate. Letting
    only the decode steps go unwaited does not pay either: work in flight holds the pool on CUDA
    too, and on an H200 such rounds queued 14-24 GB (copies of a 110 GB pool's layers) while the
    server served 7,609 greedy tok/s against 8,649 waiting (2026-12-07). An offline engine's pool
    holds only what its requests need: its steps stay pipelined."""
    if mx.default_device() == mx.cpu:
        return 0
    return SERVER_SETTLE_BYTES if fixed_shapes else None


# A server's GPU pool from this size on is written only after the write before it has run.
SERVER_SETTLE_BYTES = 1 << 30


def fixed_pool_blocks(budget: int, full: int) -> int:
    """A fixed-shape engine's pool in blocks: the `budget`, at most `full` (every row at full
    context) with an eighth more for the prefix cache and the scratch blocks."""
    return min(budget, 2 + full + full // 8)


def process_memory_limit() -> int | None:
    """What a server's engine process may hold on a GPU shared with other processes: what MLX holds
    now and what the device has free, less `UNCOUNTED_BYTES` (None off CUDA). Set as MLX's memory
    limit (`mx.set_memory_limit`), it makes MLX hand back its cache of freed buffers before the
    device runs out: MLX's own limit is a share of the whole device, past which alone it trims the
    cache. Beside the server's HTTP process and a benchmark's process, an H100 server's engine
    (1B, 128 rows, a 61 GB pool and 11 GB of cached buffers) ran out of memory in the prefill of a
    burst of 128 prompts, and failed the requests in it (`benchmarks/serve_load.py`, 2026-12-07)."""
    free = free_memory()
    if free is None:
        return None
    return mx.get_active_memory() + mx.get_cache_memory() + free - UNCOUNTED_BYTES
