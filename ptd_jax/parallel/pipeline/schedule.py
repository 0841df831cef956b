"""Pipeline schedules as data (paper §2.2): actions, the stage map, dependencies, and each rank's order. Pure Python.

An `Action` is `F<chunk>.<microbatch>` (forward), `B` (the whole backward), `I` (its input gradient) or `W` (its
weight gradients), as torch.distributed.pipelining writes them. A schedule's properties are data
(`config.SCHEDULE_SPECS`): whether its backwards split into I and W, how its orders are placed on ticks, its chunks
and stage map. Chunk c on rank r is virtual stage c·p + r ("round-robin"), except in the V ("v"), where chunk 1 runs
back up: stage 2p − 1 − r, so the first and the last virtual stage both sit on rank 0.

Order builders (`ORDERS`), each rank's list of actions:
- "gpipe": all forwards, then all backwards.
- "1f1b" (PipeDream-flush, Megatron's): warm-up p − 1 − s forwards on stage s, then one forward and one backward
  in turn, then the cool-down backwards; a split backward is I followed at once by its W. Stage s holds p − s
  microbatches.
- "1f1b-lockstep": the same with fused backwards and warm-up 2(p − 1 − s), for lockstep rows: (p − 1)/m whatever
  B/F is (full recomputation), at a stash of 2(p − 1 − s) + 1.
- "interleaved": megatron-core's order — microbatches in groups of G (default p) swept over the v chunks; warm-up
  2(p − r − 1) + (v − 1)·G forwards on rank r.
- "zb-h1" (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order with stage s's W(j) moved after I(j + s):
  every stage holds p microbatches from F to W, 1F1B's peak, and the deferred W's fill the cool-down bubble.
- "zero-bubble" (ZB-V's): a greedy unit-time replay (`greedy_orders`): per tick a ready I, else a ready F (the
  deepest stage first) while fewer than 2p chunk-microbatches are in flight from F to W (ZB-V's chunks are half
  a stage: 1F1B's p stages' worth), else the oldest waiting W.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ptd_jax.config import ConfigError, ScheduleSpec, check_pipeline_request, schedule_spec

KINDS = "FBIW"
BACKWARD = ("B", "I")
"""The kinds that take the output gradient and send the input gradient: a fused B, or a split backward's I."""


class ScheduleError(ValueError):
    """An impossible schedule request; the message names the values and the rule."""


def spec_of(name: str) -> ScheduleSpec:
    try:
        return schedule_spec(name)
    except ConfigError as err:
        raise ScheduleError(str(err)) from None


def stage_of(spec: ScheduleSpec, p: int, chunk: int, rank: int) -> int:
    """The virtual stage of `chunk` on `rank`: c·p + r, or the V's (chunk 1 runs back up: stage 2p − 1 − r)."""
    if spec.stage_map == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def place_of(spec: ScheduleSpec, p: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) of a virtual stage: the inverse of `stage_of`."""
    if spec.stage_map == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" | "B" | "I" | "W"
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        kind, rest = text[:1], text[1:]
        if kind not in KINDS or not kind:
            raise ScheduleError(f"action {text!r} has kind {kind!r}, expected one of {', '.join(KINDS)}")
        chunk, microbatch = rest.split(".")
        return cls(kind, int(chunk), int(microbatch))


def F(chunk: int, mb: int) -> Action:  # noqa: N802 - reads like the paper's notation
    return Action("F", chunk, mb)


def B(chunk: int, mb: int) -> Action:  # noqa: N802
    return Action("B", chunk, mb)


def I(chunk: int, mb: int) -> Action:  # noqa: N802, E743
    return Action("I", chunk, mb)


def W(chunk: int, mb: int) -> Action:  # noqa: N802
    return Action("W", chunk, mb)


def dependencies(spec: ScheduleSpec, action: Action, rank: int, p: int, v: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish at an earlier tick: an F the previous stage's F; a B or I its own F and
    the next stage's B or I (what sends its output gradient); a W its own I."""
    stage, last = stage_of(spec, p, action.chunk, rank), p * v - 1
    back = "I" if spec.split else "B"
    if action.kind == "W":
        return [(rank, I(action.chunk, action.microbatch))]
    if action.kind == "F":
        if stage == 0:
            return []
        r, c = place_of(spec, p, stage - 1)
        return [(r, F(c, action.microbatch))]
    deps = [(rank, F(action.chunk, action.microbatch))]
    if stage < last:
        r, c = place_of(spec, p, stage + 1)
        deps.append((r, Action(back, c, action.microbatch)))
    return deps


