"""Training: the single-device reference step, the loop around the parallel step, checkpoints, metrics and the
paper's FLOP formulas.

    reference.py   the single-device oracle step (every parallel path is compared against it)
    loop.py        train(): data -> step -> metrics -> checkpoints (`RunOptions` says where things go)
    checkpoint.py  orbax checkpoints of the training state
    metrics.py     progress bar, JSONL records, loss-curve plot
    flops.py       parameters (eq. 2), FLOPs per iteration (eq. 3), training time (eq. 4), device peaks
"""

from ptd_jax.train.loop import RunOptions, train

__all__ = ["RunOptions", "train"]
