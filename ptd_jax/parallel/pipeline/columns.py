"""The lockstep table (`lockstep.Schedule`) as the executor's columns, computed before tracing (numpy only).

- `schedule_arrays`: each cell's chunk, microbatch and slots as int32 arrays [T, p];
- `tick_work`: where the embedding and the head run ([T, p] per cell, or [T] per tick: the branching's choice);
- `tick_runs`: the ticks cut into runs of a static pattern, one `lax.scan` each.
"""

from __future__ import annotations

import numpy as np

from ptd_jax.parallel.pipeline.branching import strategy
from ptd_jax.parallel.pipeline.lockstep import Schedule


def schedule_arrays(sched: Schedule) -> dict[str, np.ndarray]:
    """Table rows as int32 arrays per rank [T, p]: active, chunk, microbatch, in_slot, grad_slot, recv_slot (each
    tick's kind is static: `tick_runs`). Missing slots point at the trash slot (index num_slots)."""
    T, p = sched.ticks, sched.p
    trash_act, trash_grad = sched.num_act_slots, sched.num_grad_slots
    out = {name: np.zeros((T, p), np.int32) for name in
           ("active", "chunk", "microbatch", "in_slot", "grad_slot", "recv_slot")}
    for t, row in enumerate(sched.cells):
        is_f = sched.kinds[t] == "F"
        for r, cell in enumerate(row):
            a = cell.action
            out["active"][t, r] = a is not None
            out["chunk"][t, r] = a.chunk if a else 0
            out["microbatch"][t, r] = a.microbatch if a else 0
            out["in_slot"][t, r] = cell.in_slot if cell.in_slot >= 0 else trash_act
            out["grad_slot"][t, r] = cell.grad_slot if cell.grad_slot >= 0 else trash_grad
            trash = trash_act if is_f else trash_grad
            out["recv_slot"][t, r] = cell.recv_slot if cell.recv_slot >= 0 else trash
    return out


def tick_runs(kinds) -> list[tuple[str, int, int]]:
    """The table's ticks as runs that one `lax.scan` each executes, with the kind of every tick static:
    (pattern, first tick, repeats), the pattern "F" or "B" (a run of one kind) or "FB" (an alternation, as pairs).
    GPipe is two runs; 1F1B and interleaving four: the warm-up forwards, the steady state's first backward, its
    F/B pairs, the cool-down backwards. Pairs start with the F: then the B reads the stash after the F has written
    it in place. With the B first, the two ticks are independent, so the F's in-place writes are not ordered after
    the B's reads, and XLA keeps a second copy of the whole stash (about twice the step's temporary memory)."""
    kinds = "".join(kinds)
    runs, i, T = [], 0, len(kinds)
    while i < T:
        j = i
        while j < T and kinds[j] == kinds[i]:
            j += 1
        if j - i == 1 and j < T and kinds[i] == "F":  # an alternation starts here
            pattern, n = "FB", 0
            while kinds[i + 2 * n:i + 2 * n + 2] == pattern:
                n += 1
            runs.append((pattern, i, n))
            i += 2 * n
        else:
            runs.append((kinds[i], i, j - i))
            i = j
    return runs


def tick_work(sched: Schedule, branching: str) -> dict[str, np.ndarray]:
    """Where the embedding and the head (output layer and loss) run: {"embed", "head"} as bool arrays, [T, p] per
    cell ("per-rank": the rank of virtual stage 0 embeds, in its F and B; the last virtual stage's rank runs the
    head in its B, or in its F in a table of forwards only, evaluation's) or [T] per tick ("uniform": every rank
    runs them, masked, on the ticks where some rank needs them)."""
    chosen = strategy(branching)
    T, p, last = sched.ticks, sched.p, sched.p * sched.v - 1
    head_kind = "B" if "B" in sched.kinds else "F"
    embed, head = np.zeros((T, p), bool), np.zeros((T, p), bool)
    for t, (kind, row) in enumerate(zip(sched.kinds, sched.cells)):
        for r, cell in enumerate(row):
            if cell.action is not None:
                stage = sched.stage(cell.action, r)
                embed[t, r] = stage == 0
                head[t, r] = stage == last and kind == head_kind
    return chosen.columns(embed, head)


def residual_slots(sched: Schedule, idle_cells_run: bool) -> int:
    """Slots of the residual stash: the table's, and a trash slot only where an idle cell writes its residuals
    there (uniform branching with idle cells; per-rank idle cells run nothing, and p = 1 has none)."""
    idle = any(cell.action is None for row in sched.cells for cell in row)
    return sched.num_act_slots + (1 if idle and idle_cells_run else 0)
