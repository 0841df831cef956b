"""Energy at the same speed: one SM clock per pipeline rank that burns the least energy per step while the step
takes at most (1 + ε) × its time at full clock (Perseus, SOSP'24, and EnvPipe, ATC'23, do this per computation).
Pure Python and numpy.

A pipeline's ranks are not all on the critical path: a rank whose cells are shorter than its tick's longest, or
that waits in a bubble, can run slower and still be on time. The model (`hardware.ClockPower`):
- a cell's time at clock f = its compute-bound part × f_max / f + its memory-bound part (HBM, communication);
- a busy rank draws static + dynamic · (f / f_max)^k, a rank waiting (an idle cell, the rest of a tick after its
  cell, the data-parallel all-reduce) the bubble power;
- the step's time is the table's (`Table.simulate` with each cell timed at its rank's clock: a tick lasts its
  longest cell), plus the optimizer (busy) and the data-parallel all-reduce (waiting), as `perf/timing.py` has it.
So a rank's energy = its busy time × busy power at its clock + (step time − busy time) × bubble power.

**One clock per rank.** The step is one compiled SPMD program: a rank runs its table's cells back to back inside
one `lax.scan`, with no point between two actions where the host could change the clock, and NVML's clock lock
takes milliseconds. So a plan is one clock per pipeline rank, set before the step (`runtime/clocks.py`). A plan
that gives every cell its own clock (Perseus's) is reported beside it as the bound it is (`per_action_bound`):
the least energy any per-cell plan on this table could reach, from the linear relaxation of the choice of each
tick's length.

**The search** (`plan`) is exact: a depth-first branch and bound over the ranks' clocks (the catalogue's 15 MHz
steps from f_max down to f_max / 2, or a measured sweep's clocks). A partial plan is cut when its step time with
the other ranks at full clock is already too long (time only grows as clocks fall), or when its energy bound
(its ranks' own terms, each other rank's least term, the bubble power over that shortest step time) is no better
than the best plan found. The test compares it with brute force over every combination.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig
from ptd_jax.parallel.pipeline.schedule import Action
from ptd_jax.parallel.pipeline.table import Table
from ptd_jax.perf.hardware import CLOCK_POWER, Hardware, ClockPower
from ptd_jax.perf.memory import grad_bytes_per_param, params_per_gpu, state_bytes_per_param
from ptd_jax.perf.timing import (
    HALF,
    data_parallel_seconds,
    layer_elementwise_bytes,
    layer_gemm_seconds,
    p2p_seconds,
    regather_seconds,
    tensor_allreduce_seconds,
)

FRONTIER_EPSILONS = (0.0, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
"""The slowdown budgets the time–energy frontier is drawn at."""
MAX_NODES = 200_000
"""Branch-and-bound nodes before the search stops with the best plan found (`Plan.exact` False)."""
PROFILE_FORMAT = "ptd_jax.clock_profile/1"


@dataclass(frozen=True)
class Work:
    """Seconds at full clock: the part that scales with f_max / f (compute-bound) and the part that does not."""

    compute: float = 0.0
    memory: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.compute + other.compute, self.memory + other.memory)

    def scaled(self, k: float) -> Work:
        return Work(self.compute * k, self.memory * k)

    @property
    def total(self) -> float:
        return self.compute + self.memory


@dataclass(frozen=True)
class StageTimes:
    """A whole stage's F, I (the input-gradient backward) and W at full clock, as `ptd-schedule`'s f, b, w (a
    chunk runs 1/v of them; a fused B = I + W); what the last virtual stage's forward adds (the output layer and
    the loss, forward and backward); and the step's tail after the pipeline: the optimizer (busy) and the
    data-parallel all-reduce (waiting, at bubble power)."""

    f: Work
    b: Work
    w: Work
    head: Work = Work()
    tail_busy: Work = Work()
    tail_wait_s: float = 0.0

    @classmethod
    def from_ratios(cls, times: tuple[float, float, float], memory_fraction: float) -> StageTimes:
        """`ptd-schedule`'s (f, b, w) with the same memory-bound share in every action."""
        f, b, w = (Work(x * (1 - memory_fraction), x * memory_fraction) for x in times)
        return cls(f, b, w)


