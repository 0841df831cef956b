"""Pipeline schedules as data (paper §2.2): actions and each rank's order of them. Pure Python, no JAX.

An `Action` is `F<chunk>.<microbatch>` (forward), `B<chunk>.<microbatch>` (backward: in the split schedules the
input gradient only) or `W<chunk>.<microbatch>` (the weight gradients of a split backward). Chunk c on rank r is
virtual stage c·p + r, except in ZB-V, whose two chunks form a V: chunk 0 on rank r is stage r, chunk 1 is stage
2p−1−r (`stage_of`), so the first and the last virtual stage both sit on rank 0.

Builders return each rank's order of actions:
- GPipe: all forwards, then all backwards.
- 1F1B (PipeDream-flush): a warm-up of forwards, then alternate one forward / one backward, then cool-down.
  Megatron's warm-up on stage s is p−1−s; in lockstep (`lockstep.py`) that leaves neighbouring stages wanting
  opposite kinds, so the default here is the lockstep warm-up 2(p−1−s), which reaches the asynchronous makespan
  at a stash of 2(p−1−s)+1 (docs/architecture.md, "Pipeline").
- Interleaved 1F1B: megatron-core's order — microbatches in groups of G (default p) swept over the v chunks;
  warm-up 2(p−r−1) + (v−1)·G forwards on rank r.

Split schedules (`SPLIT_SCHEDULES`: every cell one unit long, F ≈ B ≈ W; `unit.py` places them, a rank's kind
may differ from its neighbour's in one tick):
- 1F1B-split: Megatron's warm-up p−1−s, each B followed at once by its W: stage s holds p − s microbatches.
- ZB-H1 and ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism"): `greedy_orders`, a rank's next action chosen
  tick by tick: a ready B while fewer than p W's wait, else a ready F while the stash holds fewer than
  `act_limit` chunk-microbatches (p for ZB-H1; 2p for ZB-V, whose chunks are half a stage: 1F1B's p stages'
  worth), else the oldest waiting W. The W's fill what would be bubbles.

`lockstep.py` places the fused orders on global ticks of one kind; the executor reads the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ptd_jax.config import PIPELINE_SCHEDULES, SPLIT_SCHEDULES, ConfigError, check_pipeline_request  # noqa: F401

SCHEDULES = PIPELINE_SCHEDULES


def stage_of(name: str, p: int, chunk: int, rank: int) -> int:
    """The virtual stage of `chunk` on `rank`: c·p + r, or ZB-V's V (chunk 1 runs back up: stage 2p−1−r)."""
    if name == "zb-v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def place_of(name: str, p: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) of a virtual stage: the inverse of `stage_of`."""
    if name == "zb-v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


class ScheduleError(ValueError):
    """An impossible schedule request; the message names the values and the rule."""


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" | "B" | "W"
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        kind, rest = text[0], text[1:]
        chunk, microbatch = rest.split(".")
        if kind not in "FBW":
            raise ScheduleError(f"action {text!r} has kind {kind!r}, expected F, B or W")
        return cls(kind, int(chunk), int(microbatch))


def F(chunk: int, mb: int) -> Action:  # noqa: N802 - reads like the paper's notation
    return Action("F", chunk, mb)


def B(chunk: int, mb: int) -> Action:  # noqa: N802
    return Action("B", chunk, mb)


def W(chunk: int, mb: int) -> Action:  # noqa: N802
    return Action("W", chunk, mb)


