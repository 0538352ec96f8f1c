#!/bin/bash
# The GPU runs the open kernel and collector work still waits for, in priority order, as parts that
# each fit one 10-minute device call (setup included). Every job runs under its own timeout and
# the part goes on after a failure, so one call always returns what it measured.
#
# Usage, on the device machine from the checkout's root (wheels in .whl/, see device_tests.sh):
#   bash scripts/gpu_pending.sh bits        # gpu tests of the FP8 kernels not yet run on a GPU (~9 min)
#   bash scripts/gpu_pending.sh graphs      # MoE decode in CUDA graphs; fused logprobs, split policy (~9 min)
#   bash scripts/gpu_pending.sh trainer     # the compiled trainer at the bench shape: phases, who waits for the device (~8 min)
#   bash scripts/gpu_pending.sh rl          # the compiled trainer at RL-sized batches (~8 min)
#   bash scripts/gpu_pending.sh kernels     # FP8 fused/host/MoE, decode GEMMs, fused logprobs memory (~9 min)
#   bash scripts/gpu_pending.sh steps       # GRPO steps: --fp8, and the long-context one (~9 min)
# Logs go to $OUT/<part>.log when $OUT is set (the device tool brings it back), else to stdout.
set -u
part=${1:?usage: gpu_pending.sh bits|graphs|trainer|rl|kernels|steps}
log=${OUT:+$OUT/$part.log}
log=${log:-/dev/stdout}
rm -rf /tmp/isoaudit-site  # install this checkout, not a previous call's
run() {  # run LABEL SECONDS COMMAND...: one job under its timeout, its outcome on one line
  local label=$1 seconds=$2
  shift 2
  echo "=== $label (at most ${seconds} s): $*" >>"$log"
  local started=$SECONDS
  timeout "$seconds" bash scripts/device_tests.sh "$@" >>"$log" 2>&1
  echo "=== $label: exit $? after $((SECONDS - started)) s" >>"$log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$log" 2>&1
case $part in
  bits)
    run fp8-grouped-fused 240 pytest -m gpu tests/kernels/test_fp8_grouped.py tests/kernels/test_fp8_fused.py
    run fp8-e2e 300 pytest -m gpu tests/kernels/test_fp8_e2e.py
    ;;
  graphs)
    run moe-graph-decode 300 pytest -m gpu tests/kernels/test_moe_graph_decode.py tests/kernels/test_moe_e2e.py \
      tests/collectors/test_engine_graph_prints.py
    run logprobs-gemm 240 pytest -m gpu tests/kernels/test_fused_logprobs.py tests/kernels/test_logprobs.py tests/kernels/test_gemm.py
    ;;
  trainer)
    run trainer-bench-shape 360 python bench/collector_overhead.py --scenario graphs --device cuda --model 0.5b \
      --part trainer --rounds 8 --phases --no-switch --find-waits
    run trainer-bits 90 pytest -m gpu tests/collectors/test_step_batching.py
    ;;
  rl)
    run trainer-rl-shape 420 python bench/collector_overhead.py --scenario graphs --device cuda --model 0.5b \
      --part trainer --rounds 3 --phases --no-switch --prompt 256 --completion 1024 --kernels 20 \
      --without-distribution
    ;;
  kernels)
    run fp8-benches 300 python bench/kernels.py --only fp8_fused@graph,fp8_host@eager,fp8_moe@graph
    run gemm-small 120 python bench/kernels.py --only gemm_small@graph
    run fingerprint-kernel 60 python bench/fingerprints.py
    run logprobs-memory 120 python bench/logprobs_memory.py
    ;;
  steps)
    run rl-loop-fp8 270 python bench/rl_loop_gpu.py --fp8
    run rl-loop-long 270 python bench/rl_loop_gpu.py --prompt-len 8192
    ;;
  *)
    echo "gpu_pending.sh: no part named '$part' (bits, graphs, trainer, rl, kernels, steps)" >&2
    exit 2
    ;;
esac
grep "^=== .*: exit" "$log" 2>/dev/null || true
