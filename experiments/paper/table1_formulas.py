"""Paper Table 1 through the paper's formulas: parameters (eq. 2), FLOPs per iteration (eq. 3), and the
end-to-end training time of eq. (4) at the published per-GPU throughput.

Usage: python -m experiments.paper.table1_formulas [--tokens 300e9] [--out experiments/results/table1_formulas.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ptd_jax.presets import PAPER_TABLE_1, PAPER_VOCAB_SIZE, model_preset
from ptd_jax.perf.flops import flops_per_iteration, model_flops_per_iteration, num_params, training_days


def rows(tokens: float) -> list[dict]:
    out = []
    for row in PAPER_TABLE_1:
        cfg = model_preset(f"paper-{row.name.lower()}")
        vocab = PAPER_VOCAB_SIZE  # Table 1's V (Megatron's padding of GPT-2's 50,257 at t = 8)
        params = num_params(cfg, vocab)
        flops = flops_per_iteration(cfg, row.global_batch_size, vocab)
        out.append(
            {
                "model": row.name,
                "heads": row.num_attention_heads,
                "hidden": row.hidden_size,
                "layers": row.num_layers,
                "t": row.tensor_model_parallel_size,
                "p": row.pipeline_model_parallel_size,
                "gpus": row.num_gpus,
                "batch": row.global_batch_size,
                "params_eq2_billion": params / 1e9,
                "published_params_billion": row.published_params_billion,
                "flops_per_iteration_eq3": flops,
                "model_flops_per_iteration": model_flops_per_iteration(cfg, row.global_batch_size, vocab),
                "published_tflops_per_gpu": row.published_tflops_per_gpu,
                "implied_iteration_time_s": flops / (row.num_gpus * row.published_tflops_per_gpu * 1e12),
                "training_days_eq4": training_days(tokens, params, row.num_gpus, row.published_tflops_per_gpu),
            }
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=300e9)
    parser.add_argument("--out", default="experiments/results/table1_formulas.json")
    args = parser.parse_args(argv)
    result = {"tokens": args.tokens, "rows": rows(args.tokens)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in result["rows"]:
        print(
            f"{r['model']:>7}  P={r['params_eq2_billion']:8.2f}B (published {r['published_params_billion']})  "
            f"F/iter={r['flops_per_iteration_eq3']:.3e}  iter={r['implied_iteration_time_s']:6.2f}s  "
            f"days@{args.tokens:.0e} tokens={r['training_days_eq4']:6.1f}"
        )


if __name__ == "__main__":
    main()
