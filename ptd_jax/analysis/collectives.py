"""Count the collectives of a traced or compiled step, with loop trip counts: the check that every collective
is one the paper names, and the measured side of the communication report.

- `jaxpr_collectives(closed_jaxpr)`: dynamic counts per (primitive, mesh axes) from a jaxpr, multiplying the
  bodies of `scan`s by their length (each tick/microbatch/layer counted). Elements are the operand sizes.
- `hlo_collectives(hlo_text)`: the same from compiled HLO text (after XLA's own rewrites and combining), bytes
  from result shapes, `while` bodies multiplied by their `known_trip_count`.

A loop whose trip count is known only at run time counts once, in both: under "per-rank" branching the pipeline
executor runs each kind's layers in such a loop (k trips where the cell runs that kind), so the collectives inside
a layer count once per tick there, not once per layer.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

from ptd_jax.analysis.jaxpr import tally

COLLECTIVE_PRIMITIVES = {
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "all_gather",
    "all_gather_invariant",
    "reduce_scatter",
    "psum_scatter",
    "ppermute",
    "all_to_all",
}


def _axes(params) -> tuple[str, ...]:
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def jaxpr_collectives(jaxpr) -> dict:
    """{(primitive, axes): {"count": n, "elements": e}} over the whole program, loops unrolled by count.

    `cond` branches are counted once (the one with most collectives): exactly one runs per execution."""

    def count(eqn):
        if eqn.primitive.name not in COLLECTIVE_PRIMITIVES:
            return None
        key = (eqn.primitive.name, _axes(eqn.params))
        return Counter({(key, "count"): 1, (key, "elements"): sum(math.prod(v.aval.shape) for v in eqn.invars)})

    tallied = tally(jaxpr, count, size=lambda c: sum(v for (_, what), v in c.items() if what == "count"))
    counts: dict = {}
    for (key, what), value in tallied.items():
        counts.setdefault(key, {"count": 0, "elements": 0})[what] = value
    return counts


def summarize(counts) -> dict:
    """JSON-friendly {"psum_invariant@tensor": {...}, ...}."""
    return {f"{name}@{','.join(axes)}": dict(entry) for (name, axes), entry in sorted(counts.items())}


# ---------------------------------------------------------------------------------------------------------------
# Compiled HLO
# ---------------------------------------------------------------------------------------------------------------

_HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "s16": 2,
    "u16": 2,
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s32|u32|s64|u64|s8|u8|pred|s16|u16)\[([\d,]*)\]")


def _tuple_elements(text: str) -> list[str]:
    """The top-level elements of an HLO tuple shape "(a, (b, c), d)"; [text] for a non-tuple."""
    if not text.startswith("("):
        return [text]
    elements, depth, begin = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            elements.append(text[begin:i].strip())
            begin = i + 1
    return elements


def _shape_bytes(text: str, op: str = "", started: bool = False) -> int:
    """Bytes of an op's result. An asynchronous all-gather's, collective-permute's or reduce-scatter's `-start`
    result is a tuple (operands, results, contexts...): its bytes are the results' (the second element, itself a
    tuple when the op was combined); an all-reduce-start's result is its results; a synchronous op's counts whole."""
    if started and op != "all-reduce" and text.startswith("("):
        elements = _tuple_elements(text)
        text = elements[1] if len(elements) >= 2 else text
    return sum(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(text))


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines}, and the ENTRY computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line.strip()) if line and not line.startswith(" ") else None
        if match:
            current = match.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.startswith("  "):
            computations[current].append(line.strip())
    return computations, entry


def _calls(line: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(callees run every time the instruction runs, with their trip counts; a conditional's branches)."""
    trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
    always = []
    for key in ("body", "condition", "to_apply", "calls"):
        for callee in re.findall(rf"\b{key}=%([\w.\-]+)", line):
            always.append((callee, int(trip.group(1)) if (trip and key == "body") else 1))
    branches = re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", line)
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    branches += re.findall(r"%([\w.\-]+)", listed.group(1) if listed else "")
    return always, branches


_OP = re.compile(r"= (.*?) (" + "|".join(_HLO_COLLECTIVES) + r")(-start)?\(")


def hlo_collectives(hlo_text: str) -> dict:
    """{op: {"count", "bytes", "replica_groups", "ops": [{shape, bytes, times, replica_groups, source_target_pairs}]}}
    per execution of the ENTRY computation: loop bodies times their known trip count (once without one: module
    docstring), of each conditional the branch with the most collectives (exactly one runs; as `jaxpr_collectives`
    counts)."""
    computations, entry = _computations(hlo_text)
    own = {name: sum(1 for line in lines if _OP.search(line)) for name, lines in computations.items()}
    weight: dict[str, int] = {}

    def total(name: str) -> int:  # collectives one run of `name` issues, nested calls included
        if name not in weight:
            weight[name] = own.get(name, 0)  # (a cycle cannot happen: HLO calls form a DAG)
            for line in computations.get(name, ()):
                always, branches = _calls(line)
                weight[name] += sum(total(c) * k for c, k in always)
                weight[name] += max((total(b) for b in branches), default=0)
        return weight[name]

    multiplicity: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        multiplicity[name] += times
        for line in computations.get(name, ()):
            always, branches = _calls(line)
            for callee, k in always:
                visit(callee, times * k)
            if branches:
                visit(max(branches, key=total), times)

    visit(entry, 1)
    result: dict[str, dict] = {}
    for name, lines in computations.items():
        times = multiplicity.get(name, 0)
        for line in lines:
            op = _OP.search(line)
            if not op or times == 0:
                continue
            entry_ = result.setdefault(op.group(2), {"count": 0, "bytes": 0, "replica_groups": set(), "ops": []})
            nbytes = _shape_bytes(op.group(1), op.group(2), started=bool(op.group(3)))
            entry_["count"] += times
            entry_["bytes"] += times * nbytes
            groups = re.search(r"replica_groups=(\{[^ ]*\}|\[[^ ]*\][^ ,]*)", line)
            group = groups.group(1) if groups else ""
            entry_["replica_groups"].add(group)
            pairs = re.search(r"source_target_pairs=(\{[^ ]*\})", line)
            entry_["ops"].append(
                {
                    "shape": op.group(1),
                    "bytes": nbytes,
                    "times": times,
                    "replica_groups": group,
                    "source_target_pairs": pairs.group(1) if pairs else "",
                }
            )
    return result
