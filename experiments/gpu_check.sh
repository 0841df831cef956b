#!/usr/bin/env bash
# The one script to run when a GPU is lent (device tool: `bash experiments/gpu_check.sh`, timeout ~600 s on one GPU:
# at most 360 s of kernels, 90 s of the executor, 60 + 90 s of the memory checks and seconds for the probe's
# "skipped"; set BENCH_TIMEOUT_S lower for a shorter run; with 4 GPUs the probe and the pipeline benchmark add up
# to 360 s more).
# Everything lands under $OUT (or experiments/results/ without it); each step's JSON is written as it goes,
# so a run cut short still brings back what it measured.
set -uo pipefail
out="${OUT:-experiments/results}"
mkdir -p "$out"
export PYTHONPATH=.
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "${PYTHON:-python}" -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$out/gpu_check_env.txt"
# 1. kernels at the 1.3B widths, compiled: values and all gradients against the references (seconds)
# 2. attention vs XLA and cuDNN over sequence lengths, LayerNorm and loss vs XLA, the 1.3B step (5 variants)
timeout "${BENCH_TIMEOUT_S:-360}" "${PYTHON:-python}" -m experiments.bench.speed.bench_kernels --out "$out/bench_kernels.json" \
    --plot "$out/bench_kernels.png" 2>&1 | tail -n 40
echo "bench exit: ${PIPESTATUS[0]}"
# 3. the pipeline executor's own machinery at p = 1 (tick scans, residual stash, conds) against the reference
#    step, recompute none and full: the one pipeline measurement a single GPU can make
timeout "${EXECUTOR_TIMEOUT_S:-90}" "${PYTHON:-python}" -m experiments.bench.speed.bench_executor_p1 --rounds 5 \
    --out "$out/bench_executor_p1.json" 2>&1 | tail -n 5
echo "executor bench exit: ${PIPESTATUS[0]}"
# 3b. the training step's bytes per parameter on the GPU (bfloat16, d = 1, m = 1 and 4, compiled, not run): what
#     XLA:GPU holds where XLA:CPU converts bf16 weights to float32 and runs its all-reduce out of place
timeout "${MEMORY_TIMEOUT_S:-60}" "${PYTHON:-python}" -m experiments.bench.memory.bench_optimizer_memory --dtypes bfloat16 \
    --data-sizes 1 --out "$out/bench_optimizer_memory_gpu.json" 2>&1 | tail -n 3
echo "memory bench exit: ${PIPESTATUS[0]}"
# 3c. the 1.3B-shaped step's memory: compiled for this GPU, compiled ahead of time for the described target (what
#     ptd-train --compile-only says without a GPU), the device's peak after two steps, the planner's prediction
timeout "${GPU_MEMORY_TIMEOUT_S:-90}" "${PYTHON:-python}" -m experiments.bench.memory.gpu_memory_check \
    --out "$out/gpu_memory_check.json" 2>&1 | tail -n 2
echo "gpu memory check exit: ${PIPESTATUS[0]}"
# 4. pipe-divergent branches (per-rank) against uniform on 4 devices, with a hang timeout; with fewer than 4 GPUs it
#    says "skipped" at once. 5. the p = 4 pipeline benchmark (interleaved vs 1F1B, both branchings), when 4 GPUs
#    exist; skipped otherwise.
timeout "${PROBE_TIMEOUT_S:-120}" "${PYTHON:-python}" -m experiments.bench.probes.probe_divergent_branches --timeout-s 90 \
    --out "$out/probe_divergent_branches.json" 2>&1 | tail -n 3
echo "divergent-branches probe exit: ${PIPESTATUS[0]}"
if "${PYTHON:-python}" -c "import jax, sys; sys.exit(len(jax.devices()) < 4)" 2>/dev/null; then
  timeout "${PIPELINE_TIMEOUT_S:-240}" "${PYTHON:-python}" -m experiments.bench.speed.bench_interleaving --rounds 3 \
      --out "$out/bench_interleaving_gpu.json" 2>&1 | tail -n 3
  echo "pipeline bench exit: ${PIPESTATUS[0]}"
  # 6. every schedule of the one executor (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) against the single device at p = 4
  timeout "${ZERO_BUBBLE_TIMEOUT_S:-240}" "${PYTHON:-python}" -m experiments.bench.speed.bench_one_pipeline --rounds 3 \
      --out "$out/bench_one_pipeline_gpu.json" 2>&1 | tail -n 7
  echo "one-pipeline bench exit: ${PIPESTATUS[0]}"
else
  echo "pipeline and zero-bubble benches: skipped (need 4 devices)"
fi
# 7. the tests that need a GPU (marked gpu, excluded from the default run): NVML's energy counter on this GPU
timeout "${GPU_TESTS_TIMEOUT_S:-120}" "${PYTHON:-python}" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 3
echo "gpu tests exit: ${PIPESTATUS[0]}"
# 8. ptd-train end to end: the README's main command, and bf16 runs that attend by cuDNN (GPT 1.3B and Llama 3.2 1B
#    shapes, 4 layers each)
bash experiments/gpu_train_check.sh
