"""The one pipeline executor, every schedule (fused and split backwards, lockstep and unit tables), against the
single-device reference: loss, every gradient, grad norm, traces, and the collectives of one tick."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import SCHEDULE_SPECS, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.analysis.collectives import jaxpr_collectives, summarize
from ptd_jax.analysis.jaxpr import equations, is_call, named_calls
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.pipeline import build, build_forward_only
from ptd_jax.parallel.pipeline.lowering import columns, tick_runs
from ptd_jax.parallel.step import (
    init_sharded_state,
    make_parallel_eval_step,
    make_parallel_grad_step,
    make_parallel_train_step,
    pipeline_schedule,
)
from ptd_jax.train.reference import accumulate_gradients, make_eval_step
from tests.helpers.exactness import assert_equals_reference

B, S = 8, 16
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b-lockstep", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]
LAYOUTS = [(1, 4, 1), (1, 4, 2), (2, 2, 2), (1, 2, 1), (1, 8, 1), (1, 2, 4)]  # (d, p, t)


def branchings(schedule: str) -> tuple[str, ...]:
    """Unit tables (each rank its own kind in a tick) run per-rank only."""
    return ("uniform", "per-rank") if SCHEDULE_SPECS[schedule].rows == "lockstep" else ("per-rank",)


def model_cfg(p, x64=True):
    cfg = ModelConfig(num_layers=2 * p, hidden_size=32, num_attention_heads=8, seq_length=S, vocab_size=257)
    return cfg.replace(dtype="float64", param_dtype="float64") if x64 else cfg


def layout(d, p, t, schedule, v, sp=False, scatter_gather=True, branching="uniform"):
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=B,
        sequence_parallel=sp,
        scatter_gather=scatter_gather,
        pipeline_branching=branching,
    )


def batch(m):
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, 257))
    mask = np.ones((B, S), np.int32)
    mask[2, 3:9] = 0
    return [x.reshape(m, B // m, S) for x in (toks[:, :-1], toks[:, 1:], mask)]


def abstract_params(cfg, parallel):
    """ShapeDtypeStructs of the reference params in `parallel`'s layout, on its mesh, and their specs (for tracing)."""
    t = parallel.tensor_model_parallel_size
    params = jax.eval_shape(lambda key: gpt.init_params(key, cfg, tensor_parallel_size=t), jax.random.key(0))
    return sharding.place_params(params, parallel, make_mesh(parallel))


def compare(parallel, cfg, rtol, recompute="none"):
    params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=parallel.tensor_model_parallel_size)
    m = parallel.num_microbatches * parallel.data_parallel_size  # reference microbatches of b rows each
    reference = jax.jit(accumulate_gradients, static_argnums=4)(params, *batch(m), cfg)
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)  # ZB-V's chunks in the V
    step = make_parallel_grad_step(
        mesh, cfg, parallel, specs, scatter_gather=parallel.scatter_gather, recompute=recompute
    )
    loss, grads, norm = step(placed, *batch(parallel.num_microbatches))
    assert_equals_reference((loss, sharding.reference_layout(grads, parallel), norm), reference, rtol)


# The default run covers every schedule and each of the issue's layouts (1,4,1), (1,4,2), (2,2,2) at least once,
# uniform branching once (more below: sequence parallelism, recomputation, evaluation, dropout); `pytest -m slow`
# runs the whole product (p = 8, (1,2,1), (1,2,4) too).
# GPipe: the distributed optimizer's training step below.
COVERING = {
    ((1, 4, 2), "interleaved", "uniform"),
    ((2, 2, 2), "1f1b", "per-rank"),
    ((1, 4, 1), "zb-h1", "per-rank"),
    ((1, 4, 2), "zb-v", "per-rank"),
    ((1, 4, 1), "1f1b-lockstep", "uniform"),
}
PRODUCT = [
    pytest.param(
        d, p, t, s, v, b, id=f"d{d}p{p}t{t}-{s}-{b}", marks=() if ((d, p, t), s, b) in COVERING else pytest.mark.slow
    )
    for d, p, t in LAYOUTS
    for s, v in SCHEDULES
    for b in branchings(s)
    if p >= SCHEDULE_SPECS[s].min_p
]


def test_the_exactness_cases_cover_every_schedule():
    """Every registered schedule is in the product, and in the default run (GPipe through the distributed
    optimizer's training step)."""
    assert {s for s, _ in SCHEDULES} == set(SCHEDULE_SPECS)
    assert {s for _, s, _ in COVERING} | {"gpipe"} == set(SCHEDULE_SPECS)
    assert {dpt for dpt, _, _ in COVERING} >= {(1, 4, 1), (1, 4, 2), (2, 2, 2)}


@pytest.mark.parametrize("d, p, t, schedule, v, branching", PRODUCT)
def test_float64_pipeline_equals_the_reference(d, p, t, schedule, v, branching):
    with jax.enable_x64(True):
        compare(layout(d, p, t, schedule, v, branching=branching), model_cfg(p), rtol=1e-12)


