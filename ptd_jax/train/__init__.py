"""Training: the single-device reference step, the loop around the parallel step, checkpoints and metrics.

reference.py   the single-device oracle step (every parallel path is compared against it)
loop.py        train(): data -> step -> hooks (`RunOptions` says where things go)
hooks.py       what runs after a step (log, evaluate, save, the bubble): `Hooks.add_hook`, `StepTimer`
power.py       the job's energy meter, --gpu-clock-plan's clock locks and governor
resume.py      --load: the step to resume from and the refusals before anything starts
interrupt.py   Ctrl-C: stop after the current step, checkpoints intact
checkpoint.py  orbax checkpoints of the training state
guards.py      skipped iterations counted, --max-skipped-iters, no checkpoint from a non-finite state
metrics.py     progress bar, JSONL records, the summary's medians, loss-curve plot
bubble.py      the measured pipeline bubble (the train step timed at m and 2m), shown after the first step
"""

from ptd_jax.train.loop import RunOptions, train

__all__ = ["RunOptions", "train"]
