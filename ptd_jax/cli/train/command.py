"""`ptd-train`: parse, check, start the backend, train (or compile only), and print the JSON summary.

With no flags it runs the demo: the tiny preset on the embedded corpus (this interpreter's standard library).
Bad input exits with code 2 and one line on stderr naming the values. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import json
import math
import os
import sys

from ptd_jax.cli import errors
from ptd_jax.cli.train import checks, compile_only
from ptd_jax.cli.train.configs import (
    apply_demo_layout,
    configs_for_target,
    fill_defaults,
    model_config_from_args,
    parallel_config_from_args,
    run_options,
    train_config_from_args,
)
from ptd_jax.cli.train.parser import build_parser
from ptd_jax.config import ConfigError
from ptd_jax.data import DataError
from ptd_jax.data.indexed_dataset import IndexedDatasetError
from ptd_jax.data.tokenizer import training_tokenizer
from ptd_jax.perf.memory import check_fits
from ptd_jax.runtime import multiprocess
from ptd_jax.runtime.failures import RunError

MAX_FAKE_DEVICES = 256
"""Simulated devices share this machine's cores; at 1024 XLA:CPU's all-reduce stalls (measured)."""


def run(argv=None) -> dict | int:
    """Parse, validate and train (the summary), or compile only (the exit code); raises ConfigError/DataError/
    IndexedDatasetError on bad input."""
    args = build_parser().parse_args(argv)
    checks.check_compile_only_flags(args)
    demo = apply_demo_layout(args)
    fill_defaults(args)
    checks.check_flag_combinations(args)
    if args.compile_only:
        return compile_for_target(args)
    start_backend(args)
    import logging

    import jax

    from ptd_jax.train import train

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's info/warnings; our own lines say what happened

    tokenizer = training_tokenizer(
        args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size, tokenizer_model=args.tokenizer_model
    )
    model_cfg = checks.check_default_kernels(model_config_from_args(args, tokenizer), args)
    train_cfg = train_config_from_args(args)
    device, local = jax.local_devices()[0], jax.local_device_count()
    checks.check_sizes(args, model_cfg.seq_length, len(jax.devices()))
    parallel = parallel_config_from_args(args, model_cfg, len(jax.devices()), device, local)
    checks.check_backend(model_cfg)
    checks.check_outputs(args)
    check_fits(model_cfg, parallel, train_cfg.recompute_granularity, device, local)
    if args.sequence_parallel and not parallel.sequence_parallel:
        print(
            "ptd-train: warning: --sequence-parallel has no effect with tensor_model_parallel_size=1; "
            "running without it (as Megatron does)",
            file=sys.stderr,
        )

    if demo:
        print(
            "ptd-train: no accelerator found and no layout given: running the 3-D demo layout d=2 p=2 t=2 "
            "(interleaved 1F1B, v=2) on 8 simulated CPU devices (--fake-devices 1 for a single device)",
            file=sys.stderr,
        )
    return train(model_cfg, parallel, train_cfg, run_options(args, tokenizer))


def compile_for_target(args) -> int:
    """--compile-only: the configs as on --num-gpus GPUs of --target, the kernels' defaults as a GPU resolves them."""
    if args.fake_devices is not None:
        raise ConfigError(f"--compile-only compiles for --target GPUs: drop fake_devices={args.fake_devices}")
    checks.check_data_flags(args)  # the data is not read, but a path that names nothing is a mistake
    return compile_only.run(args, *configs_for_target(args))


def start_backend(args) -> None:
    """Join the other processes (if any) and simulate --fake-devices, both before JAX starts its backend."""
    group = multiprocess.resolve(args.coordinator_address, args.num_processes, args.process_id)
    if args.heartbeat_timeout < 1:
        raise ConfigError(f"heartbeat_timeout={args.heartbeat_timeout} must be at least 1 (seconds)")
    coordinator_timeout = multiprocess.coordinator_timeout(args.coordinator_timeout)

    def join_processes():  # before JAX starts its backend
        if os.environ.get("PTD_JAX_KEEP_HOST_MEMORY") == "1":  # opt-in (runtime/host_memory.py)
            from ptd_jax.runtime.host_memory import keep_freed_host_memory

            keep_freed_host_memory()
        if group is not None:
            multiprocess.initialize(group, args.heartbeat_timeout, coordinator_timeout)

    if args.fake_devices is not None:
        if not 1 <= args.fake_devices <= MAX_FAKE_DEVICES:
            raise ConfigError(
                f"fake_devices={args.fake_devices} must be in [1, {MAX_FAKE_DEVICES}] (simulated "
                f"devices share this machine's CPU cores)"
            )
        from ptd_jax.parallel.mesh import set_fake_devices

        set_fake_devices(args.fake_devices, before_backend=join_processes)
    else:
        join_processes()


def main(argv=None) -> int:
    errors.quiet_libraries()
    return multiprocess.end(_main(argv))


def _main(argv) -> int:
    from ptd_jax.train.guards import DivergedError

    try:
        summary = run(argv)
        if isinstance(summary, int):  # --compile-only: its exit code; it printed its own summary
            return summary
    except BrokenPipeError:  # `ptd-train ... | head -1`: the reader has what it wanted
        errors.close_stdout_quietly()
        return 0
    except (ConfigError, DataError, IndexedDatasetError, OSError) as err:
        return errors.report("ptd-train", err)
    except (DivergedError, RunError) as err:  # --max-skipped-iters, a failed write: not bad input, a failed run
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        return errors.report("ptd-train", RunError(str(err)))
    except RuntimeError as err:  # XLA's out-of-memory, past the estimate of perf/memory.py
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        if SHARED_MEMORY_LIMIT in str(err):  # a kernel's tiles too large for one SM: a compile error, not memory
            if errors.debug():
                raise
            return errors.report("ptd-train", RunError(kernel_limit_message(err)))
        if "RESOURCE_EXHAUSTED" not in str(err):
            if errors.debug():
                raise
            return errors.report("ptd-train", err)
        print(
            f"ptd-train: error: out of device memory ({str(err).splitlines()[0][:300]}); use more devices, a "
            f"larger t or p, a smaller micro batch, or --recompute-granularity full",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as stop:  # the loop re-raises it saying where it stopped
        print(f"ptd-train: interrupted (Ctrl-C) {str(stop) or 'before training started'}", file=sys.stderr)
        return 130
    except Exception as err:  # anything else: one line, the traceback under PTD_DEBUG=1
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        if errors.debug():
            raise
        return errors.report("ptd-train", err)
    if multiprocess.is_primary():  # only process 0 prints
        try:
            print(json.dumps(_strict(summary)), flush=True)
        except BrokenPipeError:
            errors.close_stdout_quietly()
    return 0


SHARED_MEMORY_LIMIT = "Shared memory size limit exceeded"
"""XLA:GPU's words when a Triton kernel's tiles need more shared memory than one block may have (a RESOURCE_EXHAUSTED
status, like an allocation that does not fit the device)."""


def kernel_limit_message(err: BaseException) -> str:
    """A kernel that does not fit the GPU's shared memory, said as the compile error it is."""
    line = next((x.strip() for x in str(err).splitlines() if SHARED_MEMORY_LIMIT in x), str(err).splitlines()[0])
    return (
        f"a kernel does not compile for this GPU, its blocks exceed the shared memory of one SM ({line[:300]}); not "
        f"device memory: use --attention-backend xla or cudnn, or --no-fused-kernels"
    )


def _strict(value):
    """The summary as strict JSON: a non-finite float (a diverged loss) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())
