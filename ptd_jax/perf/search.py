"""The layout planner: every PTD-P layout of N GPUs for a model and a global batch, predicted (`timing.predict`),
the ones that fit in memory ranked by iteration time, and why the best one wins — the paper's takeaways made
numeric by comparing the best layout with the fastest layout of each other value of one knob (`explain`):

- Takeaway #1 (§3.2): tensor parallelism up to the GPUs of a node, pipeline parallelism across nodes (t);
- Takeaway #2 (§3.3): a model-parallel size t·p just large enough for the model to fit, data parallelism beyond (p);
- Takeaway #3 (§3.4): the best micro-batch size trades GEMM efficiency against the bubble and memory (b);
- §2.2.2: interleaving (v model chunks per rank) divides the bubble by v at v times the pipeline p2p (v);
- how robust the choice of t is (`sensitivity_of_t`, the "sensitivity" key and the last lines of "why"): against the
  next t inside a node, the break-even values of the NVLink bus bandwidth, the GEMM efficiency and the InfiniBand
  efficiency (bisection over 0.3x..3x the preset, efficiencies at most 1, the whole search re-run at each trial
  value), and the fastest layout of each t without interleaving and at b = 1.

What it says for GPT-3 175B on 1,024 A100-80GB at batch 1,536 in fp16 (the figures are in experiments/README.md):
t = 4 comes first, ahead of the t = 8 of Megatron-LM's examples/pretrain_gpt3_175B.sh (the paper, §5.1, reports
the throughput of that run but not its layout). Why: at a fixed t·p (the same d and m), t = 8 holds twice the
layers per GPU, so it all-reduces more than twice the bytes of t = 4 (6 all-reduces of b·s·h per layer and
microbatch with full recomputation, each moving 2(t−1)/t of them) and repeats twice the LayerNorms and
bias-dropout-adds that every tensor rank runs (22·s·b·h bytes per layer, whatever t). At h = 12288 that outweighs
what t = 8 saves in bubble and p2p; the compute per all-reduced byte grows with h, and at Fig. 13's h = 20480 the
model puts t = 8 first at both batch sizes, as the paper measured.

The sensitivity lines test that answer: the NVLink bus bandwidth over 0.3x..3x its preset, the GEMM efficiency and
the InfiniBand efficiency, each re-ranking every layout; part of t = 8's deficit (the repeated LayerNorm and
dropout bytes) does not shrink with the bandwidth. Interleaving is most of t = 4's lead, and t = 8's best
layout needs b = 2: the rankings restricted to plain 1F1B and to b = 1 show both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Callable

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig
from ptd_jax.perf.hardware import GIB, Hardware, allocator_fraction
from ptd_jax.perf.timing import Prediction, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
SHORT = {
    "tensor_model_parallel_size": "t",
    "pipeline_model_parallel_size": "p",
    "data_parallel_size": "d",
    "micro_batch_size": "b",
    "num_layers_per_virtual_pipeline_stage": "k",
}


def divisors(n: int) -> list[int]:
    small = [i for i in range(1, int(n**0.5) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def make_parallel(
    cfg: ModelConfig,
    num_gpus: int,
    t: int,
    p: int,
    b: int,
    global_batch_size: int,
    layers_per_virtual_stage: int | None = None,
    **fields,
) -> ParallelConfig:
    """A `ParallelConfig` the way ptd-train builds one from Megatron's flags (raises ConfigError naming values).
    `fields`: other `ParallelConfig` fields (sequence_parallel, use_distributed_optimizer, scatter_gather, ...), and
    `schedule`: None gives ptd-train's default, interleaved with layers per virtual stage, else 1F1B."""
    v = 1
    if layers_per_virtual_stage is not None:
        if layers_per_virtual_stage < 1 or cfg.num_layers % (layers_per_virtual_stage * p):
            raise ConfigError(
                f"num_layers={cfg.num_layers} is not divisible by num_layers_per_virtual_pipeline_"
                f"stage={layers_per_virtual_stage} x pipeline_model_parallel_size={p}"
            )
        v = cfg.num_layers // (layers_per_virtual_stage * p)
    schedule = fields.pop("schedule", None)
    if schedule is None:
        schedule = INTERLEAVED if layers_per_virtual_stage is not None else ParallelConfig.pipeline_schedule
    fields["sequence_parallel"] = fields.get("sequence_parallel", False) and t > 1
    parallel = ParallelConfig.for_devices(
        num_gpus,
        tensor_model_parallel_size=t,
        pipeline_model_parallel_size=p,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=b,
        global_batch_size=global_batch_size,
        **fields,
    )
    parallel.check_model(cfg)
    return parallel


