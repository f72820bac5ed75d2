#!/usr/bin/env bash
# The H200 runs of round 2 (issues 14, 15, 16, 20, 21), recorded in benchmarks/README.md. On the lent
# machine, from the repo root, after `. .gpu-b/install.sh` (prepare.sh with mlx-lm==0.32.2), with
# round 1's mlxfun (commit bb0fcea) in .old/, server wheels in .whl/ and SmolLM2's tokenizer in .tok/:
#   bash benchmarks/gpu_round2.sh a   # kernel check, smoke; scheduler + paged KV against round 1, 1B static and continuous
#   bash benchmarks/gpu_round2.sh b   # prefix reuse (1B); structured output (1B, a real tokenizer); multi-turn reuse
#   bash benchmarks/gpu_round2.sh c   # speculative decoding (8B: oracle, a 1B drafter)
#   bash benchmarks/gpu_round2.sh d   # the server under load beside mlx_lm.server (1B)
#   bash benchmarks/gpu_round2.sh e   # 8B static
#   bash benchmarks/gpu_round2.sh f   # kernel check, smoke, where verify rounds and admissions spend their time
#   bash benchmarks/gpu_round2.sh g   # prefix reuse at the full workload (256 requests, 64 tokens)
#   bash benchmarks/gpu_round2.sh h   # structured output; prefix reuse with 128 rows; the server, 32 clients x 128 requests
#   bash benchmarks/gpu_round2.sh s   # 1B static against round 1 only
#   bash benchmarks/gpu_round2.sh k   # the few-row dense product (mlxfun.dmv): checked, then off / on at small batches and in verify
#   bash benchmarks/gpu_round2.sh t1  # kernels checked, dmv timed; a constrained step's parts; 8B verify parts, dmv off / on
#   bash benchmarks/gpu_round2.sh t2  # 1B static and continuous against round 1; prefix reuse with 256 rows
#   bash benchmarks/gpu_round2.sh t3  # structured output against the code before (.prev); prefix reuse, 256 rows; prefill's parts;
#                                     dmv checked and timed; a constrained step's parts
#   bash benchmarks/gpu_round2.sh t4  # continuous against round 1; speculative decoding, 8B with a 1B drafter, dmv on
#   bash benchmarks/gpu_round2.sh t5  # t3, continuous against round 1, then t4's speculative run at batch 1 (one lease)
#   bash benchmarks/gpu_round2.sh u1  # ncu: one 1B prefill, this code and round 1's; structured with and without the head start
#   bash benchmarks/gpu_round2.sh u2  # 1B static against round 1; prefill's parts; ncu of one prefill
#   bash benchmarks/gpu_round2.sh u4  # admissions' host time by phase, batch 1 and 8, this code and round 1's (u5: buffer
#                                     cache emptied first, then 1B static at 1 and 8 against round 1)
#   bash benchmarks/gpu_round2.sh u6  # ncu: one 8B decode step at batch 8, this code and round 1's; continuous pair
#   bash benchmarks/gpu_round2.sh u3  # 8B static against round 1
#   bash benchmarks/gpu_round2.sh v1  # speculative, 8B batch 1: oracle with device drafts (pipelined rounds) and host
#                                     drafts, a 1B drafter; ncu of one verify step (k = 4)
#   bash benchmarks/gpu_round2.sh v3  # where a verify round's host time goes (8B batch 1), then v1's bench
#   bash benchmarks/gpu_round2.sh w1  # verify_profile alone: host phases, and rounds queued back to back (8B batch 1)
#   bash benchmarks/gpu_round2.sh w2  # launch cost of a decode step and a verify round under CUDA graph settings
#   bash benchmarks/gpu_round2.sh w3  # launch cost, dmv off / on, 100 and 400 ops per CUDA graph; the bench, dmv off / on
#   bash benchmarks/gpu_round2.sh w4  # dmv across warps: checked, tuned per map; speculative 8B b1 and 1B decode with it
#   bash benchmarks/gpu_round2.sh x1  # dmv as shipped: checked; speculative 8B b1 (alpha 0.5-0.9); a round's host time
#   bash benchmarks/gpu_round2.sh x2  # speculative 8B at batch 8 and 32, oracle and the 1B drafter with the rule
#   bash benchmarks/gpu_round2.sh z3  # dmv on tensor cores timed with dependent products; speculative 8B b1 with the picks
#   bash benchmarks/gpu_round2.sh z4  # dmv past 8 rows (tiles of 8): checked, timed; 1B decode 1-32 rows, up to 8 then 32
#   bash benchmarks/gpu_round2.sh y1  # prompt lookup on real text, the real model (a call before copies .model-a/part.00
#                                     to $HOME/gpu/part.00.model; this one carries .model-b)
#   bash benchmarks/gpu_round2.sh v2  # speculative, 8B batch 8 and 32: oracle at alpha 0.7, the 1B drafter with the rule
#   bash benchmarks/gpu_round2.sh q1  # dmv checked (2-32 rows); 1B static: this code, round 1's, this code with dmv to 32 rows
#   bash benchmarks/gpu_round2.sh q2  # (carries .model-a, copied first) speculative 8B at batch 8 and 32 (x2)
#   bash benchmarks/gpu_round2.sh q3  # (carries .model-b) prompt lookup on the real model (y1); structured, this code
#                                     against the code before (.prev)
#   bash benchmarks/gpu_round2.sh q4  # static batches of the continuous bench one by one; speculative 8B at 8-128
#   bash benchmarks/gpu_round2.sh r1  # 8B static (batch 1-128): this code, round 1's; 1B static at 32 and 128 (the pool's grid)
#   bash benchmarks/gpu_round2.sh r2  # speculative 8B at batch 1-128: oracle, the random 1B drafter, its cost with oracle drafts
#   bash benchmarks/gpu_round2.sh r3  # structured output at 128 tokens, twice; the static half of the continuous bench; the pair
#   bash benchmarks/gpu_round2.sh r4  # (carries .old, .whl, .tok) r3; an 8B admission's peak memory; r2 after the catch-up fix
#   bash benchmarks/gpu_round2.sh r5  # (carries .old, .whl, .tok) after the prefill chunk bound and the constrained step's
#                                     new order: r1, structured at 128 tokens twice, the rule's trace with a draft model
#   bash benchmarks/gpu_round2.sh r6  # the rule's trace and speculative 8B at 1-32, the oracle's rows independent
#   bash benchmarks/gpu_round2.sh s1  # (carries .whl, .tok) structured variants alternating in one process; the rule's
#                                     trace with the engine's phases (what a switch of modes costs)
#   bash benchmarks/gpu_round2.sh s2  # after the draft pool fix and the windowed rule: the trace again (rule warmed),
#                                     speculative 8B at batch 1 and 32 (oracle, the 1B drafter's cost, random 1B)
#   bash benchmarks/gpu_round2.sh s3  # s2's trace alone (it ran past s2's time limit)
#   bash benchmarks/gpu_round2.sh n1  # the prefill chunk compiled or not, alternating (1B, 8B); speculative 8B at batch
#                                     1 and 32, 64 tokens, with the rule's measuring budget
#   bash benchmarks/gpu_round2.sh n2  # speculative 8B at batch 1 and 32, 256 tokens, plain and speculative runs
#                                     alternating (3 of each, medians)
#   bash benchmarks/gpu_round2.sh n3  # (carries .old) 1B static against round 1 (the prefill compiled on a GPU),
#                                     processes alternating, twice each
#   bash benchmarks/gpu_round2.sh n4  # n2 at 64 tokens
#   bash benchmarks/gpu_round2.sh n6  # (carries .old) after chunks over 2,048 tokens went uncompiled: n5, then 1B
#   bash benchmarks/gpu_round2.sh n5  # (carries .old) 8B static against round 1 (prompt 128, 64 generated), alternating
#   (m1-m3, twelfth session: intermediate versions of structured_ab.py, described in benchmarks/README.md)
#   bash benchmarks/gpu_round2.sh m4  # (carries .whl, .tok) masks read in place (mapped.HostArray): the probe, then
#                                     structured variants, 1B and 8B at batch 32
#   bash benchmarks/gpu_round2.sh p26 # (carries .old) a first chunk's first layers launched early: 1B static 32/128 against
#                                     round 1 and this code without it; the admission's host timeline at 32 rows
#   bash benchmarks/gpu_round2.sh p27 # (carries .old) the same for the 8B at 32/128
#   bash benchmarks/gpu_round2.sh p28 # (carries .old) the early launch bounded to chunks of 4,096 tokens: p26's 1B
#                                     run again, then the 8B at 32 rows
#   bash benchmarks/gpu_round2.sh p29 # (carries .old) decoding against round 1 over longer runs: 1B 32/128 rows, 256
#                                     generated; 8B 128 rows, 128 generated
#   bash benchmarks/gpu_round2.sh p30 # (carries .old) does what a row reserves (max_tokens) move prefill against round 1?
#                                     1B 32/128 rows, 32 then 256 generated, twice, on one machine
#   bash benchmarks/gpu_round2.sh p31 # does a decode step copy the KV pool? 1B, 128 and 32 rows, the same steps with a
#                                     small and a large reservation (decode_reserve.py)
#   bash benchmarks/gpu_round2.sh p32 # (carries .old) a decode step's host and device time, 1B at 32 and 128 rows, this
#                                     code and round 1 (mlxfun profile), twice alternating (run before and after the
#                                     decode loop's trim, with a rounds_ab at 128 rows after the second)
#   bash benchmarks/gpu_round2.sh p33 # (carries .old) the session's final code: 1B static 1/8/32/128 against round 1,
#                                     128 generated
#   bash benchmarks/gpu_round2.sh p34 # (carries .old) a chunk's writes as one slice update where its slots are one run
#                                     (chunk_write.py view against run; rounds_ab --scatter: 1B 32 and 128 rows)
#   bash benchmarks/gpu_round2.sh p35 # (carries .old) p33 on the nineteenth session's code (chunks written as runs)
#   bash benchmarks/gpu_round2.sh p36 # (carries .old) the 1B admission's timeline at 128 rows; 8B 32 and 128 rows against
#                                     round 1, and with every write scattered
#   bash benchmarks/gpu_round2.sh p37 # (carries .old) a chunk's attention, grouped against fused, by shape
#                                     (attention_paths.py); 1B 32 and 128 rows with chunks over 2^25 scores fused
#   bash benchmarks/gpu_round2.sh p38 # (carries .old) p37 with fused attention given an additive mask, first calls timed
#                                     before any other; 1B 128 rows with chunks over 2^25 scores fused
#   bash benchmarks/gpu_round2.sh p39 # (carries .old) the nineteenth session's code: 1B 1/8/32/128 and 8B 32/128 against
#                                     round 1; attention paths at the 8B's head size
#   bash benchmarks/gpu_round2.sh p40 # (carries .old) 1B 128 rows, fused against grouped attention (2^26 scores) in one run;
#                                     1B 8 and 32 rows again, 6 repeats
#   bash benchmarks/gpu_round2.sh p41 # (carries .old) p39's 1B table with 6 repeats (the session's final figures)
#   bash benchmarks/gpu_round2.sh p42 # (carries .old) one decode step's nodes and host time, this code and round 1
#                                     (step_nodes.py; 1B, batch 1 and 32)
#   bash benchmarks/gpu_round2.sh p43 # the 1B admission's peak at 128 rows, fused against grouped attention, with MLX's
#                                     default and 20 ops per CUDA graph (admit_memory.py)
#   bash benchmarks/gpu_round2.sh p44 # (carries .old) the decode loop's host time at 1B batch 1 and 32, real steps, by
#                                     phase; then 1B static at 1 and 32 against round 1
#   bash benchmarks/gpu_round2.sh p45 # the host's cost of a graph node by kind (node_costs.py)
#   bash benchmarks/gpu_round2.sh p46 # (carries .old) after the least pool's compaction fix and the leaner loop: the
#                                     loop's host time at batch 1 by phase (it ran past a 100 s limit: 200 now),
#                                     then 1B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p47 # (carries .old) p46's loop at batch 1; 8B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p48 # (carries .old) is each step's KV write in place while the step before runs?
#                                     (pool_copies.py, 1B, batch 1 and 32, both codes)
#   bash benchmarks/gpu_round2.sh p49 # (carries .old) the loop's phases at 1B batch 1 and 32, with a step in flight
#                                     and with the device idle before each launch (loop_host.py --idle)
#   bash benchmarks/gpu_round2.sh p50 # (carries .old) p42 again, round 1's cache growth evaluated before its nodes are counted
#   bash benchmarks/gpu_round2.sh p51 # (carries .old) products through transposed views: the loop's phases at 1B batch 1,
#                                     then 1B static at 1 and 32 against round 1
#   bash benchmarks/gpu_round2.sh p52 # (carries .old) a decode step's bookkeeping fused and its KV writes without
#                                     reshapes: kernels checked, smoke, step nodes at batch 1, the loop's phases at
#                                     batch 1, then 1B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p53 # (carries .old) 1B batch 1 against round 1, 12 repeats of 256 tokens; 8B static
#                                     at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p54 # (carries .old) the session's final code (table widths read at run time):
#                                     kernels checked, smoke, the first step at a new width (stall_probe.py),
#                                     1B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p55 # (carries .old) after streamed detokenization (DecodeStream): continuous against
#                                     round 1 (round 1 first); 1B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p56 # (carries .old, .prev: the commit before) run from branch
#                                     prefill-compile-after's policy (chunk shapes compiled from their second sight):
#                                     continuous and static passes, that code / .prev / round 1 (ABBA); ncu of one 1B
#                                     decode step at batch 1, this code and round 1
#   bash benchmarks/gpu_round2.sh p57 # (run on an H100, twenty-seventh session) decode attention reading its mask and table at once: kernels
#                                     checked, smoke, ncu of one 1B decode step at batch 1 (against p56's); a new
#                                     chunk shape's first admission, plain and compiled (prefill_first_sight.py, each
#                                     twice, in turn)
#   bash benchmarks/gpu_round2.sh p60 # (carries .old) does this code's static mixed pass slow down as a process repeats it? (CUDA graph cache 400, 4000)
#   bash benchmarks/gpu_round2.sh p61 # (carries .old) 1B static mixed batches, round 1 and this code alone, CUDA graph cache 400 / 4000 / 400
#   bash benchmarks/gpu_round2.sh p63 # (carries .old) 1B at 32 rows against round 1: rounds_ab at 32/128/512 tokens,
#                                     ncu of a decode step, step_timeline.py (the twenty-seventh session's calls, gathered)
#   bash benchmarks/gpu_round2.sh p62 # (carries .old) p61 with the codes' cold-pass order alternating across six processes
#   bash benchmarks/gpu_round2.sh p59 # (carries .old) 1B static batches of mixed prompts: round 1, this code, its prefill
#                                     plain and compiled from a shape's second sight, cold and warm in one process
#   bash benchmarks/gpu_round2.sh p58 # (carries .old) 1B static at 1-128 against round 1
#   bash benchmarks/gpu_round2.sh p25 # (carries .whl, .tok) mlxfun bench --structured with medians of 5 alternating pairs
#                                     (1B, 32 rows, 128 tokens): 0.98x (eighteenth session)
#   bash benchmarks/gpu_round2.sh p24 # (carries .whl, .tok) mlxfun bench --structured alone (1B, 32 rows, 64 tokens),
#                                     with every thread's stack dumped if it runs past its time (p21's did)
#   bash benchmarks/gpu_round2.sh p23 # (carries .old, .whl, .tok) the session's final code: 1B static 1/8/32/128 against
#                                     round 1; structured_ab 1B free / schema; 8B at 32 and 128 against round 1
#   bash benchmarks/gpu_round2.sh p22 # (carries .old) the next group's host work before the wait: admission timelines
#                                     (1B, 128), then 1B at 32 and 128 against round 1 (and groups of 16,384), 8B at 128
#   bash benchmarks/gpu_round2.sh p21 # (carries .old, .whl, .tok) static admissions' host timelines, this code and round 1
#                                     (admit_timeline.py, 1B at 32 and 128); structured_ab 8B free / 4 families / 1;
#                                     mlxfun bench --structured (1B, 32 rows, 128 tokens)
#   bash benchmarks/gpu_round2.sh p20 # (carries .whl, .tok) llguidance matcher families: structured_ab 1B free / 4
#                                     families (shipped) / 1 family (before) / 8 and 12 families and threads; the
#                                     timeline with 4 families
#   bash benchmarks/gpu_round2.sh p19 # (carries .whl, .tok) a constrained 1B step's two threads on one timeline
#                                     (structured_timeline.py): which one a slow step waits for
#   bash benchmarks/gpu_round2.sh p18 # (carries .old) a chunk's 16-bit KV written as uint32 words, end to end: the 8B
#                                     admission's peak, elements / words; 1B and 8B at 32 and 128 against round 1
#                                     (run on the words code, its variant then elements; words 3-10% slower, dropped)
#   bash benchmarks/gpu_round2.sh p17 # continuous 1B (256 mixed prompts, 32 rows), the compiled prefill on and off
#                                     (PREFILL_COMPILED_TOKENS 0), alternating in separate processes
#   bash benchmarks/gpu_round2.sh p16 # (carries .old) the table after the ordered writes: 1B and 8B static
#                                     1/8/32/128 against round 1 alternating (rounds_ab.py); continuous 32, both
#   bash benchmarks/gpu_round2.sh p15 # (carries .whl, .tok) structured_ab with 4 llguidance threads (the default now)
#                                     against 2, 8, 12; 1B then 8B
#   bash benchmarks/gpu_round2.sh p14 # (carries .whl, .tok) structured_ab 8B and 1B: free / schema / a new pool per
#                                     step / 4 threads, alternating
#   bash benchmarks/gpu_round2.sh p13 # (carries .whl, .tok) p12 with one llguidance pool per process; structured_ab
#                                     1B (free / schema / a new pool per step, as before) and 8B; chunk writes as
#                                     complex64 words (a chunk_write.py variant since removed: the CUDA scatter takes no complex64)
#   bash benchmarks/gpu_round2.sh p12 # (carries .whl, .tok) a constrained 1B step's host phases, per call
#                                     (structured_costs.py: the engine's wait for the masks, the worker's fill)
#   bash benchmarks/gpu_round2.sh p11 # (carries .old) a first chunk's writes ordered layer by layer (mx.depends):
#                                     the 8B admission's peak with and without; 8B at 32 and 128 against round 1
#   bash benchmarks/gpu_round2.sh p10 # p9 over 1,536 tokens, where the rule measures at 32 rows (no rule-off runs)
#   bash benchmarks/gpu_round2.sh p9  # what an idle draft model costs: no drafter / rule off / rule on (8B, 32 rows)
#   bash benchmarks/gpu_round2.sh p8  # p4 after the catch-up priced and the budget's headroom: 8B batch 32, 512 tokens
#   bash benchmarks/gpu_round2.sh p7  # chunk write variants (a new handle, uint64 words) timed, and in an admission
#   bash benchmarks/gpu_round2.sh p6  # the chunk write from a strided view (chunk_write.py); admission peaks; 8B and
#                                     1B at 32 and 128 against round 1, and with GROUP_TOKENS 4096
#   bash benchmarks/gpu_round2.sh p5  # an 8B admission's peak under variants (admit_variants.py); 8B batch 128
#                                     against round 1 with one prefill group (GROUP_TOKENS 16384)
#   bash benchmarks/gpu_round2.sh p1  # (carries .old) round 1 against this code alternating in one process
#                                     (benchmarks/rounds_ab.py), 8B then 1B static batches
#   bash benchmarks/gpu_round2.sh p2  # (carries .whl, .tok) a draft model priced by its layers too: speculative 8B at
#                                     batch 32, 256 tokens, the rule's rows only (5 of each); structured 8B again
#   bash benchmarks/gpu_round2.sh p3  # (carries .old) after the admission's pool copy fix: 8B static at 32 and 128
#                                     against round 1 (rounds_ab.py); `mlxfun profile` 8B batch 128, both versions
#   bash benchmarks/gpu_round2.sh p4  # speculative 8B at batch 32, 512 tokens, the rule's rows only (it measures)
# A later call on the same warm machine needs no install: the CUDA build stays in $HOME/gpu-site.
# Each step has its own time limit and output file, so one failure costs only itself.
set -u
OUT=${OUT:-/tmp/mlxfun-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "${PYTHONPATH:-}" ] || export PYTHONPATH=$HOME/gpu-site:$PWD
old() { (cd .old && "$@"); }  # round 1's mlxfun: python puts the working directory first on the path
wheels() {  # the server's and structured output's packages, once per machine
  [ -d /tmp/site/httpx2 ] || python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH}"
}
static=(--batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16)
continuous_pair() {  # 256 mixed requests through 32 rows, then as static batches: this code, then round 1's
  timeout 90 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-new.json" | tail -2
  old timeout 90 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-old.json" | tail -2
}
decode_ncu() {  # one decode step of shape $1 at batch $2, kernel by kernel (Nsight Compute): this code, then round 1
  local n P
  for n in new old; do
    P=$PYTHONPATH; [ $n = old ] && P=$HOME/gpu-site:$PWD/.old
    PYTHONPATH=$P timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      --log-file "$OUT/decode-$1-$2-$n.csv" python3 benchmarks/prefill_ncu.py --shape $1 --batch $2 --decode | tail -1
  done
  python3 benchmarks/prefill_ncu.py --summarize "$OUT/decode-$1-$2-new.csv" "$OUT/decode-$1-$2-old.csv" \
    --json "$OUT/decode-ncu-$1-$2.json" > "$OUT/decode-ncu-$1-$2.txt"
  head -60 "$OUT/decode-ncu-$1-$2.txt"
  gzip "$OUT/decode-$1-$2-new.csv" "$OUT/decode-$1-$2-old.csv"
}
case "${1:-a}" in
  a)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    timeout 100 python3 benchmarks/kernels_check.py --json "$OUT/r2-kernels.json" | grep -c '"ok": true'
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/r2-smoke.json" | tail -2
    timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-new.json" | tail -4
    old timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-old.json" | tail -4
    timeout 100 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-new.json" \
      | tail -1
    old timeout 100 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/r2-cont-old.json" \
      | tail -1
    ;;
  b)
    wheels
    timeout 150 python3 -m mlxfun.bench --prefix --shape 1B --prompts 128 --shared-tokens 2000 --gen-tokens 32 \
      --rows 32 --json "$OUT/r2-prefix-1B.json" | tail -5
    timeout 120 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok --batch-sizes 32 --gen-tokens 32 \
      --json "$OUT/r2-structured-1B.json" | tail -1
    timeout 150 python3 benchmarks/multiturn.py --shape 1B --conversations 32 --turns 6 \
      --json "$OUT/r2-multiturn-1B.json" | tail -3
    ;;
  c)
    timeout 300 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,8 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/r2-spec-8B.json" | tail -8
    ;;
  d)
    wheels
    timeout 330 python3 benchmarks/serve_load.py --shape 1B --clients 8,32 --modes greedy,seeded --mlx-lm \
      --mlx-lm-python python3 --repeats 1 --json "$OUT/r2-serve-1B.json" | tail -12
    ;;
  f)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    timeout 100 python3 benchmarks/kernels_check.py --json "$OUT/r2-kernels.json" | grep -c '"ok": true'
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/r2-smoke.json" | tail -2
    timeout 150 python3 benchmarks/step_costs.py --shape 8B --batch-sizes 1,8 --json "$OUT/r2-costs-8B.json"
    timeout 100 python3 benchmarks/step_costs.py --shape 1B --batch-sizes 1,32,128 --json "$OUT/r2-costs-1B.json"
    ;;
  g)
    timeout 400 python3 -m mlxfun.bench --prefix --shape 1B --prompts 256 --shared-tokens 2000 --gen-tokens 64 \
      --rows 32 --json "$OUT/r2-prefix-1B-full.json" | tail -5
    ;;
  h)
    wheels
    timeout 120 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok --batch-sizes 32 --gen-tokens 32 \
      --json "$OUT/r2-structured-1B.json" | tail -1
    timeout 100 python3 -m mlxfun.bench --prefix --shape 1B --prompts 256 --shared-tokens 2000 --gen-tokens 64 \
      --rows 128 --json "$OUT/r2-prefix-1B-rows128.json" | tail -3
    timeout 300 python3 benchmarks/serve_load.py --shape 1B --clients 32 --requests 128 --modes greedy,seeded \
      --mlx-lm --mlx-lm-python python3 --json "$OUT/r2-serve-1B-128.json" | tail -8
    ;;
  s)
    timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-new.json" | tail -4
    old timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-old.json" | tail -4
    ;;
  k)
    timeout 100 python3 benchmarks/kernels_check.py --json "$OUT/r2-kernels.json" | tail -1
    for dense in 0 1; do
      MLXFUN_DENSE_KERNEL=$dense timeout 150 python3 -m mlxfun.bench --shape 1B --batch-sizes 1,2,4,8 \
        --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16 --json "$OUT/r2-1B-dmv$dense.json" | tail -5
    done
    for dense in 0 1; do
      MLXFUN_DENSE_KERNEL=$dense timeout 250 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 \
        --alphas 0.7 --ks 4 --gen-tokens 64 --json "$OUT/r2-spec-8B-dmv$dense.json" | tail -3
    done
    ;;
  t1)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    timeout 100 python3 benchmarks/kernels_check.py --time-dmv --json "$OUT/r2-kernels.json" | grep -v '"ok": true'
    wheels
    timeout 150 python3 benchmarks/structured_costs.py --shape 1B --tokenizer .tok --batch 32 \
      --json "$OUT/r2-structured-costs-1B.json"
    for dense in 0 1; do
      MLXFUN_DENSE_KERNEL=$dense timeout 110 python3 benchmarks/step_costs.py --shape 8B --batch-sizes 1 \
        --json "$OUT/r2-costs-8B-dmv$dense.json"
    done
    ;;
  t3)
    wheels
    structured=(--structured --shape 1B --batch-sizes 32 --gen-tokens 64)
    timeout 150 python3 -m mlxfun.bench "${structured[@]}" --tokenizer .tok --json "$OUT/r2-structured-new.json" | tail -1
    (cd .prev && timeout 150 python3 -m mlxfun.bench "${structured[@]}" --tokenizer ../.tok \
      --json "$OUT/r2-structured-prev.json" | tail -1)
    timeout 150 python3 -m mlxfun.bench --prefix --shape 1B --prompts 256 --shared-tokens 2000 --gen-tokens 64 \
      --rows 256 --json "$OUT/r2-prefix-1B-rows256.json" | tail -3
    timeout 90 python3 benchmarks/prefill_costs.py --shape 1B --batch-sizes 8,32,128 --json "$OUT/r2-prefill-costs-1B.json"
    timeout 120 python3 benchmarks/kernels_check.py --only dmv --time-dmv --json "$OUT/r2-kernels-dmv.json" | tail -10
    timeout 100 python3 benchmarks/structured_costs.py --shape 1B --tokenizer .tok --batch 32 \
      --json "$OUT/r2-structured-costs-1B.json"
    ;;
  t5)
    bash "$0" t3
    continuous_pair
    MLXFUN_DENSE_KERNEL=1 timeout 200 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 --alphas 0.7 \
      --ks 4 --draft-shape 1B --gen-tokens 64 --json "$OUT/r2-spec-8B-dmv1.json" | tail -8
    ;;
  t4)
    continuous_pair
    MLXFUN_DENSE_KERNEL=1 timeout 290 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,8 --alphas 0.7 \
      --ks 4 --draft-shape 1B --gen-tokens 64 --json "$OUT/r2-spec-8B-dmv1.json" | tail -8
    ;;
  u1)
    ncu_prefill() {  # $1: name; the rest: environment for python
      local name=$1; shift
      env "$@" timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        --log-file "$OUT/prefill-$name.csv" python3 benchmarks/prefill_ncu.py --batch 128 | tail -1
    }
    ncu_prefill new PYTHONPATH="$PYTHONPATH"
    ncu_prefill old PYTHONPATH="$HOME/gpu-site:$PWD/.old"
    python3 benchmarks/prefill_ncu.py --summarize "$OUT/prefill-new.csv" "$OUT/prefill-old.csv" \
      --json "$OUT/prefill-ncu.json" | head -60
    rm -f "$OUT"/prefill-*.csv
    wheels
    structured=(--structured --shape 1B --batch-sizes 32 --gen-tokens 64)
    for run in 1 2; do
      timeout 150 python3 -m mlxfun.bench "${structured[@]}" --tokenizer .tok --json "$OUT/r2-structured-new-$run.json" | tail -1
      timeout 150 python3 -c 'import sys, mlxfun.engine as e; e.HEAD_START = 0; from mlxfun import bench; sys.exit(bench.main(sys.argv[1:]))' \
        "${structured[@]}" --tokenizer .tok --json "$OUT/r2-structured-nohead-$run.json" | tail -1
    done
    ;;
  u2)  # the admission's host path cut down: 1B static against round 1, prefill's parts and kernels
    bash "$0" s
    timeout 90 python3 benchmarks/prefill_costs.py --shape 1B --batch-sizes 8,32,128 --json "$OUT/r2-prefill-costs-1B.json"
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/prefill-new.csv" \
      python3 benchmarks/prefill_ncu.py --batch 128 | tail -1
    python3 benchmarks/prefill_ncu.py --summarize "$OUT/prefill-new.csv" --json "$OUT/prefill-ncu.json" | head -30
    rm -f "$OUT/prefill-new.csv"
    ;;
  u4)  # the admission's host time, this code against round 1, batch 1 and 8
    for b in 1 8; do
      timeout 100 python3 benchmarks/admit_profile.py --batch $b --lines 25 2>&1 | tee "$OUT/admit-new-$b.txt" | head -20
      PYTHONPATH="$HOME/gpu-site:$PWD/.old" timeout 100 python3 benchmarks/admit_profile.py --batch $b --lines 25 \
        > "$OUT/admit-old-$b.txt" 2>&1; head -8 "$OUT/admit-old-$b.txt"
    done
    ;;
  u5)  # the same with MLX's buffer cache emptied before each admission (as the bench does); 1B static, continuous
    for b in 1 8; do
      timeout 100 python3 benchmarks/admit_profile.py --batch $b --clear-cache --lines 25 2>&1 \
        | tee "$OUT/admit-new-$b.txt" | head -12
      PYTHONPATH="$HOME/gpu-site:$PWD/.old" timeout 100 python3 benchmarks/admit_profile.py --batch $b --clear-cache \
        --lines 25 > "$OUT/admit-old-$b.txt" 2>&1; head -6 "$OUT/admit-old-$b.txt"
    done
    small=(--shape 1B --batch-sizes 1,8 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16)
    timeout 100 python3 -m mlxfun.bench "${small[@]}" --json "$OUT/r2-1B-small-new.json" | tail -3
    old timeout 100 python3 -m mlxfun.bench "${small[@]}" --json "$OUT/r2-1B-small-old.json" | tail -3
    ;;
  u6)  # one 8B decode step at batch 8, kernel by kernel, this code against round 1; continuous against round 1
    decode_ncu 8B 8  # (its files were decode-{new,old}.csv and decode-ncu-8B.json when it ran)
    continuous_pair
    ;;
  u3)  # 8B static against round 1; continuous against round 1
    timeout 250 python3 -m mlxfun.bench --shape 8B "${static[@]}" --json "$OUT/r2-8B-new.json" | tail -4
    old timeout 250 python3 -m mlxfun.bench --shape 8B "${static[@]}" --json "$OUT/r2-8B-old.json" | tail -4
    ;;
  t2)
    timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-new.json" | tail -4
    old timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/r2-1B-old.json" | tail -4
    continuous_pair
    timeout 150 python3 -m mlxfun.bench --prefix --shape 1B --prompts 256 --shared-tokens 2000 --gen-tokens 64 \
      --rows 256 --json "$OUT/r2-prefix-1B-rows256.json" | tail -3
    ;;
  v1)
    timeout 330 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 --alphas 0.5,0.7,0.9 --ks 4 \
      --draft-shape 1B --gen-tokens 256 --json "$OUT/r2-spec-8B-b1.json" | tail -12
    for step in "--verify 4"; do  # one decode step: 534 kernels, 5.61 ms (2026-12-02-h200-s5-verify-ncu-before.json)
      name=$(echo $step | tr -d ' -')
      timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/$name.csv" \
        python3 benchmarks/prefill_ncu.py --shape 8B --batch 1 $step | tail -1
    done
    python3 benchmarks/prefill_ncu.py --summarize "$OUT/verify4.csv" --json "$OUT/verify-ncu-8B.json" | head -30
    gzip "$OUT"/*.csv
    ;;
  v3)  # where a verify round's host time goes (8B batch 1), then v1's batch-1 bench
    timeout 200 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 --json "$OUT/verify-profile-8B.json"
    timeout 300 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 --alphas 0.5,0.7,0.9 --ks 4 \
      --draft-shape 1B --gen-tokens 256 --json "$OUT/r2-spec-8B-b1.json" | tail -12
    ;;
  w1)  # where a verify round's time goes, 8B batch 1: host phases, and rounds queued back to back
    timeout 400 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 --json "$OUT/verify-profile-8B.json"
    ;;
  w2)  # the host's launch cost of a decode step and a verify round (8B batch 1) under MLX's CUDA graph settings
    for env in MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_OPS_PER_BUFFER=400 \
               MLX_MAX_OPS_PER_BUFFER=2000; do
      echo "== $env"
      env $env timeout 100 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 --loops-only \
        --json "$OUT/launch-$env.json"
    done
    MLX_USE_CUDA_GRAPHS=0 timeout 150 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 \
      --json "$OUT/verify-profile-8B-nographs.json"
    ;;
  w3)  # launch cost with mlxfun.dmv off / on (in one process), default graphs and 400 ops per graph; the bench, dmv off / on
    for ops in 100 400; do
      echo "== MLX_MAX_OPS_PER_BUFFER=$ops"
      MLX_MAX_OPS_PER_BUFFER=$ops timeout 200 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 --loops-only \
        --dmv-ab --draft-shape 1B --json "$OUT/launch-ops$ops.json" | grep loop
    done
    for dense in 0 1; do
      MLXFUN_DENSE_KERNEL=$dense timeout 150 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 \
        --alphas 0.7 --ks 4 --gen-tokens 256 --json "$OUT/r2-spec-8B-b1-dmv$dense.json" | tail -4
    done
    ;;
  w4)  # dmv split across warps: checked, each launch timed per map; speculative 8B b1 at the fastest; 1B decode at 1-8
    timeout 300 python3 benchmarks/kernels_check.py --only dmv --time-dmv --json "$OUT/dmv-tune.json" | tail -32
    timeout 200 python3 benchmarks/dmv_tuned.py "$OUT/dmv-tune.json" -- --speculative --shape 8B --batch-sizes 1 \
      --alphas 0.5,0.7,0.9 --ks 4 --gen-tokens 256 --json "$OUT/r2-spec-8B-b1-dmv-tuned.json" | tail -8
    small=(--shape 1B --batch-sizes 1,2,4,8 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16)
    timeout 90 python3 benchmarks/dmv_tuned.py "$OUT/dmv-tune.json" -- "${small[@]}" --json "$OUT/r2-1B-dmv-tuned.json" \
      | tail -5
    timeout 90 python3 -m mlxfun.bench "${small[@]}" --json "$OUT/r2-1B-dmv-off.json" | tail -5
    ;;
  x1)  # dmv as shipped (tuned launches, on by default): checked; speculative 8B b1; a round's host time
    timeout 100 python3 benchmarks/kernels_check.py --only dmv | tail -1
    timeout 250 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1 --alphas 0.5,0.7,0.9 --ks 4 \
      --gen-tokens 256 --json "$OUT/r2-spec-8B-b1.json" | tail -8
    timeout 150 python3 benchmarks/verify_profile.py --shape 8B --tokens 128 --json "$OUT/verify-profile-8B.json"
    ;;
  x2)  # speculative 8B at batch 8 and 32 (oracle; the 1B drafter with the rule), 64 tokens
    timeout 550 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 8,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/r2-spec-8B-b8-32.json" | tail -12
    ;;
  z3)  # dmv on tensor cores timed per launch with dependent products (5 rows); speculative 8B b1 with those picks
    timeout 150 python3 benchmarks/kernels_check.py --only dmv --time-dmv --rows 5 --json "$OUT/dmv-mma-tune-chained.json" \
      | grep -v '"ok": true' | tail -12
    timeout 260 python3 benchmarks/dmv_tuned.py "$OUT/dmv-mma-tune-chained.json" -- --speculative --shape 8B \
      --batch-sizes 1 --alphas 0.7 --ks 4 --gen-tokens 256 --json "$OUT/spec-8B-b1-mma-chained.json"
    ;;
  z4)  # dmv past 8 rows: checked, timed at 16 and 32 rows; 1B decode at 1-32 rows with it up to 8 rows, then 32
    timeout 120 python3 benchmarks/kernels_check.py --only dmv --time-dmv --rows 16,32 --json "$OUT/dmv-rows-16-32.json" \
      | grep -v '"ok": true' | tail -12
    for rows in 8 32; do
      MLXFUN_DENSE_KERNEL=$rows timeout 150 python3 -m mlxfun.bench --shape 1B --batch-sizes 1,2,4,8,16,32 \
        --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16 --json "$OUT/1B-dmv-rows-$rows.json" | tail -7
    done
    ;;
  q1)  # dmv checked at 2-32 rows; 1B static at 1/8/32/128: this code, round 1's, this code with dmv up to 32 rows
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    timeout 90 python3 benchmarks/kernels_check.py --only dmv --json "$OUT/dmv-check.json" | tail -1
    timeout 130 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-new.json" | tail -5
    old timeout 130 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-old.json" | tail -5
    MLXFUN_DENSE_KERNEL=32 timeout 130 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-new-dmv32.json" \
      | tail -5
    ;;
  q2)  # the first half of the default model's GGUF stays for q3; speculative 8B at batch 8 and 32 (x2)
    mkdir -p $HOME/gpu && cp .model-a/part.00 $HOME/gpu/part.00.model
    bash "$0" x2
    ;;
  q3)  # prompt lookup on the real model (y1); structured output, this code against the code before (.prev)
    bash "$0" y1
    wheels
    structured=(--structured --shape 1B --batch-sizes 32 --gen-tokens 32)
    for run in 1 2; do
      timeout 100 python3 -m mlxfun.bench "${structured[@]}" --tokenizer .tok --json "$OUT/structured-new-$run.json" | tail -1
      (cd .prev && timeout 100 python3 -m mlxfun.bench "${structured[@]}" --tokenizer ../.tok \
        --json "$OUT/structured-prev-$run.json" | tail -1)
    done
    ;;
  q4)  # the static half of the continuous bench batch by batch; speculative 8B at batch 8, 32, 128 with the rule's tries
    timeout 120 python3 benchmarks/static_mixed.py --shape 1B --rows 32 --prompts 256 --json "$OUT/static-mixed.json" | tail -20
    timeout 400 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 8,32,128 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/spec-8B-b8-128.json" | tail -14
    ;;
  y1)  # prompt lookup on real text with the real model (SmolLM2, carried in halves: benchmarks/carry_model.sh)
    cat $HOME/gpu/part.00.model .model-b/part.01 > $HOME/gpu/smollm2.gguf
    [ "$(sha256sum $HOME/gpu/smollm2.gguf | cut -d' ' -f1)" = "$(cat .model-b/sha256)" ] || { echo "GGUF halves differ"; exit 1; }
    timeout 300 python3 -m mlxfun.bench --speculative --model $HOME/gpu/smollm2.gguf --batch-sizes 1,8 --alphas 0.7 \
      --ks 4 --gen-tokens 128 --json "$OUT/r2-spec-smollm2-tasks.json" | tail -20
    ;;
  v2)
    timeout 400 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 8,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 128 --json "$OUT/r2-spec-8B-b8-32.json" | tail -12
    ;;
  e)
    timeout 200 python3 -m mlxfun.bench --shape 8B "${static[@]}" --json "$OUT/r2-8B-new.json" | tail -4
    ;;
  r1)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    static8=(--shape 8B --batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 64 --dtypes bfloat16)
    timeout 170 python3 -m mlxfun.bench "${static8[@]}" --json "$OUT/8B-new.json" | tail -5
    old timeout 170 python3 -m mlxfun.bench "${static8[@]}" --json "$OUT/8B-old.json" | tail -5
    static1=(--shape 1B --batch-sizes 32,128 --prompt-tokens 128 --gen-tokens 128 --dtypes bfloat16)
    timeout 80 python3 -m mlxfun.bench "${static1[@]}" --json "$OUT/1B-new.json" | tail -3
    old timeout 80 python3 -m mlxfun.bench "${static1[@]}" --json "$OUT/1B-old.json" | tail -3
    ;;
  r2)
    timeout 560 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,8,32,128 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/spec-8B.json" | tail -24
    ;;
  r3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH}"
    for run in 1 2; do
      timeout 100 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok --batch-sizes 32 --gen-tokens 128 \
        --json "$OUT/structured-128-$run.json" | tail -1
    done
    timeout 120 python3 benchmarks/static_mixed.py --shape 1B --rows 32 --prompts 256 --json "$OUT/static-mixed.json" \
      | tail -20
    continuous_pair
    ;;
  r4)
    bash "$0" r3
    timeout 60 python3 benchmarks/admit_memory.py --shape 8B --batch 128 --prompt-tokens 128 --max-tokens 128 \
      --json "$OUT/admit-memory-8B.json" | tail -4
    bash "$0" r2
    ;;
  r5)
    bash "$0" r1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH}"
    for run in 1 2; do
      timeout 100 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok --batch-sizes 32 --gen-tokens 128 \
        --json "$OUT/structured-128-$run.json" | tail -1
    done
    timeout 150 python3 benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 1,8,32 \
      --json "$OUT/policy-trace.json" | grep "B="
    ;;
  r6)
    timeout 150 python3 benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 1,8,32 \
      --json "$OUT/policy-trace-rows.json" | grep "B="
    timeout 300 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,8,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/spec-8B-rows.json" | tail -17
    ;;
  s1)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH}"
    timeout 200 python3 benchmarks/structured_ab.py --shape 1B --tokenizer .tok --batch 32 --gen-tokens 128 \
      --repeats 3 --json "$OUT/structured-ab.json" | tail -5
    timeout 200 python3 benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 1,32 --phases \
      --json "$OUT/policy-phases.json" | grep "B="
    ;;
  s2)
    timeout 200 python3 benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 1,32 --phases --warm-rule \
      --json "$OUT/policy-phases-2.json" | grep "B="
    timeout 330 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/spec-8B.json" | tail -12
    ;;
  n1)
    timeout 120 python3 benchmarks/prefill_compile_ab.py --shape 1B --batch-sizes 1,8,32,128 \
      --json "$OUT/prefill-compile-1B.json"
    timeout 150 python3 benchmarks/prefill_compile_ab.py --shape 8B --batch-sizes 1,8,32 --repeats 6 \
      --json "$OUT/prefill-compile-8B.json"
    timeout 300 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --json "$OUT/spec-8B-64.json" | tail -12
    ;;
  n2)
    timeout 560 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 256 --repeats 3 --json "$OUT/spec-8B-256.json" | tail -12
    ;;
  n5)
    static8=(--shape 8B --batch-sizes 1,8,32,128 --prompt-tokens 128 --gen-tokens 64 --dtypes bfloat16)
    timeout 170 python3 -m mlxfun.bench "${static8[@]}" --json "$OUT/8B-new.json" | tail -5
    old timeout 170 python3 -m mlxfun.bench "${static8[@]}" --json "$OUT/8B-old.json" | tail -5
    ;;
  m4)
    wheels
    timeout 60 python3 benchmarks/mapped_masks.py --rows 1,32,128
    timeout 200 python3 benchmarks/structured_ab.py --shape 1B --tokenizer .tok --batch 32 --gen-tokens 128 \
      --repeats 6 --json "$OUT/structured-1B-mapped.json" | grep -v repeat
    timeout 300 python3 benchmarks/structured_ab.py --shape 8B --tokenizer .tok --batch 32 --gen-tokens 128 \
      --repeats 6 --variants 0,3,4 --json "$OUT/structured-8B-mapped.json" | grep -v repeat
    ;;
  p26)
    timeout 300 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 6 --late --json "$OUT/rounds-ab-1B-early.json" | tail -10
    timeout 120 python3 benchmarks/admit_timeline.py --shape 1B --old .old --batch-sizes 32 --repeats 5 \
      --json "$OUT/admit-timeline-1B-early.json" | tail -4
    ;;
  p27)
    timeout 400 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 3 --late --json "$OUT/rounds-ab-8B-early.json" | tail -10
    ;;
  p28)
    timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 6 --late --json "$OUT/rounds-ab-1B-early-bounded.json" | tail -10
    timeout 300 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32 --gen-tokens 32 \
      --repeats 4 --late --json "$OUT/rounds-ab-8B-early.json" | tail -5
    ;;
  p29)
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 256 \
      --repeats 6 --json "$OUT/rounds-ab-1B-gen256.json" | tail -6
    timeout 330 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 128 --gen-tokens 128 \
      --repeats 3 --json "$OUT/rounds-ab-8B-128-gen128.json" | tail -3
    ;;
  p30)
    for gen in 32 256 32 256; do
      timeout 100 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens $gen \
        --repeats 4 --json "$OUT/rounds-ab-1B-gen$gen-$RANDOM.json" | grep ratio | sed "s/^/gen $gen /"
    done
    ;;
  p31)
    timeout 200 python3 benchmarks/decode_reserve.py --shape 1B --batch 128 --max-tokens 64,2048 --steps 32 \
      --repeats 3 --json "$OUT/decode-reserve-1B-128.json"
    timeout 150 python3 benchmarks/decode_reserve.py --shape 1B --batch 32 --max-tokens 64,2048 --steps 32 \
      --repeats 3 --json "$OUT/decode-reserve-1B-32.json"
    ;;
  p32)
    for i in 1 2; do
      timeout 100 python3 -m mlxfun.profile --shape 1B --batch-sizes 32,128 --max-tokens 128 --no-matmuls \
        --json "$OUT/profile-1B-$i.json" | tail -2
      old timeout 100 python3 -m mlxfun.profile --shape 1B --batch-sizes 32,128 --max-tokens 128 --no-matmuls \
        --json "$OUT/profile-1B-old-$i.json" | tail -2
    done
    ;;
  p33)
    timeout 250 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final.json" | tail -12
    ;;
  p34)
    timeout 60 python3 benchmarks/chunk_write.py --rows 128 --tokens 128 --layers 16 --head-dim 64 --slots 40000 \
      --contiguous --variants view,run --json "$OUT/chunk-write-1B-run.json"
    timeout 60 python3 benchmarks/chunk_write.py --rows 64 --tokens 128 --contiguous --variants view,run \
      --json "$OUT/chunk-write-8B-run.json"
    timeout 300 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 6 --scatter --json "$OUT/rounds-ab-1B-run.json" | tail -10
    ;;
  p35)
    timeout 260 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-run-final.json" | tail -12
    ;;
  p36)
    timeout 120 python3 benchmarks/admit_timeline.py --shape 1B --old .old --batch-sizes 128 --repeats 5 \
      --json "$OUT/admit-timeline-1B-128-run.json" | tail -30
    timeout 420 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 3 --scatter --json "$OUT/rounds-ab-8B-run.json" | tail -10
    ;;
  p37)
    timeout 120 python3 benchmarks/attention_paths.py --json "$OUT/attention-paths-1B.json"
    timeout 120 python3 benchmarks/attention_paths.py --head-dim 128 --json "$OUT/attention-paths-8B.json"
    timeout 300 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 6 --max-scores 33554432 --json "$OUT/rounds-ab-1B-scores.json" | tail -10
    ;;
  p38)
    timeout 150 python3 benchmarks/attention_paths.py --shapes 32x128,64x128,128x128,96x160,128x256,32x512,8x2048 \
      --json "$OUT/attention-paths-1B-bias.json"
    timeout 300 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 128 --gen-tokens 32 \
      --repeats 6 --max-scores 33554432 --json "$OUT/rounds-ab-1B-128-bias.json" | tail -4
    ;;
  p39)
    timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-fused-final.json" | tail -12
    timeout 300 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 3 --json "$OUT/rounds-ab-8B-fused.json" | tail -6
    timeout 60 python3 benchmarks/attention_paths.py --head-dim 128 --shapes 32x128,64x128,8x1024 \
      --json "$OUT/attention-paths-8B-bias.json"
    ;;
  p40)
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 128 --gen-tokens 32 \
      --repeats 4 --max-scores 67108864 --json "$OUT/rounds-ab-1B-128-fused-vs-grouped.json" | tail -5
    timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 8,32 --gen-tokens 128 \
      --repeats 6 --json "$OUT/rounds-ab-1B-8-32-again.json" | tail -6
    ;;
  p41)
    timeout 400 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 6 --json "$OUT/rounds-ab-1B-final-6.json" | tail -12
    ;;
  p42|p50)  # (the same commands; p50 ran step_nodes.py after its fix)
    for b in 1 32; do
      timeout 150 python3 benchmarks/step_nodes.py --shape 1B --old .old --batch $b --repeats 50 \
        --json "$OUT/step-nodes-1B-$b.json"
    done
    ;;
  p43)
    for ops in default 20; do
      for limit in 16777216 67108864; do
        echo "ops per graph $ops, grouped up to $limit scores:"
        ( [ $ops = default ] || export MLX_MAX_OPS_PER_BUFFER=$ops
          timeout 90 python3 benchmarks/admit_memory.py --shape 1B --batch 128 --max-tokens 128 \
            --grouped-max-scores $limit --json "$OUT/admit-memory-1B-128-ops$ops-limit$limit.json" )
      done
    done
    ;;
  p44)
    for b in 1 32; do
      timeout 120 python3 benchmarks/loop_host.py --shape 1B --real --phases --batch $b --steps 128 --repeats 5 \
        --json "$OUT/loop-host-1B-$b.json"
    done
    timeout 240 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,32 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-1-32.json" | tail -6
    ;;
  p45)
    timeout 120 python3 benchmarks/node_costs.py --nodes 200 --repeats 30 --json "$OUT/node-costs.json"
    ;;
  p46)
    timeout 200 python3 benchmarks/loop_host.py --shape 1B --real --phases --batch 1 --steps 128 --repeats 5 \
      --json "$OUT/loop-host-1B-1.json"
    timeout 440 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 5 --json "$OUT/rounds-ab-1B-final-5.json" | tail -12
    ;;
  p47)
    timeout 200 python3 benchmarks/loop_host.py --shape 1B --real --phases --batch 1 --steps 128 --repeats 5 \
      --json "$OUT/loop-host-1B-1.json"
    timeout 380 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 1,8,32,128 --gen-tokens 32 \
      --repeats 3 --json "$OUT/rounds-ab-8B-final-3.json" | tail -12
    ;;
  p48)
    timeout 200 python3 benchmarks/pool_copies.py --shape 1B --batch 1,32 --steps 64 --json "$OUT/pool-copies-1B.json"
    ;;
  p49)
    for b in 1 32; do
      for idle in "" --idle; do
        echo "batch $b ${idle:-pipelined}:"
        timeout 120 python3 benchmarks/loop_host.py --shape 1B --real --phases $idle --batch $b --steps 128 --repeats 5 \
          --json "$OUT/loop-host-1B-$b${idle:+-idle}.json"
      done
    done
    ;;
  p51)
    timeout 100 python3 -u benchmarks/loop_host.py --shape 1B --real --phases --batch 1 --steps 128 --repeats 4 \
      --json "$OUT/loop-host-1B-1.json"
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,32 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-1-32.json" | tail -6
    ;;
  p52)
    # (100 s cut a fresh H100 off after the bfloat16 cases: it builds each kernel first)
    timeout 240 python3 benchmarks/kernels_check.py --json "$OUT/kernels.json" | grep -c '"ok": true'
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/smoke.json" | tail -2
    timeout 60 python3 benchmarks/step_nodes.py --shape 1B --old .old --batch 1 --repeats 50 \
      --json "$OUT/step-nodes-1B-1.json" | tail -3
    timeout 100 python3 -u benchmarks/loop_host.py --shape 1B --real --phases --batch 1 --steps 128 --repeats 4 \
      --json "$OUT/loop-host-1B-1.json"
    timeout 330 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final-4.json" | tail -12
    ;;
  p53)
    timeout 100 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1 --gen-tokens 256 --repeats 12 \
      --json "$OUT/rounds-ab-1B-1-12.json" | tail -3
    timeout 380 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 1,8,32,128 --gen-tokens 32 \
      --repeats 3 --json "$OUT/rounds-ab-8B-final-3.json" | tail -12
    ;;
  p54)
    # (100 s cut a fresh H100 off after the bfloat16 cases: it builds each kernel first)
    timeout 240 python3 benchmarks/kernels_check.py --json "$OUT/kernels.json" | grep -c '"ok": true'
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/smoke.json" | tail -2
    timeout 100 python3 -u benchmarks/stall_probe.py --gen-tokens 256 --json "$OUT/stall-probe-1B-1.json"
    timeout 330 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final-4.json" | tail -12
    ;;
  p55)
    for i in 1; do
      old timeout 90 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/cont-old-$i.json" \
        | tail -2 | head -1
      timeout 90 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/cont-new-$i.json" \
        | tail -2 | head -1
    done
    timeout 300 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final-4.json" | tail -12
    ;;
  p56)
    cont() { timeout 90 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/cont-$1.json" \
      | tail -2 | head -1; }
    prev() { (cd .prev && "$@"); }
    echo new; cont new-1; echo prev; prev cont prev-1; echo old; old cont old-1
    echo old; old cont old-2; echo prev; prev cont prev-2; echo new; cont new-2
    decode_ncu 1B 1
    ;;
  p57)
    # (100 s cut a fresh H100 off after the bfloat16 cases: it builds each kernel first)
    timeout 240 python3 benchmarks/kernels_check.py --json "$OUT/kernels.json" | grep -c '"ok": true'
    MLX_ENABLE_TF32=0 timeout 100 python3 benchmarks/smoke.py --json "$OUT/smoke.json" | tail -2
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/decode-new.csv" \
      python3 benchmarks/prefill_ncu.py --shape 1B --batch 1 --decode | tail -1
    python3 benchmarks/prefill_ncu.py --summarize "$OUT/decode-new.csv" --json "$OUT/decode-ncu-1B-1.json" \
      > "$OUT/decode-ncu-1B-1.txt"
    head -8 "$OUT/decode-ncu-1B-1.txt"
    gzip "$OUT"/decode-*.csv
    for v in plain compiled plain compiled; do
      timeout 60 python3 benchmarks/prefill_first_sight.py --variant $v --json "$OUT/first-sight-$v-$SECONDS.json"
    done
    ;;
  p60)
    cd benchmarks
    timeout 250 python3 static_drift.py --shape 1B --old ../.old --passes 3 --json "$OUT/static-drift-1B.json" \
      | cut -c1-200
    echo "MLX_CUDA_GRAPH_CACHE_SIZE=4000"
    MLX_CUDA_GRAPH_CACHE_SIZE=4000 timeout 250 python3 static_drift.py --shape 1B --old ../.old --passes 3 \
      --json "$OUT/static-drift-1B-graphs4000.json" | cut -c1-200
    ;;
  p61)  # round 1 and this code alone, with MLX's CUDA-graph cache at its default and at 4000
    cd benchmarks
    for g in 400 4000 400; do
      echo "graphs $g"
      MLX_CUDA_GRAPH_CACHE_SIZE=$g timeout 130 python3 static_mixed_ab.py --shape 1B --old ../.old --repeats 4 \
        --variants "" --json "$OUT/static-mixed-ab-1B-two-graphs$g-$SECONDS.json" | tail -3
    done
    ;;
  p63)  # (carries .old) the 1B at 32 rows against round 1: generated tok/s at 32-512 tokens, a step's kernels, step timelines
    for g in 128 512 32; do
      timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32 --gen-tokens $g --repeats 8 \
        --json "$OUT/rounds-ab-1B-32-gen$g.json" | tail -1
    done
    decode_ncu 1B 32
    cd benchmarks
    for run in "32 128" "32 512" "8 128"; do
      set -- $run
      timeout 200 python3 step_timeline.py --shape 1B --old ../.old --batch $1 --gen-tokens $2 --repeats 6 \
        --json "$OUT/step-timeline-1B-$1-gen$2.json" | tail -3
    done
    ;;
  p62)  # round 1 and this code alone, which code's cold pass comes first alternating across processes
    cd benchmarks
    for first in round1 ours round1 ours round1 ours; do
      echo "cold first: $first"
      timeout 100 python3 static_mixed_ab.py --shape 1B --old ../.old --repeats 2 --variants "" --cold-order $first \
        --json "$OUT/static-mixed-ab-1B-order-$first-$SECONDS.json" | tail -3
    done
    ;;
  p59)
    (cd benchmarks && timeout 400 python3 static_mixed_ab.py --shape 1B --old ../.old --repeats 3 \
      --json "$OUT/static-mixed-ab-1B.json" | tail -25)
    ;;
  p58)
    timeout 330 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final-4.json" | tail -12
    ;;
  p25)
    wheels
    PYTHONFAULTHANDLER=1 timeout -s ABRT 400 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok \
      --batch-sizes 32 --gen-tokens 128 --repeats 5 --json "$OUT/bench-structured-1B-medians.json" 2>&1 | tail -40
    ;;
  p24)
    wheels
    PYTHONFAULTHANDLER=1 timeout -s ABRT 150 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok \
      --batch-sizes 32 --gen-tokens 64 --json "$OUT/bench-structured-1B.json" 2>&1 | tail -40
    ;;
  p23)
    wheels
    timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 32 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final.json" | tail -12
    (cd benchmarks && timeout 120 python3 structured_ab.py --shape 1B --tokenizer ../.tok --batch 32 --repeats 5 \
      --variants 0,3 --json "$OUT/structured-ab-1B-final.json" | tail -3)
    timeout 230 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 32 \
      --repeats 3 --json "$OUT/rounds-ab-8B-final.json" | tail -6
    ;;
  p22)
    timeout 100 python3 benchmarks/admit_timeline.py --shape 1B --old .old --batch-sizes 128 --repeats 3 \
      --json "$OUT/admit-timeline-1B-ahead.json" | head -3
    timeout 170 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 16 \
      --repeats 5 --group-tokens 16384 --json "$OUT/rounds-ab-1B-ahead.json" | tail -9
    timeout 170 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 128 --gen-tokens 16 \
      --repeats 3 --json "$OUT/rounds-ab-8B-ahead.json" | tail -3
    ;;
  p21)
    wheels
    timeout 150 python3 benchmarks/admit_timeline.py --shape 1B --old .old --batch-sizes 32,128 --repeats 3 \
      --json "$OUT/admit-timeline-1B.json"
    timeout 120 python3 -m mlxfun.bench --structured --shape 1B --tokenizer .tok --batch-sizes 32 --gen-tokens 128 \
      --json "$OUT/bench-structured-1B.json" | tail -2
    cd benchmarks
    timeout 240 python3 structured_ab.py --shape 8B --tokenizer ../.tok --batch 32 --repeats 4 --variants 0,3,9 \
      --json "$OUT/structured-ab-8B-families.json" | tail -5
    ;;
  p20)
    wheels
    cd benchmarks
    timeout 240 python3 structured_ab.py --shape 1B --tokenizer ../.tok --batch 32 --repeats 6 --variants 0,3,9,10,11 \
      --json "$OUT/structured-ab-1B-families.json" | tail -7
    timeout 150 python3 structured_timeline.py --shape 1B --tokenizer ../.tok --batch 32 \
      --json "$OUT/structured-timeline-1B-families.json" | tail -30
    ;;
  p19)
    wheels
    cd benchmarks
    timeout 200 python3 structured_timeline.py --shape 1B --tokenizer ../.tok --batch 32 \
      --json "$OUT/structured-timeline-1B.json" | tail -30
    ;;
  p18)
    timeout 120 python3 benchmarks/admit_variants.py --shape 8B --batch 128 --variants base,wide \
      --json "$OUT/admit-variants-8B-words.json"
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 16 \
      --repeats 5 --words --json "$OUT/rounds-ab-1B-words.json" | tail -9
    timeout 250 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 16 \
      --repeats 4 --words --json "$OUT/rounds-ab-8B-words.json" | tail -9
    ;;
  p17)
    nocompile="import sys, mlxfun.step as s; s.PREFILL_COMPILED_TOKENS = 0; from mlxfun import bench; sys.exit(bench.main(sys.argv[1:]))"
    for run in 1 2 3; do  # the first pair also compiles the machine's CUDA kernels
      timeout 95 python3 -c "$nocompile" --shape 1B --continuous 32 --prompts 256 --json "$OUT/cont-plain-$run.json" \
        | grep -v '^{'
      timeout 95 python3 -m mlxfun.bench --shape 1B --continuous 32 --prompts 256 --json "$OUT/cont-compiled-$run.json" \
        | grep -v '^{'
    done
    ;;
  p16)
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B-final.json" | tail -13
    timeout 260 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 3 --json "$OUT/rounds-ab-8B-final.json" | tail -13
    continuous_pair
    ;;
  p15)
    wheels
    cd benchmarks
    timeout 200 python3 structured_ab.py --shape 1B --tokenizer ../.tok --batch 32 --repeats 8 --variants 0,3,6,7,8 \
      --json "$OUT/structured-ab-1B-threads.json" | tail -7
    timeout 200 python3 structured_ab.py --shape 8B --tokenizer ../.tok --batch 32 --repeats 5 --variants 0,3,8 \
      --json "$OUT/structured-ab-8B-threads.json" | tail -5
    ;;
  p14)
    wheels
    cd benchmarks
    timeout 260 python3 structured_ab.py --shape 8B --tokenizer ../.tok --batch 32 --repeats 5 --variants 0,3,5,6 \
      --json "$OUT/structured-ab-8B-pools.json" | tail -6
    timeout 200 python3 structured_ab.py --shape 1B --tokenizer ../.tok --batch 32 --repeats 8 --variants 0,3,5,6 \
      --json "$OUT/structured-ab-1B-pools.json" | tail -6
    ;;
  p13)
    wheels
    timeout 60 python3 benchmarks/chunk_write.py --json "$OUT/chunk-write-8B-wider.json"
    timeout 40 python3 benchmarks/chunk_write.py --layers 16 --head-dim 64 --json "$OUT/chunk-write-1B-wider.json"
    cd benchmarks
    timeout 150 python3 structured_costs.py --shape 1B --tokenizer ../.tok --batch 32 --gen-tokens 128 \
      --json "$OUT/structured-costs-1B-pool.json"
    timeout 200 python3 structured_ab.py --shape 1B --tokenizer ../.tok --batch 32 --repeats 6 --variants 0,3,5 \
      --json "$OUT/structured-ab-1B-pool.json" | tail -5
    timeout 150 python3 structured_ab.py --shape 8B --tokenizer ../.tok --batch 32 --repeats 4 --variants 0,3 \
      --json "$OUT/structured-ab-8B-pool.json" | tail -4
    ;;
  p12)
    wheels
    (cd benchmarks && timeout 240 python3 structured_costs.py --shape 1B --tokenizer ../.tok --batch 32 \
      --gen-tokens 128 --json "$OUT/structured-costs-1B.json")
    ;;
  p11)
    timeout 150 python3 benchmarks/admit_variants.py --shape 8B --batch 128 --variants base,nodepends,nowrite \
      --json "$OUT/admit-variants-8B-depends.json"
    timeout 250 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 64 \
      --repeats 4 --json "$OUT/rounds-ab-8B-depends.json"
    ;;
  p10)
    timeout 250 python3 benchmarks/idle_drafter.py --shape 8B --draft-shape 1B --batch 32 --gen-tokens 1536 \
      --repeats 3 --skip-off --json "$OUT/idle-drafter-8B-32-1536.json"
    ;;
  p9)
    timeout 400 python3 benchmarks/idle_drafter.py --shape 8B --draft-shape 1B --batch 32 --gen-tokens 512 \
      --repeats 6 --json "$OUT/idle-drafter-8B-32.json"
    ;;
  p8)
    timeout 480 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 32 --alphas 0.7 --draft-shape 1B \
      --gen-tokens 512 --repeats 3 --rule-only --json "$OUT/spec-8B-512-rule-priced.json" | tail -8
    ;;
  p7)
    timeout 60 python3 benchmarks/chunk_write.py --json "$OUT/chunk-write-8B-2.json"
    timeout 200 python3 benchmarks/admit_variants.py --shape 8B --batch 128 --variants wide \
      --json "$OUT/admit-variants-8B-writes.json"
    ;;
  p6)
    timeout 60 python3 benchmarks/chunk_write.py --json "$OUT/chunk-write-8B.json"
    timeout 120 python3 benchmarks/admit_variants.py --shape 8B --batch 128 --variants base,group4096,nowrite \
      --json "$OUT/admit-variants-8B-view.json"
    timeout 250 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 16 \
      --repeats 4 --group-tokens 4096 --json "$OUT/rounds-ab-8B-view.json"
    timeout 150 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 32,128 --gen-tokens 16 \
      --repeats 4 --group-tokens 4096 --json "$OUT/rounds-ab-1B-view.json"
    ;;
  p5)
    timeout 330 python3 benchmarks/admit_variants.py --shape 8B --batch 128 --json "$OUT/admit-variants-8B.json"
    timeout 250 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 128 --gen-tokens 16 \
      --repeats 4 --group-tokens 16384 --json "$OUT/rounds-ab-8B-groups.json"
    ;;
  p1)
    timeout 320 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 1,8,32,128 --gen-tokens 64 \
      --repeats 4 --json "$OUT/rounds-ab-8B.json"
    timeout 200 python3 benchmarks/rounds_ab.py --shape 1B --old .old --batch-sizes 1,8,32,128 --gen-tokens 128 \
      --repeats 4 --json "$OUT/rounds-ab-1B.json"
    ;;
  p3)
    timeout 230 python3 benchmarks/rounds_ab.py --shape 8B --old .old --batch-sizes 32,128 --gen-tokens 64 \
      --repeats 4 --json "$OUT/rounds-ab-8B-fix.json"
    timeout 150 python3 -m mlxfun.profile --shape 8B --batch-sizes 128 --no-matmuls --json "$OUT/profile-8B-128.json" \
      | tail -25
    old timeout 150 python3 -m mlxfun.profile --shape 8B --batch-sizes 128 --no-matmuls \
      --json "$OUT/profile-8B-128-old.json" | tail -25
    ;;
  p4)
    timeout 500 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 32 --alphas 0.7 --draft-shape 1B \
      --gen-tokens 512 --repeats 5 --rule-only --json "$OUT/spec-8B-512-rule.json" | tail -6
    ;;
  p2)
    wheels
    timeout 330 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 32 --alphas 0.7 --draft-shape 1B \
      --gen-tokens 256 --repeats 5 --rule-only --json "$OUT/spec-8B-256-rule.json" | tail -6
    timeout 220 python3 benchmarks/structured_ab.py --shape 8B --tokenizer .tok --batch 32 --gen-tokens 128 \
      --repeats 6 --variants 0,3 --json "$OUT/structured-8B-mapped-2.json" | grep -v repeat
    ;;
  n6)
    bash "$0" n5
    timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-new.json" | tail -5
    old timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-old.json" | tail -5
    ;;
  n4)
    timeout 560 python3 -m mlxfun.bench --speculative --shape 8B --batch-sizes 1,32 --alphas 0.7 --ks 4 \
      --draft-shape 1B --gen-tokens 64 --repeats 3 --json "$OUT/spec-8B-64-paired.json" | tail -12
    ;;
  n3)
    for run in 1 2; do
      timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-new-$run.json" | tail -5
      old timeout 110 python3 -m mlxfun.bench --shape 1B "${static[@]}" --json "$OUT/1B-old-$run.json" | tail -5
    done
    ;;
  s3)
    timeout 500 python3 benchmarks/policy_trace.py --shape 8B --draft-shape 1B --batch-sizes 1,32 --phases --warm-rule \
      --json "$OUT/policy-phases-2.json" | grep "B="
    ;;
esac
