"""`ptd-train`'s command line: every flag, with Megatron-LM's names and defaults (nothing is checked here).

`build_parser()` is the one parser; `ptd_jax/cli/train/configs.py` maps the parsed flags onto the configs.
"""

from __future__ import annotations

import argparse

from ptd_jax.cli.args import OneLineParser, add_tokenizer_args, finite_float, positive_float, positive_int
from ptd_jax.config import (
    CP_COMM_TYPES,
    LR_DECAY_STYLES,
    NORMALIZATIONS,
    PIPELINE_BRANCHINGS,
    POSITION_EMBEDDINGS,
    PIPELINE_SCHEDULES,
    RECOMPUTE_GRANULARITIES,
    TrainConfig,
)
from ptd_jax.presets import MODEL_PRESETS
from ptd_jax.perf.hardware import TARGETS
from ptd_jax.runtime.multiprocess import DEFAULT_HEARTBEAT_TIMEOUT_S

DEMO_PRESET = "tiny"
DEFAULT_TARGET = "h100-sxm"
"""The GPU `--compile-only` compiles for and `ptd-plan predict` predicts, when --target is not given."""
DEFAULT_SPLIT = "969,30,1"
PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """ptd-train's parser (`ptd-plan predict` takes it whole as a parent, without its -h)."""
    p = OneLineParser(
        prog="ptd-train",
        description="Train a GPT with PTD-P parallelism on JAX.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=add_help,
    )
    add_model_args(p.add_argument_group("model (unset flags come from --model-preset)"))
    add_parallel_args(p.add_argument_group("parallelism"))
    add_process_args(
        p.add_argument_group(
            "several processes (jax.distributed; default: from ptd-launch, SLURM or Open MPI, else one process)"
        )
    )
    add_training_args(p.add_argument_group("training"))
    add_data_args(p.add_argument_group("data, checkpoints, logging"))
    add_compile_only_args(p)
    return p


def add_model_args(g) -> None:
    g.add_argument("--model-preset", default=DEMO_PRESET, choices=sorted(MODEL_PRESETS))
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument(
        "--vocab-size",
        type=int,
        help="V of data made with another tokenizer (default: --tokenizer-type's vocabulary size)",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=finite_float, default=0.0)
    g.add_argument("--attention-dropout", type=finite_float, default=0.0)
    g.add_argument("--init-method-std", type=finite_float, default=0.02)
    g.add_argument(
        "--norm-epsilon",
        "--layernorm-epsilon",
        dest="layernorm_epsilon",
        type=finite_float,
        help="the norms' epsilon (default: the preset's, 1e-5 for GPT-2)",
    )
    g.add_argument("--gelu", choices=["tanh", "erf"], default="tanh", help="GeLU form: tanh approximation or exact")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 master weights")
    add_precision_args(g)
    add_llama_args(g)
    g.add_argument(
        "--attention-backend",
        choices=["xla", "pallas", "cudnn"],
        help="attention implementation (default on a GPU: cudnn where jax's cuDNN path takes the model, else "
        "pallas; under context parallelism the ring on pallas; xla for attention dropout and elsewhere)",
    )
    g.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        help="LayerNorm and cross-entropy by the Pallas kernels (default: on with a GPU, off elsewhere)",
    )


