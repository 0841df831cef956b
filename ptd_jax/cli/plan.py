"""`ptd-plan`: the performance model and layout planner on the command line (pure Python, starts at once).

    ptd-plan predict <ptd-train's command line> [--target h100-sxm] [--num-gpus N] [--json]
        the prediction for the run `ptd-train` would make with the same flags, on --num-gpus (default t * p * c) GPUs of
        --target (alias --hardware; default h100-sxm, as --compile-only): the same parser, the same defaults, the
        configs `--compile-only` compiles (`configs_for_target`). Flags that do not change the prediction (data,
        checkpoints, learning rate, ...) are accepted and listed as ignored.
    ptd-plan search <model flags> --num-gpus N --global-batch-size B --hardware H [--top 10] [--json]
        [--verify K]  (compile the K best with XLA:GPU: compiled memory beside the predicted)
    both: [--fp16 | --bf16] (precision: 20 or 18 bytes of state per parameter, fp16 or fp32 gradient all-reduce;
    default --bf16; the paper's runs were fp16)

Model flags are ptd-train's (Megatron's names; unset ones come from --model-preset, default paper-1.7b, whose
sequence 2048 is the paper's; its GPT-2 vocabulary of 50,257 pads to the paper's 51,200 at t = 8, as Megatron
pads). `tflops_per_gpu` is the paper's eq. (3) figure (comparable with its Table 1); `model_tflops_per_gpu` and
`mfu` count model FLOPs without recomputation. Bad input: one line naming the values, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from ptd_jax.cli import energy as energy_cli
from ptd_jax.cli.args import OneLineParser, positive_int
from ptd_jax.cli.train.checks import cudnn_attention_problem, default_attention_backend
from ptd_jax.cli.train.configs import configs_for_target, fill_defaults
from ptd_jax.cli.train.parser import DEFAULT_TARGET
from ptd_jax.cli.train.parser import build_parser as train_parser
from ptd_jax.config import ATTENTION_BACKENDS, PIPELINE_SCHEDULES, RECOMPUTE_GRANULARITIES, ConfigError, ModelConfig
from ptd_jax.presets import MODEL_PRESETS, model_preset
from ptd_jax.data import DataError
from ptd_jax.perf.hardware import GIB, HARDWARE, allocator_fraction
from ptd_jax.perf.search import describe, layout_record, search
from ptd_jax.perf.timing import predict

DEFAULT_PRESET = "paper-1.7b"
LOCKSTEP_CELL_LIMIT = 40_000
"""Largest p·v·m for which `predict` also builds ptd_jax's lockstep table (building it is O(ticks·p))."""


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (unset flags come from --model-preset)")
    g.add_argument("--model-preset", default=DEFAULT_PRESET, choices=sorted(MODEL_PRESETS))
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--seq-length",
        "--max-position-embeddings",
        "--vocab-size",
        "--make-vocab-size-divisible-by",
    ):
        g.add_argument(flag, type=positive_int)
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="the attention the run uses (xla keeps the s x s scores; pallas and cudnn do not; default: the "
        "preset's, xla: ptd-train's on GPUs is pallas)",
    )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--num-gpus", type=positive_int, required=True)
    g.add_argument("--global-batch-size", type=positive_int, required=True)
    g.add_argument("--hardware", choices=sorted(HARDWARE), default="a100-80gb")
    g.add_argument(
        "--recompute-granularity",
        choices=RECOMPUTE_GRANULARITIES,
        help="one policy (full: the paper's runs; eq. 3 counts it); default: rank none, selective and full",
    )
    precision = g.add_mutually_exclusive_group()
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="Megatron's fp16 of the paper: fp16 params and grads, 20 bytes per parameter, fp16 "
        "gradient all-reduce (ptd-train --fp16 keeps float32 gradients: plan it with --bf16)",
    )
    precision.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 params, fp32 grads: 18 bytes per parameter, fp32 gradient all-reduce (default)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        help="predict: ptd-train's schedule (default: interleaved with "
        "--num-layers-per-virtual-pipeline-stage, else 1f1b)",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ptd-plan", description="Predict and plan PTD-P layouts (paper §3).")
    sub = parser.add_subparsers(dest="command", required=True)
    energy_cli.add_parser(sub)  # ptd-plan energy: one GPU clock per pipeline rank (cli/energy.py)
    parser.predict_parser = sub.add_parser(
        "predict",
        parents=[train_parser(add_help=False)],
        help="the run of ptd-train's flags: time per iteration and its terms, TFLOP/s, MFU, memory term by term",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    srch = sub.add_parser("search", help="every layout of --num-gpus that fits, ranked")
    add_model_flags(srch)
    add_run_flags(srch)
    srch.add_argument("--top", type=positive_int, default=10, help="rows of the table (the JSON lists all)")
    srch.add_argument(
        "--context-parallel-sizes",
        type=context_sizes_flag,
        metavar="C[,C...]",
        help="the context-parallel sizes c to weigh beside c = 1 (the p2p ring on the flash kernel); default: every "
        "c that divides N/(t*p), halves S/c and keeps c*t GPUs in a node",
    )
    srch.add_argument(
        "--verify",
        type=positive_int,
        metavar="K",
        help="compile the K best layouts with XLA:GPU for --hardware (no GPU needed: the gpu-compile "
        "extra) and show the compiled memory per GPU beside the prediction",
    )
    return parser


def context_sizes_flag(text: str) -> tuple[int, ...]:
    """ "2,4" -> (2, 4): positive integers, comma-separated."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--context-parallel-sizes={text!r} is not a list of positive integers")
    return sizes


def model_config(args) -> ModelConfig:
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
            "vocab_size",
            "make_vocab_size_divisible_by",
            "attention_backend",
        )
        if getattr(args, name) is not None
    }
    cfg = base.replace(**overrides, dtype="float16" if args.fp16 else "bfloat16")
    cfg = cfg.replace(fused_kernels=True)
    if args.attention_backend is None:  # as ptd-train resolves it for an NVIDIA target without the GPU here
        cudnn = cudnn_attention_problem(cfg, hopper=False) is None
        cfg = cfg.replace(attention_backend=default_attention_backend(cfg, 1, cudnn=cudnn))
    return cfg


def layout_flags(args) -> dict:
    return {
        "sequence_parallel": args.sequence_parallel,
        "use_distributed_optimizer": args.use_distributed_optimizer,
        "scatter_gather": not args.no_scatter_gather_tensors_in_pipeline,
    }


PREDICTION_GROUPS = ("model", "parallelism")
"""ptd-train's flag groups that change the prediction; of the others only these do:"""
PREDICTION_FLAGS = frozenset(
    {"recompute_granularity", "target", "num_gpus", "json", "compile_only"}
    | {"tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"}  # the tokenizer decides V
)


def ignored_flags(parser: argparse.ArgumentParser, args) -> list[str]:
    """The flags given (not at their default) that the prediction does not depend on."""
    prediction = set(PREDICTION_FLAGS)
    for group in parser._action_groups:
        if group.title and group.title.startswith(PREDICTION_GROUPS):
            prediction |= {a.dest for a in group._group_actions}
    prediction.discard("fake_devices")  # the prediction is for --target GPUs
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and action.dest not in prediction
        and action.dest != "help"
        and getattr(args, action.dest, None) != action.default
    ]


