"""`ptd-train`: Megatron-LM's flag names mapped onto ModelConfig, ParallelConfig, TrainConfig and RunOptions.

With no flags it runs the demo: the tiny preset on the embedded corpus (this interpreter's standard library).
Bad input exits with code 2 and one line on stderr naming the values. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ptd_jax.cli.args import OneLineParser, finite_float
from ptd_jax.cli.data_flags import add_data_flags, check_data_flags, data_options
from ptd_jax.config import (LR_DECAY_STYLES, MODEL_PRESETS, PIPELINE_BRANCHINGS, PIPELINE_SCHEDULES,
                            RECOMPUTE_GRANULARITIES,
                            ConfigError, ModelConfig, ParallelConfig, TrainConfig, model_preset)
from ptd_jax.data import DataError
from ptd_jax.data.indexed_dataset import IndexedDatasetError
from ptd_jax.data.tokenizer import ByteTokenizer, training_tokenizer
from ptd_jax.perf.memory import check_fits
from ptd_jax.cli import compile_only, schedule_choice
from ptd_jax.runtime import multiprocess, platform
from ptd_jax.runtime.multiprocess import DEFAULT_HEARTBEAT_TIMEOUT_S
from ptd_jax.cli.precision import add_precision_args, compute_dtype, train_config_fields

DEMO_PRESET = "tiny"
MAX_FAKE_DEVICES = 256
"""Simulated devices share this machine's cores; at 1024 XLA:CPU's all-reduce stalls (measured)."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ptd-train", description="Train a GPT with PTD-P parallelism on JAX.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p.add_argument_group("model (unset flags come from --model-preset)"))
    add_parallel_args(p.add_argument_group("parallelism"))
    add_process_args(p.add_argument_group("several processes (jax.distributed; default: from ptd-launch, SLURM or "
                                          "Open MPI, else one process)"))
    add_training_args(p.add_argument_group("training"))
    add_data_args(p.add_argument_group("data, checkpoints, logging"))
    compile_only.add_args(p)
    return p


def add_model_args(g) -> None:
    g.add_argument("--model-preset", default=DEMO_PRESET, choices=sorted(MODEL_PRESETS))
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--vocab-size", type=int, help="V of data made with another tokenizer (default: "
                   "--tokenizer-type's vocabulary size)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=finite_float, default=0.0)
    g.add_argument("--attention-dropout", type=finite_float, default=0.0)
    g.add_argument("--init-method-std", type=finite_float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=finite_float, default=1e-5)
    g.add_argument("--gelu", choices=["tanh", "erf"], default="tanh", help="GeLU form: tanh approximation or exact")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 master weights")
    add_precision_args(g)
    g.add_argument("--attention-backend", choices=["xla", "pallas", "cudnn"],
                   help="attention implementation (default: pallas on GPU, xla elsewhere)")
    g.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction,
                   help="LayerNorm and cross-entropy by the Pallas kernels (default: on with a GPU, off elsewhere)")


def add_parallel_args(g) -> None:
    g.add_argument("--tensor-model-parallel-size", type=int, help="t (default 1; see the demo layout below)")
    g.add_argument("--pipeline-model-parallel-size", type=int, help="p (default 1; see the demo layout below)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES + ("auto",), default="1f1b",
                   help="auto: the shortest simulated step at --schedule-times, printed with the alternatives")
    schedule_choice.add_args(g)
    g.add_argument("--pipeline-branching", choices=PIPELINE_BRANCHINGS, default="auto",
                   help="uniform: every pipeline rank takes the same branch each tick (embedding and output layer "
                        "masked on all ranks, only on the ticks that need them); per-rank: each rank computes only "
                        "its own work (tensor collectives in pipe-divergent branches; measured correct on XLA:CPU, "
                        "not yet on GPUs); auto (default): per-rank on CPU, where fake devices share the cores and "
                        "idle work costs time, and for unit-tick schedules (1f1b, zb-h1, zb-v) everywhere; uniform for "
                        "lockstep schedules on accelerators")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_true",
                   help="send whole boundary activations between pipeline stages (paper §4.1 off)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--micro-batch-size", type=int, help="b (default 4; 2 in the demo layout)")
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--fake-devices", type=int, help="simulate N CPU devices per process (sets XLA_FLAGS before JAX "
                   "starts)")