def stage_times(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware, recompute: str = "full") -> StageTimes:
    """The stage times of a model on a layout, term by term as `perf.timing.predict` (its module docstring): GEMMs
    are compute-bound; elementwise kernels, collectives, pipeline sends, gradient accumulation and the optimizer
    are not. F runs the layers' forward; I their input gradients, the recomputation and the elementwise backward; W
    the weight-gradient GEMMs and the accumulation into the gradient buffer."""
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    layers = cfg.num_layers / p
    gemm = layer_gemm_seconds(cfg, parallel, hw)
    fwd = gemm["dense"] + gemm["attention"]
    elem_bytes = layer_elementwise_bytes(cfg, parallel)
    elem = hw.memory_seconds(elem_bytes["linear"] + elem_bytes["softmax"])
    allreduce = tensor_allreduce_seconds(cfg, parallel, hw)
    recomputed = {
        "none": Work(),
        "selective": Work(gemm["attention"], hw.memory_seconds(elem_bytes["softmax"])),
        "full": Work(fwd, elem + 2 * allreduce),
    }[recompute]
    send = v * p2p_seconds(cfg, parallel, hw) if p > 1 else 0.0
    params = params_per_gpu(cfg, parallel)["last"]
    grad_bytes = grad_bytes_per_param(cfg)
    t = parallel.tensor_model_parallel_size
    tokens, vocab = cfg.seq_length * parallel.micro_batch_size, cfg.padded_vocab_size(t)
    return StageTimes(
        f=Work(layers * fwd, layers * (elem + 2 * allreduce) + send),
        b=Work(
            layers * fwd, layers * (2 * elem + 2 * allreduce + regather_seconds(cfg, parallel, hw, recompute)) + send
        )
        + recomputed.scaled(layers),
        w=Work(layers * fwd, hw.memory_seconds((HALF + 2 * grad_bytes) * params)),
        head=Work(
            3 * hw.gemm_seconds(tokens, vocab / t, cfg.hidden_size),
            3 * hw.memory_seconds(4 * tokens * vocab / t) + allreduce,
        ),
        tail_busy=Work(0.0, hw.memory_seconds(2 * state_bytes_per_param(parallel, cfg) * params)),
        tail_wait_s=data_parallel_seconds(params, parallel, hw, grad_bytes),
    )


@dataclass(frozen=True)
class Problem:
    """A table, its stage times at full clock and the GPU's clock/power model."""

    table: Table
    times: StageTimes
    power: ClockPower

    def work(self, rank: int, action: Action) -> Work:
        """One cell's work at full clock: its kind's stage time / v, and the head on the last virtual stage's
        forward (the executor runs the output layer and the loss, forward and backward, right after it)."""
        t, v = self.times, self.table.v
        base = {"F": t.f, "B": t.b + t.w, "I": t.b, "W": t.w}[action.kind].scaled(1 / v)
        last = self.table.stage(action, rank) == self.table.p * v - 1
        return base + t.head if last and action.kind == "F" else base

    def duration(self, clocks: list[float]):
        """(rank, action) -> seconds at the ranks' `clocks` (MHz): what `Table.simulate` times the cells with."""
        fmax = self.power.max_mhz

        def seconds(rank: int, action: Action) -> float:
            w = self.work(rank, action)
            return w.compute * fmax / clocks[rank] + w.memory

        return seconds

    def step(self, clocks: list[float]) -> dict:
        """The step at the ranks' `clocks`, through the one simulator: time (s), energy (J) and per rank busy
        seconds, busy power, energy."""
        sim = self.table.simulate(duration=self.duration(clocks))
        tb, fmax, pw = self.times.tail_busy, self.power.max_mhz, self.power
        tails = [tb.compute * fmax / f + tb.memory for f in clocks]
        time = sim["makespan"] + max(tails) + self.times.tail_wait_s
        busy = [b + tail for b, tail in zip(sim["busy"], tails)]
        watts = [pw.busy_w(f) for f in clocks]
        energy = [b * w + (time - b) * pw.idle_w for b, w in zip(busy, watts)]
        return {"time_s": time, "energy_j": sum(energy), "busy_s": busy, "busy_w": watts, "rank_energy_j": energy}