def layout_record(cfg: ModelConfig, parallel: ParallelConfig, pred: Prediction, hw: Hardware) -> dict:
    """The JSON row of one layout (the keys of docs/architecture.md, "Interfaces", and more)."""
    v = parallel.virtual_pipeline_stages
    return {
        "num_parameters": cfg.num_parameters,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "cp_comm_type": parallel.cp_comm_type,
        "attention_backend": cfg.attention_backend,
        "micro_batch_size": parallel.micro_batch_size,
        "num_layers_per_virtual_pipeline_stage": (
            cfg.num_layers // (parallel.pipeline_model_parallel_size * v) if v > 1 else None
        ),
        "virtual_pipeline_stages": v,
        "pipeline_schedule": parallel.pipeline_schedule,
        "num_microbatches": parallel.num_microbatches,
        "tflops_per_gpu": pred.tflops_per_gpu("eq3"),
        "model_tflops_per_gpu": pred.tflops_per_gpu("model"),
        "hardware_tflops_per_gpu": pred.tflops_per_gpu("hardware"),
        "mfu": pred.tflops_per_gpu("model") * 1e12 / hw.peak_flops,
        "iteration_time_s": pred.iteration_time_s,
        "bubble_fraction": pred.bubble_fraction,
        "memory_gb_per_gpu": pred.memory["total"] / GIB,
        "memory_breakdown_gb": {k: pred.memory[k] / GIB for k in ("state", "activations")},
        "fits": pred.memory["total"] <= hw.usable_memory_bytes,
        "terms_s": dict(pred.terms),
        "recompute_split_s": dict(pred.details["recompute_split_s"]),
    }


def context_sizes(cfg: ModelConfig, n: int, t: int, allowed: tuple[int, ...] | None, gpus_per_node: int) -> list[int]:
    """The c that split n = N/(t·p) GPUs: c | n, S % (2c) = 0 (Megatron's 2c load-balanced chunks), and c·t GPUs in
    one node (the K/V ring on NVLink; `perf.context`); `allowed` None: every such c, else those of it."""
    sizes = [c for c in divisors(n) if cfg.seq_length % (2 * c) == 0 and c * t <= max(gpus_per_node, t)]
    return [1] + [c for c in sizes if c > 1 and (allowed is None or c in allowed)]