def check_request(name: str, p: int, v: int, m: int, group: int | None = None) -> int:
    """Validate (schedule name, p, v, m, G) by `config.check_pipeline_request`; returns the effective G."""
    try:
        return check_pipeline_request(name, p, v, m, group)
    except ConfigError as err:
        raise ScheduleError(str(err)) from None


def _backward(split: bool, chunk: int, mb: int) -> list[Action]:
    return [I(chunk, mb), W(chunk, mb)] if split else [B(chunk, mb)]


def gpipe_orders(p: int, v: int, m: int, split: bool = False) -> list[list[Action]]:
    return [[F(0, i) for i in range(m)] + [a for i in range(m) for a in _backward(split, 0, i)] for _ in range(p)]


def one_f_one_b_orders(p: int, v: int, m: int, split: bool = True) -> list[list[Action]]:
    """Megatron's 1F1B: warm-up p − 1 − s forwards on stage s, steady one forward / one backward, cool-down."""
    orders = []
    for s in range(p):
        n_warm = min(p - 1 - s, m)
        order = [F(0, i) for i in range(n_warm)]
        for i in range(m - n_warm):
            order += [F(0, n_warm + i), *_backward(split, 0, i)]
        for i in range(m - n_warm, m):
            order += _backward(split, 0, i)
        orders.append(order)
    return orders


def lockstep_1f1b_orders(p: int, v: int, m: int) -> list[list[Action]]:
    """1F1B with fused backwards for lockstep rows: warm-up 2(p − 1 − s) forwards on stage s, so that neighbouring
    stages want the same kind in each tick and one kind per row reaches the asynchronous makespan, (p − 1)/m at any
    B/F ratio, at a stash of 2(p − 1 − s) + 1 (Megatron's warm-up p − 1 − s on lockstep rows: bubble 0.80 at p = 4,
    m = 16)."""
    orders = []
    for s in range(p):
        n_warm = min(2 * (p - 1 - s), m)
        order = [F(0, i) for i in range(n_warm)]
        for i in range(m - n_warm):
            order += [F(0, n_warm + i), B(0, i)]
        order += [B(0, i) for i in range(m - n_warm, m)]
        orders.append(order)
    return orders


def zb_h1_orders(p: int, v: int, m: int) -> list[list[Action]]:
    """1F1B's order with stage s's W(j) right after I(j + s) (the rest at the end, oldest first): stage s holds p − s
    microbatches between F and I and up to s between I and W, p in all, and the late W's fill the cool-down."""
    orders = []
    for s, order in enumerate(one_f_one_b_orders(p, v, m, split=True)):
        out, waiting = [], []
        for a in order:
            if a.kind == "W":
                continue
            out.append(a)
            if a.kind == "I":
                waiting.append(W(0, a.microbatch))
                if len(waiting) > s:
                    out.append(waiting.pop(0))
        out += waiting
        orders.append(out)
    return orders


def interleaved_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """megatron-core's (microbatch, chunk) order of forwards: groups of G microbatches swept over the chunks;
    the last group takes whatever microbatches remain."""
    table = []
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        table += [(mb, chunk) for chunk in range(v) for mb in range(first, last)]
    return table


def interleaved_orders(p: int, v: int, m: int, g: int, split: bool = False) -> list[list[Action]]:
    """megatron-core's interleaved 1F1B for the effective group size G (`check_request`)."""
    table = interleaved_table(m, v, g)
    total = m * v
    fwd = [F(chunk, mb) for mb, chunk in table]
    bwd = [_backward(split, v - 1 - chunk, mb) for mb, chunk in table]
    orders = []
    for r in range(p):
        n_warm = min(2 * (p - r - 1) + (v - 1) * g, total)
        order = fwd[:n_warm]
        for i in range(total - n_warm):
            order += [fwd[n_warm + i], *bwd[i]]
        order += [a for back in bwd[total - n_warm :] for a in back]
        orders.append(order)
    return orders