@dataclass
class _Compiled:
    """The table as arrays for the search: unique rows of compute [R, p] and memory [R, p] seconds at full clock
    with their counts, the tail as one more row. Evaluated with the simulator's rule (a row lasts its longest
    cell); `Problem.step` rechecks the result through `Table.simulate`."""

    compute: np.ndarray
    memory: np.ndarray
    count: np.ndarray
    wait: float
    slow: np.ndarray
    """[L] f_max / f of each clock level."""
    watts: np.ndarray
    """[L] busy power of each level."""
    idle: float

    @classmethod
    def of(cls, problem: Problem, levels: list[float]) -> _Compiled:
        table, tb = problem.table, problem.times.tail_busy
        comp = table.durations(lambda r, a: problem.work(r, a).compute) + [[tb.compute] * table.p]
        mem = table.durations(lambda r, a: problem.work(r, a).memory) + [[tb.memory] * table.p]
        rows, count = np.unique(np.concatenate([np.array(comp), np.array(mem)], axis=1), axis=0, return_counts=True)
        pw = problem.power
        return cls(
            rows[:, : table.p],
            rows[:, table.p :],
            count.astype(float),
            problem.times.tail_wait_s,
            np.array([pw.max_mhz / f for f in levels]),
            np.array([pw.busy_w(f) for f in levels]),
            pw.idle_w,
        )

    def cells(self, slow: np.ndarray) -> np.ndarray:
        """[R, p] seconds with rank r slowed by slow[r]."""
        return self.compute * slow + self.memory

    def time(self, cells: np.ndarray) -> float:
        return float(self.count @ cells.max(axis=1)) + self.wait

    def rank_terms(self) -> np.ndarray:
        """[p, L]: busy seconds × (busy − bubble power) of each rank at each level (the step's energy = the sum
        over ranks + p × step time × bubble power)."""
        busy_c, busy_m = self.count @ self.compute, self.count @ self.memory
        busy = busy_c[:, None] * self.slow[None, :] + busy_m[:, None]
        return busy * (self.watts - self.idle)[None, :]


@dataclass(frozen=True)
class Plan:
    """One clock per pipeline rank and what it gives against full clock."""

    clocks: tuple[float, ...]
    epsilon: float
    time_s: float
    energy_j: float
    full_time_s: float
    full_energy_j: float
    exact: bool
    nodes: int

    @property
    def saving(self) -> float:
        return 1 - self.energy_j / self.full_energy_j

    @property
    def slowdown(self) -> float:
        return self.time_s / self.full_time_s - 1