def add_process_args(g) -> None:
    g.add_argument("--coordinator-address", help="host:port of process 0's coordination service")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   help="seconds without a heartbeat after which a process is declared dead and the others stop")


def add_training_args(g) -> None:
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--lr", type=finite_float, default=2e-3)
    g.add_argument("--min-lr", type=finite_float, default=2e-4)
    g.add_argument("--lr-warmup-iters", type=int, help="default: --lr-warmup-fraction of --lr-decay-iters")
    g.add_argument("--lr-warmup-fraction", type=finite_float, help="warm-up as a fraction of the decay iterations "
                   "(default 0.1 when --lr-warmup-iters is not given)")
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
    add_data_flags(g)  # cli/data_flags.py
    g.add_argument("--save", help="checkpoint folder (the canonical format: loads under any layout)")
    g.add_argument("--load", help="resume from the newest complete step of this folder; --save D --load D on an "
                   "empty D starts fresh (auto-resume)")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--keep-checkpoints", type=int, help="keep the newest K steps in --save (default: all)")
    g.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True,
                   help="write checkpoints in the background (training waits only for the device-to-host copy)")
    g.add_argument("--no-load-optim", action="store_true", help="load the parameters only; fresh optimizer state")
    g.add_argument("--finetune", action="store_true", help="load the parameters only and start at iteration 0 "
                   "(fresh optimizer, data stream and dropout key)")
    g.add_argument("--override-data-config", action="store_true",
                   help="resume even if seed, batch size, sequence length, split, blend weights or data changed")
    g.add_argument("--exit-interval", type=int, help="stop when the iteration is a multiple of N, after saving "
                   "a checkpoint if --save is given")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--metrics-file", help="JSONL, one object per logged iteration")
    g.add_argument("--plot-dir", help="write loss_curve.png here")
    g.add_argument("--peak-tflops", type=finite_float, help="device peak for MFU (default: datasheet or measured)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


DEMO_LAYOUT = {"fake_devices": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
               "num_layers_per_virtual_pipeline_stage": 1, "pipeline_schedule": "interleaved", "micro_batch_size": 2}


def apply_demo_layout(args) -> bool:
    """With no layout flags on a machine without accelerators, the demo runs the paper's 3-D layout on 8
    simulated CPU devices: d=2, p=2 (interleaved, v=2), t=2."""
    layout_flags = ("fake_devices", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "num_layers_per_virtual_pipeline_stage")
    if any(getattr(args, name) is not None for name in layout_flags) or args.compile_only or \
            platform.accelerator_present():
        return False
    for name, value in DEMO_LAYOUT.items():
        if name == "pipeline_schedule" and args.pipeline_schedule != ParallelConfig.pipeline_schedule:
            continue  # an explicit --pipeline-schedule wins
        if getattr(args, name) is None or name == "pipeline_schedule":
            setattr(args, name, value)
    return True


def fill_defaults(args) -> None:
    for name, value in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                        ("micro_batch_size", 4)):
        if getattr(args, name) is None:
            setattr(args, name, value)


def model_config_from_args(args, tokenizer=None) -> ModelConfig:
    base = model_preset(args.model_preset)
    overrides = {name: getattr(args, name) for name in
                 ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                  "max_position_embeddings") if getattr(args, name) is not None}
    return base.replace(
        **overrides,
        # the data's tokenizer decides V, as in Megatron
        vocab_size=(tokenizer.vocab_size if tokenizer is not None else ByteTokenizer.vocab_size
                    if args.vocab_size is None else args.vocab_size),
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
        gelu_approximate=args.gelu == "tanh", dtype=compute_dtype(args),
        # the kernels are the default on GPUs (`check_default_kernels` tests them first), XLA's elsewhere
        attention_backend=args.attention_backend or ("pallas" if platform.gpu_present() else "xla"),
        fused_kernels=args.fused_kernels if args.fused_kernels is not None else platform.gpu_present(),
    )