# Tables the layouts above do not reach: an uneven microbatch group (G = 3 ≠ p, m % G = 2), fewer microbatches
# than stages (m = 2 < p = 4), three chunks per rank; each under every recompute policy, all under -m slow (the
# default run has the executor's regular tables above).
ODD_TABLES = {
    "uneven-group": (
        dict(
            pipeline_model_parallel_size=2,
            virtual_pipeline_stages=2,
            pipeline_schedule="interleaved",
            microbatch_group_size=3,
        ),
        4,
    ),
    "m-below-p": (dict(pipeline_model_parallel_size=4, pipeline_schedule="1f1b", micro_batch_size=4), 8),
    "v3": (dict(pipeline_model_parallel_size=2, virtual_pipeline_stages=3, pipeline_schedule="interleaved"), 6),
}


@pytest.mark.parametrize(
    "table, recompute",
    [
        pytest.param(name, r, id=f"{name}-{r}", marks=pytest.mark.slow)
        for name in ODD_TABLES
        for r in ("none", "selective", "full")
    ],
)
def test_float64_pipeline_on_odd_tables(table, recompute):
    overrides, num_layers = ODD_TABLES[table]
    parallel = layout(1, 2, 1, "gpipe", 1, branching="per-rank").replace(**overrides)
    with jax.enable_x64(True):
        compare(parallel, model_cfg(2).replace(num_layers=num_layers), rtol=1e-12, recompute=recompute)


# Each recompute policy on a split schedule (with sequence parallelism once) in the default run; the rest, and the
# fused backwards' recomputation below, under -m slow.
RECOMPUTE_QUICK = {((2, 2, 2), "1f1b", "selective", True), ((1, 4, 2), "zb-v", "full", False)}
RECOMPUTE_CASES = sorted(
    RECOMPUTE_QUICK
    | {
        ((d, p, t), s, r, sp)
        for (d, p, t), s, _ in COVERING | {((1, 8, 1), "gpipe", "uniform")}
        for r in ("selective", "full")
        for sp in (False,)
    }
    | {((2, 2, 2), s, "none", True) for s in ("zb-h1", "zb-v", "1f1b")}
)


@pytest.mark.parametrize(
    "dpt, schedule, recompute, sp",
    [
        pytest.param(
            *c,
            id=f"d{c[0][0]}p{c[0][1]}t{c[0][2]}-{c[1]}-{c[2]}{'-sp' if c[3] else ''}",
            marks=() if c in RECOMPUTE_QUICK else pytest.mark.slow,
        )
        for c in RECOMPUTE_CASES
    ],
)
def test_float64_pipeline_recompute_policies(dpt, schedule, recompute, sp):
    d, p, t = dpt
    v = dict(SCHEDULES)[schedule]
    with jax.enable_x64(True):
        compare(
            layout(d, p, t, schedule, v, sp=sp, branching="per-rank"), model_cfg(p), rtol=1e-12, recompute=recompute
        )


@pytest.mark.parametrize(
    "sp, scatter_gather, branching",
    [
        # sequence parallelism inside the pipeline stays in the default run through the recompute policies' d2p2t2
        # 1F1B case above
        pytest.param(True, True, "uniform", id="sequence-parallel-uniform", marks=pytest.mark.slow),
        pytest.param(False, False, "uniform", id="no-scatter-gather-uniform", marks=pytest.mark.slow),
        # interleaved under per-rank (each kind's loop with a per-rank trip count, the chunk index traced) stays in
        # the default run
        pytest.param(True, True, "per-rank", id="sequence-parallel-per-rank"),
        pytest.param(False, False, "per-rank", id="no-scatter-gather-per-rank", marks=pytest.mark.slow),
    ],
)
def test_float64_pipeline_variants(sp, scatter_gather, branching):
    with jax.enable_x64(True):
        compare(layout(1, 2, 2, "interleaved", 2, sp, scatter_gather, branching), model_cfg(2), rtol=1e-12)


@pytest.mark.slow  # 30 s; the default run checks the pipeline's arithmetic exactly in float64
def test_bf16_pipeline_equals_the_bf16_reference():
    """--bf16 (bfloat16 compute, float32 master weights): the stashed residuals, cotangents and the embedding's
    transpose in bfloat16, gradients accumulated in float32; against the reference step in the same precision
    (the two differ by summation order only: 2e-2 of the largest gradient, where a dropped term is O(1))."""
    cfg = model_cfg(2, x64=False).replace(dtype="bfloat16")
    compare(layout(1, 2, 2, "1f1b", 1, branching="per-rank"), cfg, rtol=2e-2)


