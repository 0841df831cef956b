"""A table (`table.Table`) as the executor's integer columns, and its ticks as runs of a static pattern. numpy only.

- `columns`: each cell's kind, chunk, microbatch, slots and arrivals as int32 arrays [T, p]. A missing slot is the
  pool's size: out of bounds, so the executor's scatters (mode="drop") write nothing there;
- `tick_runs`: the ticks cut into runs that one `lax.scan` each executes, each tick's pattern static: the kinds its
  cells run and the ring directions its sends take. A tick then traces only the work and the sends that some rank
  needs (an F tick of GPipe has no backward in it and one ring direction).
"""

from __future__ import annotations

import numpy as np

from ptd_jax.parallel.pipeline.table import Table

KIND_CODES = {None: 0, "F": 1, "B": 2, "I": 3, "W": 4}
SIDES = {1: "left", -1: "right", 0: "self"}  # +1 arrives from rank − 1 (the left), −1 from rank + 1, 0 from itself
SLOT_POOLS = {
    "in_slot": "act",
    "out_slot": "act",
    "grad_slot": "grad",
    "rec_slot": "rec",
    "hold_slot": "hold",
    "w_slot": "w",
}
MAX_RUNS = 8
"""More runs than this (unit tables whose ticks change pattern often) become one run of the union pattern: each
run is one scan body to compile."""


def columns(table: Table) -> dict[str, np.ndarray]:
    """Per tick and rank: kind (`KIND_CODES`), chunk, microbatch, each slot (`SLOT_POOLS`), `embed` (virtual stage
    0's F, or its B/I: the embedding's transpose), `head` (the last stage's F: the output layer and loss, forward
    and, in training, backward), and per side `recv_<pool>_<side>`: the slot an arriving activation or gradient goes
    to."""
    T, p, last = table.ticks, table.p, table.p * table.v - 1
    size = {pool: max(n, 1) for pool, n in table.slots.items()}
    names = ["kind", "chunk", "microbatch", "embed", "head", *SLOT_POOLS] + [
        f"recv_{pool}_{side}" for side in SIDES.values() for pool in ("act", "grad")
    ]
    out = {n: np.zeros((T, p), np.int32) for n in names}
    for t, row in enumerate(table.cells):
        for r, cell in enumerate(row):
            a = cell.action
            stage = table.stage(a, r) if a else -1
            out["kind"][t, r] = KIND_CODES[a.kind if a else None]
            out["chunk"][t, r], out["microbatch"][t, r] = (a.chunk, a.microbatch) if a else (0, 0)
            out["embed"][t, r] = a is not None and a.kind != "W" and stage == 0
            out["head"][t, r] = a is not None and a.kind == "F" and stage == last
            for name, pool in SLOT_POOLS.items():
                slot = getattr(cell, name)
                out[name][t, r] = slot if slot >= 0 else size[pool]
            for d, side in SIDES.items():
                got = cell.recv.get(d)
                for pool in ("act", "grad"):
                    out[f"recv_{pool}_{side}"][t, r] = got[1] if got and got[0] == pool else size[pool]
    return out


def patterns(table: Table) -> list[tuple[str, tuple[int, ...]]]:
    """Per tick: (the kinds its cells run, the ring directions those kinds send in anywhere in the table: +1, −1;
    0, the V's turn, needs no ring). Directions by kind, not by tick, so that a tick whose only F is the last
    stage's (which sends nothing) does not cut a run."""
    sends: dict[str, set] = {}
    for row in table.cells:
        for c in row:
            if c.send is not None:
                sends.setdefault(c.action.kind, set()).add(c.send)
    return [(kinds, tuple(sorted(set().union(*(sends.get(k, set()) for k in kinds))))) for kinds in table.kinds]


def union(pats) -> tuple[str, tuple[int, ...]]:
    kinds = "".join(k for k in "FBIW" if any(k in p[0] for p in pats))
    return kinds, tuple(sorted({d for p in pats for d in p[1]}))


def tick_runs(table: Table) -> list[tuple[tuple, int, int]]:
    """(pattern, first tick, repeats): the pattern a tuple of one tick's pattern (a run of one) or of two (an
    alternation, as pairs). GPipe is two runs; 1F1B-style lockstep tables four: the warm-up forwards, the steady
    state's first backward, its F/B pairs, the cool-down backwards. Pairs start with the F: then the B reads the
    stash after the F has written it in place (with the B first the two are independent, and XLA kept a second copy
    of the whole stash). Beyond `MAX_RUNS` runs, one run of the union of every tick's pattern."""
    pats = patterns(table)
    runs, i, T = [], 0, len(pats)
    while i < T:
        j = i
        while j < T and pats[j] == pats[i]:
            j += 1
        if j - i == 1 and j < T and "F" in pats[i][0] and "F" not in pats[j][0]:  # an alternation starts here
            pair, n = (pats[i], pats[j]), 0
            while tuple(pats[i + 2 * n : i + 2 * n + 2]) == pair:
                n += 1
            runs.append((pair, i, n))
            i += 2 * n
        else:
            runs.append(((pats[i],), i, j - i))
            i = j
    if len(runs) > MAX_RUNS:
        return [((union(pats),), 0, T)]
    return runs
