"""What compare_torch's engines share (the orchestrator and every worker process): the model, training settings
and layouts, the data, and the torch side's optimizer and update (AdamW with ptd_jax's groups and schedule, clipping
to the global norm)."""

from __future__ import annotations

import dataclasses
import math
import os
import re

MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=256)
"""The data are bytes, so V = 256: it divides over t = 2 with no padded rows, which megatron-core's vocab-parallel
softmax would count and ours does not."""
TRAIN = dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine", weight_decay=0.01, clip_grad=1.0)
MICRO_BATCH, MICROBATCHES = 2, 4
LAYOUT_NAME = re.compile(
    r"^(serial|t(\d+)|p(\d+)(?:v(\d+))?(?:t(\d+))?-(gpipe|1f1b-lockstep|1f1b|interleaved)(?:-(uniform|per-rank))?)$"
)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    p: int = 1
    v: int = 1
    t: int = 1
    """tensor-parallel size: only ptd_jax and megatron-core run t > 1 (torch.distributed.pipelining has no tensor
    parallelism of its own)"""
    schedule: str = "1f1b"
    branching: str = "auto"
    """ptd_jax's --pipeline-branching (torch runs the same schedule either way): the name's suffix, else the
    default, "auto" (per-rank on this CPU; the record names the branching that ran). "uniform" needs a schedule on
    lockstep ticks: "1f1b" splits its backwards on unit ticks, "1f1b-lockstep" is 1F1B with fused ones."""

    @classmethod
    def parse(cls, name: str) -> Layout:
        match = LAYOUT_NAME.match(name)
        if match is None:
            raise SystemExit(
                f"layout {name!r}: expected 'serial', t<T> or "
                f"p<P>[v<V>][t<T>]-<gpipe|1f1b|1f1b-lockstep|interleaved>[-uniform|-per-rank]"
            )
        if match[1] == "serial":
            return cls(name)
        if match[2]:
            return cls(name, t=int(match[2]))
        layout = cls(name, int(match[3]), int(match[4] or 1), int(match[5] or 1), match[6], match[7] or "auto")
        if layout.branching == "uniform" and layout.p > 1 and not _lockstep(layout.schedule):
            raise SystemExit(
                f"layout {name!r}: {layout.schedule} runs different kinds on different ranks in one tick "
                f"and needs per-rank branching; uniform runs a lockstep schedule (e.g. "
                f"{name.replace(layout.schedule + '-', '1f1b-lockstep-', 1)!r})"
            )
        return layout

    @property
    def family(self) -> str:
        """The schedule torch and megatron-core run for it: 1f1b-lockstep is 1F1B (the same microbatches' forwards
        and backwards on each stage; only ptd_jax's order of them differs)."""
        return "1f1b" if self.schedule == "1f1b-lockstep" else self.schedule

    @property
    def devices(self) -> int:
        return self.p * self.t


def _lockstep(schedule: str) -> bool:
    from ptd_jax.config import SCHEDULE_SPECS

    return SCHEDULE_SPECS[schedule].rows == "lockstep"


def schedule_lr_factor(step: int, train: dict, iters: int) -> float:
    """ptd_jax's `optimizer.learning_rate_schedule` / lr, in Python (for torch's LambdaLR)."""
    warmup, peak, floor = train["lr_warmup_iters"], train["lr"], train["min_lr"]
    if step < warmup:
        return step / max(warmup, 1)
    ratio = min(max((step - warmup) / max(iters - warmup, 1), 0.0), 1.0)
    return (floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)) / peak


def make_data(iters: int, batch: int, seq: int, seed: int):
    """[iters, B, s + 1] int64 windows of the standard library's bytes (random offsets, fixed by `seed`)."""
    import numpy as np

    from ptd_jax.data.corpus import stdlib_files

    text = b"".join(path.read_bytes() for path in stdlib_files()[:60])
    stream = np.frombuffer(text, np.uint8).astype(np.int64)
    starts = np.random.default_rng(seed).integers(0, len(stream) - seq - 1, (iters, batch))
    return stream[starts[..., None] + np.arange(seq + 1)]


def torch_setup(spec: dict, threads: int):
    """(torch, a loader of the Hugging Face GPT-2 of the spec's weights, the spec's data as a tensor), torch's
    threads set."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from transformers import GPT2LMHeadModel

    def load():
        return GPT2LMHeadModel.from_pretrained(spec["weights"], attn_implementation="sdpa", dtype=torch.float32).train()

    return torch, load, torch.from_numpy(np.load(spec["data"]))


def torch_optimizer(torch, named_params, spec: dict):
    """AdamW with ptd_jax's groups (no decay for biases and LayerNorms: the 1-D tensors) and schedule."""
    params = list(named_params)
    groups = [
        {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": spec["train"]["weight_decay"]},
        {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=spec["train"]["lr"], betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_lr_factor(s, spec["train"], spec["iters"]))
    return opt, sched


def clip_grads(torch, grads, norm, max_norm: float):
    """ptd_jax's `optimizer.clip_by_global_norm` (the same formula as torch's clip_grad_norm_)."""
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coeff)


def distributed_update(torch, dist, params, counted, loss: float, opt, sched, max_norm: float) -> tuple[float, float]:
    """One optimizer step of a multi-process torch engine: the squared grad norm of `counted` (each weight once
    over the ranks) and the loss summed over the ranks, the gradients of `params` clipped to the global norm, AdamW,
    the schedule; returns (loss, grad norm)."""
    sq = torch.stack([torch.sum(w.grad * w.grad) for w in counted]).sum() if counted else torch.tensor(0.0)
    both = torch.stack([sq, torch.tensor(float(loss))])
    if dist.get_world_size() > 1:
        dist.all_reduce(both)
    norm = torch.sqrt(both[0])
    clip_grads(torch, [w.grad for w in params], norm, max_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(both[1]), float(norm)