def add_parallel_args(g) -> None:
    g.add_argument("--tensor-model-parallel-size", type=int, help="t (default 1; see the demo layout below)")
    g.add_argument("--pipeline-model-parallel-size", type=int, help="p (default 1; see the demo layout below)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    g.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES + ("auto",),
        help="default: interleaved with --num-layers-per-virtual-pipeline-stage (as in Megatron), else 1f1b; auto: "
        "the shortest simulated step at --schedule-times, printed with the alternatives",
    )
    g.add_argument(
        "--schedule-times",
        type=positive_float,
        nargs=3,
        metavar=("F", "B", "W"),
        help="--pipeline-schedule auto: a stage's forward, input-gradient and weight-gradient times, "
        "e.g. measured (default: the ratios of their FLOPs in this model; 1 1 1 is the zero-bubble "
        "paper's assumption)",
    )
    g.add_argument(
        "--pipeline-branching",
        choices=PIPELINE_BRANCHINGS,
        default="auto",
        help="uniform: every pipeline rank takes the same branch each tick (embedding and output layer "
        "masked on all ranks, only on the ticks that need them); per-rank: each rank computes only "
        "its own work (tensor collectives in pipe-divergent branches; measured correct on XLA:CPU, "
        "not yet on GPUs); auto (default): per-rank on CPU, where fake devices share the cores and "
        "idle work costs time, and for unit-tick schedules (1f1b, zb-h1, zb-v) everywhere; uniform for "
        "lockstep schedules on accelerators",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--no-scatter-gather-tensors-in-pipeline",
        action="store_true",
        help="send whole boundary activations between pipeline stages (paper §4.1 off)",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="c: split each sequence over c devices (Megatron's load-balanced 2c chunks; seq-length %% 2c == 0); "
        "data-parallel size = devices / (t * p * c)",
    )
    g.add_argument(
        "--cp-comm-type",
        choices=CP_COMM_TYPES,
        default="p2p",
        help="context parallelism's attention: p2p (a ring of K/V blocks, overlapped with the blocks' attention) "
        "or all_gather (K/V gathered, then local attention)",
    )
    g.add_argument("--micro-batch-size", type=int, help="b (default 4; 2 in the demo layout)")
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument(
        "--fake-devices", type=int, help="simulate N CPU devices per process (sets XLA_FLAGS before JAX starts)"
    )


def add_process_args(g) -> None:
    g.add_argument("--coordinator-address", help="host:port of process 0's coordination service")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds without a heartbeat after which a process is declared dead and the others stop",
    )
    g.add_argument(
        "--coordinator-timeout",
        type=positive_float,
        help="seconds to wait for the coordinator (process 0) and the other processes to join (default: "
        "PTD_COORDINATOR_TIMEOUT from ptd-launch, else 120)",
    )


def add_training_args(g) -> None:
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--lr", type=finite_float, default=2e-3)
    g.add_argument("--min-lr", type=finite_float, default=2e-4)
    g.add_argument("--lr-warmup-iters", type=int, help="default: --lr-warmup-fraction of --lr-decay-iters")
    g.add_argument(
        "--lr-warmup-fraction",
        type=finite_float,
        help="warm-up as a fraction of the decay iterations (default 0.1 when --lr-warmup-iters is not given)",
    )
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--weight-decay", type=finite_float, default=0.01)
    g.add_argument("--adam-beta1", type=finite_float, default=0.9)
    g.add_argument("--adam-beta2", type=finite_float, default=0.999)
    g.add_argument("--adam-eps", type=finite_float, default=1e-8)
    g.add_argument("--clip-grad", type=finite_float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default="none")


def add_data_args(g) -> None:
    """Data, checkpoints (Megatron's --save/--load family) and logging."""
    add_data_flags(g)
    g.add_argument("--save", help="checkpoint folder (the canonical format: loads under any layout)")
    g.add_argument(
        "--load",
        help="resume from the newest complete step of this folder; --save D --load D on an "
        "empty D starts fresh (auto-resume)",
    )
    g.add_argument("--save-interval", type=int)
    g.add_argument("--keep-checkpoints", type=int, help="keep the newest K steps in --save (default: all)")
    g.add_argument(
        "--async-save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write checkpoints in the background (training waits only for the device-to-host copy)",
    )
    g.add_argument("--no-load-optim", action="store_true", help="load the parameters only; fresh optimizer state")
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load the parameters only and start at iteration 0 (fresh optimizer, data stream and dropout key)",
    )
    g.add_argument(
        "--override-data-config",
        action="store_true",
        help="resume even if seed, batch size, sequence length, split, blend weights or data changed",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        help="stop when the iteration is a multiple of N, after saving a checkpoint if --save is given",
    )
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--metrics-file", help="JSONL, one object per logged iteration")
    g.add_argument("--plot-dir", help="write loss_curve.png here")
    g.add_argument("--peak-tflops", type=finite_float, help="device peak for MFU (default: datasheet or measured)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--gpu-clock-plan",
        metavar="PLAN.json",
        help="lock each GPU's SM clock to its pipeline rank's (`ptd-plan energy --output`) through NVML; needs the "
        "permission; reset on exit; raised when the step runs slower than (1 + eps) x full clock's",
    )


