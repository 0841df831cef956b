"""`ptd-train`'s flags mapped onto `ModelConfig`, `ParallelConfig`, `TrainConfig` and `RunOptions`.

Unset flags take the preset's or the config's defaults (Megatron's); the demo layout applies when no layout flag is
given on a machine without accelerators; `--pipeline-schedule auto` is resolved here by
`ptd_jax/perf/auto_schedule.py`, before the ParallelConfig is built.
"""

from __future__ import annotations

import sys

from ptd_jax.cli.train import checks
from ptd_jax.cli.train.parser import DEFAULT_SPLIT, DEFAULT_TARGET, PER_SPLIT
from ptd_jax.config import SCHEDULE_SPECS, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.presets import model_preset
from ptd_jax.data.tokenizer import ByteTokenizer
from ptd_jax.perf import auto_schedule
from ptd_jax.perf.hardware import TARGETS
from ptd_jax.runtime import multiprocess, platform

LLAMA_SWITCHES = (
    "normalization",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "kv_channels",
    "untie_embeddings_and_output_weights",
    "add_qkv_bias",
    "window_size",
)
"""ModelConfig fields set by flags of the same name (unset: the preset's)."""
SCALER_FLAGS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")

DEMO_LAYOUT = {
    "fake_devices": 8,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "num_layers_per_virtual_pipeline_stage": 1,
    "pipeline_schedule": "interleaved",
    "micro_batch_size": 2,
}


def apply_demo_layout(args) -> bool:
    """With no layout flags on a machine without accelerators, the demo runs the paper's 3-D layout on 8
    simulated CPU devices: d=2, p=2 (interleaved, v=2), t=2."""
    layout_flags = (
        "fake_devices",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
    )
    if (
        any(getattr(args, name) is not None for name in layout_flags)
        or args.compile_only
        or platform.accelerator_present()
    ):
        return False
    for name, value in DEMO_LAYOUT.items():
        if name == "pipeline_schedule" and args.pipeline_schedule is not None:
            continue  # an explicit --pipeline-schedule wins
        if getattr(args, name) is None or name == "pipeline_schedule":
            setattr(args, name, value)
    return True


def fill_defaults(args) -> None:
    for name, value in (
        ("tensor_model_parallel_size", 1),
        ("pipeline_model_parallel_size", 1),
        ("micro_batch_size", 4),
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)


def model_config_from_args(args, tokenizer=None, gpu: bool | None = None) -> ModelConfig:
    """The ModelConfig of the flags; the kernels' defaults as on a GPU when `gpu` (None: whether this machine has
    one)."""
    local = gpu is None  # a run on this machine: its own GPU decides; else a compile for an NVIDIA target
    gpu = platform.gpu_present() if local else gpu
    base = model_preset(args.model_preset)
    overrides = {
        name: getattr(args, name)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "seq_length",
            "max_position_embeddings",
            "layernorm_epsilon",
            *LLAMA_SWITCHES,
        )
        if getattr(args, name) is not None
    }
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError(
            f"num_query_groups={args.num_query_groups} needs --group-query-attention (without it Megatron silently "
            f"trains multi-head attention)"
        )
    if args.group_query_attention:
        overrides["num_query_groups"] = 1 if args.num_query_groups is None else args.num_query_groups
    if args.disable_bias_linear:
        overrides["add_bias_linear"] = False
    rope = overrides.get("position_embedding_type", base.position_embedding_type) == "rope"
    rotary = [n for n in LLAMA_SWITCHES if n.startswith(("rotary_", "rope_", "use_rope")) and n in overrides]
    if rotary and not rope:
        raise ConfigError(f"{rotary[0]}={overrides[rotary[0]]} needs --position-embedding-type rope")
    cfg = base.replace(
        **overrides,
        # the data's tokenizer decides V, as in Megatron
        vocab_size=(
            tokenizer.vocab_size
            if tokenizer is not None
            else ByteTokenizer.vocab_size
            if args.vocab_size is None
            else args.vocab_size
        ),
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        gelu_approximate=args.gelu == "tanh",
        dtype=compute_dtype(args),
        attention_backend=args.attention_backend or "xla",
        # the kernels are the default on GPUs (`check_default_kernels` tests them first), XLA's elsewhere
        fused_kernels=args.fused_kernels if args.fused_kernels is not None else gpu,
    )
    if args.attention_backend is None and gpu:
        # a compile for a GPU that is not here (--compile-only, ptd-plan) is for an NVIDIA target, whose head-dim
        # limit jax takes as 128 without a GPU; it starts no JAX backend
        problem = checks.local_cudnn_problem(cfg) if local else checks.cudnn_attention_problem(cfg, hopper=False)
        cfg = cfg.replace(
            attention_backend=checks.default_attention_backend(
                cfg, args.context_parallel_size, cudnn=problem is None, cp_comm_type=args.cp_comm_type
            )
        )
    return cfg


