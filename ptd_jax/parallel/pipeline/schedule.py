"""Pipeline schedules as data (paper §2.2): actions and each rank's order of them. Pure Python, no JAX.

An `Action` is `F<chunk>.<microbatch>` (forward), `B<chunk>.<microbatch>` (backward) or, for zero-bubble
schedules later, `W<chunk>.<microbatch>` (weight gradient). Chunk c on rank r is virtual stage c·p + r.

Builders return each rank's order of actions:
- GPipe: all forwards, then all backwards.
- 1F1B (PipeDream-flush): a warm-up of forwards, then alternate one forward / one backward, then cool-down.
  Megatron's warm-up on stage s is p−1−s; in lockstep (`lockstep.py`) that leaves neighbouring stages wanting
  opposite kinds, so the default here is the lockstep warm-up 2(p−1−s), which reaches the asynchronous makespan
  at a stash of 2(p−1−s)+1 (docs/architecture.md, "Pipeline").
- Interleaved 1F1B: megatron-core's order — microbatches in groups of G (default p) swept over the v chunks;
  warm-up 2(p−r−1) + (v−1)·G forwards on rank r.

`lockstep.py` places these orders on global ticks; the executor reads the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptd_jax.config import PIPELINE_SCHEDULES, ConfigError, check_pipeline_request

SCHEDULES = PIPELINE_SCHEDULES


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


def build_orders(name: str, p: int, v: int, m: int, group: int | None = None) -> list[list[Action]]:
    check_request(name, p, v, m, group)
    if name == "gpipe":
        return gpipe_orders(p, m)
    if name == "1f1b":
        return one_f_one_b_orders(p, m)
    return interleaved_orders(p, v, m, group)