def add_llama_args(g) -> None:
    """Megatron's switches that make the GPT a Llama, Mistral or Qwen2 (unset: the preset's; GPT-2's by default)."""
    g.add_argument("--normalization", choices=NORMALIZATIONS)
    g.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP: silu(x W_gate) * (x W_up)")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS)
    g.add_argument("--rotary-base", type=positive_float)
    g.add_argument("--rotary-percent", type=finite_float, help="the share of each head's dims that rotate, (0, 1]")
    g.add_argument(
        "--rotary-interleaved",
        action="store_true",
        default=None,
        help="rotate adjacent pairs (Meta's original Llama code) instead of the two halves (Hugging Face's)",
    )
    g.add_argument("--use-rope-scaling", action="store_true", default=None, help="Llama 3.1's RoPE scaling")
    g.add_argument("--rope-scaling-factor", type=finite_float, help="default 8")
    g.add_argument("--rope-low-freq-factor", type=finite_float, help="default 1")
    g.add_argument("--rope-high-freq-factor", type=finite_float, help="default 4")
    g.add_argument("--rope-original-max-position-embeddings", dest="rope_original_max_position", type=int)
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention with --num-query-groups key/value heads (1 when not given: multi-query, as "
        "in Megatron)",
    )
    g.add_argument("--num-query-groups", type=int, help="needs --group-query-attention")
    g.add_argument("--kv-channels", type=int, help="the head dim (default: hidden / heads)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers (Llama)")
    g.add_argument("--add-qkv-bias", action="store_true", default=None, help="biases on QKV only (Qwen2)")
    g.add_argument("--window-size", type=int, help="sliding-window attention: each query sees this many keys")


def add_data_flags(g) -> None:
    g.add_argument(
        "--data-path",
        nargs="+",
        metavar="[WEIGHT] PREFIX",
        help="prefix of a .bin/.idx pair, or a blend 'w1 prefix1 w2 prefix2 ...' (samples drawn in "
        "proportion to the weights, Megatron's BlendedDataset); default: the embedded stdlib corpus",
    )
    for split in ("train", "valid", "test"):
        g.add_argument(
            f"--{split}-data-path",
            nargs="+",
            metavar="[WEIGHT] PREFIX",
            help=f"the {split} data, a prefix or a blend, used whole (instead of --data-path and --split)",
        )
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="random tokens of the model's vocabulary, deterministic from --seed, no files (for benchmarks)",
    )
    add_tokenizer_args(
        g, default=None, help_default="the data's tokenizer; V is its vocabulary size (default: ByteTokenizer, 257)"
    )
    g.add_argument("--split", help=f"train,valid,test weights of --data-path's documents (default {DEFAULT_SPLIT})")
    g.add_argument(
        "--data-cache-path", help="where the data's index arrays are cached (default: a cache/ folder beside the data)"
    )


def add_precision_args(group) -> None:
    group.add_argument("--fp16", action="store_true", help="float16 compute with loss scaling, float32 master weights")
    group.add_argument("--loss-scale", type=finite_float, help="--fp16: a static loss scale (default: dynamic)")
    group.add_argument("--initial-loss-scale", type=finite_float, help="--fp16: first dynamic scale (default 2^32)")
    group.add_argument("--min-loss-scale", type=finite_float, help="--fp16: floor of the dynamic scale (default 1)")
    group.add_argument(
        "--loss-scale-window",
        type=int,
        help="--fp16: double the scale after this many iterations without overflow (default 1000)",
    )
    group.add_argument("--hysteresis", type=int, help="--fp16: overflows tolerated before the scale halves (default 2)")
    group.add_argument(
        "--max-skipped-iters",
        type=int,
        default=TrainConfig.max_skipped_iters,
        help="stop after this many iterations in a row skipped for a non-finite loss or gradients",
    )


def add_compile_only_args(parser) -> None:
    g = parser.add_argument_group("compile for GPUs that are not here (the gpu-compile extra)")
    g.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the train and eval steps with XLA:GPU for --num-gpus of --target and report memory, "
        "collectives and kernels; trains nothing",
    )
    g.add_argument(
        "--target", "--hardware", choices=sorted(TARGETS), help=f"the GPU to compile for (default {DEFAULT_TARGET})"
    )
    g.add_argument("--num-gpus", type=positive_int, help="GPUs to compile for (hosts of 8; default: t * p)")
    g.add_argument("--json", action="store_true", help="--compile-only: one JSON object on stdout")
