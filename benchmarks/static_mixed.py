"""The continuous bench's static half, batch by batch: wall time, steps, traces of the decode step,
prefill and generation time, to find where a static batch of mixed requests loses time (GPU).

    python benchmarks/static_mixed.py --shape 1B --rows 32 --prompts 256 [--json PATH]
"""

import argparse
import json
import time

import mlxfun.step as step
from mlxfun import bench
from mlxfun import bench_workloads as bw
from mlxfun.generate import generate

traces = [0]
_make = step.make_steps
step.make_steps = lambda config, mode, on_trace=None: _make(config, mode, lambda: traces.__setitem__(0, traces[0] + 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1B")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = bench.random_model(bench.SHAPES[args.shape])
    prompts, limits = bw.mixed_workload(model.config.vocab_size, args.prompts, 16, 256)
    warm = prompts[:args.rows]
    generate(model, warm, max_tokens=4, ignore_eos=True)
    out = []
    for repeat in range(2):
        for i in range(0, len(prompts), args.rows):
            t0, n0 = time.perf_counter(), traces[0]
            r = generate(model, prompts[i:i + args.rows], max_tokens=limits[i:i + args.rows], ignore_eos=True)
            s = r.stats
            out.append({"repeat": repeat, "batch": i // args.rows, "wall_s": time.perf_counter() - t0,
                        "traces": traces[0] - n0, "steps": s.steps, "prompt_s": s.prompt_time,
                        "generation_s": s.generation_time, "longest_prompt": max(map(len, prompts[i:i + args.rows])),
                        "most_tokens": max(limits[i:i + args.rows])})
            print(json.dumps(out[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
