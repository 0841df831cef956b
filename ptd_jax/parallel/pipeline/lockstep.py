"""Lockstep: each rank's order of actions placed on global ticks of one kind (all F or all B), with the stash
slots the executor reads and writes; a validator and a simulator of the result. Pure Python, no JAX.

One kind per tick is what lets one SPMD program issue identical collectives on every device (the executor's
`lax.cond` predicate comes from the table) and, because a tick lasts as long as its slowest cell, what lets
lockstep reach the asynchronous makespan. `Schedule` holds the result: per tick, the kind and each rank's action
(or None), slot assignments, a simulated makespan and bubble, and the peak stash per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ptd_jax.parallel.pipeline.schedule import (SPLIT_SCHEDULES, Action, B, F, ScheduleError, build_orders,
                                                check_request, dependencies, stage_of)


@dataclass
class Cell:
    """What one rank does in one tick, with the executor's buffer slots (-1: none)."""

    action: Action | None = None
    in_slot: int = -1      # activation slot holding (or, on virtual stage 0, receiving) this action's input
    grad_slot: int = -1    # B only: slot holding the gradient received from the next virtual stage
    recv_slot: int = -1    # where the tensor arriving at the end of this tick goes (F: activation, B: gradient)
    # Split schedules (`unit.py`) only:
    w_slot: int = -1       # B: where it stashes what its W needs; W: where it reads it
    send: int | None = None  # where its output goes: +1 (rank + 1), -1 (rank − 1), 0 (this rank: the V's turn)
    recv: dict = field(default_factory=dict)  # arrivals {+1: from rank − 1, -1: from rank + 1, 0: own} -> (buf, slot)


