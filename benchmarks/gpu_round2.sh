#!/usr/bin/env bash
# The H200 runs of round 2 (issues 14, 15, 16, 20, 21), recorded in benchmarks/README.md. On the lent
# machine, from the repo root, after `. .gpu-b/install.sh`:
#   bash benchmarks/gpu_round2.sh a   # kernel checks, smoke; the scheduler + paged KV against round 1's
#                                     # code (carried in .old/), static 1B/8B and continuous 1B
#   bash benchmarks/gpu_round2.sh b   # prefix reuse (1B), speculative decoding (8B oracle, 1B drafter)
#   bash benchmarks/gpu_round2.sh c   # structured output, the server under load (needs .whl/), real-model
#                                     # prompt lookup (needs the default model's GGUF in .gguf/)
set -u
OUT=${OUT:-/tmp/mlxfun-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
old() { PYTHONPATH="$PWD/.old:${PYTHONPATH}" "$@"; }  # round 1's mlxfun (commit bb0fcea) first on the path
static=(--batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16)
case "${1:-a}" in
  a)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    timeout 100 python3 benchmarks/kernels_check.py --json "$OUT/r2-kernels.json" | tail -3
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/r2-smoke.json" | tail -3
    for shape in 1B 8B; do
      timeout 150 python3 -m mlxfun.bench --shape $shape "${static[@]}" --json "$OUT/r2-$shape-new.json" | tail -6
      timeout 150 old python3 -m mlxfun.bench --shape $shape "${static[@]}" --json "$OUT/r2-$shape-old.json" | tail -6
    done
    timeout 100 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-new.json" | tail -2
    timeout 100 old python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-old.json" \
      | tail -2
    ;;
  b)
    timeout 150 python3 -m mlxfun.bench --prefix --shape 1B --prompts 256 --shared-tokens 2000 --gen-tokens 64 \
      --rows 64 --json "$OUT/r2-prefix-1B.json" | tail -6
    timeout 330 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --alphas 0.5,0.7,0.9 --ks 2,4,6 --draft-shape 1B --json "$OUT/r2-spec-8B.json" | tail -50
    ;;
  c)
    timeout 120 python3 -m mlxfun.bench --structured --shape 1B --batch-sizes 32 --json "$OUT/r2-structured.json" \
      | tail -6
    timeout 200 python3 benchmarks/serve_load.py --shape 1B --clients 8,32,128 --mlx-lm \
      --json "$OUT/r2-serve-1B.json" | tail -12
    ;;
esac
