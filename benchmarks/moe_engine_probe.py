"""A Qwen3-MoE shape through the engine (diagnostic): which setting makes a prefill fail here."""
import dataclasses
import os
import traceback

import mlx.core as mx

from mlxfun.bench import models as bench
from mlxfun.bench.main import run_batch
from mlxfun.engine import prefill
from mlxfun.model import weights
from mlxfun.model.load import Model

S = bench.SHAPES["qwen3-30B-A3B-24L"]
for layers in [int(n) for n in os.environ.get("PROBE_LAYERS", "2,24").split(",")]:
    c = dataclasses.replace(S, num_layers=layers, layer_windows=S.layer_windows[:layers],
                            local_layers=S.local_layers[:layers], moe_layers=S.moe_layers[:layers],
                            layer_sinks=S.layer_sinks[:layers])
    for quant in [q == "q4" for q in os.environ.get("PROBE_DTYPES", "q4,bf16").split(",")]:
        p = bench.random_params(c, mx.bfloat16)
        params = weights.quantize(c, p, 4, 64) if quant else p
        mx.eval(params)
        model = Model(c, params, bench.word_tokenizer(c.vocab_size), "moe")
        for early in [int(e) for e in os.environ.get("PROBE_EARLY", "4096,0").split(",")]:
            prefill.EARLY_LAUNCH_TOKENS = early
            for B in (1, 8):
                try:
                    stats, _, dense = run_batch(model, bench.random_prompts(c.vocab_size, B, 128),
                                                int(os.environ.get("PROBE_MAX_TOKENS", "8")), None)
                    print(f"layers {layers} q4 {quant} early {early} B {B}: ok {stats.generation_tps:.1f} tok/s",
                          flush=True)
                except Exception as e:
                    print(f"layers {layers} q4 {quant} early {early} B {B}: FAIL {str(e)[:100]}", flush=True)
                    traceback.print_exc(limit=-2)
        del model, params, p
        mx.clear_cache()
