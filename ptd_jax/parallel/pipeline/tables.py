"""A schedule request -> its table: fused schedules on lockstep ticks of one kind (`lockstep.py`), split ones on
unit ticks (`unit.py`). Pure Python, no JAX."""

from __future__ import annotations

from ptd_jax.parallel.pipeline import lockstep, unit
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline.schedule import SPLIT_SCHEDULES


def build(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    """The validated request's table: "gpipe", "1f1b", "interleaved" on lockstep ticks, "1f1b-split", "zb-h1",
    "zb-v" on unit ticks."""
    if name in SPLIT_SCHEDULES:
        return unit.build_unit(name, p, v, m)
    return lockstep.build(name, p, v, m, group)


def build_forward_only(name: str, p: int, v: int = 1, m: int = 1, group: int | None = None) -> Schedule:
    """The forwards alone (evaluation): for 1F1B-split and ZB-H1 1F1B's forwards on lockstep ticks (one chunk per
    rank, the stages in order: the same table); for ZB-V its V on unit ticks."""
    if name == "zb-v":
        return unit.build_unit_forward_only(name, p, v, m)
    return lockstep.build_forward_only("1f1b" if name in SPLIT_SCHEDULES else name, p, v, m, group)


def validate(sched: Schedule) -> None:
    (unit.validate_unit if sched.split else lockstep.validate)(sched)
