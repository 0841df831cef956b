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

from ptd_jax.parallel.pipeline.schedule import Action, B, F, ScheduleError, build_orders, check_request


@dataclass
class Cell:
    """What one rank does in one tick, with the executor's buffer slots (-1: none)."""

    action: Action | None = None
    in_slot: int = -1      # activation slot holding (or, on virtual stage 0, receiving) this action's input
    grad_slot: int = -1    # B only: slot holding the gradient received from the next virtual stage
    recv_slot: int = -1    # where the tensor arriving at the end of this tick goes (F: activation, B: gradient)


@dataclass
class Schedule:
    name: str
    p: int
    v: int
    m: int
    group: int
    orders: list[list[Action]]
    kinds: list[str] = field(default_factory=list)          # per tick: "F" or "B"
    cells: list[list[Cell]] = field(default_factory=list)   # [tick][rank]
    num_act_slots: int = 0
    num_grad_slots: int = 0
    peak_stash: list[int] = field(default_factory=list)     # per rank: most microbatches held at once (a slot each)

    @property
    def ticks(self) -> int:
        return len(self.kinds)

    def stage(self, action: Action, rank: int) -> int:
        return action.chunk * self.p + rank

    def simulate(self, backward_ratio: float = 2.0) -> dict:
        """Lockstep makespan with forward = 1/v per chunk (a whole stage's forward = 1) and backward = k×forward.
        Bubble = (makespan − ideal) / ideal, the paper's t_pb / t_id."""
        tf = 1.0 / self.v
        makespan = sum(tf if k == "F" else backward_ratio * tf for k in self.kinds)
        ideal = self.m * (1.0 + backward_ratio)
        return {"makespan": makespan, "ideal": ideal, "bubble_fraction": (makespan - ideal) / ideal}

    def formula_bubble(self) -> float:
        return (self.p - 1) / (self.v * self.m)

    def to_json(self, backward_ratio: float = 2.0) -> dict:
        sim = self.simulate(backward_ratio)
        return {"schedule": self.name, "p": self.p, "v": self.v, "m": self.m, "G": self.group,
                "ticks": self.ticks, "bubble_fraction": sim["bubble_fraction"],
                "formula_bubble": self.formula_bubble(), "backward_ratio": backward_ratio,
                "peak_stash": self.peak_stash, "ranks": [[str(a) for a in order] for order in self.orders]}

    def table(self) -> str:
        """Text table: one row per tick, one column per rank."""
        width = max(6, len(str(Action("F", self.v, self.m))) + 1)
        lines = ["tick kind " + "".join(f"rank{r}".rjust(width) for r in range(self.p))]
        for t, (kind, row) in enumerate(zip(self.kinds, self.cells)):
            lines.append(f"{t:4d} {kind:>4} " + "".join((str(c.action) if c.action else ".").rjust(width)
                                                         for c in row))
        return "\n".join(lines)


