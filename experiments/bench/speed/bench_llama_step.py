"""One Llama training step (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) against the GPT-2 step of
(nearly) equal parameter count, on this machine's CPU: the cost of the Llama switches at equal size.

The GPT-2 side is the `tiny` preset's shape widened to D = 256; the Llama side has the same D, L, heads and
sequence, G = H/2 key/value heads, tied embeddings, and its MLP width F chosen so that the two parameter counts
differ by under 1% (both counts are written out). Single-device reference step (`train.reference`), alternating
rounds, medians, JSON out.
Usage: python -m experiments.bench.speed.bench_llama_step [--rounds 7] [--steps 3]
       [--out experiments/results/bench_llama_step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from experiments.common import write_json


def configs():
    """(gpt2, llama) ModelConfigs of about the same parameter count."""
    from ptd_jax.config import ModelConfig

    gpt2 = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=257)
    switches = dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        num_query_groups=2,
        add_bias_linear=False,
    )
    # F such that the models match: SwiGLU's gate, up and down add 3·D per unit of F in each of the L layers
    llama = gpt2.replace(**switches, ffn_hidden_size=1)
    gap = gpt2.num_parameters - llama.num_parameters
    F = 1 + round(gap / (3 * gpt2.hidden_size * gpt2.num_layers))
    return gpt2, llama.replace(ffn_hidden_size=F)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="experiments/results/bench_llama_step.json")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from ptd_jax.config import TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.train.reference import init_state, make_train_step

    models = dict(zip(("gpt2", "llama"), configs()))
    tcfg = TrainConfig()
    opt = make_optimizer(tcfg)
    seq = models["gpt2"].seq_length
    tokens = np.random.default_rng(0).integers(0, 257, (1, args.global_batch_size, seq), dtype=np.int32)
    mask = np.ones_like(tokens)
    states = {name: init_state(jax.random.key(0), cfg, opt) for name, cfg in models.items()}
    steps = {name: make_train_step(cfg, tcfg, opt) for name, cfg in models.items()}
    first_call_s = {}
    for name in steps:
        start = time.perf_counter()
        states[name], metrics = steps[name](states[name], tokens, tokens, mask, None)
        jax.block_until_ready(metrics)
        first_call_s[name] = time.perf_counter() - start
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name in steps:
            start = time.perf_counter()
            for _ in range(args.steps):
                states[name], metrics = steps[name](states[name], tokens, tokens, mask, None)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / args.steps)
    median = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "num_parameters": {name: cfg.num_parameters for name, cfg in models.items()},
        "llama_ffn_hidden_size": models["llama"].ffn_size,
        "global_batch_size": args.global_batch_size,
        "seq_length": seq,
        "device": jax.devices()[0].device_kind,
        "median_step_s": median,
        "all_step_s": times,
        "first_call_s": first_call_s,
        "llama_over_gpt2_step_time": median["llama"] / median["gpt2"],
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("num_parameters", "median_step_s", "llama_over_gpt2_step_time")}))


if __name__ == "__main__":
    main()