def plan(problem: Problem, epsilon: float, max_nodes: int = MAX_NODES, start: tuple[float, ...] = ()) -> Plan:
    """The clocks (one per rank) of least step energy with step time ≤ (1 + ε) × full clock's (module
    docstring). Ties go to the higher clocks. The search starts from the best of full clock, every single clock
    for all ranks, and `start` (e.g. the plan at a smaller ε), improved one rank at a time: where it stops at
    `max_nodes` (`Plan.exact` False) the plan is still no worse than these."""
    if not epsilon >= 0:
        raise ConfigError(f"epsilon={epsilon} must be >= 0 (a slowdown budget)")
    levels = problem.power.clocks()
    c = _Compiled.of(problem, levels)
    p, nlev = problem.table.p, len(levels)
    full_cells = c.cells(np.ones(p))
    full_time = c.time(full_cells)
    limit = full_time * (1 + epsilon) * (1 + 1e-12)
    terms = c.rank_terms()  # [p, L]
    idle_all = p * c.idle

    def energy(level_of: list[int], time: float) -> float:
        return float(sum(terms[r, j] for r, j in enumerate(level_of)) + idle_all * time)

    # each rank alone slowed, the others at full clock: a level too slow here is too slow in any plan
    feasible = []
    for r in range(p):
        ok = []
        for j in range(nlev):
            cells = full_cells.copy()
            cells[:, r] = c.compute[:, r] * c.slow[j] + c.memory[:, r]
            if c.time(cells) <= limit:
                ok.append(j)
        feasible.append(ok)
    order = sorted(range(p), key=lambda r: len(feasible[r]))  # the most constrained ranks first
    best = _incumbent(c, terms, limit, [[j] * p for j in range(nlev)] + [[levels.index(f) for f in start]])
    nodes = 0
    exact = True
    level_of = [0] * p

    def single_times(free: list[int], cells: np.ndarray) -> np.ndarray:
        """[len(free), L]: the step time with one free rank moved to each level, the others as in `cells`."""
        top = cells.max(axis=1)
        second = np.partition(cells, -2, axis=1)[:, -2] if p > 1 else np.zeros_like(top)
        arg = cells.argmax(axis=1)
        out = []
        for q in free:
            others = np.where(arg == q, second, top)
            columns = c.slow[:, None] * c.compute[:, q][None, :] + c.memory[:, q][None, :]  # [L, R]
            out.append(np.maximum(others[None, :], columns) @ c.count + c.wait)
        return np.maximum.accumulate(np.array(out), axis=1)  # slower never shortens a step

    def node_bound(free: list[int], times: np.ndarray) -> float:
        """The least energy any completion could have: the step lasts at least τ = the longest of the free ranks'
        single-rank times, so each free rank q takes its least term among the levels with T_q(j) ≤ τ; the least
        over τ of that sum + the bubble power over τ."""
        g = np.where(times <= limit, terms[free], np.inf)
        prefix = np.minimum.accumulate(g, axis=1)
        taus = np.unique(times[times <= limit])
        idx = np.stack([np.searchsorted(times[k], taus, side="right") - 1 for k in range(len(free))])
        sums = np.take_along_axis(prefix, idx, axis=1).sum(axis=0)
        return float(np.min(sums + idle_all * taus))

    def visit(depth: int, cells: np.ndarray, fixed: float) -> None:
        nonlocal nodes, exact
        if depth == p:
            time = c.time(cells)
            e = fixed + idle_all * time
            better = e < best["energy"] - 1e-9 * abs(best["energy"])
            tie = abs(e - best["energy"]) <= 1e-9 * abs(best["energy"])
            if better or (tie and tuple(level_of) < tuple(best["levels"])):
                best.update(levels=list(level_of), energy=e, time=time)
            return
        nodes += 1
        if nodes > max_nodes:
            exact = False
            return
        free = order[depth:]
        times = single_times(free, cells)
        if fixed + node_bound(free, times) > best["energy"] * (1 + 1e-9):
            return
        r = free[0]
        candidates = [j for j in range(nlev) if times[0, j] <= limit]
        for j in sorted(candidates, key=lambda j: (terms[r, j] + idle_all * times[0, j], j)):
            cells[:, r] = c.compute[:, r] * c.slow[j] + c.memory[:, r]
            level_of[r] = j
            visit(depth + 1, cells, fixed + terms[r, j])
            cells[:, r] = c.compute[:, r] + c.memory[:, r]
            level_of[r] = 0

    visit(0, full_cells.copy(), 0.0)
    clocks = tuple(levels[j] for j in best["levels"])
    full = problem.step([levels[0]] * p)
    chosen = problem.step(list(clocks))
    return Plan(clocks, epsilon, chosen["time_s"], chosen["energy_j"], full["time_s"], full["energy_j"], exact, nodes)