def configs_for_target(args) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """The configs `ptd-train --compile-only` compiles and `ptd-plan predict` predicts: the flags as on --num-gpus
    GPUs (default t * p * c) of --target, the kernels' defaults as a GPU resolves them, V the preset's when no tokenizer
    decides it. No JAX."""
    from ptd_jax.data.tokenizer import training_tokenizer

    if args.tokenizer_type is None and args.vocab_size is None:  # no data to decide V: the preset's
        args.vocab_size = model_preset(args.model_preset).vocab_size
    tokenizer = training_tokenizer(
        args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size, tokenizer_model=args.tokenizer_model
    )
    model_cfg = model_config_from_args(args, tokenizer, gpu=True)
    num_gpus = args.num_gpus or (
        args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    )
    budget = TARGETS[args.target or DEFAULT_TARGET].usable_memory_bytes
    parallel = parallel_config_from_args(args, model_cfg, num_gpus, budget=budget)
    return model_cfg, parallel, train_config_from_args(args)


def parallel_fields(args, model_cfg: ModelConfig) -> dict:
    """`ParallelConfig.for_devices` keywords of the layout flags, but the schedule and v."""
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        use_distributed_optimizer=args.use_distributed_optimizer,
        scatter_gather=not args.no_scatter_gather_tensors_in_pipeline,
        pipeline_branching=args.pipeline_branching,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
    )


def resolve_schedule(
    args, model_cfg: ModelConfig, num_devices: int, device=None, num_local_devices: int = 1, budget=None
):
    """Replace "auto" in `args.pipeline_schedule` by `auto_schedule.choose_for_run`'s choice (and set the layers
    per chunk for a chunked one), printing the choice and the alternatives (process 0 only); give a chunked
    schedule with a fixed chunk count (ZB-V) its chunks when --num-layers-per-virtual-pipeline-stage is not set.
    `device`: a JAX device whose memory each alternative must fit; else `budget`, bytes per device (None: not
    checked). Returns the choice, or None when nothing was chosen."""
    p, num_layers, choice = args.pipeline_model_parallel_size, model_cfg.num_layers, None
    if args.pipeline_schedule is None:  # Megatron: the layers per virtual stage alone ask for interleaving
        interleave = args.num_layers_per_virtual_pipeline_stage is not None
        args.pipeline_schedule = "interleaved" if interleave else ParallelConfig.pipeline_schedule
    if args.pipeline_schedule == "auto":
        request = auto_schedule.Request(
            num_devices,
            parallel_fields(args, model_cfg),
            layers_per_chunk=args.num_layers_per_virtual_pipeline_stage,
            recompute=args.recompute_granularity,
            times=tuple(args.schedule_times) if args.schedule_times else None,
            device=device,
            num_local_devices=num_local_devices,
            memory_budget=budget,
        )
        choice = auto_schedule.choose_for_run(model_cfg, request)
        args.pipeline_schedule = choice.name
        if choice.v > 1 and args.num_layers_per_virtual_pipeline_stage is None:
            args.num_layers_per_virtual_pipeline_stage = num_layers // (choice.v * p)
        if choice.rows and (args.compile_only or multiprocess.is_primary()):
            print(choice.text(), file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)
    chunks = SCHEDULE_SPECS[args.pipeline_schedule].chunks if args.pipeline_schedule in SCHEDULE_SPECS else None
    unset = args.num_layers_per_virtual_pipeline_stage is None
    if chunks and chunks > 1 and unset and p >= 1 and num_layers % (chunks * p):
        raise ConfigError(
            f"--pipeline-schedule {args.pipeline_schedule} runs {chunks} model chunks per rank: num_layers="
            f"{num_layers} is not divisible by {chunks} x pipeline_model_parallel_size={p}"
        )
    if chunks and chunks > 1 and unset and p >= 1:
        args.num_layers_per_virtual_pipeline_stage = num_layers // (chunks * p)
    return choice


