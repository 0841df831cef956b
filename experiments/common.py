"""What several experiment scripts share: the results folder and JSON writing, fake CPU devices, the compiled
gradient steps they time (the pipeline executor's and the single-device reference's), timing in alternating rounds,
and the XLA:CPU profile's leaf operations. No library logic: the steps come from `ptd_jax.parallel.step` and
`ptd_jax.train.reference`, the timing from `ptd_jax/train/bubble.py`.

Measured numbers are ratios of step times taken in the same run, medians of alternating rounds: the development
machine has 2 cores shared with other jobs, so absolute times are noisy, and on fake devices (which share those
cores) a step's time follows the work that every rank executes, not a GPU's critical path.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
TIMING_NOTE = (
    "fake CPU devices sharing a 2-core host with other jobs: medians of alternating rounds, ratios within "
    "one run; step time follows the work every rank executes (idle cells' dummies under uniform branching)"
)
SMALL = dict(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512)
"""The figure scripts' measured model (fast defaults: a step takes tens of milliseconds on fake devices)."""
SMOKE = dict(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)
BENCH_MODEL = dict(num_layers=16, hidden_size=256, num_attention_heads=8, vocab_size=6400, seq_length=256)
"""The benchmarks' pipeline model at the paper's vocabulary/hidden ratio (V 6400 = 25·h, as GPT-3's 51200/2048: the
output layer costs about one chunk at p = 4)."""


def write_json(path, data, indent: int = 1, end: str = "") -> Path:
    """`data` as JSON at `path` (its folder made), `end` appended; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + end)
    return path


def fake_devices(n: int) -> None:
    """n fake CPU devices; call before JAX starts."""
    from ptd_jax.parallel.mesh import set_fake_devices

    set_fake_devices(n)


def small_model(smoke: bool = False, **overrides):
    from ptd_jax.config import ModelConfig

    return ModelConfig(**{**(SMOKE if smoke else SMALL), **overrides})


def pipeline_step(cfg, schedule, v, branching, recompute, p=4, m=8, *, t=1, d=1, b=1, **parallel_fields):
    """(compiled grad step, its arguments) for the layout (d, p, t, v, b) on the first d·p·t devices: the training
    step's gradients (`parallel.step.make_parallel_grad_step`; at p = 1 the executor's 1F1B table at p = 1 when
    m > 1). `parallel_fields`: further `ParallelConfig` fields (scatter_gather, sequence_parallel)."""
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ParallelConfig
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.sharding import place_params
    from ptd_jax.parallel.step import make_parallel_grad_step

    parallel = ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule if p > 1 else "1f1b",
        micro_batch_size=b,
        global_batch_size=m * b * d,
        pipeline_branching=branching,
        **parallel_fields,
    )
    mesh = make_mesh(parallel)
    params, specs = place_params(gpt.init_params(jax.random.key(0), cfg, t), parallel, mesh)
    step = make_parallel_grad_step(
        mesh, cfg, parallel, specs, recompute=recompute, scatter_gather=parallel.scatter_gather
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m, d * b, cfg.seq_length), dtype=np.int32)
    args = (params, tokens, tokens, np.ones_like(tokens))
    return step.lower(*args).compile(), args


def reference_step(cfg, recompute, m=8):
    """(compiled single-device grad step, its arguments): `train.reference.accumulate_gradients` over m
    microbatches of one sequence."""
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.train.reference import accumulate_gradients

    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m, 1, cfg.seq_length), dtype=np.int32)
    args = (params, tokens, tokens, np.ones_like(tokens))
    step = jax.jit(lambda prm, t, lab, msk: accumulate_gradients(prm, t, lab, msk, cfg, recompute=recompute))
    return step.lower(*args).compile(), args


def grad_step(
    cfg, *, schedule="1f1b-lockstep", p=1, v=1, m=4, t=1, d=1, b=1, recompute="none", branching="uniform", **fields
):
    """`pipeline_step` with keyword arguments: (compiled grad step, its arguments). The default schedule and
    branching are the paper's 1F1B on lockstep ticks under "uniform" ("1f1b" splits its backwards on unit ticks:
    "per-rank" only)."""
    return pipeline_step(cfg, schedule, v, branching, recompute, p=p, m=m, t=t, d=d, b=b, **fields)


def alternate(steps: dict, rounds: int) -> dict:
    """{name: {"wall": [s...], "cpu": [s...]}} from alternating rounds after one warm-up run of each
    (`train.bubble.time_alternating`; the CPU time sums every XLA thread's work, so on a shared, loaded machine it
    follows the work executed better than the wall time: both are reported)."""
    from ptd_jax.train.bubble import time_alternating

    cpu = {}
    wall = time_alternating(steps, rounds, cpu_times=cpu)
    return {name: {"wall": wall[name], "cpu": cpu[name]} for name in steps}


def time_steps(steps: dict, rounds: int) -> dict:
    """{"median_step_s", "all_step_s"} of each compiled `(fn, args)`, alternating rounds after one warm-up call."""
    from ptd_jax.train.bubble import time_alternating

    times = time_alternating(steps, rounds)
    return {"median_step_s": {k: statistics.median(v) for k, v in times.items()}, "all_step_s": times}


def measure_layouts(cfg, layouts: dict, rounds: int) -> dict:
    """Compile `grad_step(cfg, **layout)` for each named layout, time them all in alternating rounds. The record
    keeps each layout and the model, which `paper/calibrate_fake_devices.py` reads back, and XLA's temp bytes per
    device of each compiled step."""
    import dataclasses

    steps, temp = {}, {}
    for name, layout in layouts.items():
        compiled, args = grad_step(cfg, **layout)
        steps[name] = (compiled, args)
        memory = compiled.memory_analysis()
        temp[name] = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    model = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
    }
    return {
        "model": model,
        "layouts": layouts,
        "temp_bytes_per_device": temp,
        "rounds": rounds,
        **time_steps(steps, rounds),
    }


CONTAINERS = re.compile(r"(while|cond|call|conditional)(\.\d+)*(\.clone)?$")


def leaf_times(trace_file: str, windows: list[tuple[float, float]]) -> tuple[dict, dict]:
    """Of an XLA:CPU perfetto trace: summed duration (ms) and count of leaf thunks per operation kind
    ("fusion.12" -> "fusion") whose start falls inside any window."""
    with gzip.open(trace_file) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ms, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        name = e["name"]
        if name.startswith("$") or "Thunk" in name or "Await" in name or CONTAINERS.match(name):
            continue
        if any(lo <= e["ts"] < hi for lo, hi in windows):
            kind = re.sub(r"\.\d+$", "", name)
            ms[kind] += e["dur"] / 1e3
            count[kind] += 1
    return ms, count
