#!/usr/bin/env bash
# The H200 runs recorded in benchmarks/ (see README.md). On the lent machine, from the repo root,
# after `. .gpu-b/install.sh` (from `bash ../shared/gpu/prepare.sh mlx-lm==0.32.2`):
#   bash benchmarks/gpu.sh 1B    # smoke test, matmul crossover, 1B bench beside mlx-lm, 1B profile
#   bash benchmarks/gpu.sh 8B    # 8B bench beside mlx-lm, 8B profile
#   bash benchmarks/gpu.sh ab    # decode-step ablation (attention paths) at 8B, continuous-batching variants at 1B
#   bash benchmarks/gpu.sh qmv      # kernel checks; the 4-bit product kernel vs MLX's and dense, per rows, 8B
#   bash benchmarks/gpu.sh qmv-step # 4-bit decode with qmv and with the dense copy, 8B and 1B, batch 1 and 8
#   bash benchmarks/gpu.sh kernels  # decode-attention kernel vs MLX ops, smoke test, 8B bench beside mlx-lm
#   bash benchmarks/gpu.sh host     # where a 4-bit step's time goes: profile, node costs, probes, Nsight Compute
#   bash benchmarks/gpu.sh prompt   # 4-bit prompts: products per rows, 8B prompt 512 (dense copy for prefill)
set -u
OUT=${OUT:-/tmp/mlxfun-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
common=(--batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16,q4 --mlx-lm)
case "${1:-1B}" in
  kernels)
    timeout 150 python3 benchmarks/kernels_check.py --json "$OUT/h200-kernels.json" || exit 1
    timeout 150 python3 benchmarks/smoke.py --json "$OUT/h200-smoke.json"
    timeout 370 python3 -m mlxfun.bench --shape 8B "${common[@]}" \
      --json "$OUT/h200-8B.json" --plot "$OUT/h200-8B.png"
    ;;
  qmv)  # kernel checks (attention and qmv); a step's 4-bit products (qmv, MLX's) vs dense, per rows
    timeout 200 python3 benchmarks/kernels_check.py --json "$OUT/h200-kernels-qmv.json" || exit 1
    timeout 350 python3 benchmarks/qmv_rows.py --shape 8B --rows 1,2,4,8 \
      --json "$OUT/h200-qmv-rows-8B.json"
    timeout 150 python3 benchmarks/qmv_probe.py --shape 8B --json "$OUT/h200-qmv-probe-8B.json"
    ;;
  qmv-step)  # decode with qmv (strategy quantized) and with the dense copy, 4-bit, batch 1 and 8
    timeout 150 python3 -m mlxfun.bench --shape 1B --batch-sizes 1 --dtypes q4 --gen-tokens 16 --matmul \
      --json "$OUT/h200-matmul.json" | grep matmul  # 4-bit vs dequantize+matmul vs dense, 1-1024 rows
    for shape in 8B 1B; do
      timeout 170 python3 -m mlxfun.bench --shape $shape --batch-sizes 1,8 --dtypes q4 --strategy quantized \
        --mlx-lm --json "$OUT/h200-$shape-qmv.json" | tail -5
      timeout 100 python3 -m mlxfun.bench --shape $shape --batch-sizes 1,8 --dtypes q4 --strategy dense \
        --json "$OUT/h200-$shape-q4-dense.json" | tail -4
    done
    timeout 150 python3 benchmarks/smoke.py --json "$OUT/h200-smoke-qmv.json" | tail -4
    ;;
  host)
    timeout 200 python3 -m mlxfun.profile --shape 8B --dtype q4 --strategy quantized --batch-sizes 1,8 \
      --max-tokens 48 --no-matmuls --json "$OUT/h200-profile-8B-q4.json"
    timeout 90 python3 benchmarks/host_cost.py --json "$OUT/h200-host-cost.json"
    timeout 150 python3 benchmarks/qmv_probe.py --shape 8B --json "$OUT/h200-qmv-probe-8B.json"
    (cd benchmarks && timeout 240 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section LaunchStats --section MemoryWorkloadAnalysis -k regex:'mlxfun|gemv|gemm' \
      --log-file "$OUT/h200-ncu-qmv.txt" python3 qmv_ncu.py)
    ;;
  prompt)
    timeout 120 python3 -m mlxfun.bench --shape 1B --batch-sizes 1 --dtypes q4 --gen-tokens 16 --matmul \
      --json "$OUT/h200-matmul.json" | grep matmul
    timeout 110 python3 -m mlxfun.bench --shape 8B --batch-sizes 1,8 --prompt-tokens 512 --gen-tokens 16 \
      --dtypes q4 --json "$OUT/h200-8B-prompt.json" | tail -3  # auto: a dense copy for these prefills
    timeout 110 python3 -m mlxfun.bench --shape 8B --batch-sizes 1,8 --prompt-tokens 512 --gen-tokens 16 \
      --dtypes q4 --strategy quantized --json "$OUT/h200-8B-prompt-q4.json" | tail -3  # MLX's 4-bit product
    ;;
  1B)
    timeout 90 python3 benchmarks/smoke.py --json "$OUT/h200-smoke.json"
    timeout 300 python3 -m mlxfun.bench --shape 1B "${common[@]}" --matmul \
      --json "$OUT/h200-1B.json" --plot "$OUT/h200-1B.png"
    timeout 120 python3 -m mlxfun.profile --shape 1B --batch-sizes 1,8,32,128 --max-tokens 64 \
      --json "$OUT/h200-profile-1B.json"
    ;;
  8B)
    timeout 420 python3 -m mlxfun.bench --shape 8B "${common[@]}" \
      --json "$OUT/h200-8B.json" --plot "$OUT/h200-8B.png"
    timeout 150 python3 -m mlxfun.profile --shape 8B --batch-sizes 1,8,32,128 --max-tokens 64 \
      --json "$OUT/h200-profile-8B.json"
    ;;
  ab)
    timeout 240 python3 benchmarks/ablate.py --shape 8B --batch-sizes 1,32,128 --steps 16 \
      --variants sdpa-masked,sdpa-no-mask,no-attention --json "$OUT/h200-ablate-8B.json"
    timeout 300 python3 benchmarks/continuous_ab.py --shape 1B --rows 32 --prompts 256 \
      --json "$OUT/h200-continuous-ab-1B.json"
    timeout 300 python3 benchmarks/continuous_ab.py --shape 8B --rows 64 --prompts 256 \
      --json "$OUT/h200-continuous-ab-8B.json"
    ;;
esac