def parallel_config_from_args(args, model_cfg: ModelConfig, num_devices: int, memory_ok=None,
                              memory=None) -> ParallelConfig:
    p = args.pipeline_model_parallel_size
    schedule_choice.resolve(args, model_cfg, num_devices, not args.compile_only, memory_ok, memory)
    virtual = 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        k = args.num_layers_per_virtual_pipeline_stage
        if k < 1 or p < 1:
            raise ConfigError(f"num_layers_per_virtual_pipeline_stage={k} and pipeline_model_parallel_size={p} "
                              f"must be positive")
        if model_cfg.num_layers % (k * p):
            raise ConfigError(f"num_layers={model_cfg.num_layers} is not divisible by "
                              f"num_layers_per_virtual_pipeline_stage={k} x pipeline_model_parallel_size={p}")
        virtual = model_cfg.num_layers // (k * p)
    parallel = ParallelConfig.for_devices(
        num_devices,
        tensor_model_parallel_size=args.tensor_model_parallel_size, pipeline_model_parallel_size=p,
        virtual_pipeline_stages=virtual, pipeline_schedule=args.pipeline_schedule,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        use_distributed_optimizer=args.use_distributed_optimizer,
        scatter_gather=not args.no_scatter_gather_tensors_in_pipeline, pipeline_branching=args.pipeline_branching,
    )
    parallel.check_model(model_cfg)
    return parallel


def train_config_from_args(args) -> TrainConfig:
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise ConfigError(f"give one of lr_warmup_iters={args.lr_warmup_iters} and "
                          f"lr_warmup_fraction={args.lr_warmup_fraction}, not both")
    warmup = args.lr_warmup_iters
    if warmup is None:
        fraction = 0.1 if args.lr_warmup_fraction is None else args.lr_warmup_fraction
        if not 0 <= fraction <= 1:
            raise ConfigError(f"lr_warmup_fraction={fraction} must be in [0, 1]")
        warmup = int(fraction * (args.lr_decay_iters or args.train_iters))
    return TrainConfig(
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=warmup,
        lr_decay_iters=args.lr_decay_iters, lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        seed=args.seed, recompute_granularity=args.recompute_granularity, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, save_interval=args.save_interval,
        exit_interval=args.exit_interval, **train_config_fields(args),
    )


def check_default_kernels(model_cfg: ModelConfig, args) -> ModelConfig:
    """On a GPU, kernels picked by default (no --attention-backend / --[no-]fused-kernels given) first pass a
    few-second self-check; a kernel that fails it falls back to cuDNN or XLA with a warning. Kernels asked for
    by flag are used as asked, failures included."""
    import jax

    attention = args.attention_backend is None and model_cfg.attention_backend == "pallas"
    fused = args.fused_kernels is None and model_cfg.fused_kernels
    if jax.default_backend() != "gpu" or not (attention or fused):
        return model_cfg
    from pallas_kernels.self_check import self_check_model

    failures = self_check_model(model_cfg, args.tensor_model_parallel_size)
    return apply_self_check(model_cfg, failures, attention=attention, fused=fused)


def apply_self_check(model_cfg: ModelConfig, failures: dict, *, attention: bool, fused: bool) -> ModelConfig:
    changes = {}
    if attention and failures.get("flash_attention"):
        changes["attention_backend"] = "cudnn" if model_cfg.dtype == "bfloat16" else "xla"
    if fused and (failures.get("layer_norm") or failures.get("cross_entropy")):
        changes["fused_kernels"] = False
    for kernel, why in failures.items():
        if why and ((kernel == "flash_attention" and attention) or (kernel != "flash_attention" and fused)):
            instead = (f"attention by {changes['attention_backend']}" if kernel == "flash_attention"
                       else "XLA for LayerNorm and the loss (--fused-kernels off)")
            print(f"ptd-train: warning: the Pallas {kernel} kernel failed its self-check on this GPU ({why}); "
                  f"using {instead} instead", file=sys.stderr)
    return model_cfg.replace(**changes)