def dependencies(name: str, action: Action, rank: int, p: int, v: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish at an earlier tick: an F the previous stage's F; a B its own F and the
    next stage's B (in a split schedule the B that gives its output gradient); a W its own B."""
    stage, last = stage_of(name, p, action.chunk, rank), p * v - 1
    if action.kind == "W":
        return [(rank, B(action.chunk, action.microbatch))]
    if action.kind == "F":
        if stage == 0:
            return []
        r, c = place_of(name, p, stage - 1)
        return [(r, F(c, action.microbatch))]
    deps = [(rank, F(action.chunk, action.microbatch))]
    if stage < last:
        r, c = place_of(name, p, stage + 1)
        deps.append((r, B(c, action.microbatch)))
    return deps


def check_request(name: str, p: int, v: int, m: int, group: int | None = None) -> int:
    """Validate (schedule name, p, v, m, G) by the rules in `config.check_pipeline_request`; returns the effective
    G."""
    try:
        return check_pipeline_request(name, p, v, m, group)
    except ConfigError as err:
        raise ScheduleError(str(err)) from None


def gpipe_orders(p: int, m: int) -> list[list[Action]]:
    return [[F(0, i) for i in range(m)] + [B(0, i) for i in range(m)] for _ in range(p)]


def one_f_one_b_orders(p: int, m: int, warmup: str = "lockstep") -> list[list[Action]]:
    """Warm-up forwards, steady 1F1B pairs, cool-down backwards. warmup: 'lockstep' (2(p−1−s)) or 'megatron'."""
    orders = []
    for s in range(p):
        depth = 2 * (p - 1 - s) if warmup == "lockstep" else p - 1 - s
        n_warm = min(depth, m)
        order = [F(0, i) for i in range(n_warm)]
        for i in range(m - n_warm):
            order += [F(0, n_warm + i), B(0, i)]
        order += [B(0, i) for i in range(m - n_warm, m)]
        orders.append(order)
    return orders


def interleaved_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """megatron-core's (microbatch, chunk) order of forwards: groups of G microbatches swept over the chunks;
    the last group takes whatever microbatches remain."""
    table = []
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        table += [(mb, chunk) for chunk in range(v) for mb in range(first, last)]
    return table


def interleaved_orders(p: int, v: int, m: int, group: int | None = None) -> list[list[Action]]:
    g = check_request("interleaved", p, v, m, group)
    table = interleaved_table(m, v, g)
    total = m * v
    orders = []
    for r in range(p):
        n_warm = min(2 * (p - r - 1) + (v - 1) * g, total)
        fwd = [F(chunk, mb) for mb, chunk in table]
        bwd = [B(v - 1 - chunk, mb) for mb, chunk in table]
        order = fwd[:n_warm]
        for i in range(total - n_warm):
            order += [fwd[n_warm + i], bwd[i]]
        order += bwd[total - n_warm:]
        orders.append(order)
    return orders


def one_f_one_b_split_orders(p: int, m: int) -> list[list[Action]]:
    """Megatron's 1F1B (warm-up p−1−s) with each backward split into its B and, right after it, its W."""
    orders = []
    for s in range(p):
        n_warm = min(p - 1 - s, m)
        order = [F(0, i) for i in range(n_warm)]
        for i in range(m - n_warm):
            order += [F(0, n_warm + i), B(0, i), W(0, i)]
        for i in range(m - n_warm, m):
            order += [B(0, i), W(0, i)]
        orders.append(order)
    return orders


class _Greedy:
    """The state of `greedy_orders`' replay: per rank the next F and B of each chunk, the stash, the waiting W's."""

    def __init__(self, name: str, p: int, v: int, m: int):
        self.name, self.p, self.v, self.m = name, p, v, m
        self.done: dict[tuple[int, Action], int] = {}
        self.next = {kind: [[0] * v for _ in range(p)] for kind in "FB"}
        self.waiting: list[list[Action]] = [[] for _ in range(p)]
        self.stash = [0] * p

    def ready(self, kind: str, r: int, tick: int) -> list[Action]:
        out = []
        for c in range(self.v):
            i = self.next[kind][r][c]
            a = Action(kind, c, i)
            if i < self.m and all(self.done.get(d, tick) < tick for d in dependencies(self.name, a, r, self.p, self.v)):
                out.append(a)
        return out

    def pick(self, r: int, tick: int, act_limit: int, w_limit: int) -> Action | None:
        stage = partial(stage_of, self.name, self.p)
        bs = self.ready("B", r, tick)
        if bs and len(self.waiting[r]) < w_limit:
            return min(bs, key=lambda a: (a.microbatch, -stage(a.chunk, r)))
        fs = self.ready("F", r, tick)
        if fs and self.stash[r] < act_limit:
            return max(fs, key=lambda a: (stage(a.chunk, r), -a.microbatch))  # the deepest stage first
        return self.waiting[r][0] if self.waiting[r] else None

    def run(self, r: int, a: Action, tick: int) -> None:
        self.done[(r, a)] = tick
        if a.kind == "W":
            self.waiting[r].pop(0)
            return
        self.next[a.kind][r][a.chunk] += 1
        self.stash[r] += 1 if a.kind == "F" else -1
        if a.kind == "B":
            self.waiting[r].append(W(a.chunk, a.microbatch))


def greedy_orders(name: str, p: int, v: int, m: int, act_limit: int, w_limit: int) -> list[list[Action]]:
    """Each rank's order from a unit-time replay: per tick, a ready B while fewer than `w_limit` W's wait, else a
    ready F (the deepest stage first) while fewer than `act_limit` chunk inputs are stashed, else the oldest W."""
    state, orders, tick = _Greedy(name, p, v, m), [[] for _ in range(p)], 0
    while sum(len(o) for o in orders) < 3 * p * v * m:
        picks = {r: a for r in range(p) if (a := state.pick(r, tick, act_limit, w_limit)) is not None}
        if not picks:
            raise ScheduleError(f"schedule {name!r} deadlocks at tick {tick} with act_limit={act_limit}")
        for r, a in picks.items():
            state.run(r, a, tick)
            orders[r].append(a)
        tick += 1
    return orders


def build_orders(name: str, p: int, v: int, m: int, group: int | None = None) -> list[list[Action]]:
    check_request(name, p, v, m, group)
    if name == "gpipe":
        return gpipe_orders(p, m)
    if name == "1f1b":
        return one_f_one_b_orders(p, m)
    if name == "1f1b-split":
        return one_f_one_b_split_orders(p, m)
    if name == "zb-h1":
        return greedy_orders(name, p, 1, m, act_limit=p, w_limit=p)
    if name == "zb-v":
        return greedy_orders(name, p, 2, m, act_limit=2 * p, w_limit=p)
    return interleaved_orders(p, v, m, group)
