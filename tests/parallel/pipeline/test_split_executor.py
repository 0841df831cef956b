"""Split schedules (1F1B-split, ZB-H1, ZB-V: B and W on unit ticks, each rank its own kind) against the
single-device reference in float64: loss, every gradient, grad norm; and what their tables promise."""

import jax
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ParallelConfig
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.pipeline import build, validate
from ptd_jax.parallel.step import make_parallel_eval_step
from ptd_jax.train.reference import make_eval_step

from .test_executor import B, batch, compare, model_cfg, one_training_step

V = {"1f1b-split": 1, "zb-h1": 1, "zb-v": 2}


def layout(d, p, t, schedule, sp=False):
    return ParallelConfig(data_parallel_size=d, pipeline_model_parallel_size=p, tensor_model_parallel_size=t,
                          virtual_pipeline_stages=V[schedule], pipeline_schedule=schedule, micro_batch_size=1,
                          global_batch_size=B, sequence_parallel=sp, pipeline_branching="per-rank")


CASES = [((d, p, t), s, r, sp) for s in V for (d, p, t) in [(1, 4, 1), (1, 4, 2), (2, 2, 2)]
         for r, sp in [("none", False)]]
CASES += [((1, 4, 2), s, r, False) for s in V for r in ("selective", "full")]
CASES += [((2, 2, 2), s, "none", True) for s in V]  # sequence parallelism
QUICK = {((1, 4, 1), "zb-h1", "none", False), ((2, 2, 2), "1f1b-split", "none", True)}  # ZB-V: the dropout step


@pytest.mark.parametrize("dpt, schedule, recompute, sp", [
    pytest.param(*c, id=f"d{c[0][0]}p{c[0][1]}t{c[0][2]}-{c[1]}-{c[2]}{'-sp' if c[3] else ''}",
                 marks=() if c in QUICK else pytest.mark.slow) for c in CASES])
def test_float64_split_schedule_equals_the_reference(dpt, schedule, recompute, sp):
    d, p, t = dpt
    with jax.enable_x64(True):
        compare(layout(d, p, t, schedule, sp), model_cfg(p), rtol=1e-12, recompute=recompute)


def test_zb_v_evaluation_equals_the_reference():
    """ZB-V's evaluation runs its V on unit ticks (the layers stored in the V's order)."""
    parallel = layout(1, 2, 1, "zb-v")
    cfg = model_cfg(2)
    with jax.enable_x64(True):
        params = gpt.init_params(jax.random.key(0), cfg)
        mesh = make_mesh(parallel)
        pp = {**params, "layers": sharding.stage_layers(params["layers"], 2, 2, True)}
        specs = sharding.param_specs(pp, pipelined=True)
        got = make_parallel_eval_step(mesh, cfg, parallel, specs)(jax.device_put(pp, sharding.named(mesh, specs)),
                                                                  *batch(parallel.num_microbatches))
        want = make_eval_step(cfg)(params, *batch(parallel.num_microbatches))
        assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_uniform_branching_is_refused_for_split_schedules():
    with pytest.raises(ConfigError, match="zb-h1.*per-rank.*'uniform'"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", pipeline_branching="uniform")


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (4, 16), (8, 16), (3, 6)])
def test_split_tables_keep_their_promises(p, m):
    """At t_F = t_B = t_W: 1F1B-split holds p − s on stage s, its bubble (p−1)(f+b)/(m(f+b+w)) = 2(p−1)/(3m);
    ZB-H1 at most 1/2 of 1F1B's bubble (p−1)/m with a stash <= p; ZB-V at most 1/4 of it with a stash (in whole
    stages: chunk inputs / 2) <= 1F1B's p."""
    times = (1.0, 1.0, 1.0)
    fused = build("1f1b", p, 1, m).simulate(times=times)["bubble_fraction"]
    assert fused == pytest.approx((p - 1) / m)
    split = build("1f1b-split", p, 1, m)
    validate(split)
    assert split.peak_stash == [p - s for s in range(p)]
    assert split.simulate(times=times)["bubble_fraction"] == pytest.approx(2 * (p - 1) / (3 * m))
    h1 = build("zb-h1", p, 1, m)
    validate(h1)
    assert h1.simulate(times=times)["bubble_fraction"] <= fused / 2
    assert h1.simulate(times=times)["bubble_fraction"] == pytest.approx(h1.formula_bubble(times))
    assert max(h1.peak_stash) <= p and max(h1.peak_w_stash) <= p
    zbv = build("zb-v", p, 2, m)
    validate(zbv)
    assert zbv.simulate(times=times)["bubble_fraction"] <= fused / 4
    assert max(zbv.peak_stash) / 2 <= p


def test_split_validator_catches_a_broken_table():
    """Two of rank 0's W's reading each other's stash (ZB-H1 holds up to p of them at once) is caught."""
    sched = build("zb-h1", 4, 1, 8)
    w_cells = [row[0] for row in sched.cells if row[0].action is not None and row[0].action.kind == "W"]
    first, second = next((a, b) for a in w_cells for b in w_cells if a.w_slot != b.w_slot)
    first.w_slot, second.w_slot = second.w_slot, first.w_slot
    with pytest.raises(ValueError, match="reads w slot"):
        validate(sched)


@pytest.mark.parametrize("schedule, recompute", [pytest.param("zb-v", "selective"),
                                                 pytest.param("zb-h1", "none", marks=pytest.mark.slow)])
def test_float64_dropout_train_step_equals_the_unpipelined_step(schedule, recompute):
    """A whole training step with dropout (state made by `init_sharded_state`, so ZB-V's V layout too): the
    loss, grad norm and updated parameters of the p = 1 step. B's and W's masks are the F's, re-drawn from the
    stashed keys under selective recomputation."""
    from ptd_jax.config import TrainConfig

    with jax.enable_x64(True):
        cfg = model_cfg(2).replace(hidden_dropout=0.2, attention_dropout=0.2)
        tcfg = TrainConfig(lr=1e-3, lr_warmup_iters=0, recompute_granularity=recompute)
        flat = ParallelConfig(micro_batch_size=1, global_batch_size=B)
        (loss, norm, params), (ref_loss, ref_norm, ref_params) = (
            one_training_step(parallel, cfg, tcfg) for parallel in (layout(1, 2, 1, schedule), flat))
        assert loss == pytest.approx(ref_loss, rel=1e-12) and norm == pytest.approx(ref_norm, rel=1e-12)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-11, atol=1e-13)


def test_split_validator_catches_an_action_run_twice():
    """A tick repeating rank 0's last W (its slot no longer held) would add the kernels' gradients twice."""
    from ptd_jax.parallel.pipeline.lockstep import Cell

    sched = build("zb-h1", 4, 1, 8)
    last_w = next(row[0] for row in reversed(sched.cells) if row[0].action is not None)
    assert last_w.action.kind == "W"
    sched.cells.append([Cell(action=last_w.action, w_slot=last_w.w_slot)] + [Cell() for _ in range(3)])
    sched.kinds.append("X")
    with pytest.raises(ValueError, match="runs twice"):
        validate(sched)


def test_zb_v_needs_two_ranks():
    with pytest.raises(ConfigError, match="zb-v schedule needs pipeline_model_parallel_size >= 2"):
        ParallelConfig(pipeline_model_parallel_size=1, virtual_pipeline_stages=2, pipeline_schedule="zb-v")