def _check_path(flag: str, value: str, kind: str) -> None:
    """`value` can become a `kind` ("file" or "folder"): it is not the other kind, no parent is a regular file,
    and the nearest existing parent is writable."""
    path = Path(value)
    if kind == "folder" and path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}={value!r} exists and is not a folder")
    if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
        raise ConfigError(f"{flag}={value!r} is not writable")
    if kind == "file" and path.is_dir():
        raise ConfigError(f"{flag}={value!r} is a folder")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag}={value!r} cannot be created: {parent} is a file, not a folder")
            if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"{flag}={value!r} cannot be created: {parent} is not writable")
            return


def check_outputs(args) -> None:
    """Fail before training, not after, on values and output paths that cannot work."""
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ConfigError(f"peak_tflops={args.peak_tflops} must be positive")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        raise ConfigError(f"keep_checkpoints={args.keep_checkpoints} must be at least 1")
    if (args.finetune or args.no_load_optim or args.override_data_config) and not args.load:
        flag = "finetune" if args.finetune else "no_load_optim" if args.no_load_optim else "override_data_config"
        raise ConfigError(f"{flag}=True needs --load")
    check_data_flags(args)
    if args.metrics_file:
        _check_path("metrics_file", args.metrics_file, "file")
    for name in ("plot_dir", "save", "data_cache_path"):
        if getattr(args, name):
            _check_path(name, getattr(args, name), "folder")
    if args.load and Path(args.load).exists() and not Path(args.load).is_dir():
        raise ConfigError(f"load={args.load!r} exists and is not a folder")


def check_backend(model_cfg: ModelConfig) -> None:
    import jax

    if model_cfg.attention_backend == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"attention_backend='cudnn' needs a GPU; this JAX backend is "
                          f"{jax.default_backend()!r} (use xla or pallas)")


def run(argv=None) -> dict | int:
    """Parse, validate and train (the summary), or compile only (the exit code); raises ConfigError/DataError/
    IndexedDatasetError on bad input."""
    args = build_parser().parse_args(argv)
    compile_only.check_flags(args)
    demo = apply_demo_layout(args)
    fill_defaults(args)
    if args.compile_only:
        return compile_for_target(args)
    start_backend(args)
    import logging

    import jax

    from ptd_jax.train import train

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's info/warnings; our own lines say what happened

    tokenizer = training_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size)
    model_cfg = check_default_kernels(model_config_from_args(args, tokenizer), args)
    train_cfg = train_config_from_args(args)
    fits = schedule_choice.memory_check(args, model_cfg, len(jax.devices()), train_cfg.recompute_granularity,
                                        jax.local_devices()[0], jax.local_device_count(), parallel_config_from_args)
    memory = schedule_choice.memory_estimate(args, model_cfg, len(jax.devices()), train_cfg.recompute_granularity,
                                             parallel_config_from_args)
    parallel = parallel_config_from_args(args, model_cfg, len(jax.devices()), fits, memory)
    check_backend(model_cfg)
    check_outputs(args)
    check_fits(model_cfg, parallel, train_cfg.recompute_granularity, jax.local_devices()[0], jax.local_device_count())
    if args.sequence_parallel and not parallel.sequence_parallel:
        print("ptd-train: warning: --sequence-parallel has no effect with tensor_model_parallel_size=1; "
              "running without it (as Megatron does)", file=sys.stderr)

    if demo:
        print("ptd-train: no accelerator found and no layout given: running the 3-D demo layout d=2 p=2 t=2 "
              "(interleaved 1F1B, v=2) on 8 simulated CPU devices (--fake-devices 1 for a single device)",
              file=sys.stderr)
    return train(model_cfg, parallel, train_cfg, run_options(args, tokenizer))


