#!/usr/bin/env bash
# The GPU benchmarks, in named suites. On the lent machine, from the repo root, after
# `. .gpu-b/install.sh` (made here by `bash ../shared/gpu/prepare.sh`):
#   bash benchmarks/gpu.sh SUITE [SUITE ...]
# On a fresh machine the first server (or engine) of a shape builds MLX's kernels, 160-250 s; later starts
# on the same machine take seconds (/tmp/mlx/<version>/ptx). Give a serving suite's first call 300 s or more.
# Suites (each writes JSON to $OUT, default /tmp/mlxfun-out):
#   smoke        batched == alone in float32, the decode kernels on (benchmarks/smoke.py)
#   kernels      the CUDA kernels against MLX references (benchmarks/kernels_check.py; $KERNELS_ONLY: one kernel)
#   qmv-shapes   benchmarks/qmv_shapes.py: the quantized product's block shapes (N x F) per map and row count,
#                against bf16 products ($SHAPES_ARGS: qmv_shapes.py options, e.g. --shapes pick --targets 528)
#   invariance   benchmarks/invariance.py: a row's product alone vs inside batches of 2-257, plain and at one fixed
#                row count (bf16, fp16, 4-bit), and each way's time
#   invariant-e2e  benchmarks/invariant_e2e.py: batch_invariant off and on, a row's tokens and logprobs alone vs batched,
#                reversed, continuous, behind a cached prefix, other chunks (random SmolLM2 shape; bf16, fp16, 4-bit)
#   invariant-cost mlxfun bench --batch-invariant: bf16 1B and 8B ($INVARIANT_SHAPES) at batch 1/8/32/128, the mode off and on
#                (its products in pieces of 128 rows, the default; MLXFUN_INVARIANT_PIECES=0 in the environment: dmv)
#   static       mlxfun bench: 1B and 8B shapes, batch 1/8/32/128, bf16 and q4, mlx-lm beside if installed
#   quant        mlxfun bench: 1B and 8B ($QUANT_SHAPES), batch 1/8/32/128, bf16 against 4- and 8-bit (peak memory too)
#   quant-ab     the same, bf16 and q4, then q4 again with MLXFUN_QMV_FEATURES=1 (the product's blocks of one
#                group of features: the block shapes before qmv.block_shape), $QUANT_BATCHES
#   tiled-quant  mlxfun bench, bf16 and q4 (and q4 with MLXFUN_TILED_FROM=$TILED_FROM, default 33: quantized
#                products from that many rows through the tiled kernel, qmm.py, no dense copy), $QUANT_SHAPES, $QUANT_BATCHES
#   tiled-invariant  invariant-e2e and invariant-cost with MLXFUN_INVARIANT_TILED=1 (the mode's products tiled)
#   moe-ab       kernels_check --only experts, then the 6-layer Qwen3-30B-A3B shape in bf16, batch 1/8/32/128,
#                with MLXFUN_EXPERTS_KERNEL=0 and =1 (dmv.experts_product for dense experts)
#   continuous   mlxfun bench --continuous 32: 256 mixed requests, static batches vs continuous (1B)
#   prefix       mlxfun bench --prefix: 256 requests sharing a 2,000-token prefix, cache off vs on (1B)
#   speculative  mlxfun bench --speculative --rule-only (1B target, 135M draft)
#   structured   mlxfun bench --structured: a JSON schema on every row vs free rows (1B)
#   serve        benchmarks/serve_load.py (1B): $SERVE_CLIENTS (32) streaming clients, 8 requests each, greedy and seeded,
#                against offline generate (same prompts) and mlx_lm.server. Needs the server's wheels, made here by
#                `echo /.whl/ >> .git/info/exclude` and `pip download --no-deps --only-binary=:all:
#                --python-version 3.12 --platform manylinux2014_x86_64 -d .whl fastapi starlette uvicorn pydantic
#                pydantic-core typing-inspection annotated-types annotated-doc opentelemetry-api typing-extensions
#                click idna anyio h11 uvloop httptools openai httpx2 httpcore2 truststore jiter sniffio distro
#                [mlx-lm] [py-spy]` (versions as in this venv; the GPU machine's Python lacks these), carried as
#                ".whl"; uvloop and httptools are the [server] extra's, which uvicorn picks when importable (the
#                leases up to 2026-12-08 lacked them: asyncio's own loop and h11 served those runs);
#                $SERVE_MODES (greedy,seeded) picks the modes
#   closed-loop  benchmarks/closed_loop.py: the server's engine (1B, 32 rows) replacing each finished request at once,
#                no HTTP; rounds timed by kind, for the default KV pool, the same after every
#                prefill shape was seen once, and a 0.5 GB pool ($CLOSED_RUNS, $CLOSED_ARGS)
#   serve-ab     serve_load.py ($SERVE_SHAPE (1B), $SERVE_CLIENTS (32) clients, 8 requests each, greedy and seeded,
#                first requests spread over $SERVE_ARRIVAL (1) s) against offline generate: mlxfun serve from this
#                tree and from $AB_REF (reported as mlxfun-ref; see ab-static for how to make it)
#   serve-load   serve_load.py ($SERVE_SHAPE (1B), $SERVE_CLIENTS (32) clients, $SERVE_EACH (8) requests each, greedy and
#                seeded, all starting at once unless $SERVE_ARRIVAL) against offline generate; $SERVE_PROCS client
#                processes; SERVE_SPY=1: under py-spy (add its wheel to .whl), stacks read by benchmarks/spy_threads.py;
#                a burst beside other processes on the device: SERVE_CLIENTS=128 SERVE_EACH=4 SERVE_MODES=greedy;
#                SERVE_LM=1: mlx_lm.server too (from .whl); SERVE_ALSO=NAME=ARGS[|NAME=ARGS...]: more mlxfun
#                servers with those flags (say mlxfun-mixed2048=--mixed-tokens 2048|mlxfun-wait0=--admit-wait 0),
#                each started after the last stopped; offline is the best of 2 runs, every
#                timed phase samples the GPU's utilization, and each run splits the engine's rounds into plain
#                ones (ms each) and the admissions' excess over them
#   step-gap     benchmarks/step_gap.py: steady decode rounds, $GAP_SHAPE (8B), 32 rows, $GAP_ROUNDS (100) each, variants
#                $GAP_VARIANTS (a server's engine plain, with the engine process' memory limit, beside a process that
#                builds MLX arrays as the HTTP process did, alternating; offline last)
#   http-layer   benchmarks/http_layer.py: the server's HTTP layer over a stand-in engine, CPU per streamed chunk with
#                uvloop + httptools and with asyncio + h11 ($SERVE_CLIENTS (128) clients; needs them in .whl)
#   serve-cold   benchmarks/serve_cold.py (1B, 32 rows): fresh servers' first requests, each timed alone ($COLD_SEQUENCES)
#   families     mlxfun bench: Gemma 3 4B and Qwen3-30B-A3B (24 of 48 layers) shapes ($FAMILY_SHAPES), batch
#                1/8/32/128, q4 and bf16 ($FAMILY_DTYPES), mlx-lm beside (installed from .whl, as for serve)
#   moe          mlxfun bench: the Qwen3-30B-A3B shape (24 of 48 layers), $FAMILY_DTYPES (q4), batch 1/8/32/128
#                ($FAMILY_BATCHES), $FAMILY_GEN (64) generated, mlx-lm beside; on a CUDA-graph launch failure,
#                again at batch 1/8 with MLX_USE_CUDA_GRAPHS=0 (dense experts in decode steps of 2 or more tokens
#                through dmv.experts_product unless MLXFUN_EXPERTS_KERNEL=0)
#   sampling     benchmarks/sampling_search.py: top-k/top-p by threshold search against $AB_REF's sort (128K vocab)
#   ab-static    this tree against the package in $AB_REF (default .ab/ref, made here by
#                `echo /.ab/ >> .git/info/exclude; mkdir -p .ab/ref; git archive REV mlxfun | tar -x -C .ab/ref`
#                and carried with the device tool's `carry: [".gpu-b", ".ab"]`), alternating processes:
#                1B bf16 batch 1/8/32/128 (ABBA), 8B bf16 (AB); ratios by benchmarks/ab_compare.py
#   ab-continuous  the same for --continuous 32 (1B, ABBA)
#   ab-1B        the 1B part of ab-static only, in the order $AB_ORDER (default "ref ours ours ref"),
#                at batch sizes $AB_BATCHES (default 1,8,32,128)
set -u
OUT=${OUT:-/tmp/mlxfun-out}
AB_REF=${AB_REF:-.ab/ref}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
bench() { timeout -s INT -k 30 "$1" python3 -m mlxfun.bench "${@:2}"; }  # SIGINT: bench keeps the rows measured
# The server's extra, the openai client and mlx-lm (side by side) from the wheels in .whl/ (see serve).
wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  python3 -c "import uvloop, httptools" 2>/dev/null || echo "note: no uvloop / httptools in .whl: uvicorn serves with asyncio and h11"; }
# Runs mlxfun bench with the package at $1 (a folder holding mlxfun/) first on the path.
# issue 54: batch_invariant end to end, and its cost; $1 names the JSON files.
invariant_e2e() { timeout ${INVARIANT_TIMEOUT:-240} python3 benchmarks/invariant_e2e.py \
  --models ${INVARIANT_MODELS:-bf16,fp16,q4} --json "$OUT/$1-e2e.json"; }