def predict_run(args, ignored: list[str]) -> dict:
    """The prediction for ptd-train's flags: `configs_for_target`'s configs on --target, as --compile-only builds
    them."""
    from ptd_jax.runtime.platform import resolve_branching

    fill_defaults(args)
    target = args.target or DEFAULT_TARGET
    hw = HARDWARE[target]
    cfg, parallel, train_cfg = configs_for_target(args)
    recompute = train_cfg.recompute_granularity
    pred = predict(cfg, parallel, hw, recompute)
    record = layout_record(cfg, parallel, pred, hw)
    record.update(
        hardware=hw.name,
        num_gpus=parallel.num_devices,
        global_batch_size=parallel.global_batch_size,
        recompute_granularity=recompute,
        lockstep_bubble_fraction=lockstep_bubble(parallel, recompute),
        memory_stage=pred.memory["stage"],
        memory_terms_gb={k: v / GIB for k, v in pred.memory.items() if k not in ("stage", "params")},
        usable_memory_gb=hw.usable_memory_bytes / GIB,
        allocator_fraction=allocator_fraction(),
        resolved={
            "pipeline_schedule": parallel.pipeline_schedule,
            "pipeline_branching": resolve_branching(parallel.pipeline_branching, "gpu", parallel.pipeline_schedule),
            "attention_backend": cfg.attention_backend,
            "fused_kernels": cfg.fused_kernels,
            "dtype": cfg.dtype,
            "vocab_size": cfg.vocab_size,
            "sequence_parallel": parallel.sequence_parallel,
        },
        ignored_flags=ignored,
        context_parallel_size=parallel.context_parallel_size,
        notes=[],
    )
    return record


