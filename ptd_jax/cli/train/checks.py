"""`ptd-train`'s start-up checks: flags that cannot work together, output paths that cannot be written, data that
cannot be read, kernels that fail their self-check on this GPU — each refused (or worked around) before anything
starts, with one line naming the values.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

from ptd_jax.cli.schedule import MAX_ACTIONS
from ptd_jax.cli.train.parser import DEFAULT_SPLIT, DEFAULT_TARGET, PER_SPLIT
from ptd_jax.config import SCHEDULE_SPECS, ConfigError, ModelConfig, ParallelConfig
from ptd_jax.data import IndexedDataset, parse_split
from ptd_jax.data.blend import parse_blend


def check_compile_only_flags(args) -> None:
    """--target, --num-gpus and --json mean something only with --compile-only: refuse them elsewhere."""
    given = [f"--{name.replace('_', '-')}" for name in ("target", "num_gpus", "json") if getattr(args, name)]
    if given and not args.compile_only:
        raise ConfigError(f"{', '.join(given)} need --compile-only")
    if args.compile_only and args.target is None:
        args.target = DEFAULT_TARGET


MAX_TRAIN_ITERS = 2**31 - 1
"""The iteration counter is an int32 on the devices."""
HOST_BATCH_SHARE = 0.25
"""A global batch's token ids (inputs and labels) may take at most this share of the host's memory."""


def check_flag_combinations(args) -> None:
    """Flags that cannot mean what they say in this run, refused before anything starts (as Megatron would):
    a schedule's times without `auto`, --compile-only with outputs of a training run, counts out of range."""
    if args.train_iters is not None and args.train_iters > MAX_TRAIN_ITERS:
        raise ConfigError(f"train_iters={args.train_iters} is more than {MAX_TRAIN_ITERS} (an int32 counter)")
    if args.lr_decay_iters is not None and args.lr_decay_iters < 1:
        raise ConfigError(
            f"lr_decay_iters={args.lr_decay_iters} must be positive (the learning rate would be --min-lr from "
            f"iteration 1); leave it out to decay over --train-iters"
        )
    if args.schedule_times is not None:
        if args.pipeline_schedule != "auto":
            raise ConfigError(
                f"--schedule-times applies to --pipeline-schedule auto only, got {args.pipeline_schedule!r}"
            )
        if not math.isfinite(sum(args.schedule_times) * MAX_ACTIONS):
            raise ConfigError(
                f"--schedule-times {' '.join(f'{t:g}' for t in args.schedule_times)} are too large: a step's "
                f"simulated time overflows; give them in seconds or as ratios"
            )
    spec = SCHEDULE_SPECS.get(args.pipeline_schedule)
    if spec is not None and spec.chunks is None and args.num_layers_per_virtual_pipeline_stage is None:
        raise ConfigError(
            f"--pipeline-schedule {args.pipeline_schedule} needs --num-layers-per-virtual-pipeline-stage (without "
            f"it every rank holds one chunk, v=1: plain 1F1B)"
        )
    default = args.pipeline_schedule == ParallelConfig.pipeline_schedule
    if spec is not None and args.pipeline_model_parallel_size == 1 and spec.min_p == 1 and not default:
        print(
            f"ptd-train: warning: --pipeline-schedule {args.pipeline_schedule} has no effect at "
            f"pipeline_model_parallel_size=1 (one stage: no pipeline to schedule)",
            file=sys.stderr,
        )
    if args.compile_only:
        given = [f"--{n.replace('_', '-')}" for n in ("save", "load", "metrics_file", "plot_dir") if getattr(args, n)]
        if given:
            raise ConfigError(f"--compile-only trains nothing and writes no {', '.join(given)}: drop it")
        if args.num_gpus is not None and args.num_gpus < 1:
            raise ConfigError(f"num_gpus={args.num_gpus} must be positive")


