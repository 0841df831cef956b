"""A schedule's timeline as a PNG, in the style of the paper's Figure 4 (`ptd-schedule --plot`)."""

from __future__ import annotations

from ptd_jax.parallel.pipeline.lockstep import Schedule


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