def lockstep_bubble(parallel, recompute: str) -> float | None:
    """The bubble of ptd_jax's own table for this layout (backward = 3 forwards under full recomputation, 2
    otherwise), or None when the table would be too large to build quickly."""
    p, v, m = (parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages, parallel.num_microbatches)
    if p == 1:
        return 0.0
    if p * v * m > LOCKSTEP_CELL_LIMIT:
        return None
    from ptd_jax.parallel.pipeline import build

    sched = build(parallel.pipeline_schedule, p, v, m, parallel.microbatch_group_size)
    return sched.simulate(backward_ratio=3.0 if recompute == "full" else 2.0)["bubble_fraction"]


def print_predict(r: dict) -> None:
    res = r["resolved"]
    print(
        f"{describe(r)} ({r['pipeline_schedule']}, m={r['num_microbatches']}) on {r['num_gpus']} x {r['hardware']}, "
        f"recompute={r['recompute_granularity']}; resolved: branching {res['pipeline_branching']}, attention "
        f"{res['attention_backend']}, fused kernels {'on' if res['fused_kernels'] else 'off'}, {res['dtype']}, "
        f"V={res['vocab_size']}"
    )
    print(
        f"  iteration {r['iteration_time_s']:.3f} s: "
        + ", ".join(f"{name} {sec:.3f}" for name, sec in r["terms_s"].items() if sec)
    )
    print(
        f"  {r['tflops_per_gpu']:.1f} TFLOP/s per GPU (paper eq. 3); model {r['model_tflops_per_gpu']:.1f} "
        f"(MFU {r['mfu']:.1%}); hardware {r['hardware_tflops_per_gpu']:.1f}"
    )
    lock = r["lockstep_bubble_fraction"]
    print(
        f"  bubble {r['bubble_fraction']:.3f}; the schedule's table "
        f"{'not built (too large)' if lock is None else f'{lock:.3f}'} at B = 2F (3F under full recomputation)"
    )
    terms = r["memory_terms_gb"]
    fits = "fits" if r["fits"] else "DOES NOT FIT"
    print(
        f"  memory {r['memory_gb_per_gpu']:.2f} GiB per GPU ({r['memory_stage']} stage): "
        + ", ".join(
            f"{name} {terms[name]:.2f}"
            for name in (
                "weights",
                "compute_copy",
                "gradients",
                "optimizer",
                "stash",
                "recompute",
                "logits",
                "workspace",
            )
            if terms.get(name)
        )
        + f"; {fits} in {r['usable_memory_gb']:.2f} GiB usable ({r['allocator_fraction']:g} of the GPU: "
        "XLA_PYTHON_CLIENT_MEM_FRACTION, as ptd-train and --compile-only)"
    )
    for note in r["notes"]:
        print(f"  note: {note}")
    if r["ignored_flags"]:
        print(f"  ignored (no effect on the prediction): {' '.join(r['ignored_flags'])}")


def print_search(result: dict, top: int) -> None:
    rows = result["layouts"]
    print(
        f"{'rank':>4} {'t':>3} {'p':>3} {'c':>3} {'d':>4} {'b':>3} {'k':>3} {'schedule':>13} {'recompute':>9} {'m':>5} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'iter s':>8} {'bubble':>7} {'GiB':>6}"
    )
    for i, r in enumerate(rows[:top], 1):
        k = r["num_layers_per_virtual_pipeline_stage"]
        print(
            f"{i:>4} {r['tensor_model_parallel_size']:>3} {r['pipeline_model_parallel_size']:>3} "
            f"{r['context_parallel_size']:>3} "
            f"{r['data_parallel_size']:>4} {r['micro_batch_size']:>3} {k if k else '-':>3} "
            f"{r['pipeline_schedule']:>13} {r['recompute_granularity']:>9} "
            f"{r['num_microbatches']:>5} {r['tflops_per_gpu']:>8.1f} {r['mfu']:>6.1%} "
            f"{r['iteration_time_s']:>8.2f} {r['bubble_fraction']:>7.3f} {r['memory_gb_per_gpu']:>6.1f}"
        )
    print(
        f"({len(rows)} layouts fit, {len(result['excluded'])} do not; TFLOP/s = paper eq. 3; k = layers per "
        f"virtual stage, '-' = one chunk per rank)"
    )
    print(f"why {describe(rows[0])} wins:")
    for line in result["why"]:
        print(f"  - {line}")


