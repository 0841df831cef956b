"""A schedule's timeline as a PNG, in the style of the paper's Figure 4 (`ptd-schedule --plot`); split schedules
(B and W) in the style of the zero-bubble paper's Figure 3."""

from __future__ import annotations

from ptd_jax.parallel.pipeline.table import Table


def draw(ax, sched: Table, times: tuple[float, float, float], title: str | None = None) -> None:
    """The timeline on `ax`: ranks as rows, one bar per cell, a tick as wide as its longest cell
    (`Table.cell_time`); microbatches coloured, forwards light with the number, backwards dark, weight
    gradients (W) the colour at 0.75 with a "x" hatch; odd chunks hatched "//"."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if sched.m <= 10 else "tab20")
    x = 0.0
    for row in sched.cells:
        width = max(sched.cell_time(cell.action, times) for cell in row)
        for r, cell in enumerate(row):
            a = cell.action
            if a is None:
                continue
            w = sched.cell_time(a, times)
            color = cmap(a.microbatch % cmap.N)
            alpha = {"F": 0.45, "B": 1.0, "I": 1.0, "W": 0.75}[a.kind]
            hatch = "xx" if a.kind == "W" else ("//" if a.chunk % 2 else None)
            ax.barh(r, w, left=x, color=color, alpha=alpha, edgecolor="black", linewidth=0.4, hatch=hatch)
            label = str(a.microbatch) if a.kind != "W" else f"W{a.microbatch}"
            ax.text(x + w / 2, r, label, ha="center", va="center", fontsize=6 if a.kind != "W" else 5)
        x += width
    ax.set_yticks(range(sched.p), [f"rank {r}" for r in range(sched.p)])
    ax.invert_yaxis()
    sim = sched.simulate(times=times)
    formula = sched.formula_bubble(times)
    formula_text = "no closed form" if formula is None else f"formula {formula:.3f}"
    legend = (
        "light = F, dark = B, xx = W, // = odd chunk"
        if sched.split
        else "light = forward, dark = backward, hatched = odd chunk"
    )
    ax.set_title(
        title
        or f"{sched.name}: p={sched.p} v={sched.v} m={sched.m} — makespan {sim['makespan']:.4g}, "
        f"bubble {sim['bubble_fraction']:.3f} ({formula_text}); {legend}",
        fontsize=9,
    )


def plot(sched: Table, path: str, backward_ratio: float = 2.0, times: tuple[float, float, float] | None = None) -> None:
    """PNG (or PDF/SVG) timeline of `sched` (`draw`) at `times` = (f, b, w) per whole stage, by default
    (1, k/2, k/2) for backward = `backward_ratio` k × forward; a fused backward lasts b + w."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = tuple(times) if times is not None else (1.0, backward_ratio / 2, backward_ratio / 2)
    fig, ax = plt.subplots(figsize=(min(4 + sched.ticks * 0.25, 40), 0.6 * sched.p + 1.2))
    draw(ax, sched, times)
    ax.set_xlabel(f"time (one stage: F = {times[0]:g}, B = {times[1]:g}, W = {times[2]:g})")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
