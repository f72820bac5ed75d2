"""Is the KV-cache write in place? ms per step of writing one token into cache-shaped buffers.

Each variant is a compiled function writing (B, H, 1, D) at a slot given as an array into each of
`layers` buffers of shape (B, H, C, D), chained over steps with the old buffers dropped, as the
decode loop does. A write that copies costs about 2 * buffer bytes / bandwidth per buffer.
Run: python benchmarks/cache_write.py [--batch 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx


def slice_update(buf, new, slot):
    return mx.slice_update(buf, new, slot[None], axes=(2,))


def put_along(buf, new, slot):
    B, H, T, D = new.shape
    idx = mx.broadcast_to((slot + mx.arange(T, dtype=mx.int32))[None, None, :, None], (B, H, T, D))
    return mx.put_along_axis(buf, idx, new, axis=2)


def where_rewrite(buf, new, slot):  # rewrites every slot: the cost of a full copy
    hit = (mx.arange(buf.shape[2]) == slot)[None, None, :, None]
    return mx.where(hit, new, buf)


VARIANTS = {"slice_update": slice_update, "put_along_axis": put_along, "where (full copy)": where_rewrite}


def _run(fn, bufs, steps: int, mode: str) -> float:
    """mode: sync (wait every step), pipelined (async_eval the buffers), pipelined-y (async_eval only a
    small output that depends on every write, as mlx-lm's loop does with the next token)."""
    for i in range(2):
        y, bufs = fn(bufs, i)
        mx.eval(y, bufs)
    t = time.perf_counter()
    for i in range(steps):
        y, bufs = fn(bufs, i + 2)
        if mode == "sync":
            mx.eval(y, bufs)
        else:
            mx.async_eval(*((y,) if mode == "pipelined-y" else (y, bufs)))
    mx.eval(y, bufs)
    return 1e3 * (time.perf_counter() - t) / steps


def time_variant(write, bufs, new, steps: int, compiled: bool, mode: str) -> float:
    def step(bufs, slot):
        bufs = tuple(write(b, new, slot) for b in bufs)
        return mx.stack([b[:1, :1, :1].sum() for b in bufs]).sum(), bufs

    fn = mx.compile(step) if compiled else step
    bufs = tuple(b + 0 for b in bufs)  # buffers of our own
    mx.eval(bufs)
    return _run(lambda bufs, i: fn(bufs, mx.array(i, mx.int32)), bufs, steps, mode)


def time_setitem(bufs, new, steps: int, mode: str) -> float:
    """mlx-lm's way: `buf[..., i:i + 1, :] = new` with a Python int, uncompiled, on arrays it owns."""
    bufs = [b + 0 for b in bufs]
    mx.eval(bufs)

    def step(bufs, i):
        for b in bufs:
            b[:, :, i:i + 1, :] = new
        return mx.stack([b[:1, :1, :1].sum() for b in bufs]).sum(), bufs

    return _run(step, bufs, steps, mode)


def check() -> None:
    buf = mx.random.normal((2, 3, 8, 4))
    new = mx.random.normal((2, 3, 1, 4))
    slot = mx.array(5, mx.int32)
    ref = slice_update(buf, new, slot)
    for name, write in VARIANTS.items():
        assert mx.array_equal(write(buf, new, slot), ref), name


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    check()
    dtype = mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32
    shape = (args.batch, args.heads, args.capacity, args.head_dim)
    bufs = tuple(mx.zeros(shape, dtype) for _ in range(args.layers))
    new = mx.random.normal((args.batch, args.heads, 1, args.head_dim)).astype(dtype)
    mx.eval(bufs, new)
    mb = bufs[0].nbytes / 1e6
    out = {"shape": shape, "buffer_mb": mb, "layers": args.layers, "device": str(mx.default_device()), "ms": {}}
    modes = ("sync", "pipelined", "pipelined-y")
    timings = [(f"{name}{'' if c else ' uncompiled'} {m}", lambda w=write, c=c, m=m: time_variant(w, bufs, new,
                                                                                               args.steps, c, m))
               for name, write in VARIANTS.items() for c in (True, False) for m in modes]
    timings += [(f"setitem (mlx-lm) {m}", lambda m=m: time_setitem(bufs, new, args.steps, m)) for m in modes]
    for key, fn in timings:
        ms = fn()
        out["ms"][key] = ms
        print(f"{key:40s} {ms:8.3f} ms/step for {args.layers} buffers of {mb:.1f} MB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