@pytest.mark.parametrize("branching", ["uniform", pytest.param("per-rank", marks=pytest.mark.slow)])
def test_pipeline_evaluation_equals_the_reference(branching):
    cfg = model_cfg(2, x64=False)
    parallel = layout(2, 2, 2, "interleaved", 2, branching=branching)
    params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=2)
    ref = float(make_eval_step(cfg)(params, *batch(4)))
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    got = float(make_parallel_eval_step(mesh, cfg, parallel, specs)(placed, *batch(parallel.num_microbatches)))
    assert got == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize(
    "schedule, v",
    [
        pytest.param("interleaved", 2, marks=pytest.mark.slow),
        ("1f1b", 1),
        pytest.param("zb-v", 2, marks=pytest.mark.slow),
    ],
)
def test_float64_pipeline_evaluation_equals_the_reference(schedule, v):
    """Evaluation's table reuses its two slots per rank (m = 8 microbatches through p = 4): every forward still
    reads its own input, so the loss equals the reference's to 1e-12."""
    with jax.enable_x64(True):
        cfg = model_cfg(4)
        parallel = layout(1, 4, 2, schedule, v, branching="per-rank")
        assert build_forward_only(schedule, 4, v, parallel.num_microbatches).slots["act"] <= 3
        params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=2)
        ref = float(make_eval_step(cfg)(params, *batch(parallel.num_microbatches)))
        mesh = make_mesh(parallel)
        placed, specs = sharding.place_params(params, parallel, mesh)
        got = float(make_parallel_eval_step(mesh, cfg, parallel, specs)(placed, *batch(parallel.num_microbatches)))
    assert got == pytest.approx(ref, rel=1e-12)


# --- collectives of one tick -----------------------------------------------------------------------------------


def tick_bodies(jaxpr, sched):
    """[(kinds, scan body)] of the executor's runs (`tick_runs`) that send, in order: the scans whose body issues
    the pipe ring itself (a chunk's layer scan does not)."""
    found = [
        e
        for e in equations(jaxpr)
        if e.primitive.name == "scan" and any(q.primitive.name == "ppermute" for q in e.params["jaxpr"].jaxpr.eqns)
    ]
    runs = [run for run in tick_runs(sched) if any(dirs for _, dirs in run[0])]  # a tick that sends nothing: no ring
    assert [e.params["length"] for e in found] == [n for _, _, n in runs]
    return [
        ("".join(kinds for kinds, _ in pattern), e.params["jaxpr"].jaxpr)
        for (pattern, _, _), e in zip(runs, found, strict=True)
    ]


def _calls(eqn, name) -> bool:
    """Whether `eqn` is, or holds, a call named `name` (the executor's named pieces of work)."""
    return any(is_call(e, name) for e in equations(SimpleNamespace(eqns=[eqn])))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_one_tick_issues_exactly_the_expected_collectives(sp):
    """A forward and a backward tick (recompute none, uniform; conds counted by their larger branch). The F tick
    holds stage 0's embedding (1: its reduction; under sequence parallelism a reduce-scatter), k layers' forwards
    (2 each; under sequence parallelism 2 all-gathers and 2 reduce-scatters) and the last stage's head, forward and
    backward (cross-entropy: max + 2 sums; the output layer's input gradient: 1, under sequence parallelism a
    reduce-scatter after its forward all-gather). The B tick holds k layers' backwards (2 each; under sequence
    parallelism 2 reduce-scatters, 2 all-gathers and the two forward all-gathers again, `model.REGATHERED_PRIMITIVES`:
    the stash holds their 1/t inputs) and the embedding's transpose (nothing; under sequence parallelism the
    all-gather that transposes its reduce-scatter), no recomputed forward. Outside the conds, each: one ring ppermute
    and, with scatter/gather, one all-gather re-assembling the hidden dim. Nothing over "data" and no all-reduce over
    "pipe" inside the loop: a stray one is the silent 2–4x gradient bug of the prototype."""
    p, v, t, k = 2, 2, 2, 1
    cfg = model_cfg(p, x64=False)
    parallel = layout(2, p, t, "interleaved", v, sp)
    tcfg = TrainConfig()
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = jax.eval_shape(lambda key: init_sharded_state(key, cfg, opt, mesh, parallel), jax.random.key(0))
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    x = jax.ShapeDtypeStruct((parallel.num_microbatches, 2, S), jnp.int32)
    jaxpr = jax.make_jaxpr(step)(state, x, x, x, jax.random.key(0))
    bodies = tick_bodies(jaxpr.jaxpr, pipeline_schedule(parallel))
    backward = [body for kinds, body in bodies if kinds == "B"]
    assert len(backward) == 2  # the steady state's first backward and the cool-down's: one B tick per scan step
    forward = [body for kinds, body in bodies if kinds == "F"]
    counts = {
        kind: {key: value["count"] for key, value in summarize(jaxpr_collectives(body[-1])).items()}
        for kind, body in (("F", forward), ("B", backward))
    }
    assert len(forward) == 1  # the warm-up forwards (the steady state's F runs in F/B pairs)
    assert counts["B"] == {key: value["count"] for key, value in summarize(jaxpr_collectives(backward[0])).items()}
    if sp:
        expected = {
            "F": {
                "reduce_scatter@tensor": 1 + 2 * k + 1,
                "all_gather@tensor": 2 * k + 1,
                "psum_invariant@tensor": 2,
                "pmax@tensor": 1,
                "ppermute@pipe": 1,
            },
            "B": {"reduce_scatter@tensor": 2 * k, "all_gather@tensor": 2 * k + 2 * k + 1, "ppermute@pipe": 1},
        }
    else:
        expected = {
            "F": {
                "psum_invariant@tensor": 1 + 2 * k + 2 + 1,
                "all_gather_invariant@tensor": 1,
                "pmax@tensor": 1,
                "ppermute@pipe": 1,
            },
            "B": {"psum_invariant@tensor": 2 * k, "all_gather_invariant@tensor": 1, "ppermute@pipe": 1},
        }
    assert counts == expected