def _incumbent(c: _Compiled, terms: np.ndarray, limit: float, seeds: list[list[int]]) -> dict:
    """The best feasible seed (levels per rank; full clock is the first), then improved by moving one rank at a
    time to its best level given the others, until no move helps."""
    p, nlev = terms.shape
    idle_all = p * c.idle

    def evaluate(level_of: list[int]) -> tuple[float, float]:
        time = c.time(c.cells(c.slow[level_of]))
        return time, float(terms[np.arange(p), level_of].sum() + idle_all * time)

    scored = []
    for seed in seeds:
        if len(seed) == p:
            time, e = evaluate(seed)
            if time <= limit:
                scored.append((e, seed, time))
    e, level_of, time = min(scored, key=lambda x: (x[0], x[1]))
    level_of = list(level_of)
    for _ in range(4 * nlev):
        moved = False
        for r in range(p):
            for j in range(nlev):
                if j == level_of[r]:
                    continue
                trial = level_of[:r] + [j] + level_of[r + 1 :]
                t, te = evaluate(trial)
                if t <= limit and te < e * (1 - 1e-12):
                    e, level_of, time, moved = te, trial, t, True
        if not moved:
            break
    return {"levels": level_of, "energy": e, "time": time}


def brute_force(problem: Problem, epsilon: float) -> tuple[tuple[float, ...], float]:
    """(clocks, energy) of the best plan over every combination of clocks, each step through `Problem.step`: what
    `plan` is tested against (small tables only: levels^p steps)."""
    import itertools

    levels = problem.power.clocks()
    p = problem.table.p
    full = problem.step([levels[0]] * p)["time_s"]
    best = (tuple([levels[0]] * p), math.inf)
    for clocks in itertools.product(levels, repeat=p):
        step = problem.step(list(clocks))
        if step["time_s"] <= full * (1 + epsilon) * (1 + 1e-12) and step["energy_j"] < best[1]:
            best = (clocks, step["energy_j"])
    return best


def uniform_clocks(problem: Problem) -> list[dict]:
    """Every rank at the same clock, for each clock: {"clock_mhz", "time_s", "energy_j"} (the frontier's
    reference: what a power cap or one `nvidia-smi -lgc` for the whole job gives)."""
    out = []
    for f in problem.power.clocks():
        step = problem.step([f] * problem.table.p)
        out.append({"clock_mhz": f, "time_s": step["time_s"], "energy_j": step["energy_j"]})
    return out


def per_action_bound(problem: Problem, epsilon: float) -> float:
    """The least step energy (J) that clocks chosen per cell could reach on this table within (1 + ε) × full clock's
    time, a lower bound: each tick's length is chosen among the lengths its cells can take, each cell runs at the
    cheapest clock that fits its tick, and the ticks share the slack by the linear relaxation of that choice
    (each tick's energy against its length, convexified; the steepest savings first). At ε = 0 every tick keeps
    its length and the bound is exact."""
    levels = problem.power.clocks()
    c = _Compiled.of(problem, levels)
    full_cells = c.cells(np.ones(problem.table.p))
    full_time = c.time(full_cells)
    base_energy, segments = 0.0, []
    for i in range(len(c.count)):
        options = c.compute[i][:, None] * c.slow[None, :] + c.memory[i][:, None]  # [p, L] seconds
        cost = options * (c.watts - c.idle)[None, :]  # [p, L] energy above the bubble power
        length = full_cells[i].max()
        candidates = np.unique(options[(options >= length) & (options <= length + epsilon * full_time)])
        candidates = np.unique(np.append(candidates, length))
        # each rank's cheapest cell that fits in a tick of each candidate length
        fits = options[:, :, None] <= candidates[None, None, :] * (1 + 1e-12)  # [p, L, K]
        cheapest = np.where(fits, cost[:, :, None], np.inf).min(axis=1).sum(axis=0)  # [K]
        energy = cheapest + problem.table.p * c.idle * candidates  # [K]
        base_energy += c.count[i] * energy[0]
        hull = _lower_hull(candidates, energy)
        for (d0, e0), (d1, e1) in zip(hull, hull[1:]):
            if e1 < e0:
                segments.append(((e1 - e0) / (d1 - d0), (d1 - d0) * c.count[i]))
    budget = epsilon * full_time
    total = base_energy + problem.table.p * c.idle * c.wait
    for slope, width in sorted(segments):
        take = min(width, budget)
        total += slope * take
        budget -= take
        if budget <= 0:
            break
    return float(total)


