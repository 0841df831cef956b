"""Unit ticks: the orders of a split schedule (F, B and W actions, each about one unit long) placed on global ticks
where every rank runs its own next action, whatever its kind. Pure Python, no JAX.

With every cell one unit long a tick lasts one unit on every rank, so the table follows the asynchronous timeline
exactly: an action runs at the first tick after its dependencies (`schedule.dependencies`) finished. What a tick
sends travels with the output's direction (`Cell.send`: +1 to rank + 1, −1 to rank − 1, 0 to the rank itself at
ZB-V's turn), and what arrives is written to the slot named in the receiver's `Cell.recv`. The executor
(`unit_executor.py`) runs each rank's kind under per-rank conditionals, both ring directions outside them.

Slots, per rank: activations (a chunk's input, from its F, or its arrival, to its B; on the last stage the chunk's
output too), gradients (from arrival to the B that reads it), and the W stash (from a B to its W).
"""

from __future__ import annotations

from ptd_jax.parallel.pipeline.lockstep import Cell, Schedule, _SlotPool, check_actions
from ptd_jax.parallel.pipeline.schedule import (Action, F, ScheduleError, build_orders, check_request, dependencies,
                                                place_of, stage_of)


def _direction(name: str, p: int, rank: int, to_rank: int, to_stage: int, from_stage: int) -> int:
    """+1, −1 or 0: the ring direction from `rank` to `to_rank` that the stage order implies (at p = 2 both
    directions reach the other rank: the V's chunk 1 and the backwards use −1, the rest +1)."""
    if to_rank == rank:
        return 0
    if name == "zb-v":
        going_down = to_stage > from_stage
        chunk0 = min(to_stage, from_stage) < p
        return 1 if going_down == chunk0 else -1
    return 1 if to_stage > from_stage else -1


class _UnitPlacement:
    """Slots of the actions placed so far and what each rank holds."""

    def __init__(self, name: str, p: int, v: int, forward_only: bool):
        self.name, self.p, self.v, self.forward_only = name, p, v, forward_only
        self.act, self.grad, self.w = _SlotPool(p), _SlotPool(p), _SlotPool(p)
        self.act_slot: dict[tuple[int, Action], int] = {}
        self.grad_slot: dict[tuple[int, Action], int] = {}
        self.w_slot: dict[tuple[int, Action], int] = {}
        self.held, self.peak = [0] * p, [0] * p
        self.waiting, self.peak_w = [0] * p, [0] * p
        self.sent: list[tuple[int, int, str, int]] = []  # this tick's (to rank, direction, buffer, slot)

    def _send(self, r: int, a: Action, cell: Cell, to_stage: int, kind: str, pool: _SlotPool, slots: dict) -> None:
        to_rank, to_chunk = place_of(self.name, self.p, to_stage)
        slot = pool.alloc(to_rank)
        slots[(to_rank, Action(kind, to_chunk, a.microbatch))] = slot
        cell.send = _direction(self.name, self.p, r, to_rank, to_stage, self.stage(a, r))
        self.sent.append((to_rank, cell.send, "act" if kind == "F" else "grad", slot))

    def deliver(self, row: list[Cell]) -> None:
        """Each receiver's `recv`: what arrives at the end of the tick, by the direction it comes from."""
        for to_rank, direction, buffer, slot in self.sent:
            row[to_rank].recv[direction] = (buffer, slot)
        self.sent = []

    def stage(self, a: Action, r: int) -> int:
        return stage_of(self.name, self.p, a.chunk, r)

    def forward(self, r: int, a: Action, cell: Cell) -> None:
        stage = self.stage(a, r)
        if stage == 0:
            self.act_slot[(r, a)] = -1 if self.forward_only else self.act.alloc(r)
        cell.in_slot = self.act_slot.pop((r, a)) if self.forward_only else self.act_slot[(r, a)]
        self.held[r] += 1
        self.peak[r] = max(self.peak[r], self.held[r])
        if stage < self.p * self.v - 1:
            self._send(r, a, cell, stage + 1, "F", self.act, self.act_slot)

    def backward(self, r: int, a: Action, cell: Cell) -> None:
        stage = self.stage(a, r)
        cell.in_slot = self.act_slot.pop((r, F(a.chunk, a.microbatch)))
        if stage < self.p * self.v - 1:
            cell.grad_slot = self.grad_slot.pop((r, a))
        cell.w_slot = self.w.alloc(r)
        self.w_slot[(r, a)] = cell.w_slot
        self.waiting[r] += 1
        self.peak_w[r] = max(self.peak_w[r], self.waiting[r])
        if stage > 0:
            self._send(r, a, cell, stage - 1, "B", self.grad, self.grad_slot)

    def weight(self, r: int, a: Action, cell: Cell) -> None:
        cell.w_slot = self.w_slot.pop((r, Action("B", a.chunk, a.microbatch)))

    def release(self, row: list[Cell]) -> None:
        """Free what this tick read (reads come before writes within a tick; freed slots are reused from the next
        tick on)."""
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            if a.kind == "B" or (a.kind == "F" and self.forward_only):
                if cell.in_slot >= 0:
                    self.act.release(r, cell.in_slot)
                self.held[r] -= 1
                if cell.grad_slot >= 0:
                    self.grad.release(r, cell.grad_slot)
            if a.kind == "W":
                self.w.release(r, cell.w_slot)
                self.waiting[r] -= 1


