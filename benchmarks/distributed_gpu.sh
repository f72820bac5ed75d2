#!/usr/bin/env bash
# Several GPUs on one host (the lent 2 x H200 machine), through MLX's NCCL backend under mlx.launch.
# From the repo root, after the usual install (benchmarks/gpu.sh's header):
#   bash benchmarks/distributed_gpu.sh smoke  # greedy 2-GPU == 1-GPU, float32, TF32 off
#   bash benchmarks/distributed_gpu.sh tp     # tensor parallel, 8B bf16 and q4, batch 1/8/32/128: 2 GPUs vs 1
#   bash benchmarks/distributed_gpu.sh dp     # data parallel, 256 prompts: 2 GPUs vs 1
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0. The tables report per-rank and aggregate
# tok/s and, for tensor parallel, the time of one decode step's all-reduces alone (all-reduce ms/step).
set -u
OUT=${OUT:-/tmp/mlxfun-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
N=${N:-2}
# A short lease can narrow the runs: DTYPES=bfloat16 BATCHES=1,8,32 GEN=64 SHAPE=1B.
DTYPES=${DTYPES:-bfloat16,q4} BATCHES=${BATCHES:-1,8,32,128} GEN=${GEN:-128} SHAPE=${SHAPE:-8B}
[ -d "$HOME/gpu-site/bin" ] && export PATH="$HOME/gpu-site/bin:$PATH"  # mlx.launch, from the carried install
launch=(mlx.launch -n "$N" --backend nccl --env NCCL_NVLS_ENABLE=0 --env PYTHONUNBUFFERED=1 --env "PYTHONPATH=${PYTHONPATH:-}")
bench=(--shape "$SHAPE" --prompt-tokens 128 --gen-tokens "$GEN" --dtypes "$DTYPES")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
case "${1:-smoke}" in
  smoke)
    (cd benchmarks && timeout 300 "${launch[@]}" --env MLX_ENABLE_TF32=0 -- \
      python3 dist_smoke.py --json "$OUT/h200x2-dist-smoke.json")
    ;;
  tp)
    timeout 500 python3 -m mlxfun.bench.main "${bench[@]}" --batch-sizes "$BATCHES" --tensor-parallel \
      --json "$OUT/h200x1-tp-$SHAPE.json"  # one GPU: the same command without mlx.launch
    timeout 500 "${launch[@]}" -- python3 -m mlxfun.bench.main "${bench[@]}" --batch-sizes "$BATCHES" \
      --tensor-parallel --json "$OUT/h200x2-tp-$SHAPE.json"
    ;;
  dp)
    timeout 500 python3 -m mlxfun.bench.main "${bench[@]}" --batch-sizes 256 --data-parallel \
      --json "$OUT/h200x1-dp-$SHAPE.json"
    timeout 500 "${launch[@]}" -- python3 -m mlxfun.bench.main "${bench[@]}" --batch-sizes 256 --data-parallel \
      --json "$OUT/h200x2-dp-$SHAPE.json"
    ;;
  *) echo "usage: $0 smoke|tp|dp"; exit 2 ;;
esac
