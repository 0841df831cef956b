"""The one walker over traced programs: every other count (collectives, matmul FLOPs, named calls) is a function of
one equation handed to it.

- `sub_jaxprs(eqn)`: the jaxprs nested in one equation (scan and cond bodies, calls, custom rules).
- `equations(jaxpr)`: every equation, nested ones included, in program order (static: each body once).
- `tally(jaxpr, count)`: what runs, as a Counter: `count(eqn)` for each equation, a `scan` body times its length and
  a `cond` as its largest branch (exactly one runs); `count` returns None to descend into an equation instead.
- `named_calls(jaxpr, name)`: the bodies of the calls named `name` (`jax.jit` of a named function).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator


def _as_jaxpr(value):
    """The open jaxpr of a ClosedJaxpr or a Jaxpr, else None."""
    if hasattr(value, "eqns"):
        return value
    inner = getattr(value, "jaxpr", None)
    return inner if hasattr(inner, "eqns") else None


def sub_jaxprs(eqn) -> Iterator:
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            inner = _as_jaxpr(item)
            if inner is not None:
                yield inner


def equations(jaxpr, skip: Callable | None = None) -> Iterator:
    """Every equation of `jaxpr` and of the jaxprs nested in it; `skip(eqn)` true: that equation's insides are not
    entered (the equation itself is still yielded)."""
    for eqn in _as_jaxpr(jaxpr).eqns:
        yield eqn
        if skip is None or not skip(eqn):
            for inner in sub_jaxprs(eqn):
                yield from equations(inner, skip)


def tally(jaxpr, count: Callable, size: Callable = lambda c: sum(c.values())) -> Counter:
    """Sum of `count(eqn)` (a Counter, or None to descend) over the program as it runs: scan bodies times their
    trip count, of each `cond` the branch that `size` finds largest. A `while` body counts once: its trip count is
    known only at run time (the pipeline executor's per-rank layer loops: count their bodies, then multiply by the
    layers per chunk)."""
    total: Counter = Counter()
    for eqn in _as_jaxpr(jaxpr).eqns:
        own = count(eqn)
        if own is not None:
            total.update(own)
        elif eqn.primitive.name == "cond":
            total.update(max((tally(b, count, size) for b in eqn.params["branches"]), key=size))
        else:
            times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for inner in sub_jaxprs(eqn):
                total.update({k: v * times for k, v in tally(inner, count, size).items()})
    return total


def is_call(eqn, name: str) -> bool:
    return eqn.primitive.name == "jit" and eqn.params.get("name") == name


def named_calls(jaxpr, name: str) -> Iterator:
    """The bodies of the calls named `name`, outermost first."""
    for eqn in equations(jaxpr):
        if is_call(eqn, name):
            yield eqn.params["jaxpr"].jaxpr


def dot_flops(jaxpr) -> float:
    """Matmul FLOPs as the program runs (`tally`). Loops without a static trip count (`while`) and Pallas kernels
    (counted per block) are refused."""

    def count(eqn):
        name = eqn.primitive.name
        if name in ("while", "pallas_call"):
            raise ValueError(f"cannot count the matmul FLOPs of a {name!r} (no static trip count / per-block kernel)")
        if name != "dot_general":
            return None
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return Counter(flops=2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract))

    return float(tally(jaxpr, count)["flops"])