def candidates(cfg: ModelConfig, num_gpus: int, global_batch_size: int, contexts=(1,), gpus_per_node: int = 8):
    """(t, p, c, b, k) of every layout the flags allow: t | heads, query groups and ffn, p | layers, c from
    `context_sizes` (`contexts`: the c allowed, None for all), d = N/(t·p·c) | B, b | B/d, k = layers per virtual
    stage (None: plain 1F1B) with v = l/(p·k) >= 2."""
    for t in divisors(num_gpus):
        if cfg.num_attention_heads % t or cfg.num_groups % t or cfg.ffn_size % t:
            continue
        for p in divisors(num_gpus // t):
            if cfg.num_layers % p:
                continue
            for c in context_sizes(cfg, num_gpus // (t * p), t, contexts, gpus_per_node):
                d = num_gpus // (t * p * c)
                if global_batch_size % d:
                    continue
                for b in MICRO_BATCH_SIZES:
                    if (global_batch_size // d) % b:
                        continue
                    yield t, p, c, b, None
                    if p > 1:
                        for k in divisors(cfg.num_layers // p):
                            if cfg.num_layers // (p * k) >= 2:
                                yield t, p, c, b, k


INTERLEAVED = "interleaved"
PLAIN_SCHEDULES = ("1f1b", "1f1b-lockstep", "zb-h1")
"""The unchunked schedules the search weighs: Megatron's stash on unit ticks (I and W split; best when F ≈ I ≈ W), fused
backwards on lockstep ticks ((p − 1)/m whatever B/F is: best under full recomputation), and ZB-H1 (W deferred to
fill the bubble). Chunked: interleaved at every k, and ZB-V at v = 2."""
RECOMPUTE_POLICIES = ("none", "selective", "full")


SPLIT_CELL_LIMIT = 1_000
"""The zero-bubble schedules are weighed where their table (p · v · m cells, simulated: no closed form) stays this
small; larger layouts keep the fused schedules' closed forms."""


def _with_schedules(layouts, num_layers: int, num_gpus: int, global_batch_size: int):
    for t, p, c, b, k in layouts:
        cells = p * global_batch_size // (num_gpus // (t * p * c) * b) * (num_layers // (p * k) if k else 1)
        split = p > 1 and cells <= SPLIT_CELL_LIMIT
        if k is not None:
            yield t, p, c, b, k, None
            if split and num_layers == 2 * p * k:
                yield t, p, c, b, k, "zb-v"
            continue
        for schedule in (None,) if p == 1 else PLAIN_SCHEDULES if split else PLAIN_SCHEDULES[:2]:
            yield t, p, c, b, k, schedule


def _context_model(cfg: ModelConfig, c: int) -> ModelConfig:
    """The model's attention under the p2p ring at c > 1: cuDNN's (refused there: no log-sum-exp) becomes the ring on
    the Pallas flash kernel, as ptd-train resolves it on a GPU (`checks.default_attention_backend`), and the kernel
    with a sliding window XLA's blocks; an XLA or Pallas model keeps its attention. (Attention dropout under p2p is
    refused by `ParallelConfig`: such layouts are left out.)"""
    if c == 1:
        return cfg
    if cfg.attention_backend == "xla":
        return cfg
    return cfg.replace(attention_backend="pallas" if cfg.window_size is None else "xla")


def search(
    cfg: ModelConfig,
    num_gpus: int,
    global_batch_size: int,
    hw: Hardware,
    recompute: str | tuple[str, ...] = "full",
    *,
    sensitivity: bool = True,
    context_parallel_sizes: tuple[int, ...] | None = (1,),
    **flags,
) -> dict:
    """{"layouts": fitting layouts fastest first, "excluded": the ones that do not fit (with why), "why": lines,
    "sensitivity": how robust the choice of t is (`sensitivity`; None when `sensitivity` is False or nothing
    fits), its lines also at the end of "why"}. `recompute`: one policy, or several to rank as one more knob
    (each record says its `recompute_granularity`). `context_parallel_sizes`: the c to weigh (None: every c of
    `context_sizes`), each c > 1 with the p2p ring (`_context_model`)."""
    policies = (recompute,) if isinstance(recompute, str) else tuple(recompute)
    fits, excluded = [], []
    layouts = candidates(cfg, num_gpus, global_batch_size, context_parallel_sizes, hw.gpus_per_node)
    for t, p, c, b, k, schedule in _with_schedules(layouts, cfg.num_layers, num_gpus, global_batch_size):
        model = _context_model(cfg, c)
        try:
            parallel = make_parallel(
                model, num_gpus, t, p, b, global_batch_size, k, schedule=schedule, context_parallel_size=c, **flags
            )
        except ConfigError:
            continue  # e.g. the interleaved schedule's rules on m, the ring's on the schedule
        for policy in policies:
            record = layout_record(model, parallel, predict(model, parallel, hw, policy), hw)
            record["recompute_granularity"] = policy
            if record["fits"]:
                fits.append(record)
            else:
                record["excluded_because"] = (
                    f"needs {record['memory_gb_per_gpu']:.1f} GiB per GPU, {hw.usable_memory_bytes / GIB:.1f} GiB "
                    f"usable ({allocator_fraction():g} of {hw.memory_bytes / GIB:.1f})"
                )
                excluded.append(record)
    fits.sort(key=lambda r: r["iteration_time_s"])
    excluded.sort(key=lambda r: r["memory_gb_per_gpu"])
    result = {
        "layouts": fits,
        "excluded": excluded,
        "why": explain(fits, excluded, hw.gpus_per_node) if fits else [],
        "sensitivity": None,
    }
    if sensitivity and fits:
        best_policy = fits[0]["recompute_granularity"]
        result["sensitivity"] = sensitivity_of_t(
            cfg,
            num_gpus,
            global_batch_size,
            hw,
            fits,
            best_policy,
            context_parallel_sizes=context_parallel_sizes,
            **flags,
        )
        result["why"] += result["sensitivity"]["lines"]
    return result


def describe(r: dict) -> str:
    """t=.. p=.. d=.. b=.. k=.., and c=.. under context parallelism."""
    text = " ".join(f"{SHORT[k]}={r[k] if r[k] is not None else '-'}" for k in SHORT)
    c = r.get("context_parallel_size", 1)
    return text if c == 1 else f"{text} c={c}"


def _tp(r: dict) -> int:
    return r["tensor_model_parallel_size"] * r["pipeline_model_parallel_size"]


def _because(best: dict, rival: dict) -> str:
    """The three terms that moved most from `best` to `rival`; recomputation split into its three parts."""
    deltas = {name: rival["terms_s"][name] - best["terms_s"][name] for name in best["terms_s"]}
    parts = []
    for name, delta in sorted(deltas.items(), key=lambda kv: -abs(kv[1]))[:3]:
        text = f"{name} {delta:+.2f} s"
        if name == "recompute" and "recompute_split_s" in best:
            split = {k: rival["recompute_split_s"][k] - best["recompute_split_s"][k] for k in best["recompute_split_s"]}
            text += " [its " + ", ".join(f"{k} {v:+.2f}" for k, v in split.items()) + "]"
        parts.append(text)
    return ", ".join(parts)


def _versus(best: dict, rival: dict) -> str:
    slower = rival["iteration_time_s"] / best["iteration_time_s"] - 1
    return f"{describe(rival)} {rival['tflops_per_gpu']:.1f} TFLOP/s, {slower:+.1%} time ({_because(best, rival)})"


def _fastest(rows: list[dict], key) -> dict:
    """The first (fastest) row of each key value, in the order the values first appear."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), r)
    return out


def explain(fits: list[dict], excluded: list[dict], gpus_per_node: int = 8) -> list[str]:
    """The paper's takeaways as numbers: the best layout against the fastest layout of every other value of one
    knob, the others held where the takeaway holds them:
    - Takeaway #1, t: the same model-parallel size t·p (so the same d and m), every other t (t > gpus_per_node:
      across nodes);
    - Takeaway #2, t·p: the fastest layout of every model-parallel size, and the sizes where nothing fits;
    - Takeaway #3, b: the same (t, p), any k;
    - §2.2.2, interleaving: the same (t, p, b), plain 1F1B and every k."""
    best = fits[0]
    t, p, b, k = (
        best["tensor_model_parallel_size"],
        best["pipeline_model_parallel_size"],
        best["micro_batch_size"],
        best["num_layers_per_virtual_pipeline_stage"],
    )
    lines = [
        (
            f"best: {describe(best)} at {best['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
            f"{best['iteration_time_s']:.2f} s per iteration (m={best['num_microbatches']}, "
            f"bubble {best['bubble_fraction']:.3f}, {best['memory_gb_per_gpu']:.1f} GiB)"
        )
    ]
    same_tp = [r for r in fits if _tp(r) == t * p]
    for other_t, r in sorted(_fastest(same_tp, lambda r: r["tensor_model_parallel_size"]).items()):
        if other_t != t:
            where = "across nodes" if other_t > gpus_per_node else "within a node"
            lines.append(
                f"Takeaway #1 (§3.2) t within a node, same t·p={t * p}: t={other_t} ({where}): " + _versus(best, r)
            )
    unfit_t = sorted(
        {r["tensor_model_parallel_size"] for r in excluded if _tp(r) == t * p}
        - {r["tensor_model_parallel_size"] for r in same_tp}
    )
    if unfit_t:
        lines.append(f"Takeaway #1 (§3.2): at t·p={t * p}, t in {unfit_t} does not fit")
    by_t = _fastest(fits, lambda r: r["tensor_model_parallel_size"])
    lines.append(
        "Takeaway #1 (§3.2): the fastest layout of each t, any t·p: "
        + ", ".join(f"t={x} {by_t[x]['tflops_per_gpu']:.1f}" for x in sorted(by_t))
        + " TFLOP/s"
    )
    head = "Takeaway #2 (§3.3) t·p just large enough to fit"
    by_tp = _fastest(fits, _tp)
    smallest = min(by_tp)
    unfit_sizes = sorted({_tp(r) for r in excluded} - by_tp.keys())
    below = [x for x in unfit_sizes if x < smallest]
    if below:
        tightest = min((r for r in excluded if _tp(r) == below[-1]), key=lambda r: r["memory_gb_per_gpu"])
        lines.append(f"{head}: t·p <= {below[-1]}: nothing fits ({describe(tightest)} {tightest['excluded_because']})")
    lines.append(f"{head}: the smallest t·p that fits is {smallest}; the best layout's is {t * p}")
    larger = [x for x in sorted(by_tp) if x != t * p]
    for size in [x for x in larger if x < t * p] + [x for x in larger if x > t * p][:2]:
        lines.append(f"{head}: t·p={size}: " + _versus(best, by_tp[size]))
    same_t_p = [r for r in fits if r["tensor_model_parallel_size"] == t and r["pipeline_model_parallel_size"] == p]
    for other_b, r in sorted(_fastest(same_t_p, lambda r: r["micro_batch_size"]).items()):
        if other_b != b:
            lines.append(f"Takeaway #3 (§3.4) micro-batch size, same t, p: b={other_b}: " + _versus(best, r))
    same_b = [r for r in same_t_p if r["micro_batch_size"] == b]
    for other_k, r in _fastest(same_b, lambda r: r["num_layers_per_virtual_pipeline_stage"]).items():
        if other_k != k:
            name = "plain 1F1B" if other_k is None else f"k={other_k} (v={r['virtual_pipeline_stages']})"
            lines.append(f"§2.2.2 interleaved schedule, same t, p, b: {name}: " + _versus(best, r))
    return lines


# --- How robust the choice of t is (Takeaway #1): break-even values of the model's uncertain inputs ---------------


@dataclass(frozen=True)
class Knob:
    """One uncertain input of the model: how to read it from a `Hardware` and make a `Hardware` with another value."""

    name: str
    label: str
    unit: str
    """Of the JSON values ("bytes/s" or "fraction"); the text prints GB/s."""
    get: Callable[[Hardware], float]
    put: Callable[[Hardware, float], Hardware]
    cap: float | None = None
    """The largest physically sensible value (1.0 for an efficiency)."""

    def text(self, value: float) -> str:
        return f"{value / 1e9:.1f} GB/s" if self.unit == "bytes/s" else f"{value:.3f}"


KNOBS = (
    Knob(
        "nvlink_bus_bandwidth",
        "NVLink bus bandwidth (nvlink_efficiency × nvlink_bandwidth: every intra-node transfer)",
        "bytes/s",
        lambda hw: hw.nvlink_efficiency * hw.nvlink_bandwidth,
        lambda hw, x: replace(hw, nvlink_bandwidth=x / hw.nvlink_efficiency),
    ),
    Knob(
        "gemm_efficiency",
        "GEMM efficiency",
        "fraction",
        lambda hw: hw.gemm_efficiency,
        lambda hw, x: replace(hw, gemm_efficiency=x),
        cap=1.0,
    ),
    Knob(
        "ib_efficiency",
        "InfiniBand efficiency",
        "fraction",
        lambda hw: hw.ib_efficiency,
        lambda hw, x: replace(hw, ib_efficiency=x),
        cap=1.0,
    ),
)
KNOB_RANGE = (0.3, 3.0)
"""Each knob is tried from 0.3× to 3× its preset value (an efficiency up to its cap)."""
SIGN = {">=": "≥", "<=": "≤"}
BISECTION_TOLERANCE = 1e-4
"""Of the preset value: the break-even is bracketed to within this."""


def rival_t(fits: list[dict], gpus_per_node: int) -> int | None:
    """The t the best layout's t is weighed against: the next larger t inside a node with a layout that fits, else
    the next smaller one (the best t already fills the node), None if there is no other t inside a node."""
    best_t = fits[0]["tensor_model_parallel_size"]
    inside = {r["tensor_model_parallel_size"] for r in fits} - {best_t}
    inside = {x for x in inside if x <= gpus_per_node}
    larger = sorted(x for x in inside if x > best_t)
    smaller = sorted(x for x in inside if x < best_t)
    return larger[0] if larger else (smaller[-1] if smaller else None)


def _gap(layouts: list[dict], t: int) -> float | None:
    """How much longer the best layout of t takes than the first (0.0: t ranks first), None if no t fits."""
    rival = next((r for r in layouts if r["tensor_model_parallel_size"] == t), None)
    return None if rival is None else rival["iteration_time_s"] / layouts[0]["iteration_time_s"] - 1


def _bisect(first: Callable[[float], bool], not_first: float, first_at: float, tol: float) -> tuple[float, float]:
    """(a value where `first` is False, one where it is True), at most `tol` apart, between the two given."""
    while abs(first_at - not_first) > tol:
        mid = (not_first + first_at) / 2
        if first(mid):
            first_at = mid
        else:
            not_first = mid
    return not_first, first_at


def break_even(knob: Knob, rerun: Callable[[Hardware], dict], hw: Hardware, t: int) -> dict:
    """The values of `knob` at which the best layout of `t` ranks first (ties count), found by bisection between the
    preset and each end of the range where t ranks first (one crossing per side: the one bisection lands on). It
    assumes t's gap to the first is monotone in the knob on each side of the preset (a 40-point scan found it so for
    GPT-3 175B on 1,024 A100s); where it is not, "no value makes t first" means at neither end nor where the
    bisection looked;
    `rerun(hw)` is the whole search at that hardware."""
    preset = knob.get(hw)
    lo, hi = preset * KNOB_RANGE[0], preset * KNOB_RANGE[1]
    if knob.cap is not None:
        hi = min(hi, knob.cap)

    def gap(x: float) -> float | None:
        return _gap(rerun(knob.put(hw, x))["layouts"], t)

    def first(x: float) -> bool:
        g = gap(x)
        return g is not None and g <= 0.0

    ends = {"lo": lo, "hi": hi}
    tied = first(preset)  # a tie for first at the preset (the rival is not first outright): no crossing to look for
    gaps = {side: None if tied else gap(x) for side, x in ends.items()}
    crossings = []
    for side in ("hi", "lo"):
        if not tied and ends[side] != preset and gaps[side] is not None and gaps[side] <= 0.0:
            not_first, value = _bisect(first, preset, ends[side], BISECTION_TOLERANCE * preset)
            crossings.append(
                {
                    "direction": ">=" if side == "hi" else "<=",
                    "value": value,
                    "not_first_at": not_first,
                    "first": describe(rerun(knob.put(hw, value))["layouts"][0]),
                }
            )
    return {
        "name": knob.name,
        "unit": knob.unit,
        "preset": preset,
        "range": [lo, hi],
        "gap_at_range": [gaps["lo"], gaps["hi"]],
        "crossings": crossings,
        "tied_at_preset": tied,
    }


def break_even_line(knob: Knob, entry: dict, t: int) -> str:
    preset, (lo, hi) = entry["preset"], entry["range"]
    if entry["tied_at_preset"]:
        return f"t={t}'s best already ties for first at the preset {knob.label} ({knob.text(preset)})"
    if not entry["crossings"]:
        at = " and ".join("no layout" if g is None else f"{g:+.1%}" for g in entry["gap_at_range"])
        return (
            f"no {knob.label} in [{knob.text(lo)}, {knob.text(hi)}] makes t={t} first (preset "
            f"{knob.text(preset)}; at the two ends t={t}'s best takes {at} time against the first)"
        )
    return "; ".join(
        f"t={t} would rank first if the {knob.label} were {SIGN[c['direction']]} "
        f"{knob.text(c['value'])} (preset {knob.text(preset)}; there {c['first']} is first)"
        for c in entry["crossings"]
    )


def _ranking_line(name: str, rows: list[dict]) -> str:
    """The fastest layout of each t among `rows` (fastest first), in order of t, the first marked."""
    by_t = _fastest(rows, lambda r: r["tensor_model_parallel_size"])
    if not by_t:
        return f"{name}: nothing fits"

    def behind(r: dict) -> str:
        slower = r["iteration_time_s"] / rows[0]["iteration_time_s"] - 1
        return "first" if r is rows[0] else f"{slower:+.1%}"

    return (
        f"{name}, the fastest layout of each t: "
        + ", ".join(f"{describe(r)} {r['tflops_per_gpu']:.1f} ({behind(r)})" for _, r in sorted(by_t.items()))
        + " TFLOP/s"
    )


RANKINGS = {"plain_1f1b": "plain 1F1B only (no interleaving)", "micro_batch_size_1": "b=1 only"}


def rankings(fits: list[dict]) -> dict[str, list[dict]]:
    """The layouts that fit without interleaving, and with b = 1, fastest first (the keys of `RANKINGS`)."""
    return {
        "plain_1f1b": [r for r in fits if r["num_layers_per_virtual_pipeline_stage"] is None],
        "micro_batch_size_1": [r for r in fits if r["micro_batch_size"] == 1],
    }


def _ranking_rows(rows: list[dict]) -> list[dict]:
    """The JSON of the fastest layout of each t among `rows`, fastest first."""
    return [
        {
            "t": x,
            "layout": describe(r),
            "tflops_per_gpu": r["tflops_per_gpu"],
            "iteration_time_s": r["iteration_time_s"],
        }
        for x, r in _fastest(rows, lambda r: r["tensor_model_parallel_size"]).items()
    ]


def sensitivity_of_t(
    cfg: ModelConfig,
    num_gpus: int,
    global_batch_size: int,
    hw: Hardware,
    fits: list[dict],
    recompute: str = "full",
    **flags,
) -> dict:
    """How robust the best layout's t is against the next t inside a node (Takeaway #1): for each of `KNOBS` the
    values at which the other t's best layout ranks first, every layout re-predicted and re-ranked at each trial
    value; and the best layout of each t without interleaving and at b = 1."""
    best_t, other = fits[0]["tensor_model_parallel_size"], rival_t(fits, hw.gpus_per_node)
    head = f"Takeaway #1 sensitivity, t={best_t}" + ("" if other is None else f" vs t={other}")
    ranked = rankings(fits)
    out = {
        "best_t": best_t,
        "rival_t": other,
        "break_even": {},
        "lines": [],
        "rankings": {key: _ranking_rows(rows) for key, rows in ranked.items()},
    }
    if other is not None:

        def rerun(trial: Hardware) -> dict:
            return search(cfg, num_gpus, global_batch_size, trial, recompute, sensitivity=False, **flags)

        for knob in KNOBS:
            out["break_even"][knob.name] = entry = break_even(knob, rerun, hw, other)
            out["lines"].append(f"{head} (all layouts re-ranked): " + break_even_line(knob, entry, other))
    out["lines"] += [f"{head}: " + _ranking_line(RANKINGS[key], rows) for key, rows in ranked.items()]
    return out