class _Greedy:
    """The state of `greedy_orders`' replay: per rank the next F and I of each chunk, the chunk-microbatches in
    flight (from F until W), the waiting W's."""

    def __init__(self, spec: ScheduleSpec, p: int, v: int, m: int):
        self.spec, self.p, self.v, self.m = spec, p, v, m
        self.done: dict[tuple[int, Action], int] = {}
        self.next = {kind: [[0] * v for _ in range(p)] for kind in "FI"}
        self.waiting: list[list[Action]] = [[] for _ in range(p)]
        self.in_flight = [0] * p

    def ready(self, kind: str, r: int, tick: int) -> list[Action]:
        out = []
        for c in range(self.v):
            i = self.next[kind][r][c]
            a = Action(kind, c, i)
            deps = dependencies(self.spec, a, r, self.p, self.v)
            if i < self.m and all(self.done.get(d, tick) < tick for d in deps):
                out.append(a)
        return out

    def pick(self, r: int, tick: int, limit: int) -> Action | None:
        stage = partial(stage_of, self.spec, self.p)
        backs = self.ready("I", r, tick)
        if backs:
            return min(backs, key=lambda a: (a.microbatch, -stage(a.chunk, r)))
        fs = self.ready("F", r, tick)
        if fs and self.in_flight[r] < limit:
            return max(fs, key=lambda a: (stage(a.chunk, r), -a.microbatch))  # the deepest stage first
        return self.waiting[r][0] if self.waiting[r] else None

    def run(self, r: int, a: Action, tick: int) -> None:
        self.done[(r, a)] = tick
        if a.kind == "W":
            self.waiting[r].pop(0)
            self.in_flight[r] -= 1
            return
        self.next[a.kind][r][a.chunk] += 1
        if a.kind == "F":
            self.in_flight[r] += 1
        else:
            self.waiting[r].append(W(a.chunk, a.microbatch))


def greedy_orders(spec: ScheduleSpec, p: int, v: int, m: int, limit: int) -> list[list[Action]]:
    """Each rank's order from a unit-time replay: per tick, a ready I, else a ready F (the deepest stage first) while
    fewer than `limit` chunk-microbatches are in flight from F to W, else the oldest waiting W. The in-flight limit
    alone bounds the memory (a W-waiting microbatch counts against it); a limit on the waiting W's as well only
    lengthens the step (p = 4, m = 8: bubble 0.104 with at most p waiting, 0.062 without)."""
    state, orders, tick = _Greedy(spec, p, v, m), [[] for _ in range(p)], 0
    while sum(len(o) for o in orders) < 3 * p * v * m:
        picks = {r: a for r in range(p) if (a := state.pick(r, tick, limit)) is not None}
        if not picks:
            raise ScheduleError(f"schedule {spec.name!r} deadlocks at tick {tick} with limit={limit}")
        for r, a in picks.items():
            state.run(r, a, tick)
            orders[r].append(a)
        tick += 1
    return orders


ORDERS = {
    "gpipe": lambda spec, p, v, m, g: gpipe_orders(p, v, m, spec.split),
    "1f1b": lambda spec, p, v, m, g: one_f_one_b_orders(p, v, m, spec.split),
    "1f1b-lockstep": lambda spec, p, v, m, g: lockstep_1f1b_orders(p, v, m),
    "interleaved": lambda spec, p, v, m, g: interleaved_orders(p, v, m, g, spec.split),
    "zb-h1": lambda spec, p, v, m, g: zb_h1_orders(p, v, m),
    "zero-bubble": lambda spec, p, v, m, g: greedy_orders(spec, p, v, m, limit=p * v),
}
"""Order builders by `ScheduleSpec.orders`: (spec, p, v, m, effective G) -> each rank's list of actions. The
greedy one lets p·v chunk-microbatches be in flight from F to W: 1F1B's p whole stages."""


def build_orders(name: str, p: int, v: int, m: int, group: int | None = None) -> list[list[Action]]:
    g = check_request(name, p, v, m, group)
    spec = spec_of(name)
    return ORDERS[spec.orders](spec, p, v, m, g)