# --- what each tick computes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, p, v, m", [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("gpipe", 2, 1, 4), ("zb-v", 4, 2, 8)]
)
def test_the_head_and_the_embedding_run_only_where_the_table_needs_them(schedule, p, v, m):
    """Per cell: the head (forward and backward) only in the last virtual stage's F cells (m of them, on the last
    stage's rank), the embedding only in virtual stage 0's F and B/I cells (2m, on rank 0), nothing in idle or W
    cells."""
    sched = build(schedule, p, v, m)
    cols = columns(sched)
    last = p * v - 1
    for t, row in enumerate(sched.cells):
        for r, cell in enumerate(row):
            a = cell.action
            stage = None if a is None else sched.stage(a, r)
            assert cols["embed"][t, r] == (stage == 0 and a.kind != "W")
            assert cols["head"][t, r] == (stage == last and a.kind == "F")
    head_cells = list(zip(*np.nonzero(cols["head"])))
    last_rank = 0 if sched.spec.stage_map == "v" else p - 1
    assert len(head_cells) == m and {r for _, r in head_cells} == {last_rank}
    embed_cells = list(zip(*np.nonzero(cols["embed"])))
    assert len(embed_cells) == 2 * m and {r for _, r in embed_cells} == {0}


def test_evaluation_runs_the_head_in_the_last_stages_forwards():
    sched = build_forward_only("interleaved", 4, 2, 8)
    assert set(sched.kinds) == {"F"}
    head = columns(sched)["head"]
    assert head.sum() == 8 and set(np.nonzero(head)[1]) == {3}


def test_tick_runs_cover_the_table_in_order():
    """Runs of one pattern, or of an F/B alternation as pairs (the F first); a unit table whose pattern changes
    more often than `lowering.MAX_RUNS` is one run of the union of its ticks' kinds and directions."""
    from ptd_jax.parallel.pipeline.lowering import patterns, union

    for schedule, p, v, m, G in [
        ("gpipe", 4, 1, 8, None),
        ("1f1b", 4, 1, 8, None),
        ("interleaved", 4, 2, 8, None),
        ("1f1b", 4, 1, 2, None),
        ("interleaved", 2, 2, 8, 3),
        ("interleaved", 2, 3, 6, None),
        ("zb-h1", 4, 1, 8, None),
        ("zb-v", 4, 2, 8, None),
    ]:
        sched = build(schedule, p, v, m, G)
        pats, runs = patterns(sched), tick_runs(sched)
        assert [first for _, first, _ in runs] == list(np.cumsum([0] + [len(pt) * n for pt, _, n in runs])[:-1])
        assert sum(len(pt) * n for pt, _, n in runs) == sched.ticks
        if len(runs) == 1 and len(runs[0][0]) == 1 and len(set(pats)) > 1:
            assert runs[0][0][0] == union(pats)
        else:
            assert [pt for pattern, _, n in runs for _ in range(n) for pt in pattern] == pats
    kinds = [kinds for pattern, _, n in tick_runs(build("interleaved", 4, 2, 8)) for kinds, _ in pattern]
    assert kinds == ["F", "B", "F", "B", "B"]  # warm-up, the first backward, F/B pairs, cool-down
    from ptd_jax.parallel.pipeline.lowering import MAX_RUNS

    assert [len(tick_runs(build(s, 4, v, 8))) for s, v in SCHEDULES if s in ("gpipe", "interleaved")] == [2, 4]
    assert all(len(tick_runs(build(s, 4, v, 8))) <= MAX_RUNS for s, v in SCHEDULES)


def _dot_output_dims(jaxpr, skip=None):
    """Output widths of the matmuls inside `jaxpr` (each traced once), not counting those inside calls named
    `skip`."""
    return [
        e.outvars[0].aval.shape[-1]
        for e in equations(jaxpr, skip=lambda e: is_call(e, skip))
        if e.primitive.name == "dot_general"
    ]