def compile_for_target(args) -> int:
    """--compile-only: the configs as on --num-gpus GPUs of --target, the kernels' defaults as a GPU resolves them."""
    if args.fake_devices is not None:
        raise ConfigError(f"--compile-only compiles for --target GPUs: drop fake_devices={args.fake_devices}")
    if args.tokenizer_type is None and args.vocab_size is None:  # no data to decide V: the preset's
        args.vocab_size = model_preset(args.model_preset).vocab_size
    tokenizer = training_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size)
    model_cfg = model_config_from_args(args, tokenizer).replace(**compile_only.gpu_defaults(args))
    num_gpus = args.num_gpus or args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    return compile_only.run(args, model_cfg, parallel_config_from_args(args, model_cfg, num_gpus),
                            train_config_from_args(args))


def start_backend(args) -> None:
    """Join the other processes (if any) and simulate --fake-devices, both before JAX starts its backend."""
    group = multiprocess.resolve(args.coordinator_address, args.num_processes, args.process_id)
    if args.heartbeat_timeout < 1:
        raise ConfigError(f"heartbeat_timeout={args.heartbeat_timeout} must be at least 1 (seconds)")

    def join_processes():  # before JAX starts its backend
        if os.environ.get("PTD_JAX_KEEP_HOST_MEMORY") == "1":  # opt-in (runtime/host_memory.py)
            from ptd_jax.runtime.host_memory import keep_freed_host_memory

            keep_freed_host_memory()
        if group is not None:
            multiprocess.initialize(group, args.heartbeat_timeout)

    if args.fake_devices is not None:
        if not 1 <= args.fake_devices <= MAX_FAKE_DEVICES:
            raise ConfigError(f"fake_devices={args.fake_devices} must be in [1, {MAX_FAKE_DEVICES}] (simulated "
                              f"devices share this machine's CPU cores)")
        from ptd_jax.parallel.mesh import set_fake_devices

        set_fake_devices(args.fake_devices, before_backend=join_processes)
    else:
        join_processes()


def run_options(args, tokenizer):
    """The `RunOptions` of the data, checkpoint and logging flags."""
    from ptd_jax.train import RunOptions

    return RunOptions(**data_options(args), save=args.save, load=args.load,
                      metrics_file=args.metrics_file, plot_dir=args.plot_dir, peak_tflops=args.peak_tflops,
                      progress=not args.no_progress, keep_checkpoints=args.keep_checkpoints,
                      load_optim=not args.no_load_optim, finetune=args.finetune,
                      override_data_config=args.override_data_config,
                      async_save=args.async_save, tokenizer=tokenizer.describe() if tokenizer else None)


def main(argv=None) -> int:
    return multiprocess.end(_main(argv))


def _main(argv) -> int:
    from ptd_jax.train.guards import DivergedError

    try:
        summary = run(argv)
        if isinstance(summary, int):  # --compile-only: its exit code; it printed its own summary
            return summary
    except (ConfigError, DataError, IndexedDatasetError, OSError) as err:
        print(f"ptd-train: error: {err}", file=sys.stderr)
        return 2
    except DivergedError as err:  # --max-skipped-iters: not bad input, a run that failed
        print(f"ptd-train: error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:  # XLA's out-of-memory, past the estimate of perf/memory.py
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        print(f"ptd-train: error: out of device memory ({str(err).splitlines()[0][:300]}); use more devices, a "
              f"larger t or p, a smaller micro batch, or --recompute-granularity full", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # the loop re-raises it saying where it stopped
        print(f"ptd-train: interrupted (Ctrl-C) {str(stop) or 'before training started'}", file=sys.stderr)
        return 130
    if multiprocess.is_primary():  # only process 0 prints
        print(json.dumps(_strict(summary)))
    return 0


def _strict(value):
    """The summary as strict JSON: a non-finite float (a diverged loss) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())