def _lower_hull(x: np.ndarray, y: np.ndarray) -> list[tuple[float, float]]:
    """The lower convex hull of the points (x sorted ascending), left to right, up to its lowest point."""
    hull: list[tuple[float, float]] = []
    for point in zip(x.tolist(), y.tolist()):
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (point[1] - y0) - (y1 - y0) * (point[0] - x0) <= 0:
                hull.pop()
            else:
                break
        hull.append(point)
    low = min(range(len(hull)), key=lambda k: hull[k][1])
    return hull[: low + 1]


@dataclass(frozen=True)
class Frontier:
    """The time–energy frontier: per-rank plans at each ε, every rank at one clock, and the per-cell bound."""

    plans: list[Plan] = field(default_factory=list)
    uniform: list[dict] = field(default_factory=list)
    bounds: list[tuple[float, float]] = field(default_factory=list)
    """(ε, per-action bound energy J)."""


def frontier(problem: Problem, epsilons=FRONTIER_EPSILONS, max_nodes: int = MAX_NODES) -> Frontier:
    """The plans at each ε (ascending; each search starts from the previous plan, which stays feasible), every
    single clock for all ranks, and the per-action bounds."""
    plans: list[Plan] = []
    for e in sorted(epsilons):
        plans.append(plan(problem, e, max_nodes, plans[-1].clocks if plans else ()))
    return Frontier(plans, uniform_clocks(problem), [(e, per_action_bound(problem, e)) for e in sorted(epsilons)])


def load_profile(path: str | Path, base: ClockPower | None = None) -> ClockPower:
    """A measured sweep (docs/architecture.md, "Energy"): JSON
    `{"format": "ptd_jax.clock_profile/1", "hardware": NAME, "idle_w": W, "points": [{"sm_mhz": F, "busy_w": W}, ...]}`
    with at least two points at distinct positive clocks, the highest of them the full clock. Raises ConfigError
    with one line on anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--profile {str(path)!r} does not parse: {err}") from None
    where = f"--profile {str(path)!r}"
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f'{where} is not a clock profile: it needs "format": "{PROFILE_FORMAT}"')
    points = data.get("points")
    idle = data.get("idle_w")
    if not isinstance(points, list) or len(points) < 2:
        raise ConfigError(f'{where}: "points" must list at least two {{"sm_mhz", "busy_w"}} measurements')
    pairs = []
    for k, point in enumerate(points):
        f = point.get("sm_mhz") if isinstance(point, dict) else None
        w = point.get("busy_w") if isinstance(point, dict) else None
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in (f, w)):
            raise ConfigError(f"{where}: points[{k}]={point!r} needs positive finite sm_mhz and busy_w")
        pairs.append((float(f), float(w)))
    if len({f for f, _ in pairs}) != len(pairs):
        raise ConfigError(f"{where}: two points share a clock")
    if not (isinstance(idle, (int, float)) and math.isfinite(idle) and idle >= 0):
        raise ConfigError(f'{where}: "idle_w" must be a finite number >= 0, not {idle!r}')
    name = data.get("hardware")
    if base is not None and name is not None and name != base.name:
        raise ConfigError(f"{where} was measured on hardware={name!r}, not --hardware {base.name}")
    pairs.sort()
    top, bottom = pairs[-1][0], pairs[0][0]
    return ClockPower(
        str(name or (base.name if base else "profile")),
        top,
        bottom,
        0.0,
        0.0,
        0.0,
        0.0,
        float(idle),
        source=f"measured sweep {path}",
        points=tuple(pairs),
    )


def clock_power(hardware: str) -> ClockPower:
    """The catalogue's clock/power model of `hardware`, or a ConfigError naming the known ones."""
    if hardware not in CLOCK_POWER:
        raise ConfigError(f"hardware={hardware!r} has no clock/power model; known: {sorted(CLOCK_POWER)}")
    return CLOCK_POWER[hardware]