def unit_ticks(name: str, orders: list[list[Action]], p: int, v: int, m: int, forward_only: bool = False
               ) -> Schedule:
    """Place the orders on unit ticks: each rank runs its next action at the first tick after its dependencies."""
    sched = Schedule(name, p, v, m, 1, orders, forward_only=forward_only)
    place = _UnitPlacement(name, p, v, forward_only)
    done: dict[tuple[int, Action], int] = {}
    pos, total = [0] * p, sum(len(o) for o in orders)
    while len(done) < total:
        tick, row = sched.ticks, [Cell() for _ in range(p)]
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            deps = dependencies(name, a, r, p, v)
            if all(done.get(d, tick) < tick for d in deps):
                row[r].action = a
                {"F": place.forward, "B": place.backward, "W": place.weight}[a.kind](r, a, row[r])
        if all(c.action is None for c in row):
            raise ScheduleError(f"schedule {name!r} deadlocks at tick {tick}: no rank can proceed")
        for r, cell in enumerate(row):
            if cell.action is not None:
                done[(r, cell.action)] = tick
                pos[r] += 1
        place.deliver(row)
        place.release(row)
        sched.kinds.append("X")
        sched.cells.append(row)
    sched.num_act_slots, sched.num_grad_slots, sched.num_w_slots = place.act.size, place.grad.size, place.w.size
    sched.peak_stash, sched.peak_w_stash = place.peak, place.peak_w
    return sched


def build_unit(name: str, p: int, v: int, m: int) -> Schedule:
    check_request(name, p, v, m)
    return unit_ticks(name, build_orders(name, p, v, m), p, v, m)


def build_unit_forward_only(name: str, p: int, v: int, m: int) -> Schedule:
    """The forwards of a split schedule alone (evaluation), on unit ticks in the schedule's stage order."""
    check_request(name, p, v, m)
    orders = [[a for a in order if a.kind == "F"] for order in build_orders(name, p, v, m)]
    return unit_ticks(name, orders, p, v, m, forward_only=True)


def validate_unit(sched: Schedule) -> None:
    """Every F, B and W (F alone in a table of forwards only) exactly once per (virtual stage, microbatch); every
    dependency at an earlier tick; every slot read holding what the reader needs."""
    seen = {(r, c.action): t for t, row in enumerate(sched.cells) for r, c in enumerate(row) if c.action}
    check_actions(sched, seen, "F" if sched.forward_only else "FBW")
    _replay_slots(sched)


def _replay_slots(sched: Schedule) -> None:
    p, last = sched.p, sched.p * sched.v - 1
    held = {"act": [{} for _ in range(p)], "grad": [{} for _ in range(p)], "w": [{} for _ in range(p)]}
    for t, row in enumerate(sched.cells):
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            key, stage = (a.chunk, a.microbatch), sched.stage(a, r)

            def check(buffer, slot, what, a=a, r=r, key=key, t=t):
                if held[buffer][r].get(slot) != key:
                    raise ScheduleError(f"{a} on rank {r} at tick {t} reads {buffer} slot {slot} ({what}) holding "
                                        f"{held[buffer][r].get(slot)}")
            if a.kind == "F" and stage > 0:
                check("act", cell.in_slot, "its input")
                if sched.forward_only:
                    held["act"][r].pop(cell.in_slot)
            if a.kind == "F" and stage == 0 and cell.in_slot >= 0:
                held["act"][r][cell.in_slot] = key
            if a.kind == "B":  # a slot is free once read: a second read finds it empty
                check("act", cell.in_slot, "its stash")
                held["act"][r].pop(cell.in_slot)
                if stage < last:
                    check("grad", cell.grad_slot, "its output gradient")
                    held["grad"][r].pop(cell.grad_slot)
            if a.kind == "W":
                check("w", cell.w_slot, "its B's stash")
                held["w"][r].pop(cell.w_slot)
        for r, cell in enumerate(row):
            if cell.action is not None and cell.action.kind == "B":
                held["w"][r][cell.w_slot] = (cell.action.chunk, cell.action.microbatch)
            for direction, (buffer, slot) in cell.recv.items():
                src = (r - direction) % p
                sa = row[src].action
                if sa is None or sa.kind == "W":
                    raise ScheduleError(f"tick {t}: rank {r} expects a tensor from rank {src}, which sends none")
                stage = sched.stage(sa, src) + (1 if sa.kind == "F" else -1)
                rank, chunk = place_of(sched.name, p, stage)
                if rank != r:
                    raise ScheduleError(f"tick {t}: {sa} on rank {src} sends to rank {r}, but its stage {stage} "
                                        f"is on rank {rank}")
                held[buffer][r][slot] = (chunk, sa.microbatch)
