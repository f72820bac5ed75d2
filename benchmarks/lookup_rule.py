"""Prompt lookup on the default model's real tasks (`bench_workloads.TASKS`), the measured rule on and
forced, 64 tokens, batch 1: the rule's cost against forcing. Run on the CPU with OpenBLAS:

    MLXFUN_BLAS=openblas python benchmarks/lookup_rule.py OUT.json summarize,edit
"""
import json
import sys

from mlxfun import bench_speculative as bs
from mlxfun import bench_workloads as bw
from mlxfun.load import load

model = load(None, dtype="float32")  # the default model's 4-bit weights, dequantized: the float32 target
rows = []
for name in sys.argv[2].split(","):
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": bw.TASKS[name]}])
    for forced in (False, True):
        rows.append(bs.end_to_end(model, [prompt], 64, f"lookup, {name}", "prompt-lookup", 4, forced=forced))
print(bs.table(rows))
json.dump([r.__dict__ | {"speedup": r.speedup} for r in rows], open(sys.argv[1], "w"), indent=1)
