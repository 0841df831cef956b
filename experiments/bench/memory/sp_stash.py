"""What one layer stashes for its backward with and without sequence parallelism (Korthikanti et al. 2022, §4.2.2),
per tensor-parallel size: the executor's stash layout (`stash.Residuals`, a layer's vjp residuals less its weights)
traced on fake CPU devices under `--recompute-granularity` none and selective, in units of s·b·h compute-dtype
elements (bytes / (2 s b h) at bfloat16), each stashed leaf with its shape.

The configuration is the GPU's: flash attention ("pallas") and the fused LayerNorm/loss kernels, bfloat16; only
shapes are traced (nothing runs), so the kernels need no GPU. Megatron keeps every sequence-sharded tensor of a
layer at 1/t under sequence parallelism: the done-when is SP's stash per layer ≤ (1/t + ε) of t = 1's.

Usage: python -m experiments.bench.memory.sp_stash [--out experiments/results/sp_stash.json]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import fake_devices, write_json

MODEL = dict(
    num_layers=1,
    hidden_size=256,
    num_attention_heads=8,
    vocab_size=1024,
    seq_length=256,
    dtype="bfloat16",
    attention_backend="pallas",
    fused_kernels=True,
)
TENSOR_SIZES = (1, 2, 4, 8)


def layer_stash(t: int, sequence_parallel: bool, recompute: str, model: dict = MODEL) -> dict:
    """One layer's stash (b = 1) at tensor size t: {"units": bytes / (2 s b h), "bytes_per_sbh" (perf/memory.py's
    unit), "leaves": [[shape, dtype], ...]}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel import tensor as tp
    from ptd_jax.parallel.pipeline.stash import Residuals
    from ptd_jax.parallel.vma import mark_varying

    cfg = ModelConfig(**model)
    s, h = cfg.seq_length, cfg.hidden_size
    mesh = jax.make_mesh((1, t), ("pipe", "tensor"), devices=jax.devices()[:t], axis_types=(AxisType.Auto,) * 2)
    layers = jax.eval_shape(lambda key: gpt.init_params(key, cfg, tensor_parallel_size=t)["layers"], jax.random.key(0))
    specs = sharding.param_specs({"layers": layers})["layers"]
    layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(cfg.dtype)), layers)
    x = jax.ShapeDtypeStruct((1, s, h), jnp.dtype(cfg.dtype))
    found = {}

    def body(lc, x):
        # Typed as in the executor: weights split over "tensor", all varying over "pipe", the activation varying
        # over "tensor" too under sequence parallelism (each rank holds its own tokens).
        lc, x = jax.tree.map(lambda a: mark_varying(a, ("pipe",)), (lc, x))
        x = mark_varying(x, ("tensor",)) if sequence_parallel else x
        layer = gpt.remat_layer(
            lambda lp, h_, k: tp.transformer_layer(lp, h_, cfg, sequence_parallel, k, recompute), recompute
        )
        res = Residuals.trace(lambda lp, h_: layer(lp, h_, None), jax.tree.map(lambda a: a[0], lc), x)
        found["res"] = res
        return jnp.zeros((), jnp.int32)

    x_spec = PartitionSpec(None, "tensor") if sequence_parallel else PartitionSpec()
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(specs, x_spec), out_specs=PartitionSpec()), layers, x)
    res = found["res"]
    unit = s * h * 2  # s·b·h bfloat16 elements, b = 1
    return {
        "units": res.slot_bytes / unit,
        "bytes_per_sbh": res.slot_bytes / (s * h),
        "leaves": sorted([list(st.shape), str(st.dtype)] for st in res.structs),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/sp_stash.json")
    args = parser.parse_args(argv)
    fake_devices(max(TENSOR_SIZES))
    rows = []
    for recompute in ("none", "selective"):
        for t in TENSOR_SIZES:
            for sp in (False, True) if t > 1 else (False,):
                got = layer_stash(t, sp, recompute)
                rows.append({"recompute": recompute, "t": t, "sequence_parallel": sp, **got})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "leaves"}))
    base = {r["recompute"]: r["units"] for r in rows if r["t"] == 1}
    done_when = {
        f"{r['recompute']} t={r['t']}": {
            "sp_bytes_per_sbh": r["bytes_per_sbh"],
            "sp_units": r["units"],
            "unsplit_units_over_t": base[r["recompute"]] / r["t"],
            "ratio_to_unsplit": r["units"] / base[r["recompute"]],
            "one_over_t": 1 / r["t"],
        }
        for r in rows
        if r["sequence_parallel"]
    }
    print(json.dumps(done_when, indent=1))
    write_json(
        args.out,
        {
            "model": MODEL,
            "unit": "s*b*h elements of the compute dtype (2 bytes each)",
            "rows": rows,
            "done_when": done_when,
        },
    )


if __name__ == "__main__":
    main()
