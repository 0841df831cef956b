"""Pipeline schedules as data (paper §2.2): per-rank action orders, a lockstep timing pass, a validator and a
simulator. Pure Python — no JAX — so schedules can be built, checked and drawn anywhere.

An `Action` is `F<chunk>.<microbatch>` (forward), `B<chunk>.<microbatch>` (backward) or, for zero-bubble
schedules later, `W<chunk>.<microbatch>` (weight gradient). Chunk c on rank r is virtual stage c·p + r.

Builders return each rank's order of actions:
- GPipe: all forwards, then all backwards.
- 1F1B (PipeDream-flush): a warm-up of forwards, then alternate one forward / one backward, then cool-down.
  Megatron's warm-up on stage s is p−1−s; in lockstep (below) that leaves neighbouring stages wanting opposite
  kinds, so the default here is the lockstep warm-up 2(p−1−s), which reaches the asynchronous makespan at a
  stash of 2(p−1−s)+1 (DESIGN.md §2).
- Interleaved 1F1B: megatron-core's order — microbatches in groups of G (default p) swept over the v chunks;
  warm-up 2(p−r−1) + (v−1)·G forwards on rank r.

`lockstep` places every rank's order on global ticks where all ranks run the same kind (all F or all B), which is
what lets one SPMD program issue identical collectives on every device (the executor's `lax.cond` predicate comes
from the table). `Schedule` holds the result: per tick, the kind and each rank's action (or None), plus stash-slot
assignments for the executor, a simulated makespan and bubble, and peak stash per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved")


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
    def parse(cls, text: str) -> "Action":
        kind, rest = text[0], text[1:]
        chunk, microbatch = rest.split(".")
        if kind not in "FBW":
            raise ScheduleError(f"action {text!r} has kind {kind!r}, expected F, B or W")
        return cls(kind, int(chunk), int(microbatch))


def F(chunk: int, mb: int) -> Action:  # noqa: N802 - reads like the paper's notation
    return Action("F", chunk, mb)


def B(chunk: int, mb: int) -> Action:  # noqa: N802
    return Action("B", chunk, mb)


# ---------------------------------------------------------------------------------------------------------------
# Per-rank orders
# ---------------------------------------------------------------------------------------------------------------

def check_request(schedule: str, p: int, v: int, m: int, group: int | None = None) -> int:
    """Validate (schedule, p, v, m, G); returns the effective group size G. One-line errors name the rule."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if p < 1 or v < 1 or m < 1:
        raise ScheduleError(f"p={p}, v={v} and m={m} must be positive")
    if schedule != "interleaved":
        if v != 1:
            raise ScheduleError(f"schedule={schedule!r} has no model chunks: v={v} needs schedule='interleaved'")
        return 1
    if p < 2:
        raise ScheduleError(f"interleaving needs p >= 2 pipeline ranks, got p={p}")
    g = p if group is None else group
    if not p <= g <= m:
        raise ScheduleError(f"interleaved schedule needs p <= G <= m (Megatron's rule), got p={p}, G={g}, m={m}")
    if m % g and m % g < p:
        raise ScheduleError(f"interleaved schedule needs m % G == 0 or m % G >= p (Megatron's rule), got m={m}, "
                            f"G={g}, m % G={m % g}, p={p}")
    return g


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


def build_orders(schedule: str, p: int, v: int, m: int, group: int | None = None) -> list[list[Action]]:
    check_request(schedule, p, v, m, group)
    if schedule == "gpipe":
        return gpipe_orders(p, m)
    if schedule == "1f1b":
        return one_f_one_b_orders(p, m)
    return interleaved_orders(p, v, m, group)


# ---------------------------------------------------------------------------------------------------------------
# Lockstep timing, slots, validation, simulation
# ---------------------------------------------------------------------------------------------------------------

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
    peak_stash: list[int] = field(default_factory=list)     # per rank: most chunk inputs held at once

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


def plot(sched: Schedule, path: str, backward_ratio: float = 2.0) -> None:
    """PNG timeline in the style of the paper's Figure 4: ranks as rows, microbatches coloured, forwards light
    with the number, backwards dark; chunks told apart by hatching."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if sched.m <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(min(4 + sched.ticks * 0.25, 40), 0.6 * sched.p + 1.2))
    x = 0.0
    tf = 1.0 / sched.v
    for kind, row in zip(sched.kinds, sched.cells):
        width = tf if kind == "F" else backward_ratio * tf
        for r, cell in enumerate(row):
            if cell.action is None:
                continue
            color = cmap(cell.action.microbatch % cmap.N)
            ax.barh(r, width, left=x, color=color, alpha=0.45 if kind == "F" else 1.0, edgecolor="black",
                    linewidth=0.4, hatch="//" if cell.action.chunk % 2 else None)
            ax.text(x + width / 2, r, str(cell.action.microbatch), ha="center", va="center", fontsize=6)
        x += width
    ax.set_yticks(range(sched.p), [f"rank {r}" for r in range(sched.p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (one stage forward = 1)")
    sim = sched.simulate(backward_ratio)
    ax.set_title(f"{sched.name}: p={sched.p} v={sched.v} m={sched.m} — bubble {sim['bubble_fraction']:.3f} "
                 f"(formula {sched.formula_bubble():.3f}); light = forward, dark = backward, hatched = odd chunk",
                 fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)

