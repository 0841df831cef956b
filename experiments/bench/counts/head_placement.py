"""Where the last stage's head (output layer and loss, forward and backward) should run: in its F or in its B/I.

On a GPU each rank runs its cell and the ring's `ppermute` ends the tick, so a tick lasts its longest cell. A unit
row mixes F, I and W cells, and the head makes the last stage's cell the longest: this script charges it to the
F (what the executor does) or to the B/I (what it did before), and sums each tick's longest cell over the table.
Pure Python, no JAX: the tables are `pipeline.table.build`'s, the costs model FLOPs.

Cell costs in units of one stage's forward FLOPs: F = 1, I = 1 + a, W = 1 − a (a: attention's share of the layer's
forward, which only the input gradient carries: 4sh / (24h + 4s)), B = I + W, a chunk's 1/v of these; the head's
forward and backward 3 · 2hV / ((L/p) · (24h² + 4sh)).

Usage: python -m experiments.bench.counts.head_placement [--out experiments/results/head_placement.json]
"""

from __future__ import annotations

import argparse

from experiments.common import RESULTS, write_json

SHAPES = {  # name: (layers, hidden, vocabulary, sequence)
    "bench model (fake CPU devices: 16 layers, h 256, V 6400, s 256)": (16, 256, 6400, 256),
    "GPT 1.3B (24 layers, h 2048, V 50304, s 2048)": (24, 2048, 50304, 2048),
    "Llama-3-8B-like (32 layers, h 4096, V 128256, s 8192)": (32, 4096, 128256, 8192),
}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]


def tick_makespan(table, head: float, attention: float, head_kinds: str) -> float:
    """Σ over ticks of the longest cell, the head charged to the last stage's cells of `head_kinds`."""
    cost = {"F": 1.0, "I": 1.0 + attention, "W": 1.0 - attention, "B": 2.0}
    last, total = table.p * table.v - 1, 0.0
    for row in table.cells:
        longest = 0.0
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            c = cost[a.kind] / table.v
            if a.kind in head_kinds and table.stage(a, r) == last:
                c += head
            longest = max(longest, c)
        total += longest
    return total


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "head_placement.json"))
    args = parser.parse_args(argv)
    from ptd_jax.parallel.pipeline.table import build

    rows = []
    for shape, (layers, h, vocab, s) in SHAPES.items():
        stage_forward = layers / args.p * (24 * h * h + 4 * s * h)
        head = 3 * 2 * h * vocab / stage_forward
        attention = 4 * s * h / (24 * h * h + 4 * s * h)
        for name, v in SCHEDULES:
            table = build(name, args.p, v, args.m)
            in_backward = tick_makespan(table, head, attention, "BI")
            in_forward = tick_makespan(table, head, attention, "F")
            rows.append(
                {
                    "shape": shape,
                    "schedule": name,
                    "head_over_stage_forward": round(head, 3),
                    "makespan_head_in_backward": round(in_backward, 3),
                    "makespan_head_in_forward": round(in_forward, 3),
                    "forward_over_backward": round(in_forward / in_backward, 4),
                }
            )
            print(f"{shape[:28]:28s} {name:12s} head {head:5.2f}  in B/I {in_backward:7.2f}  in F {in_forward:7.2f}")
    result = {"p": args.p, "m": args.m, "doc": __doc__.split("\n\n")[1], "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