invariant_cost() {
  for shape in ${INVARIANT_SHAPES:-1B 8B}; do
    bench ${INVARIANT_COST_TIMEOUT:-280} --shape $shape --batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 128 \
      --dtypes bfloat16 --batch-invariant --json "$OUT/$1-cost-$shape.json"
  done; }
bench_at() { local dir=$1 limit=$2; shift 2; (cd "$dir" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "$limit" python3 -m mlxfun.bench "$@"); }
for suite in "$@"; do
  echo "=== $suite"
  case "$suite" in
    smoke) timeout ${SMOKE_TIMEOUT:-300} python3 benchmarks/smoke.py --json "$OUT/smoke.json" ;;
    kernels) timeout ${KERNELS_TIMEOUT:-240} python3 benchmarks/kernels_check.py ${KERNELS_ONLY:+--only $KERNELS_ONLY} \
      --json "$OUT/kernels.json" | grep -v '"ok": true' | tail -20 ;;
    qmv-shapes) timeout ${SHAPES_TIMEOUT:-240} python3 benchmarks/qmv_shapes.py ${SHAPES_ARGS:-} --json "$OUT/qmv-shapes.json" | tail -24 ;;
    invariant-e2e) invariant_e2e invariant ;;
    invariant-cost) invariant_cost invariant ;;  # issue 54: mlxfun bench with and without --batch-invariant
    invariance) timeout 300 python3 benchmarks/invariance.py --kinds ${INVARIANCE_KINDS:-bfloat16,float16,q4} --json "$OUT/invariance.json" ;;
    static)
      for shape in 1B 8B; do
        bench 420 --shape $shape --batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 128 \
          --dtypes bfloat16,q4 --mlx-lm --json "$OUT/static-$shape.json"
      done ;;
    quant)  # issue 53: 4- and 8-bit against bf16, decode and prefill, peak memory
      for shape in ${QUANT_SHAPES:-1B 8B}; do
        bench ${QUANT_TIMEOUT:-280} --shape $shape --batch-sizes ${QUANT_BATCHES:-1,8,32,128} --prompt-tokens 128 \
          --gen-tokens 128 --dtypes ${QUANT_DTYPES:-bfloat16,q4,q8} --json "$OUT/quant-$shape.json"
      done ;;
    quant-ab)
      for shape in ${QUANT_SHAPES:-1B 8B}; do
        bench ${QUANT_TIMEOUT:-200} --shape $shape --batch-sizes ${QUANT_BATCHES:-1,8,32,128} --prompt-tokens 128 \
          --gen-tokens 128 --dtypes bfloat16,q4 --json "$OUT/quant-ab-$shape.json" | tail -12
        MLXFUN_QMV_FEATURES=1 bench ${QUANT_TIMEOUT:-200} --shape $shape --batch-sizes ${QUANT_BATCHES:-1,8,32,128} \
          --prompt-tokens 128 --gen-tokens 128 --dtypes q4 --json "$OUT/quant-ab-$shape-f1.json" | tail -6
      done ;;
    tiled-quant)
      for shape in ${QUANT_SHAPES:-1B 8B}; do
        bench ${QUANT_TIMEOUT:-200} --shape $shape --batch-sizes ${QUANT_BATCHES:-1,8,32,128} --prompt-tokens 128 \
          --gen-tokens 128 --dtypes bfloat16,q4 --json "$OUT/tiled-quant-$shape-base.json" | tail -12
        MLXFUN_TILED_FROM=${TILED_FROM:-33} bench ${QUANT_TIMEOUT:-200} --shape $shape \
          --batch-sizes ${QUANT_BATCHES:-1,8,32,128} --prompt-tokens 128 --gen-tokens 128 --dtypes q4 \
          --json "$OUT/tiled-quant-$shape.json" | tail -6
      done ;;
    moe-ab)  # issue 55: dmv.experts_product checked, then the 6-layer MoE shape in bf16 without and with it
      timeout ${KERNELS_TIMEOUT:-120} python3 benchmarks/kernels_check.py --only experts --json "$OUT/experts.json" | tail -4
      for on in 0 1; do
        MLXFUN_EXPERTS_KERNEL=$on bench ${FAMILY_TIMEOUT:-150} --shape qwen3-30B-A3B-6L --batch-sizes 1,8,32,128 \
          --prompt-tokens 128 --gen-tokens 32 --dtypes bfloat16 --json "$OUT/moe-ab-6L-$on.json" | tail -8
      done ;;
    tiled-invariant) (export MLXFUN_INVARIANT_TILED=1; invariant_e2e tiled-invariant; invariant_cost tiled-invariant) ;;
    continuous) bench 300 --shape 1B --continuous 32 --prompts 256 --json "$OUT/continuous-1B.json" ;;
    prefix) bench 300 --shape 1B --prefix --prompts 256 --rows 256 --json "$OUT/prefix-1B.json" ;;
    speculative) bench 400 --shape 1B --speculative --rule-only --draft-shape 135M --json "$OUT/speculative-1B.json" ;;
    structured) bench 300 --shape 1B --structured --batch-sizes 1,8,32 --json "$OUT/structured-1B.json" ;;
    serve)
      wheels
      lm=(); python3 -c "import mlx_lm" 2>/dev/null && lm=(--mlx-lm --mlx-lm-python python3)
      # Long enough (8 requests per client) that the 1 s of arrivals and the last wave's tail weigh little;
      # SERVE_MLX_LM=0 leaves mlx_lm.server out (its seeded runs take minutes).
      [ "${SERVE_MLX_LM:-1}" = 0 ] && lm=()
      timeout 500 python3 benchmarks/serve_load.py --shape 1B --clients ${SERVE_CLIENTS:-32} \
        --requests $((8 * ${SERVE_CLIENTS:-32})) --modes greedy,seeded --offline "${lm[@]}" \
        --json "$OUT/serve-1B-${SERVE_CLIENTS:-32}.json" ;;
    serve-ab)
      wheels
      timeout ${SERVE_TIMEOUT:-560} python3 benchmarks/serve_load.py --shape ${SERVE_SHAPE:-1B} \
        --clients ${SERVE_CLIENTS:-32} --requests $((8 * ${SERVE_CLIENTS:-32})) --modes ${SERVE_MODES:-greedy,seeded} \
        --offline --arrival ${SERVE_ARRIVAL:-1} --mlxfun-ref "mlxfun-ref=$AB_REF" \
        --json "$OUT/serve-ab-${SERVE_SHAPE:-1B}-${SERVE_CLIENTS:-32}-arrival${SERVE_ARRIVAL:-1}.json" ;;
    serve-load)  # the generic load: $SERVE_SHAPE (1B), $SERVE_CLIENTS (32) clients, $SERVE_EACH (8) requests each,
      # $SERVE_MODES, first requests spread over $SERVE_ARRIVAL (0) s, $SERVE_PROCS client processes (default: 1 per 8
      # clients), offline generate first; SERVE_SPY=1: the whole run under py-spy (from .whl; its raw stacks by
      # process and thread in $OUT, read by benchmarks/spy_threads.py)
      wheels
      lm=(); [ "${SERVE_LM:-0}" = 1 ] && python3 -c "import mlx_lm" 2>/dev/null && lm=(--mlx-lm --mlx-lm-python python3)
      also=(); IFS='|' read -ra entries <<< "${SERVE_ALSO:-}"; for e in "${entries[@]}"; do also+=(--mlxfun-also "$e"); done
      name=serve-load-${SERVE_SHAPE:-1B}-${SERVE_CLIENTS:-32}-arrival${SERVE_ARRIVAL:-0}${SERVE_PROCS:+-procs$SERVE_PROCS}
      spy=(); [ "${SERVE_SPY:-0}" = 1 ] && spy=(/tmp/site/bin/py-spy record --subprocesses --threads --idle --nonblocking \
        -r ${SPY_RATE:-100} -f raw -o "$OUT/$name-spy.txt" --) && name=$name-spy
      timeout ${SERVE_TIMEOUT:-560} "${spy[@]}" python3 benchmarks/serve_load.py --shape ${SERVE_SHAPE:-1B} \
        --clients ${SERVE_CLIENTS:-32} --requests $((${SERVE_EACH:-8} * ${SERVE_CLIENTS:-32})) \
        --modes ${SERVE_MODES:-greedy,seeded} --offline --arrival ${SERVE_ARRIVAL:-0} ${SERVE_PROCS:+--client-procs $SERVE_PROCS} \
        "${lm[@]}" "${also[@]}" --json "$OUT/$name.json" | grep -v "^$" ;;
    http-layer)  # the HTTP layer alone, per streamed chunk: uvloop + httptools against asyncio + h11
      wheels
      timeout ${HTTP_TIMEOUT:-200} python3 benchmarks/http_layer.py --clients ${SERVE_CLIENTS:-128} --repeats 3 \
        --json "$OUT/http-layer.json" ;;
    step-gap) timeout ${GAP_TIMEOUT:-400} python3 benchmarks/step_gap.py --shape ${GAP_SHAPE:-8B} --rows 32 \
      --rounds ${GAP_ROUNDS:-100} --variants ${GAP_VARIANTS:-server,server:greedy:0:limit,server:greedy:0:neighbour,server,\
server:greedy:0:limit,server:greedy:0:neighbour,offline} --json "$OUT/step-gap-${GAP_SHAPE:-8B}-32.json" | cut -c1-330 ;;
    serve-cold) timeout ${COLD_TIMEOUT:-300} python3 benchmarks/serve_cold.py --shape 1B --rows 32 \
      --sequences ${COLD_SEQUENCES:-seeded,seeded,seeded greedy,seeded,seeded seeded,seeded@thread} --json "$OUT/serve-cold.json" ;;
    closed-loop) timeout ${CLOSED_TIMEOUT:-420} python3 benchmarks/closed_loop.py --shape 1B --rows 32 --requests 256 \
      --runs ${CLOSED_RUNS:-0:default,0:default:prewarm,0.5:default} ${CLOSED_ARGS:-} --json "$OUT/closed-loop-1B$RANDOM.json" ;;
    families)
      wheels
      for shape in ${FAMILY_SHAPES:-gemma3-4B qwen3-30B-A3B-24L}; do
        bench ${FAMILY_TIMEOUT:-540} --shape $shape --batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 64 \
          --dtypes ${FAMILY_DTYPES:-q4,bfloat16} --mlx-lm --json "$OUT/families-$shape.json"
      done ;;
    moe)  # the Qwen3-MoE shape beside mlx-lm; if MLX's CUDA graph launch fails, again without CUDA graphs
      wheels
      log=$OUT/moe-${FAMILY_DTYPES:-q4}.log
      bench ${FAMILY_TIMEOUT:-330} --shape qwen3-30B-A3B-24L --batch-sizes ${FAMILY_BATCHES:-1,8,32,128} --prompt-tokens 128 \
        --gen-tokens ${FAMILY_GEN:-64} --dtypes ${FAMILY_DTYPES:-q4} --mlx-lm --json "$OUT/moe-${FAMILY_DTYPES:-q4}.json" 2>&1 | tee "$log" | grep -v "^$" | tail -30
      if grep -q "cuGraph" "$log"; then
        MLX_USE_CUDA_GRAPHS=0 bench 150 --shape qwen3-30B-A3B-24L --batch-sizes 1,8 --prompt-tokens 128 --gen-tokens 32 \
          --dtypes ${FAMILY_DTYPES:-q4} --json "$OUT/moe-nographs.json" 2>&1 | grep -v "^$" | tail -12
      fi ;;
    sampling) timeout 200 python3 benchmarks/sampling_search.py --ref "$AB_REF" --json "$OUT/sampling.json" ;;
    ab-static|ab-1B)
      static=(--batch-sizes "${AB_BATCHES:-1,8,32,128}" --prompt-tokens 128 --dtypes bfloat16)
      for who in ${AB_ORDER:-ref ours ours ref}; do
        dir=$AB_REF; [ $who = ours ] && dir=$here
        bench_at "$dir" 240 --shape 1B "${static[@]}" --gen-tokens 128 --json "$OUT/ab-static-1B-$who-$RANDOM.json" | tail -6
      done
      [ "$suite" = ab-1B ] && continue
      for who in ref ours; do
        dir=$AB_REF; [ $who = ours ] && dir=$here
        bench_at "$dir" 300 --shape 8B "${static[@]}" --gen-tokens 32 --json "$OUT/ab-static-8B-$who.json" | tail -6
      done ;;
    ab-continuous)
      for who in ref ours ours ref; do
        dir=$AB_REF; [ $who = ours ] && dir=$here
        bench_at "$dir" 200 --shape 1B --continuous 32 --prompts 256 --json "$OUT/ab-continuous-1B-$who-$RANDOM.json" | tail -4
      done ;;
    *) echo "unknown suite $suite"; exit 2 ;;
  esac
done
[ -n "$(ls "$OUT"/ab-*.json 2>/dev/null)" ] && python3 benchmarks/ab_compare.py "$OUT"/ab-*.json
exit 0