def _dependencies(action: Action, rank: int, p: int, v: int):
    """(rank, action) pairs that must finish at an earlier tick."""
    stage = action.chunk * p + rank
    last = p * v - 1
    if action.kind == "F":
        if stage == 0:
            return []
        prev = stage - 1
        return [(prev % p, F(prev // p, action.microbatch))]
    deps = [(rank, F(action.chunk, action.microbatch))]
    if stage < last:
        nxt = stage + 1
        deps.append((nxt % p, B(nxt // p, action.microbatch)))
    return deps


def lockstep(name: str, orders: list[list[Action]], p: int, v: int, m: int, group: int) -> Schedule:
    """Place the per-rank orders on global ticks of one kind each, assigning buffer slots.

    Each tick runs the kind of the ready action (dependencies done at earlier ticks) of the highest ready rank:
    the stage furthest down the pipeline sits on the critical path, and following it reaches the formula bubble
    for GPipe, 1F1B (lockstep warm-up) and interleaved 1F1B, where 'most ready ranks' or 'backward first' reach
    about twice the formula (measured: p=4, v=2, m=8: 0.188 vs 0.333-0.438). A rank whose next action is of the
    other kind, or not ready, idles."""
    sched = Schedule(name, p, v, m, group, orders)
    done: dict[tuple[int, Action], int] = {}
    pos = [0] * p
    act_free: list[deque] = [deque() for _ in range(p)]
    grad_free: list[deque] = [deque() for _ in range(p)]
    act_count = [0] * p   # slots ever allocated per rank (buffer sizes)
    grad_count = [0] * p
    act_slot: dict[tuple[int, Action], int] = {}   # (rank, F action) -> slot holding its input
    grad_slot: dict[tuple[int, Action], int] = {}  # (rank, B action) -> slot holding its output gradient
    held = [0] * p
    peak = [0] * p
    total = sum(len(o) for o in orders)

    def alloc(free: list[deque], count: list[int], rank: int) -> int:
        if free[rank]:
            return free[rank].popleft()
        count[rank] += 1
        return count[rank] - 1

    tick = 0
    while len(done) < total:
        ready = {}
        for r in range(p):
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                if all(done.get(d, tick) < tick for d in _dependencies(a, r, p, v)):
                    ready[r] = a
        if not ready:
            raise ScheduleError(f"schedule {name!r} deadlocks at tick {tick}: no rank can proceed "
                                f"(next actions: {[str(o[i]) if i < len(o) else None for o, i in zip(orders, pos)]})")
        kind = ready[max(ready)].kind
        row = [Cell() for _ in range(p)]
        for r, a in ready.items():
            if a.kind != kind:
                continue
            cell = row[r]
            cell.action = a
            stage = a.chunk * p + r
            if kind == "F":
                if stage == 0:  # the input is the embedding, made in this tick and stashed for the backward
                    act_slot[(r, a)] = alloc(act_free, act_count, r)
                cell.in_slot = act_slot[(r, a)]
                held[r] += 1
                peak[r] = max(peak[r], held[r])
                if stage < p * v - 1:  # the output goes to the next virtual stage's rank
                    nxt = stage + 1
                    dst, dst_action = nxt % p, F(nxt // p, a.microbatch)
                    slot = alloc(act_free, act_count, dst)
                    act_slot[(dst, dst_action)] = slot
                    cell.recv_slot = slot  # recorded on the sender's cell; moved to the receiver below
            else:
                cell.in_slot = act_slot.pop((r, F(a.chunk, a.microbatch)))
                if stage < p * v - 1:
                    cell.grad_slot = grad_slot.pop((r, a))
                if stage > 0:
                    prv = stage - 1
                    dst, dst_action = prv % p, B(prv // p, a.microbatch)
                    slot = alloc(grad_free, grad_count, dst)
                    grad_slot[(dst, dst_action)] = slot
                    cell.recv_slot = slot
            done[(r, a)] = tick
            pos[r] += 1
        # Receivers: what rank r sends arrives on rank r+1 (F) or r−1 (B) at the end of the tick.
        shift = 1 if kind == "F" else -1
        recv = [-1] * p
        for r in range(p):
            if row[r].recv_slot >= 0:
                recv[(r + shift) % p] = row[r].recv_slot
        for r in range(p):
            row[r].recv_slot = recv[r]
        # Free the slots read by this tick's backwards (reads happen before writes within a tick).
        for r in range(p):
            cell = row[r]
            if cell.action is not None and kind == "B":
                act_free[r].append(cell.in_slot)
                held[r] -= 1
                if cell.grad_slot >= 0:
                    grad_free[r].append(cell.grad_slot)
        sched.kinds.append(kind)
        sched.cells.append(row)
        tick += 1
    sched.num_act_slots, sched.num_grad_slots, sched.peak_stash = max(act_count), max(grad_count), peak
    return sched


def build(schedule: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    g = check_request(schedule, p, v, m, group)
    return lockstep(schedule, build_orders(schedule, p, v, m, group), p, v, m, g)


def build_forward_only(schedule: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    """The forwards of a schedule alone (evaluation): same per-rank order, no backwards, no stash reuse."""
    g = check_request(schedule, p, v, m, group)
    orders = [[a for a in order if a.kind == "F"] for order in build_orders(schedule, p, v, m, group)]
    return lockstep(schedule, orders, p, v, m, g)


def validate(sched: Schedule) -> None:
    """Every F and B exactly once per (virtual stage, microbatch); every B after its F; every dependency at an
    earlier tick; every read from a slot written earlier and not overwritten before it is read."""
    p, v, m = sched.p, sched.v, sched.m
    seen: dict[tuple[int, Action], int] = {}
    for t, row in enumerate(sched.cells):
        for r, cell in enumerate(row):
            if cell.action is not None:
                if cell.action.kind != sched.kinds[t]:
                    raise ScheduleError(f"tick {t} is {sched.kinds[t]} but rank {r} runs {cell.action}")
                seen[(r, cell.action)] = t
    expected = {(r, Action(k, c, i)) for r in range(p) for c in range(v) for i in range(m) for k in "FB"}
    if set(seen) != expected:
        missing = sorted(expected - set(seen))[:3]
        raise ScheduleError(f"schedule {sched.name!r} misses or adds actions, e.g. {[(r, str(a)) for r, a in missing]}")
    for (r, a), t in seen.items():
        for dep in _dependencies(a, r, p, v):
            if seen[dep] >= t:
                raise ScheduleError(f"{a} on rank {r} at tick {t} runs before its dependency {dep[1]} on rank "
                                    f"{dep[0]} (tick {seen[dep]})")
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
