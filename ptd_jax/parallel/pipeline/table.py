"""Each rank's order of actions placed on ticks, with the buffer slots the executor reads and writes; one validator
and one simulator of the result. Pure Python, no JAX.

One placement serves every schedule (`place`): a rank runs its next action at the first tick after its dependencies
finished (`schedule.dependencies`). The spec's row rule says which ready ranks run together:
- "unit": all of them, whatever their kinds. With F ≈ I ≈ W every cell lasts about one unit, so the table follows
  the asynchronous timeline exactly (1F1B, ZB-H1, ZB-V);
- "lockstep": those whose kind is the kind of the highest ready rank, so that every row has one kind. With a fused
  B ≈ 2F a tick lasts its longest cell, and one kind per row is what reaches the asynchronous makespan (GPipe,
  interleaved; docs/architecture.md, "Pipeline").
A lockstep table is the special case of a unit table whose rows have one kind: the executor reads both alike.

Slots, per rank (a slot is reused from the tick after it is freed; a pool's size is its peak):
- act: a chunk's input, from its arrival to its F; on the last stage the gradient of the chunk's output, from its
  F (which runs the head, forward and backward) to its B or I;
- grad: an output gradient, from its arrival to its B or I;
- record, in three pools by how long a layer's saved values live: `rec` from F to B/I (what only the backward
  needs), `hold` from F to W (what W needs too, kept in the same place), `w` from I to W (what only W needs).
  The executor decides which saved value goes where (`stash.Record`).
What a cell sends travels in a direction (`Cell.send`: +1 to rank + 1, −1 to rank − 1, 0 to itself at the V's
turn), and what arrives is written where the receiver's `Cell.recv` says.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ptd_jax.config import ScheduleSpec
from ptd_jax.parallel.pipeline.schedule import (
    BACKWARD,
    Action,
    F,
    ScheduleError,
    build_orders,
    check_request,
    dependencies,
    place_of,
    spec_of,
    stage_of,
)

ACCUMULATION = ScheduleSpec("accumulation", orders="1f1b", split=False, rows="lockstep", chunks=1)
"""Gradient accumulation at p = 1 (`accumulation_table`): each microbatch's F, then its fused B."""


@dataclass
class Cell:
    """What one rank does in one tick, with its buffer slots (-1: none)."""

    action: Action | None = None
    in_slot: int = -1  # act: F's input (stage > 0); B/I on the last stage: the gradient of the chunk's output
    out_slot: int = -1  # act: F on the last stage (training): where its output's gradient waits for the B/I
    grad_slot: int = -1  # grad: B/I below the last stage: the output gradient
    rec_slot: int = -1  # record kept from F to B/I
    hold_slot: int = -1  # record kept from F to W (split backwards)
    w_slot: int = -1  # record kept from I to W (split backwards)
    send: int | None = None  # where its output goes: +1 (rank + 1), -1 (rank − 1), 0 (this rank: the V's turn)
    recv: dict = field(default_factory=dict)  # arrivals {+1: from rank − 1, -1: from rank + 1, 0: own} -> (buf, slot)


class _SlotPool:
    """One buffer's slots on every rank: a freed slot is reused first (oldest first), else a new one is added."""

    def __init__(self, p: int):
        self.free: list[deque] = [deque() for _ in range(p)]
        self.count = [0] * p
        self.held = [0] * p
        self.peak = [0] * p

    def alloc(self, rank: int) -> int:
        self.held[rank] += 1
        self.peak[rank] = max(self.peak[rank], self.held[rank])
        if self.free[rank]:
            return self.free[rank].popleft()
        self.count[rank] += 1
        return self.count[rank] - 1

    def release(self, rank: int, slot: int) -> None:
        self.held[rank] -= 1
        self.free[rank].append(slot)

    @property
    def size(self) -> int:
        return max(self.count)