@dataclass
class Schedule:
    name: str
    p: int
    v: int
    m: int
    group: int
    orders: list[list[Action]]
    kinds: list[str] = field(default_factory=list)          # per tick: "F" or "B"; "X" (mixed) in a split schedule
    cells: list[list[Cell]] = field(default_factory=list)   # [tick][rank]
    num_act_slots: int = 0
    num_grad_slots: int = 0
    peak_stash: list[int] = field(default_factory=list)     # per rank: most microbatches held at once (a slot each)
    forward_only: bool = False                              # forwards alone (evaluation): `build_forward_only`
    num_w_slots: int = 0                                    # split schedules: slots of the W stash
    peak_w_stash: list[int] = field(default_factory=list)   # per rank: most B's whose W has not run yet

    @property
    def split(self) -> bool:
        """Split backwards (B and W) on unit ticks, where ranks run different kinds in one tick (`unit.py`)."""
        return self.name in SPLIT_SCHEDULES

    @property
    def ticks(self) -> int:
        return len(self.kinds)

    def stage(self, action: Action, rank: int) -> int:
        return stage_of(self.name, self.p, action.chunk, rank)

    def cell_time(self, action: Action | None, times: tuple[float, float, float]) -> float:
        """One cell's duration: a whole stage's F, B, W take `times` (f, b, w), a chunk 1/v of it; a fused B is
        b + w."""
        if action is None:
            return 0.0
        f, b, w = times
        return {"F": f, "B": b if self.split else b + w, "W": w}[action.kind] / self.v

    def simulate(self, backward_ratio: float = 2.0, times: tuple[float, float, float] | None = None) -> dict:
        """Lockstep makespan: each tick lasts as long as its longest cell (`cell_time`); `times` = (f, b, w), by
        default (1, k/2, k/2) for backward = k × forward. Bubble = (makespan − ideal) / ideal, the paper's
        t_pb / t_id, with ideal = m·(f + b + w)."""
        times = times or (1.0, backward_ratio / 2, backward_ratio / 2)
        makespan = sum(max(self.cell_time(c.action, times) for c in row) for row in self.cells)
        ideal = self.m * sum(times)
        return {"makespan": makespan, "ideal": ideal, "bubble_fraction": (makespan - ideal) / ideal}

    def formula_bubble(self, times: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float | None:
        """(p−1)/(v·m) (GPipe, 1F1B, interleaved); ZB-H1's (p−1)(f+b−w)/(m(f+b+w)) (the zero-bubble paper);
        None for ZB-V, whose paper gives no closed form for this table."""
        if self.name == "zb-h1":
            f, b, w = times
            return (self.p - 1) * max(f + b - w, 0.0) / (self.m * (f + b + w))
        if self.name == "zb-v":
            return None
        return (self.p - 1) / (self.v * self.m)

    def to_json(self, backward_ratio: float = 2.0, times: tuple[float, float, float] | None = None) -> dict:
        times = times or (1.0, backward_ratio / 2, backward_ratio / 2)
        sim = self.simulate(times=times)
        return {"schedule": self.name, "p": self.p, "v": self.v, "m": self.m, "G": self.group,
                "ticks": self.ticks, "bubble_fraction": sim["bubble_fraction"], "makespan": sim["makespan"],
                "formula_bubble": self.formula_bubble(times), "backward_ratio": (times[1] + times[2]) / times[0],
                "times": {"f": times[0], "b": times[1], "w": times[2]},
                "peak_stash": self.peak_stash, "peak_w_stash": self.peak_w_stash or [0] * self.p,
                "ranks": [[str(a) for a in order] for order in self.orders]}

    def table(self) -> str:
        """Text table: one row per tick, one column per rank."""
        width = max(6, len(str(Action("F", self.v, self.m))) + 1)
        lines = ["tick kind " + "".join(f"rank{r}".rjust(width) for r in range(self.p))]
        for t, (kind, row) in enumerate(zip(self.kinds, self.cells)):
            lines.append(f"{t:4d} {kind:>4} " + "".join((str(c.action) if c.action else ".").rjust(width)
                                                         for c in row))
        return "\n".join(lines)


class _SlotPool:
    """One buffer's slots on every rank: a freed slot is reused first (oldest first), else a new one is added."""

    def __init__(self, p: int):
        self.free: list[deque] = [deque() for _ in range(p)]
        self.count = [0] * p  # slots ever allocated per rank

    def alloc(self, rank: int) -> int:
        if self.free[rank]:
            return self.free[rank].popleft()
        self.count[rank] += 1
        return self.count[rank] - 1

    def release(self, rank: int, slot: int) -> None:
        self.free[rank].append(slot)

    @property
    def size(self) -> int:
        return max(self.count)


class _Placement:
    """The slots of the actions placed so far: where each pending F's input and each pending B's gradient will be,
    and how many microbatches each rank holds."""

    def __init__(self, p: int, v: int, forward_only: bool = False):
        self.p, self.v, self.forward_only = p, v, forward_only
        self.act, self.grad = _SlotPool(p), _SlotPool(p)
        self.act_slot: dict[tuple[int, Action], int] = {}   # (rank, F action) -> slot holding its input
        self.grad_slot: dict[tuple[int, Action], int] = {}  # (rank, B action) -> slot holding its output gradient
        self.held = [0] * p
        self.peak = [0] * p

    def forward(self, r: int, a: Action, cell: Cell) -> None:
        """F: its input's slot (on virtual stage 0 a new one: the embedding, made in this tick and stashed for the
        backward; none without a backward, where the embedding goes straight into the chunk), and a slot on the
        next virtual stage's rank for its output."""
        stage = a.chunk * self.p + r
        if stage == 0:
            if self.forward_only:
                self.act_slot[(r, a)] = -1
            else:
                self.act_slot[(r, a)] = self.act.alloc(r)
        cell.in_slot = self.act_slot.pop((r, a)) if self.forward_only else self.act_slot[(r, a)]
        self.held[r] += 1
        self.peak[r] = max(self.peak[r], self.held[r])
        if stage < self.p * self.v - 1:
            nxt = stage + 1
            slot = self.act.alloc(nxt % self.p)
            self.act_slot[(nxt % self.p, F(nxt // self.p, a.microbatch))] = slot
            cell.recv_slot = slot  # recorded on the sender's cell; `_deliver` moves it to the receiver

    def backward(self, r: int, a: Action, cell: Cell) -> None:
        """B: its forward's input slot, the gradient's slot (below the last stage), and a slot on the previous
        virtual stage's rank for its input gradient."""
        stage = a.chunk * self.p + r
        cell.in_slot = self.act_slot.pop((r, F(a.chunk, a.microbatch)))
        if stage < self.p * self.v - 1:
            cell.grad_slot = self.grad_slot.pop((r, a))
        if stage > 0:
            prv = stage - 1
            slot = self.grad.alloc(prv % self.p)
            self.grad_slot[(prv % self.p, B(prv // self.p, a.microbatch))] = slot
            cell.recv_slot = slot

    def release(self, row: list[Cell], kind: str) -> None:
        """Free the slots this tick's backwards read, or, without backwards (evaluation), the slots its forwards
        read: nothing is kept for a backward, so evaluation holds a number of slots that does not grow with m.
        Reads happen before writes within a tick, and the freed slots are reused from the next tick on."""
        if kind != "B" and not self.forward_only:
            return
        for r, cell in enumerate(row):
            if cell.action is not None:
                if cell.in_slot >= 0:
                    self.act.release(r, cell.in_slot)
                self.held[r] -= 1
                if cell.grad_slot >= 0:
                    self.grad.release(r, cell.grad_slot)


def _ready(name: str, orders: list[list[Action]], pos: list[int], done: dict, tick: int, v: int
           ) -> dict[int, Action]:
    """Each rank's next action whose dependencies finished at an earlier tick."""
    p, ready = len(orders), {}
    for r in range(p):
        if pos[r] < len(orders[r]):
            a = orders[r][pos[r]]
            if all(done.get(d, tick) < tick for d in dependencies(name, a, r, p, v)):
                ready[r] = a
    return ready


def _deliver(row: list[Cell], kind: str) -> None:
    """Move each sender's recv_slot to its receiver: what rank r sends arrives on rank r+1 (F) or r−1 (B) at the
    end of the tick."""
    p, shift = len(row), 1 if kind == "F" else -1
    recv = [-1] * p
    for r in range(p):
        if row[r].recv_slot >= 0:
            recv[(r + shift) % p] = row[r].recv_slot
    for r in range(p):
        row[r].recv_slot = recv[r]


def lockstep(name: str, orders: list[list[Action]], p: int, v: int, m: int, group: int,
             forward_only: bool = False) -> Schedule:
    """Place the per-rank orders on global ticks of one kind each, assigning buffer slots.

    Each tick runs the kind of the ready action (dependencies done at earlier ticks) of the highest ready rank:
    the stage furthest down the pipeline sits on the critical path, and following it reaches the formula bubble
    for GPipe, 1F1B (lockstep warm-up) and interleaved 1F1B, where 'most ready ranks' or 'backward first' reach
    about twice the formula (p=4, v=2, m=8: 0.188 against 0.333-0.438). A rank whose next action is of the other
    kind, or not ready, idles. `forward_only`: the orders hold forwards alone (evaluation), and a slot is freed
    once its forward has read it."""
    sched = Schedule(name, p, v, m, group, orders, forward_only=forward_only)
    placement = _Placement(p, v, forward_only)
    done: dict[tuple[int, Action], int] = {}
    pos = [0] * p
    total = sum(len(o) for o in orders)
    while len(done) < total:
        tick = sched.ticks
        ready = _ready(name, orders, pos, done, tick, v)
        if not ready:
            raise ScheduleError(f"schedule {name!r} deadlocks at tick {tick}: no rank can proceed "
                                f"(next actions: {[str(o[i]) if i < len(o) else None for o, i in zip(orders, pos)]})")
        kind = ready[max(ready)].kind
        row = [Cell() for _ in range(p)]
        for r, a in ready.items():
            if a.kind == kind:
                row[r].action = a
                (placement.forward if kind == "F" else placement.backward)(r, a, row[r])
                done[(r, a)] = tick
                pos[r] += 1
        _deliver(row, kind)
        placement.release(row, kind)
        sched.kinds.append(kind)
        sched.cells.append(row)
    sched.num_act_slots, sched.num_grad_slots = placement.act.size, placement.grad.size
    sched.peak_stash = placement.peak
    return sched


def build(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    """The validated request's table: schedule `name` ("gpipe", "1f1b", "interleaved") placed on lockstep ticks
    (`tables.build` takes every schedule)."""
    _fused_only(name)
    g = check_request(name, p, v, m, group)
    return lockstep(name, build_orders(name, p, v, m, group), p, v, m, g)


def build_forward_only(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    """The forwards of a schedule alone (evaluation): same per-rank order, no backwards. A slot holds a chunk's
    input from its arrival to its forward only, so the slots (`num_act_slots`) do not grow with m; virtual stage
    0's cells read none (in_slot -1: the trash, which the embedding replaces)."""
    _fused_only(name)
    g = check_request(name, p, v, m, group)
    orders = [[a for a in order if a.kind == "F"] for order in build_orders(name, p, v, m, group)]
    return lockstep(name, orders, p, v, m, g, forward_only=True)


def _fused_only(name: str) -> None:
    if name in SPLIT_SCHEDULES:
        raise ScheduleError(f"schedule={name!r} splits its backwards: it runs on unit ticks (`tables.build`)")


def check_actions(sched: Schedule, seen: dict, kinds: str) -> None:
    """`seen` ((rank, action) -> tick) holds each action of `kinds` exactly once per (virtual stage, microbatch), no
    cell runs one twice, and every dependency ran at an earlier tick."""
    p, v, m = sched.p, sched.v, sched.m
    expected = {(r, Action(k, c, i)) for r in range(p) for c in range(v) for i in range(m) for k in kinds}
    if set(seen) != expected:
        missing = sorted(expected ^ set(seen))[:3]
        raise ScheduleError(f"schedule {sched.name!r} misses or adds actions, e.g. {[(r, str(a)) for r, a in missing]}")
    cells = sum(1 for row in sched.cells for c in row if c.action is not None)
    if cells != len(expected):
        raise ScheduleError(f"schedule {sched.name!r} runs {cells} cells for {len(expected)} actions: one runs twice")
    for (r, a), t in seen.items():
        for dep in dependencies(sched.name, a, r, p, v):
            if seen[dep] >= t:
                raise ScheduleError(f"{a} on rank {r} at tick {t} runs before its dependency {dep[1]} on rank "
                                    f"{dep[0]} (tick {seen[dep]})")


def validate(sched: Schedule) -> None:
    """Every F and B (F alone in a table of forwards only) exactly once per (virtual stage, microbatch); every B
    after its F; every dependency at an earlier tick; every read from a slot written earlier and not overwritten
    before it is read."""
    p, v = sched.p, sched.v
    seen: dict[tuple[int, Action], int] = {}
    for t, row in enumerate(sched.cells):
        for r, cell in enumerate(row):
            if cell.action is not None:
                if cell.action.kind != sched.kinds[t]:
                    raise ScheduleError(f"tick {t} is {sched.kinds[t]} but rank {r} runs {cell.action}")
                seen[(r, cell.action)] = t
    check_actions(sched, seen, "F" if sched.forward_only else "FB")
    # Slots: replay writes and reads.
    act = [dict() for _ in range(p)]
    grad = [dict() for _ in range(p)]
    for t, row in enumerate(sched.cells):
        kind = sched.kinds[t]
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            stage = sched.stage(a, r)
            key = (a.chunk, a.microbatch)
            if kind == "F" and stage > 0 and act[r].get(cell.in_slot) != key:
                raise ScheduleError(f"{a} on rank {r} at tick {t} reads activation slot {cell.in_slot} holding "
                                    f"{act[r].get(cell.in_slot)}")
            if kind == "F" and stage == 0:
                act[r][cell.in_slot] = key
            if kind == "B":
                if act[r].get(cell.in_slot) != key:
                    raise ScheduleError(f"{a} on rank {r} at tick {t} reads a stash slot that does not hold its input")
                if stage < p * v - 1 and grad[r].get(cell.grad_slot) != key:
                    raise ScheduleError(f"{a} on rank {r} at tick {t} reads gradient slot {cell.grad_slot} holding "
                                        f"{grad[r].get(cell.grad_slot)}")
        for r, cell in enumerate(row):
            if cell.recv_slot < 0:
                continue
            src = (r - 1) % p if kind == "F" else (r + 1) % p
            sa = row[src].action
            stage = sched.stage(sa, src) + (1 if kind == "F" else -1)
            key = (stage // p, sa.microbatch)
            (act if kind == "F" else grad)[r][cell.recv_slot] = key