def _inputs_reached(jaxpr, var) -> set[int]:
    """Indices of `jaxpr`'s inputs that `var` is computed from."""
    producer = {id(out): eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    inputs = {id(x): i for i, x in enumerate(jaxpr.invars)}
    reached, todo, seen = set(), [var], set()
    while todo:
        x = todo.pop()
        if id(x) in seen or not hasattr(x, "aval") or type(x).__name__ == "Literal":
            continue
        seen.add(id(x))
        if id(x) in inputs:
            reached.add(inputs[id(x)])
        elif id(x) in producer:
            todo.extend(producer[id(x)].invars)
    return reached


@pytest.mark.parametrize("branching", ["uniform", "per-rank"])
def test_no_output_layer_in_a_branch_without_the_last_stage(branching):
    """In the traced ticks, the output-layer matmuls (an output dim of Vp/t) and the cross-entropy's pmax appear
    only inside `head_backward`, in the forward ticks alone (the last stage's F runs the head forward and
    backward), and that call sits in a cond whose predicate is computed from the table's head column and the
    cell's kind (not from "active" or "embed")."""
    p, v, t = 2, 2, 2
    cfg = model_cfg(p, x64=False)
    parallel = layout(1, p, t, "interleaved", v, branching=branching)
    params, specs = abstract_params(cfg, parallel)
    step = make_parallel_grad_step(make_mesh(parallel), cfg, parallel, specs)
    jaxpr = jax.make_jaxpr(step)(params, *batch(parallel.num_microbatches))
    sched = pipeline_schedule(parallel)
    vocab_local = cfg.padded_vocab_size(t) // t  # no other matmul of the model has this output width
    assert vocab_local not in {cfg.hidden_size, cfg.ffn_size // t, cfg.head_dim, S}
    # the scan's rows, flattened in key order, are the body's last inputs
    names = sorted(columns(sched))
    bodies = tick_bodies(jaxpr.jaxpr, sched)
    assert {pattern for pattern, _ in bodies} == {"F", "FB", "B"}
    for pattern, body in bodies:
        first_row = len(body.invars) - len(names)
        assert vocab_local not in set(_dot_output_dims(body, skip="head_backward")), pattern
        outside = SimpleNamespace(eqns=[e for e in body.eqns if not _calls(e, "head_backward")])
        assert "pmax@tensor" not in summarize(jaxpr_collectives(outside)), pattern
        heads = [e for e in body.eqns if e.primitive.name == "cond" and _calls(e, "head_backward")]
        assert len(heads) == pattern.count("F"), pattern
        for cond in heads:
            reached = {names[i - first_row] for i in _inputs_reached(body, cond.invars[0]) if i >= first_row}
            assert "head" in reached and reached <= {"head", "kind"}, reached
            (head_branch,) = [br for br in cond.params["branches"] if any(named_calls(br.jaxpr, "head_backward"))]
            assert vocab_local in set(_dot_output_dims(head_branch.jaxpr))
            assert "pmax@tensor" in summarize(jaxpr_collectives(head_branch))


# --- dropout ------------------------------------------------------------------------------------------------------


def one_training_step(parallel, cfg, tcfg, key=7):
    """(loss, grad norm, updated parameters in model order) of one training step from `init_sharded_state`."""
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), cfg, opt, mesh, parallel)
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    state, metrics = step(state, *batch(parallel.num_microbatches), jax.random.key(key))
    params = sharding.reference_layout(state["params"], parallel)
    return float(metrics["lm_loss"]), float(metrics["grad_norm"]), params


@pytest.mark.parametrize(
    "d, t, schedule, v, branching, sp, recompute",
    [
        pytest.param(1, 2, "interleaved", 2, "uniform", False, "none", marks=pytest.mark.slow),
        pytest.param(1, 2, "interleaved", 2, "per-rank", True, "none", marks=pytest.mark.slow),
        pytest.param(2, 1, "1f1b", 1, "per-rank", False, "none", marks=pytest.mark.slow),
        pytest.param(1, 1, "gpipe", 1, "uniform", False, "none", marks=pytest.mark.slow),
        pytest.param(1, 1, "gpipe", 1, "uniform", False, "full", marks=pytest.mark.slow),
        # selective re-draws the attention dropout from the key stashed among the residuals (the default run checks
        # dropout at p > 1 through ZB-V's training step below)
        pytest.param(1, 1, "gpipe", 1, "uniform", False, "selective", marks=pytest.mark.slow),
    ],
)
def test_float64_dropout_step_equals_the_unpipelined_step(d, t, schedule, v, branching, sp, recompute):
    """With dropout, one training step at p = 2 gives the loss, grad norm and updated parameters of the p = 1
    step on the same data and tensor layout: every microbatch and layer draws the masks it draws there, and each
    backward's recomputed forward draws the masks of its forward (otherwise the gradients would not match)."""
    with jax.enable_x64(True):
        cfg = model_cfg(2).replace(hidden_dropout=0.2, attention_dropout=0.2)
        tcfg = TrainConfig(lr=1e-3, lr_warmup_iters=0, recompute_granularity=recompute)
        flat = ParallelConfig(
            data_parallel_size=d,
            tensor_model_parallel_size=t,
            micro_batch_size=1,
            global_batch_size=B,
            sequence_parallel=sp,
        )
        results = [
            one_training_step(parallel, model, tcfg)
            for parallel, model in (
                (layout(d, 2, t, schedule, v, sp=sp, branching=branching), cfg),
                (flat, cfg),
                (flat, cfg.replace(hidden_dropout=0.0, attention_dropout=0.0)),
            )
        ]
        (loss, norm, params), (ref_loss, ref_norm, ref_params), (plain_loss, _, _) = results
        assert abs(loss - plain_loss) > 1e-3  # dropout did act
        assert loss == pytest.approx(ref_loss, rel=1e-12) and norm == pytest.approx(ref_norm, rel=1e-12)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-11, atol=1e-13)