@dataclass
class Table:
    spec: ScheduleSpec
    p: int
    v: int
    m: int
    group: int
    orders: list[list[Action]]
    forward_only: bool = False
    cells: list[list[Cell]] = field(default_factory=list)  # [tick][rank]
    slots: dict = field(default_factory=dict)  # pool name -> slots per rank (its peak over ranks)
    peak_stash: list[int] = field(default_factory=list)  # per rank: most chunk-microbatches between F and B/I
    peak_in_flight: list[int] = field(default_factory=list)  # per rank: most between F and W (or a fused B)
    peak_w_stash: list[int] = field(default_factory=list)  # per rank: most between I and W

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def split(self) -> bool:
        return self.spec.split

    @property
    def ticks(self) -> int:
        return len(self.cells)

    @property
    def kinds(self) -> list[str]:
        """Per tick, the kinds its cells run, e.g. "F", "B", "FIW" (sorted as `schedule.KINDS`)."""
        return ["".join(k for k in "FBIW" if any(c.action and c.action.kind == k for c in row)) for row in self.cells]

    def stage(self, action: Action, rank: int) -> int:
        return stage_of(self.spec, self.p, action.chunk, rank)

    def cell_time(self, action: Action | None, times: tuple[float, float, float]) -> float:
        """One cell's duration: a whole stage's F, I, W take `times` (f, b, w), a chunk 1/v of it; a fused B b + w."""
        if action is None:
            return 0.0
        f, b, w = times
        return {"F": f, "B": b + w, "I": b, "W": w}[action.kind] / self.v

    def simulate(
        self, backward_ratio: float = 2.0, times: tuple[float, float, float] | None = None, duration=None
    ) -> dict:
        """The table's makespan: each tick lasts as long as its longest cell (`cell_time`); `times` = (f, b, w), by
        default (1, k/2, k/2) for backward = k × forward. Bubble = (makespan − ideal) / ideal, the paper's
        t_pb / t_id, with ideal = m·(f + b + w). `duration(rank, action)`, where given, times each cell instead
        (ranks at different clocks: `perf/energy.py`). `busy`: each rank's summed cell time."""
        times = times or (1.0, backward_ratio / 2, backward_ratio / 2)
        cells = self.durations(duration or (lambda rank, action: self.cell_time(action, times)))
        makespan = sum(max(row) for row in cells)
        ideal = self.m * sum(times)
        busy = [sum(row[r] for row in cells) for r in range(self.p)]
        return {"makespan": makespan, "ideal": ideal, "bubble_fraction": (makespan - ideal) / ideal, "busy": busy}

    def durations(self, duration) -> list[list[float]]:
        """[tick][rank]: each cell's time by `duration(rank, action)`; an idle cell lasts 0."""
        return [[duration(r, c.action) if c.action else 0.0 for r, c in enumerate(row)] for row in self.cells]

    def formula_bubble(self, times: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float | None:
        """The spec's closed form: (p−1)/(v·m), or ZB-H1's (p−1)(f+b−w)/(m(f+b+w)); None where there is none."""
        formula = self.spec.bubble_formula
        if formula is None:
            return None
        if formula == "(p-1)/(v*m)":
            return (self.p - 1) / (self.v * self.m)
        f, b, w = times
        return (self.p - 1) * max(f + b - w, 0.0) / (self.m * (f + b + w))

    def to_json(self, backward_ratio: float = 2.0, times: tuple[float, float, float] | None = None) -> dict:
        times = times or (1.0, backward_ratio / 2, backward_ratio / 2)
        sim = self.simulate(times=times)
        return {
            "schedule": self.name,
            "p": self.p,
            "v": self.v,
            "m": self.m,
            "G": self.group,
            "ticks": self.ticks,
            "bubble_fraction": sim["bubble_fraction"],
            "makespan": sim["makespan"],
            "formula_bubble": self.formula_bubble(times),
            "backward_ratio": (times[1] + times[2]) / times[0],
            "times": {"f": times[0], "b": times[1], "w": times[2]},
            "peak_stash": self.peak_stash,
            "peak_in_flight": self.peak_in_flight,
            "peak_w_stash": self.peak_w_stash,
            "slots": self.slots,
            "ranks": [[str(a) for a in order] for order in self.orders],
        }

    def text(self) -> str:
        """Text table: one row per tick, one column per rank."""
        width = max(6, len(str(Action("F", self.v, self.m))) + 1)
        lines = ["tick kind " + "".join(f"rank{r}".rjust(width) for r in range(self.p))]
        for t, (kind, row) in enumerate(zip(self.kinds, self.cells)):
            cells = "".join((str(c.action) if c.action else ".").rjust(width) for c in row)
            lines.append(f"{t:4d} {kind:>4} " + cells)
        return "\n".join(lines)


class _Placement:
    """The slots of the actions placed so far."""

    def __init__(self, table: Table):
        self.t, p = table, table.p
        self.pools = {name: _SlotPool(p) for name in ("act", "grad", "rec", "hold", "w")}
        self.pending: dict[tuple[str, int, Action], int] = {}  # (pool, rank, reader action) -> slot
        self.sent: list[tuple[int, int, str, int]] = []  # this tick's (to rank, direction, buffer, slot)

    def _keep(self, pool: str, r: int, reader: Action) -> int:
        slot = self.pools[pool].alloc(r)
        self.pending[(pool, r, reader)] = slot
        return slot

    def _take(self, pool: str, r: int, reader: Action) -> int:
        return self.pending.pop((pool, r, reader))

    def _send(self, r: int, a: Action, cell: Cell, to_stage: int, pool: str, kind: str) -> None:
        t = self.t
        to_rank, to_chunk = place_of(t.spec, t.p, to_stage)
        reader = Action(kind, to_chunk, a.microbatch)
        slot = self._keep(pool, to_rank, reader)
        from_stage = t.stage(a, r)
        if to_rank == r:
            cell.send = 0
        elif t.spec.stage_map == "v":  # chunk 0 runs down the ranks, chunk 1 back up
            cell.send = 1 if (to_stage > from_stage) == (min(to_stage, from_stage) < t.p) else -1
        else:
            cell.send = 1 if to_stage > from_stage else -1
        self.sent.append((to_rank, cell.send, pool, slot))

    def forward(self, r: int, a: Action, cell: Cell) -> None:
        t = self.t
        stage, last = t.stage(a, r), t.p * t.v - 1
        if stage > 0:
            cell.in_slot = self._take("act", r, a)
        if not t.forward_only:
            back = Action("I" if t.split else "B", a.chunk, a.microbatch)
            cell.rec_slot = self._keep("rec", r, back)
            if t.split:
                cell.hold_slot = self._keep("hold", r, Action("W", a.chunk, a.microbatch))
            if stage == last:
                cell.out_slot = self._keep("act", r, back)
        if stage < last:
            self._send(r, a, cell, stage + 1, "act", "F")

    def backward(self, r: int, a: Action, cell: Cell) -> None:
        t = self.t
        stage, last = t.stage(a, r), t.p * t.v - 1
        cell.rec_slot = self._take("rec", r, a)
        if stage == last:
            cell.in_slot = self._take("act", r, a)
        else:
            cell.grad_slot = self._take("grad", r, a)
        if a.kind == "I":
            cell.hold_slot = self.pending[("hold", r, Action("W", a.chunk, a.microbatch))]
            cell.w_slot = self._keep("w", r, Action("W", a.chunk, a.microbatch))
        if stage > 0:
            self._send(r, a, cell, stage - 1, "grad", a.kind)

    def weight(self, r: int, a: Action, cell: Cell) -> None:
        cell.hold_slot = self._take("hold", r, a)
        cell.w_slot = self._take("w", r, a)

    def end_tick(self, row: list[Cell]) -> None:
        """Deliver what was sent (each receiver's `recv`), then free what this tick read: reads come before writes
        within a tick, and a freed slot is reused from the next tick on."""
        for to_rank, direction, pool, slot in self.sent:
            row[to_rank].recv[direction] = (pool, slot)
        self.sent = []
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            if a.kind == "F" and cell.in_slot >= 0:
                self.pools["act"].release(r, cell.in_slot)
            if a.kind in BACKWARD:
                self.pools["rec"].release(r, cell.rec_slot)
                if cell.in_slot >= 0:
                    self.pools["act"].release(r, cell.in_slot)
                if cell.grad_slot >= 0:
                    self.pools["grad"].release(r, cell.grad_slot)
            if a.kind == "W":
                self.pools["hold"].release(r, cell.hold_slot)
                self.pools["w"].release(r, cell.w_slot)


def place(
    spec: ScheduleSpec, orders: list[list[Action]], p: int, v: int, m: int, group: int = 1, forward_only: bool = False
) -> Table:
    """Place the per-rank orders on ticks by the spec's row rule (module docstring), assigning the slots.
    `forward_only`: the orders hold forwards alone (evaluation), and nothing is kept for a backward."""
    table = Table(spec, p, v, m, group, orders, forward_only=forward_only)
    place = _Placement(table)
    run = {"F": place.forward, "B": place.backward, "I": place.backward, "W": place.weight}
    done: dict[tuple[int, Action], int] = {}
    pos, total = [0] * p, sum(len(o) for o in orders)
    while len(done) < total:
        tick = table.ticks
        ready = {}
        for r in range(p):
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                if all(done.get(d, tick) < tick for d in dependencies(spec, a, r, p, v)):
                    ready[r] = a
        if not ready:
            nxt = [str(o[i]) if i < len(o) else None for o, i in zip(orders, pos)]
            raise ScheduleError(f"schedule {spec.name!r} deadlocks at tick {tick}: no rank can proceed (next: {nxt})")
        if spec.rows == "lockstep":
            kind = ready[max(ready)].kind
            ready = {r: a for r, a in ready.items() if a.kind == kind}
        row = [Cell() for _ in range(p)]
        for r, a in ready.items():
            row[r].action = a
            run[a.kind](r, a, row[r])
            done[(r, a)] = tick
            pos[r] += 1
        place.end_tick(row)
        table.cells.append(row)
    pools = place.pools
    table.slots = {name: pool.size for name, pool in pools.items()}
    table.peak_stash = pools["rec"].peak
    table.peak_in_flight = pools["hold"].peak if spec.split else pools["rec"].peak
    table.peak_w_stash = pools["w"].peak
    return table


def build(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Table:
    """The validated request's table."""
    g = check_request(name, p, v, m, group)
    return place(spec_of(name), build_orders(name, p, v, m, group), p, v, m, g)


def build_forward_only(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Table:
    """The forwards of a schedule alone (evaluation), in its stage order; the lockstep rule places them (forwards
    alone have no mixed kinds to run)."""
    g = check_request(name, p, v, m, group)
    spec = spec_of(name)
    orders = [[a for a in order if a.kind == "F"] for order in build_orders(name, p, v, m, group)]
    return place(spec, orders, p, v, m, g, forward_only=True)


def accumulation_table(m: int) -> Table:
    """Gradient accumulation at p = 1: F(i) then its fused B(i) for each microbatch (the step adds each layer's
    gradient in place, as Megatron's main_grad)."""
    orders = [[a for i in range(m) for a in (F(0, i), Action("B", 0, i))]]
    return place(ACCUMULATION, orders, 1, 1, m)


def _gpipe_slots(p: int, v: int, m: int, g: int, split: bool) -> dict | None:
    return {"rec": m, "hold": m if split else 0, "w": m if split else 0}


def _1f1b_slots(p: int, v: int, m: int, g: int, split: bool) -> dict | None:
    held = min(p, m)  # stage 0: warm-up p − 1, then one more before its first backward
    return {"rec": held, "hold": held if split else 0, "w": 1 if split else 0}


def _lockstep_1f1b_slots(p: int, v: int, m: int, g: int, split: bool) -> dict | None:
    return {"rec": min(2 * p - 1, m), "hold": 0, "w": 0}


def _interleaved_slots(p: int, v: int, m: int, g: int, split: bool) -> dict | None:
    if split or g != p:
        return None
    return {"rec": min(p * v + p - 1, m * v), "hold": 0, "w": 0}  # stage 0 (docs/architecture.md, "Pipeline")


RECORD_SLOTS = {
    "gpipe": _gpipe_slots,
    "1f1b": _1f1b_slots,
    "1f1b-lockstep": _lockstep_1f1b_slots,
    "interleaved": _interleaved_slots,
}
"""Closed forms of a table's record slots by order builder (`ScheduleSpec.orders`), where one is known: the
planner sizes thousands of layouts without building their tables. Checked against the tables in the tests."""


def record_slots(spec: ScheduleSpec, p: int, v: int, m: int, g: int) -> dict[str, int]:
    """{"rec", "hold", "w"}: the table's record pools, by a closed form where `RECORD_SLOTS` has one."""
    formula = RECORD_SLOTS.get(spec.orders)
    closed = formula(p, v, m, g, spec.split) if formula is not None and p > 1 else None
    if closed is not None:
        return closed
    slots = place(spec, build_orders(spec.name, p, v, m, g if spec.grouped else None), p, v, m, g).slots
    return {pool: slots[pool] for pool in ("rec", "hold", "w")}


def check_actions(table: Table, seen: dict) -> None:
    """`seen` ((rank, action) -> tick) holds each action of the table's kinds exactly once per (virtual stage,
    microbatch), no cell runs one twice, and every dependency ran at an earlier tick."""
    p, v, m = table.p, table.v, table.m
    kinds = "F" if table.forward_only else ("FIW" if table.split else "FB")
    expected = {(r, Action(k, c, i)) for r in range(p) for c in range(v) for i in range(m) for k in kinds}
    if set(seen) != expected:
        missing = sorted(expected ^ set(seen))[:3]
        raise ScheduleError(f"schedule {table.name!r} misses or adds actions, e.g. {[(r, str(a)) for r, a in missing]}")
    cells = sum(1 for row in table.cells for c in row if c.action is not None)
    if cells != len(expected):
        raise ScheduleError(f"schedule {table.name!r} runs {cells} cells for {len(expected)} actions: one runs twice")
    for (r, a), t in seen.items():
        for dep in dependencies(table.spec, a, r, p, v):
            if dep in seen and seen[dep] >= t:
                raise ScheduleError(
                    f"{a} on rank {r} at tick {t} runs before its dependency {dep[1]} on rank "
                    f"{dep[0]} (tick {seen[dep]})"
                )


def validate(table: Table) -> None:
    """Every action exactly once; every dependency at an earlier tick; a lockstep table one kind per row; every
    slot read holding what the reader needs, and freed once read."""
    seen = {(r, c.action): t for t, row in enumerate(table.cells) for r, c in enumerate(row) if c.action}
    check_actions(table, seen)
    if table.spec.rows == "lockstep" and any(len(k) > 1 for k in table.kinds):
        raise ScheduleError(f"schedule {table.name!r} places its actions on lockstep rows but a row mixes kinds")
    _replay_slots(table)


def _replay_slots(table: Table) -> None:
    p, last = table.p, table.p * table.v - 1
    held = {pool: [{} for _ in range(p)] for pool in ("act", "grad", "rec", "hold", "w")}

    def read(pool, r, slot, key, what, a, t, free=True):
        if held[pool][r].get(slot) != key:
            raise ScheduleError(
                f"{a} on rank {r} at tick {t} reads {pool} slot {slot} ({what}) holding {held[pool][r].get(slot)}"
            )
        if free:
            held[pool][r].pop(slot)

    for t, row in enumerate(table.cells):
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            key, stage = (a.chunk, a.microbatch), table.stage(a, r)
            if a.kind == "F" and stage > 0:
                read("act", r, cell.in_slot, key, "its input", a, t)
            if a.kind in BACKWARD:
                read("rec", r, cell.rec_slot, key, "its record", a, t)
                if stage == last:
                    read("act", r, cell.in_slot, key, "the gradient of the last stage's output", a, t)
                else:
                    read("grad", r, cell.grad_slot, key, "its output gradient", a, t)
            if a.kind == "I":
                read("hold", r, cell.hold_slot, key, "its record", a, t, free=False)
            if a.kind == "W":
                read("hold", r, cell.hold_slot, key, "its record", a, t)
                read("w", r, cell.w_slot, key, "its I's record", a, t)
        for r, cell in enumerate(row):
            a = cell.action
            if a is not None and a.kind == "F" and not table.forward_only:
                for pool, slot in (("rec", cell.rec_slot), ("hold", cell.hold_slot), ("act", cell.out_slot)):
                    if slot >= 0:
                        held[pool][r][slot] = (a.chunk, a.microbatch)
            if a is not None and a.kind == "I":
                held["w"][r][cell.w_slot] = (a.chunk, a.microbatch)
            for direction, (pool, slot) in cell.recv.items():
                src = (r - direction) % p
                sa = row[src].action
                if sa is None or sa.kind == "W" or (pool == "act") != (sa.kind == "F"):
                    raise ScheduleError(f"tick {t}: rank {r} expects a tensor from rank {src}, which sends none")
                to_stage = table.stage(sa, src) + (1 if sa.kind == "F" else -1)
                rank, chunk = place_of(table.spec, p, to_stage)
                if rank != r:
                    raise ScheduleError(
                        f"tick {t}: {sa} on rank {src} sends to rank {r}, but its stage {to_stage} is on rank {rank}"
                    )
                held[pool][r][slot] = (chunk, sa.microbatch)