MAX_GPUS = 1 << 20


def run(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "energy":
        return energy_cli.run(args)
    if args.num_gpus is not None and args.num_gpus > MAX_GPUS:
        raise ConfigError(f"num_gpus={args.num_gpus} is more than {MAX_GPUS} (the planner enumerates its divisors)")
    if args.command == "predict":
        result = predict_run(args, ignored_flags(parser.predict_parser, args))
        if args.json:
            print(json.dumps(result))
        else:
            print_predict(result)
        return result
    cfg = model_config(args)
    result = search(
        cfg,
        args.num_gpus,
        args.global_batch_size,
        HARDWARE[args.hardware],
        args.recompute_granularity or RECOMPUTE_GRANULARITIES,
        context_parallel_sizes=args.context_parallel_sizes,
        **layout_flags(args),
    )
    if not result["layouts"] and not result["excluded"]:
        raise ConfigError(
            f"no layout of num_gpus={args.num_gpus} GPUs suits global_batch_size="
            f"{args.global_batch_size}, num_layers={cfg.num_layers} and num_attention_heads="
            f"{cfg.num_attention_heads} (d = N/(t*p) must divide B, t the heads, p the layers)"
        )
    if not result["layouts"]:
        smallest = result["excluded"][0]
        raise NothingFits(
            f"no layout of num_gpus={args.num_gpus} GPUs fits in "
            f"{HARDWARE[args.hardware].usable_memory_bytes / GIB:.1f} GiB of a {args.hardware}; the smallest, "
            f"{describe(smallest)} ({smallest['pipeline_schedule']}, "
            f"recompute {smallest['recompute_granularity']}), needs {smallest['memory_gb_per_gpu']:.1f} GiB per GPU: "
            "use more GPUs, a smaller model or sequence"
        )
    if args.verify:
        result["verified"] = verify_layouts(args, cfg, result["layouts"][: args.verify])
    if args.json:
        print(
            json.dumps(
                {
                    "hardware": args.hardware,
                    "num_gpus": args.num_gpus,
                    "global_batch_size": args.global_batch_size,
                    **result,
                }
            )
        )
    else:
        print_search(result, args.top)
        if args.verify:
            print_verified(result["verified"], args.hardware)
    return result


def verify_layouts(args, cfg: ModelConfig, layouts: list[dict]) -> list[dict]:
    from ptd_jax.aot.compile import INSTALL_HINT, plugin_installed

    if not plugin_installed():
        raise ConfigError(f"--verify compiles for GPUs and needs the CUDA plugin: {INSTALL_HINT}")
    from ptd_jax.aot.verify import verify

    return verify(cfg, layouts, args.hardware, args.num_gpus, args.global_batch_size, layout_flags(args))


def print_verified(rows: list[dict], hardware: str) -> None:
    print(f"compiled by XLA:GPU for {hardware} (train step, per GPU):")
    for i, r in enumerate(rows, 1):
        mark = "  <- predicted to fit, does NOT fit compiled" if r["fits_mismatch"] else ""
        print(
            f"{i:>4} {describe(r)} {r['pipeline_schedule']} recompute {r['recompute_granularity']}: predicted "
            f"{r['memory_gb_per_gpu']:.2f} GiB, compiled "
            f"{r['compiled_gb_per_gpu']:.2f} GiB (compiled / predicted "
            f"{r['compiled_gb_per_gpu'] / r['memory_gb_per_gpu']:.3f}; "
            f"{'fits' if r['compiled_fits'] else 'does not fit'}){mark}"
        )


class NothingFits(Exception):
    """A well-formed request that no layout satisfies: one line, exit 1."""


def main(argv=None) -> int:
    try:
        run(argv)
    except ConfigError as err:
        print(f"ptd-plan: error: {err}", file=sys.stderr)
        return 2
    except DataError as err:  # a tokenizer or data flag of ptd-train's command line
        print(f"ptd-plan: error: {err}", file=sys.stderr)
        return 2
    except NothingFits as err:
        print(f"ptd-plan: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file that --output or --plot cannot write
        print(f"ptd-plan: error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # ptd-plan ... | head
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