@pytest.mark.slow  # the default run checks dropout at p > 1 exactly (ZB-V's training step below)
def test_dropout_training_at_p2_lowers_the_loss(small_corpus):
    from ptd_jax.train import RunOptions, train

    cfg = model_cfg(2, x64=False).replace(seq_length=32, hidden_dropout=0.1, attention_dropout=0.1)
    summary = train(
        cfg,
        layout(1, 2, 1, "interleaved", 2).replace(global_batch_size=8),
        TrainConfig(train_iters=25, lr=3e-3, lr_warmup_iters=2, log_interval=5, eval_iters=0),
        RunOptions(data_path=small_corpus, progress=False),
    )
    assert summary["final_lm_loss"] < summary["first_lm_loss"] - 1.0


# --- end to end: float32 loss traces ----------------------------------------------------------------------------


# 20 training iterations each (about 30 s): the default run checks single steps exactly in float64 instead
@pytest.mark.slow
@pytest.mark.parametrize("d, p, t, schedule, v", [(1, 2, 2, "interleaved", 2), (2, 2, 2, "1f1b", 1)])
def test_20_iteration_trace_matches_the_reference(small_corpus, tmp_path, d, p, t, schedule, v):
    from ptd_jax.train import RunOptions, train

    cfg = model_cfg(p, x64=False).replace(seq_length=32)
    tcfg = TrainConfig(train_iters=20, lr=3e-3, min_lr=2e-4, lr_warmup_iters=2, log_interval=1, eval_iters=0)
    parallel = ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=8,
    )
    train(
        cfg, parallel, tcfg, RunOptions(data_path=small_corpus, progress=False, metrics_file=str(tmp_path / "pp.jsonl"))
    )
    train(
        cfg,
        ParallelConfig(micro_batch_size=4, global_batch_size=8),
        tcfg,
        RunOptions(
            data_path=small_corpus, progress=False, reference_step=True, metrics_file=str(tmp_path / "ref.jsonl")
        ),
    )
    pp = [json.loads(line)["lm_loss"] for line in (tmp_path / "pp.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["lm_loss"] for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert len(pp) == len(ref) == 20 and ref[-1] < ref[0] - 1.0
    np.testing.assert_allclose(pp, ref, rtol=1e-5)


# --- recomputation -------------------------------------------------------------------------------------------------


def _chunk_work(recompute, sp=False):
    """{"forward", "backward"}: (matmuls, tensor collectives) of one layer's work in a forward tick (`layer_forward`)
    and in a backward tick (`layer_backward`); p = 2, t = 2, GPipe (fused backwards), per-rank."""
    cfg = model_cfg(2, x64=False)
    parallel = layout(1, 2, 2, "gpipe", 1, sp=sp, branching="per-rank")
    params, specs = abstract_params(cfg, parallel)
    step = make_parallel_grad_step(make_mesh(parallel), cfg, parallel, specs, recompute=recompute)
    jaxpr = jax.make_jaxpr(step)(params, *batch(parallel.num_microbatches))
    bodies = dict(tick_bodies(jaxpr.jaxpr, pipeline_schedule(parallel)))

    def count(body, names):
        calls = [call for name in names for call in named_calls(body, name)]
        return (
            sum(len(_dot_output_dims(c)) for c in calls),
            sum(e["count"] for c in calls for e in summarize(jaxpr_collectives(c)).values()),
        )

    return {"forward": count(bodies["F"], ["layer_forward"]), "backward": count(bodies["B"], ["layer_backward"])}


def test_recomputation_runs_what_megatron_runs():
    """Megatron's semantics, counted per layer in the traced ticks (`layer_forward`, `layer_backward`):
    - none: a backward runs 2 matmuls per forward matmul (input and weight gradients) and recomputes nothing;
    - selective: plus the attention core's scores matmul (the backward needs the softmax, not the context, so
      autodiff recomputes only q·kᵀ; Megatron re-runs the core's second matmul too), and not one collective
      more than none;
    - full: plus each layer's forward once, under `jax.checkpoint` as in the reference: all of it but fc2, whose
      output the backward does not need (3 per forward matmul, less one: each layer is recomputed once, not
      twice), with one collective per layer: the attention block's all-reduce (the MLP's follows fc2; the
      embedding is not recomputed: layer 0's input is stashed)."""
    counts = {r: _chunk_work(r) for r in ("none", "selective", "full")}
    fwd_dots = counts["none"]["forward"][0]
    assert fwd_dots == 6  # qkv, scores, context, projection, fc1, fc2
    for r in counts:
        assert counts[r]["forward"] == counts["none"]["forward"]  # forwards are the same everywhere
    dots = {r: counts[r]["backward"][0] for r in counts}
    assert dots == {"none": 2 * fwd_dots, "selective": 2 * fwd_dots + 1, "full": 3 * fwd_dots - 1}
    collectives = {r: counts[r]["backward"][1] for r in counts}
    assert collectives["selective"] == collectives["none"] == 2  # per layer: the transposes of its two f's
    assert collectives["full"] == collectives["none"] + 1  # the attention block's all-reduce; the MLP's follows fc2


def test_sequence_parallel_backward_gathers_again_and_recomputes_no_matmul():
    """Under sequence parallelism and none/selective, a layer stashes its LayerNorm outputs as the rank's 1/t of the
    sequence and its backward issues the two forward all-gathers again (Megatron's arrangement), beside the
    transposes of the layer's 2 all-gathers and 2 reduce-scatters; the matmuls are counted as without it: none
    recomputes no matmul, selective only q·kᵀ."""
    counts = {r: _chunk_work(r, sp=True) for r in ("none", "selective")}
    fwd_dots = counts["none"]["forward"][0]
    assert fwd_dots == 6 and counts["none"]["forward"][1] == 4  # 2 all-gathers + 2 reduce-scatters a layer
    assert {r: counts[r]["backward"][0] for r in counts} == {"none": 2 * fwd_dots, "selective": 2 * fwd_dots + 1}
    assert {r: counts[r]["backward"][1] for r in counts} == {"none": 4 + 2, "selective": 4 + 2}


# Fused backwards under recomputation; the default run has each policy on the split schedules above
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_float64_pipeline_with_recomputation_equals_the_reference(recompute):
    with jax.enable_x64(True):
        compare(layout(1, 2, 2, "interleaved", 2), model_cfg(2), rtol=1e-12, recompute=recompute)


# --- the distributed optimizer and `--pipeline-schedule auto` ---------------------------------------------------


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), pytest.param("zb-h1", 1, marks=pytest.mark.slow)])
def test_float64_distributed_optimizer_step_equals_the_unpipelined_step(schedule, v):
    """One training step at (d, p, t) = (2, 2, 2) under the distributed optimizer (master weights and moments split
    over "data", gradients reduce-scattered), a split schedule and a fused one: the loss, grad norm and updated
    parameters of the single-device step with the plain optimizer."""
    with jax.enable_x64(True):
        cfg = model_cfg(2)
        tcfg = TrainConfig(lr=1e-3, lr_warmup_iters=0)
        parallel = layout(2, 2, 2, schedule, v, branching="per-rank").replace(use_distributed_optimizer=True)
        flat = ParallelConfig(micro_batch_size=1, global_batch_size=B)
        (loss, norm, params), (ref_loss, ref_norm, ref_params) = (
            one_training_step(x, cfg, tcfg) for x in (parallel, flat)
        )
        assert loss == pytest.approx(ref_loss, rel=1e-12) and norm == pytest.approx(ref_norm, rel=1e-12)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            got = np.asarray(got)[tuple(slice(0, n) for n in np.shape(want))]  # t = 2 pads the vocabulary rows
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-11, atol=1e-13)


