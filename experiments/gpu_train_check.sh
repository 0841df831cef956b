#!/usr/bin/env bash
# ptd-train end to end on one GPU (called by experiments/gpu_check.sh, or alone): the README's main command as it
# is (float32: the Pallas flash kernel after its self-check), then bf16 runs that resolve attention to cuDNN (a
# GPT-2 1.3B shape cut to 4 layers; Llama 3.2 1B's GQA and RoPE cut to 4 layers). Each run's last stdout line is its
# JSON summary; the metrics files land under $OUT.
set -uo pipefail
out="${OUT:-experiments/results}"
mkdir -p "$out"
export PYTHONPATH=.
py="${PYTHON:-python}"
common=(--no-progress --log-interval 10)
run() {  # name, then ptd-train's flags
  local name=$1
  shift
  echo "== $name: ptd-train $*"
  timeout "${TRAIN_TIMEOUT_S:-150}" "$py" -m ptd_jax.cli.train.command "$@" "${common[@]}" \
    --metrics-file "$out/train_$name.jsonl" 2>&1 | grep -v -E "^ |^$|onstant|slow_operation|file a bug|This isn" | tail -n 4
  echo "$name exit: ${PIPESTATUS[0]}"
}
run default --train-iters 100
run gpt-1.3b-4l-bf16 --model-preset 1.3b --num-layers 4 --bf16 --micro-batch-size 4 --global-batch-size 8 \
  --train-iters 30 --eval-iters 2
run llama3.2-1b-4l-bf16 --model-preset llama3.2-1b --num-layers 4 --bf16 --micro-batch-size 2 \
  --global-batch-size 8 --seq-length 2048 --train-iters 30 --eval-iters 2