def check_sizes(args, seq_length: int, num_devices: int) -> None:
    """Sizes that would fill the host's memory or the schedule's table before anything is printed: a global
    batch of token ids past `HOST_BATCH_SHARE` of the memory, more pipeline actions than `ptd-schedule` builds."""
    t, p, b, B = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.micro_batch_size,
        args.global_batch_size,
    )
    c = getattr(args, "context_parallel_size", None) or 1
    if min(t, p, b, B, c, num_devices) < 1:
        return  # the configs name the value
    batch_bytes = 2 * 4 * B * (seq_length + 1)  # int32 inputs and labels
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if batch_bytes > HOST_BATCH_SHARE * memory:
        raise ConfigError(
            f"global_batch_size={B} at seq_length={seq_length} is {batch_bytes / 2**30:.1f} GiB of token ids a "
            f"batch, more than {HOST_BATCH_SHARE:.0%} of this host's {memory / 2**30:.0f} GiB"
        )
    d = max(num_devices // (t * p * c), 1)
    m = B // (b * d)
    if 2 * p * m > MAX_ACTIONS:
        raise ConfigError(
            f"{m} microbatches a step (global_batch_size={B} / (micro_batch_size={b} x data_parallel_size={d})) "
            f"at pipeline_model_parallel_size={p} make {2 * p * m} forward and backward actions, more than "
            f"ptd-train schedules ({MAX_ACTIONS}): use a larger micro batch or a smaller global batch"
        )


def check_data_flags(args) -> None:
    """One line (ConfigError/DataError) for data flags that cannot work: flags that exclude each other, a bad
    split or blend, a missing or broken .bin/.idx pair."""
    given = [name for name in ("data_path", "train_data_path", "mock_data") if getattr(args, name)]
    if len(given) > 1:
        raise ConfigError(f"give one of --{given[0].replace('_', '-')} and --{given[1].replace('_', '-')}, not both")
    for name in ("valid_data_path", "test_data_path"):
        if getattr(args, name) and not args.train_data_path:
            raise ConfigError(f"--{name.replace('_', '-')} needs --train-data-path (the splits are given together)")
    if args.split is not None and (args.train_data_path or args.mock_data):
        flag = "--train-data-path" if args.train_data_path else "--mock-data"
        raise ConfigError(f"split={args.split!r} is not used with {flag}: drop --split")
    parse_split(DEFAULT_SPLIT if args.split is None else args.split)
    for name in ("data_path", *PER_SPLIT):
        if getattr(args, name):
            for _, prefix in parse_blend(name, getattr(args, name)):
                IndexedDataset(prefix)  # the header and sizes, checked before anything else starts


def check_default_kernels(model_cfg: ModelConfig, args) -> ModelConfig:
    """On a GPU, kernels picked by default (no --attention-backend / --[no-]fused-kernels given) first pass a
    few-second self-check; a kernel that fails it falls back to cuDNN or XLA with a warning. Kernels asked for
    by flag are used as asked, failures included."""
    import jax

    if jax.default_backend() != "gpu":
        return model_cfg
    from pallas_kernels import current_target
    from pallas_kernels.self_check import self_check_model

    model_cfg = check_attention_kernels(model_cfg, args, current_target())
    attention = args.attention_backend is None and model_cfg.attention_backend == "pallas"
    fused = args.fused_kernels is None and model_cfg.fused_kernels
    if not (attention or fused):
        return model_cfg

    failures = self_check_model(
        model_cfg, args.tensor_model_parallel_size, context_parallel_size=args.context_parallel_size
    )
    cudnn = args.context_parallel_size == 1 and local_cudnn_problem(model_cfg) is None
    return apply_self_check(model_cfg, failures, attention=attention, fused=fused, cudnn=cudnn)


def local_cudnn_problem(model_cfg: ModelConfig) -> str | None:
    """Why jax's cuDNN attention cannot run `model_cfg` on this machine's GPU, or None: an NVIDIA GPU of sm_80 or
    later with JAX's CUDA plugin (cuDNN's flash attention needs Ampere), then `cudnn_attention_problem`."""
    from ptd_jax.runtime import platform

    if not platform.cuda_gpu_present():
        return "needs an NVIDIA GPU and JAX's CUDA plugin"
    capability = local_gpu_capability()
    if capability < (8, 0):
        return f"needs compute capability 8.0 or later, got {capability}"
    return cudnn_attention_problem(model_cfg, hopper=capability >= (9, 0))


def local_gpu_capability() -> tuple[int, int]:
    """The compute capability of the GPU this process runs on ((0, 0) without one)."""
    import jax

    if jax.default_backend() != "gpu":
        return (0, 0)
    capability = str(getattr(jax.devices()[0], "compute_capability", "0.0"))
    return tuple(int(x) for x in capability.split(".")[:2])


def local_gpu_is_hopper() -> bool:
    """Whether the GPU this process runs on is sm_90 or later (what jax's cuDNN attention asks; False without one)."""
    return local_gpu_capability() >= (9, 0)


def cudnn_attention_problem(model_cfg: ModelConfig, hopper: bool) -> str | None:
    """Why jax's cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`, jax 0.10) refuses
    this model, or None. It takes float16 or bfloat16 and a head dim that is a multiple of 8, at most 128, or 256
    when the GPU it runs on is Hopper or later: jax asks the local GPU, so a compile without one gets 128."""
    if model_cfg.dtype not in ("bfloat16", "float16"):
        return f"takes float16 or bfloat16 (--bf16, --fp16), got dtype={model_cfg.dtype!r}"
    limit = 256 if hopper else 128
    if model_cfg.head_dim > limit or model_cfg.head_dim % 8:
        where = "" if hopper else " (256 on a Hopper GPU that jax runs on; without one jax applies 128)"
        return f"takes head dims that are multiples of 8 up to {limit}{where}, got head_dim={model_cfg.head_dim}"
    return None


def default_attention_backend(
    model_cfg: ModelConfig, context_parallel_size: int, *, cudnn: bool, cp_comm_type: str = "p2p"
) -> str:
    """The attention a GPU run gets without --attention-backend: cuDNN's flash attention where jax's cuDNN path takes
    the model (`cudnn`: an NVIDIA GPU of sm_80 or later, float16/bfloat16, its head dims; `local_cudnn_problem`),
    else the Pallas flash kernel; XLA's under attention dropout (the kernels have none). Measured on one H200
    (1.3B, b = 4, s = 2048, bf16, fused LayerNorm/loss; experiments/results/bench_kernels_gpu_steps.json): a step
    takes 0.162 s by cuDNN, 0.191 s by Pallas and 0.281 s by XLA. Under context parallelism the p2p ring runs on the
    Pallas kernel (cuDNN returns no log-sum-exp; XLA's blocks hold float32 scores: 117.5 GiB against 6.2 at
    S = 32768, c = 4, experiments/results/context_flash_memory.json); a sliding window, attention dropout and
    all_gather attend by XLA (`parallel/context.py`)."""
    if model_cfg.attention_dropout > 0:  # the fused kernels have no dropout
        return "xla"
    if context_parallel_size > 1:
        kernel_ring = cp_comm_type == "p2p" and model_cfg.window_size is None
        return "pallas" if kernel_ring else "xla"
    return "cudnn" if cudnn else "pallas"


def check_attention_kernels(model_cfg: ModelConfig, args, target) -> ModelConfig:
    """Attention that cannot compile for `target` (a `pallas_kernels.GpuTarget`), caught before anything is traced.
    Flash attention whose smallest blocks exceed the target's shared memory per block falls back, when picked by
    default, to cuDNN (within its limits) or XLA with one warning, and is refused in one line when asked for by
    flag; cuDNN attention outside its limits is refused in one line."""
    from pallas_kernels import NoBlockFits, choose_blocks

    hopper = local_gpu_is_hopper()
    if model_cfg.attention_backend == "pallas":
        try:
            choose_blocks(model_cfg.seq_length, model_cfg.head_dim, model_cfg.dtype, target)
        except NoBlockFits as err:
            if args.attention_backend is not None:
                others = "xla or cudnn" if args.context_parallel_size == 1 else "xla"
                raise ConfigError(f"attention_backend='pallas': {err}; use --attention-backend {others}") from None
            cudnn = cudnn_attention_problem(model_cfg, hopper) is None and args.context_parallel_size == 1
            instead = "cudnn" if cudnn else "xla"
            print(f"ptd-train: warning: {err}; using attention by {instead} instead", file=sys.stderr)
            return model_cfg.replace(attention_backend=instead)
    if model_cfg.attention_backend == "cudnn":
        problem = cudnn_attention_problem(model_cfg, hopper)
        if problem is not None:
            raise ConfigError(
                f"attention_backend='cudnn': jax's cuDNN attention {problem}; use --attention-backend pallas or xla"
            )
    return model_cfg


def apply_self_check(
    model_cfg: ModelConfig, failures: dict, *, attention: bool, fused: bool, cudnn: bool = False
) -> ModelConfig:
    """The kernels that failed their self-check replaced: flash attention by cuDNN's where `cudnn` (it takes the
    model here, no context parallelism), else by XLA; the fused LayerNorm/loss by XLA's."""
    changes = {}
    if attention and failures.get("flash_attention"):
        changes["attention_backend"] = "cudnn" if cudnn else "xla"
    if fused and (failures.get("layer_norm") or failures.get("cross_entropy")):
        changes["fused_kernels"] = False
    for kernel, why in failures.items():
        if why and ((kernel == "flash_attention" and attention) or (kernel != "flash_attention" and fused)):
            instead = (
                f"attention by {changes['attention_backend']}"
                if kernel == "flash_attention"
                else "XLA for LayerNorm and the loss (--fused-kernels off)"
            )
            print(
                f"ptd-train: warning: the Pallas {kernel} kernel failed its self-check on this GPU ({why}); "
                f"using {instead} instead",
                file=sys.stderr,
            )
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
            _probe(flag, value, path if path.is_dir() else parent)
            return


def _probe(flag: str, value: str, folder: Path) -> None:
    """Create and remove a file in `folder`: os.access says yes to root everywhere, and knows nothing of a
    read-only or full file system, or of /proc."""
    try:
        handle, name = tempfile.mkstemp(prefix=".ptd-probe-", dir=folder)
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        raise ConfigError(f"{flag}={value!r} cannot be written: {folder}: {err.strerror}") from None


def check_outputs(args) -> None:
    """Fail before training, not after, on values and output paths that cannot work."""
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ConfigError(f"peak_tflops={args.peak_tflops} must be positive")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        raise ConfigError(f"keep_checkpoints={args.keep_checkpoints} must be at least 1")
    unsaved = [
        f"--{n.replace('_', '-')}" for n in ("save_interval", "keep_checkpoints") if getattr(args, n) is not None
    ]
    if unsaved and not args.save:
        raise ConfigError(f"{' and '.join(unsaved)} need --save (nothing would be saved)")
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
        raise ConfigError(
            f"attention_backend='cudnn' needs a GPU; this JAX backend is {jax.default_backend()!r} (use xla or pallas)"
        )