def test_float64_pipeline_of_the_auto_schedule_equals_the_reference():
    """`--pipeline-schedule auto` at p = 4 (8 layers, m = 8): the layout ptd-train builds from its choice runs
    exactly."""
    from ptd_jax.cli import train as cli

    args = cli.build_parser().parse_args(
        [
            "--fake-devices",
            "4",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers",
            "8",
            "--pipeline-schedule",
            "auto",
            "--global-batch-size",
            str(B),
            "--micro-batch-size",
            "1",
        ]
    )
    cli.fill_defaults(args)
    parallel = cli.parallel_config_from_args(args, cli.model_config_from_args(args), 4)
    assert parallel.pipeline_schedule in SCHEDULE_SPECS and parallel.num_microbatches == B
    with jax.enable_x64(True):
        compare(parallel, model_cfg(4), rtol=1e-12)


# --- split backwards and the V ------------------------------------------------------------------------------------


def test_uniform_branching_is_refused_for_unit_tables():
    with pytest.raises(ConfigError, match="zb-h1.*per-rank.*'uniform'"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", pipeline_branching="uniform")


def test_zb_v_needs_two_ranks():
    with pytest.raises(ConfigError, match="zb-v schedule needs pipeline_model_parallel_size >= 2"):
        ParallelConfig(pipeline_model_parallel_size=1, virtual_pipeline_stages=2, pipeline_schedule="zb-v")


@pytest.mark.parametrize(
    "schedule, recompute", [pytest.param("zb-v", "selective"), pytest.param("zb-h1", "none", marks=pytest.mark.slow)]
)
def test_float64_dropout_train_step_of_split_schedules(schedule, recompute):
    """A whole training step with dropout (state made by `init_sharded_state`, so ZB-V's V layout too): the
    loss, grad norm and updated parameters of the p = 1 step. I's and W's masks are the F's, re-drawn from the
    stashed keys under selective recomputation."""
    with jax.enable_x64(True):
        cfg = model_cfg(2).replace(hidden_dropout=0.2, attention_dropout=0.2)
        tcfg = TrainConfig(lr=1e-3, lr_warmup_iters=0, recompute_granularity=recompute)
        flat = ParallelConfig(micro_batch_size=1, global_batch_size=B)
        v = dict(SCHEDULES)[schedule]
        (loss, norm, params), (ref_loss, ref_norm, ref_params) = (
            one_training_step(parallel, cfg, tcfg)
            for parallel in (layout(1, 2, 1, schedule, v, branching="per-rank"), flat)
        )
        assert loss == pytest.approx(ref_loss, rel=1e-12) and norm == pytest.approx(ref_norm, rel=1e-12)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-11, atol=1e-13)