def parallel_config_from_args(
    args, model_cfg: ModelConfig, num_devices: int, device=None, num_local_devices: int = 1, budget=None
) -> ParallelConfig:
    """The ParallelConfig of the layout flags on `num_devices` (`auto` resolved by `resolve_schedule`, whose
    memory check uses `device`, else `budget` bytes per device)."""
    p = args.pipeline_model_parallel_size
    resolve_schedule(args, model_cfg, num_devices, device, num_local_devices, budget)
    virtual = 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        k = args.num_layers_per_virtual_pipeline_stage
        if k < 1 or p < 1:
            raise ConfigError(
                f"num_layers_per_virtual_pipeline_stage={k} and pipeline_model_parallel_size={p} must be positive"
            )
        if model_cfg.num_layers % (k * p):
            raise ConfigError(
                f"num_layers={model_cfg.num_layers} is not divisible by "
                f"num_layers_per_virtual_pipeline_stage={k} x pipeline_model_parallel_size={p}"
            )
        virtual = model_cfg.num_layers // (k * p)
    parallel = ParallelConfig.for_devices(
        num_devices,
        **parallel_fields(args, model_cfg),
        virtual_pipeline_stages=virtual,
        pipeline_schedule=args.pipeline_schedule,
    )
    parallel.check_model(model_cfg)
    return parallel


def train_config_from_args(args) -> TrainConfig:
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise ConfigError(
            f"give one of lr_warmup_iters={args.lr_warmup_iters} and "
            f"lr_warmup_fraction={args.lr_warmup_fraction}, not both"
        )
    warmup = args.lr_warmup_iters
    if warmup is None:
        fraction = 0.1 if args.lr_warmup_fraction is None else args.lr_warmup_fraction
        if not 0 <= fraction <= 1:
            raise ConfigError(f"lr_warmup_fraction={fraction} must be in [0, 1]")
        warmup = int(fraction * (args.lr_decay_iters or args.train_iters))
    return TrainConfig(
        train_iters=args.train_iters,
        lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_iters=warmup,
        lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        seed=args.seed,
        recompute_granularity=args.recompute_granularity,
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        save_interval=args.save_interval,
        exit_interval=args.exit_interval,
        **train_config_fields(args),
    )


def compute_dtype(args) -> str:
    """float32, or bfloat16 / float16 from --bf16 / --fp16 (not both)."""
    if args.bf16 and args.fp16:
        raise ConfigError("bf16=True and fp16=True: give one of --bf16 and --fp16")
    given = [name for name in SCALER_FLAGS if getattr(args, name) is not None]
    if given and not args.fp16:
        raise ConfigError(f"{given[0]}={getattr(args, given[0])} needs --fp16 (loss scaling is for float16 only)")
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def train_config_fields(args) -> dict:
    """The TrainConfig fields the flags set (unset ones keep TrainConfig's defaults, Megatron's)."""
    fields = {name: getattr(args, name) for name in SCALER_FLAGS if getattr(args, name) is not None}
    return {**fields, "max_skipped_iters": args.max_skipped_iters}


def _words(value):
    """One word -> the prefix itself (as before blends); several -> the blend's words."""
    if value is None:
        return None
    return value[0] if len(value) == 1 else tuple(value)


def data_options(args) -> dict:
    """The `RunOptions` fields of the data flags."""
    return {
        "data_path": _words(args.data_path),
        "split": args.split or DEFAULT_SPLIT,
        "data_cache_path": args.data_cache_path,
        "mock_data": args.mock_data,
        **{name: _words(getattr(args, name)) for name in PER_SPLIT},
    }


def run_options(args, tokenizer):
    """The `RunOptions` of the data, checkpoint and logging flags."""
    from ptd_jax.train import RunOptions

    return RunOptions(
        **data_options(args),
        save=args.save,
        load=args.load,
        metrics_file=args.metrics_file,
        plot_dir=args.plot_dir,
        peak_tflops=args.peak_tflops,
        progress=not args.no_progress,
        keep_checkpoints=args.keep_checkpoints,
        load_optim=not args.no_load_optim,
        finetune=args.finetune,
        override_data_config=args.override_data_config,
        async_save=args.async_save,
        tokenizer=tokenizer.describe() if tokenizer else None,
        gpu_clock_plan=args.gpu_clock_plan,
    )