def test_the_tolerance_catches_a_dropped_weight_gradient(monkeypatch):
    """The exactness check can fail: a W that adds nothing for the first layer of each chunk (one kernel
    gradient lost per chunk and microbatch) is caught by `compare` at its tolerance."""
    from ptd_jax.parallel.pipeline import executor

    original = executor.LayerStep.weight_backward

    def lossy(self, params_j, h, bufs, slots, j):
        h, rows, grads = original(self, params_j, h, bufs, slots, j)
        return h, rows, jax.tree.map(lambda g: jnp.where(j == 0, jnp.zeros_like(g), g), grads)

    monkeypatch.setattr(executor.LayerStep, "weight_backward", lossy)
    with jax.enable_x64(True), pytest.raises(AssertionError, match="relative error"):
        compare(layout(1, 2, 1, "zb-h1", 1, branching="per-rank"), model_cfg(2), rtol=1e-12)


def _split_record(monkeypatch, schedule, v, t):
    """(the record layout `stash.Record`, the matmuls of one layer's W) of a split table at p = 4, traced."""
    from ptd_jax.parallel.pipeline import stash

    seen, original = [], stash.Record.layout
    monkeypatch.setattr(
        stash.Record, "layout", staticmethod(lambda res, taps: seen.append(original(res, taps)) or seen[-1])
    )
    cfg = model_cfg(4, x64=False).replace(fused_kernels=True)  # fused LayerNorm (as a GPU runs it), traced only
    parallel = layout(1, 4, t, schedule, v, branching="per-rank")
    params, specs = abstract_params(cfg, parallel)
    step = make_parallel_grad_step(make_mesh(parallel), cfg, parallel, specs)
    jaxpr = jax.make_jaxpr(step)(params, *batch(parallel.num_microbatches))
    (w,) = {len(_dot_output_dims(body)) for body in named_calls(jaxpr.jaxpr, "layer_weight_backward")}
    return seen[-1], w


@pytest.mark.parametrize("schedule, v, t", [("zb-h1", 1, 1), ("zb-v", 2, 2), ("1f1b", 1, 2)])
def test_a_waiting_w_keeps_no_more_than_an_f(monkeypatch, schedule, v, t):
    """With the fused LayerNorm (its outputs are residuals, as on a GPU): where a microbatch waits between its I and
    its W (ZB-H1, ZB-V), each of its 7 taps takes the place of a residual (no "w" buffer: a W-waiting microbatch
    holds no more than an F-waiting one) and W recomputes fc2's input from fc1's (5 matmuls: 4 kernel gradients and
    fc1). Where W follows I at once (1F1B), W keeps fc2's input as an 8th tap and runs the 4 kernel gradients alone."""
    record, w_matmuls = _split_record(monkeypatch, schedule, v, t)
    waits = schedule != "1f1b"
    assert len(record.tap_entries) == (7 if waits else 8)
    assert w_matmuls == (5 if waits else 4)
    if waits:
        assert "w" not in record.pools
