"""Checkpoints (`ptd_jax/train/checkpoint.py`, `parallel/sharding.py`'s canonical form): any layout in, any layout
out; resume is exact; a killed save leaves the previous step loadable; auto-resume and its refusals."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ptd_jax.config import TrainConfig
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import init_sharded_state
from ptd_jax.train import RunOptions, checkpoint, train
from tests.helpers.checkpoints import MODEL, layout, random_state
from tests.helpers.cli import run_train

SMALL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--global-batch-size",
    "8",
    "--no-progress",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]


@pytest.mark.parametrize(
    "target",
    [
        pytest.param((1, 4, 2, 2), marks=pytest.mark.slow),
        pytest.param((8, 1, 1, 1), marks=pytest.mark.slow),
        (1, 2, 4, 1),  # the default run: another p and t
    ],
)
def test_a_checkpoint_of_one_layout_restores_exactly_into_another(tmp_path, target):
    """Saved at (d,p,t,v) = (2,2,2,1), restored at `target`: the canonical state (params and Adam moments) is
    bitwise the saved one, and the padded vocabulary rows are zero."""
    optimizer = make_optimizer(TrainConfig())
    source = layout(2, 2, 2, 1)
    state, mesh = random_state(source, optimizer)
    with checkpoint.Checkpointer(tmp_path, optimizer=optimizer, model_cfg=MODEL, parallel=source) as c:
        c.save(3, state, {"note": "test"})
    assert checkpoint.latest_step(tmp_path) == 3
    dest = layout(*target)
    dest_mesh = make_mesh(dest)
    like = init_sharded_state(jax.random.key(9), MODEL, optimizer, dest_mesh, dest)
    restored = checkpoint.restore(
        tmp_path, 3, like, optimizer=optimizer, model_cfg=MODEL, parallel=dest, mesh=dest_mesh
    )
    for name in ("params", "opt_state"):
        got = jax.tree.map(lambda x: x.sharding, restored[name])
        assert jax.tree.leaves(got) == jax.tree.leaves(jax.tree.map(lambda x: x.sharding, like[name]))
    want = sharding.to_canonical(optimizer, state, MODEL.vocab_size, True)
    have = sharding.to_canonical(optimizer, restored, MODEL.vocab_size, dest.pipeline_model_parallel_size > 1)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, have)
    word = np.asarray(restored["params"]["embed"]["word"])
    assert word.shape[0] == MODEL.padded_vocab_size(target[2]) and not word[MODEL.vocab_size :].any()
    mu_word = np.asarray(restored["opt_state"][0].mu["embed"]["word"])
    assert not mu_word[MODEL.vocab_size :].any()


@pytest.mark.parametrize(
    "target",
    [
        pytest.param((2, 2, 2, 1, False), marks=pytest.mark.slow),
        (1, 1, 2, 4, True),  # the default run: another c, under the distributed optimizer
        pytest.param((2, 1, 1, 4, False), marks=pytest.mark.slow),
    ],
)
def test_the_context_axis_does_not_change_the_canonical_form(tmp_path, target):
    """Saved at (d,p,t,c) = (2,1,2,2) with the distributed optimizer (its shards over data), restored at
    c = 1 and c = 4, with and without it: the canonical state is bitwise the saved one (issue #36: save at c = 2,
    load at c = 1 or 4)."""
    optimizer = make_optimizer(TrainConfig())
    source = layout(2, 1, 2, 1).replace(
        context_parallel_size=2, cp_comm_type="all_gather", use_distributed_optimizer=True
    )
    state, _ = random_state(source, optimizer)
    with checkpoint.Checkpointer(tmp_path, optimizer=optimizer, model_cfg=MODEL, parallel=source) as c:
        c.save(1, state, {})
    d, p, t, cp, distributed = target
    dest = layout(d, p, t, 1).replace(
        context_parallel_size=cp, cp_comm_type="all_gather", use_distributed_optimizer=distributed
    )
    dest_mesh = make_mesh(dest)
    like = init_sharded_state(jax.random.key(9), MODEL, optimizer, dest_mesh, dest)
    restored = checkpoint.restore(
        tmp_path, 1, like, optimizer=optimizer, model_cfg=MODEL, parallel=dest, mesh=dest_mesh
    )
    want = sharding.to_canonical(optimizer, state, MODEL.vocab_size, False)
    have = sharding.to_canonical(optimizer, restored, MODEL.vocab_size, p > 1)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, have)


def _losses(path):
    return {
        r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, open(path)) if r.get("kind") == "train"
    }


LAYOUTS = {
    "1x1x1": ["--fake-devices", "1", "--micro-batch-size", "8", "--hidden-dropout", "0.1"],  # + the RNG
    "3d-interleaved": [
        "--fake-devices",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--pipeline-schedule",
        "interleaved",
        "--micro-batch-size",
        "2",
    ],
}


# Three training processes each (about 35 s): -m slow. The default run resumes bitwise in this process
# (tests/cli/test_blends.py) and restores across layouts above.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["1x1x1", "3d-interleaved"])
def test_resume_in_a_new_process_is_bitwise_an_uninterrupted_run(small_corpus, tmp_path, name):
    """20 iterations straight == 10 + save + a new process that loads and runs 10 more, bitwise (float32),
    though the second process asks for 40 iterations (stopped at 20 by --exit-interval; --lr-decay-iters fixed)."""
    common = [*SMALL, *LAYOUTS[name], "--data-path", small_corpus, "--lr-decay-iters", "40"]
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "b.jsonl")
    a = run_train(*common, "--train-iters", "20", "--metrics-file", str(tmp_path / "a.jsonl"))
    assert a.returncode == 0, a.stderr
    b1 = run_train(
        *common,
        "--train-iters",
        "10",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--save-interval",
        "5",
        "--metrics-file",
        metrics,
    )
    assert b1.returncode == 0, b1.stderr
    assert "holds no checkpoint yet: starting from scratch" in b1.stderr
    shutil.rmtree(tmp_path / "ckpt" / "10")  # resume from 5: iterations 6-10 of the metrics file are cut back
    b2 = run_train(
        *common,
        "--train-iters",
        "40",
        "--exit-interval",
        "20",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--metrics-file",
        metrics,
    )
    assert b2.returncode == 0, b2.stderr
    assert "resuming from iteration 5" in b2.stderr
    summary = json.loads(b2.stdout.splitlines()[-1])
    assert summary["iterations"] == 15 and summary["last_iteration"] == 20
    with open(metrics) as f:
        iterations = [json.loads(line)["iteration"] for line in f]
    assert iterations == list(range(1, 21))  # each once
    straight, resumed = _losses(tmp_path / "a.jsonl"), _losses(metrics)
    assert straight == resumed  # bitwise: the floats compare equal
    assert checkpoint.all_steps(ckpt) == [5, 20]


@pytest.fixture(scope="module")
def straight_run(small_corpus, tmp_path_factory):
    """8 iterations at (d,p,t,v) = (2,2,2,1), saving at 3 (and 8): the run that never changes layout."""
    root = tmp_path_factory.mktemp("straight")
    summary = train(
        MODEL.replace(seq_length=32),
        layout(2, 2, 2, 1),
        RESHARD_TRAIN.replace(save_interval=3),
        RunOptions(data_path=small_corpus, progress=False, save=str(root / "ckpt"), metrics_file=str(root / "a.jsonl")),
    )
    assert summary["iterations"] == 8 and checkpoint.all_steps(root / "ckpt") == [3, 6, 8]
    return root


RESHARD_TRAIN = TrainConfig(train_iters=8, lr=1e-3, lr_warmup_iters=2, log_interval=1, eval_iters=0)


@pytest.mark.slow  # two training runs (about 30 s); the default run restores across layouts bitwise above
@pytest.mark.parametrize("target", [(1, 4, 2, 2), (8, 1, 1, 1), (1, 2, 4, 1)])
def test_resharded_training_continues_as_if_the_layout_never_changed(small_corpus, straight_run, tmp_path, target):
    """Load step 3 of the (2,2,2,1) run at `target` and train 5 more: the losses equal the unchanged run's
    (rtol 1e-5) — parameters and optimizer state were carried over."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight_run / "ckpt", ckpt)
    for step in (6, 8):
        shutil.rmtree(ckpt / str(step))  # --load takes the newest: make it step 3
    train(
        MODEL.replace(seq_length=32),
        layout(*target),
        RESHARD_TRAIN,
        RunOptions(data_path=small_corpus, progress=False, load=str(ckpt), metrics_file=str(tmp_path / "b.jsonl")),
    )
    a, b = _losses(straight_run / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert sorted(b) == [4, 5, 6, 7, 8]
    for i in b:
        np.testing.assert_allclose(b[i], a[i], rtol=1e-5)


@pytest.mark.slow  # 30 s: a training subprocess killed mid-save
def test_sigkill_during_an_asynchronous_save_leaves_the_last_complete_step(small_corpus, tmp_path):
    """SIGKILL while orbax writes a step (its temporary folder exists): the step is not listed, the previous one
    loads, and the resumed run cleans the partial folder up."""
    ckpt = tmp_path / "ckpt"
    args = [
        *SMALL,
        "--fake-devices",
        "1",
        "--micro-batch-size",
        "8",
        "--data-path",
        small_corpus,
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "1",
    ]
    partial, steps = None, []
    for _ in range(3):  # the save may finish between seeing its folder and the kill: then try again
        shutil.rmtree(ckpt, ignore_errors=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ptd_jax.cli.train", *args, "--train-iters", "100000"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 300
        try:
            while time.time() < deadline and proc.poll() is None:
                if len(checkpoint.all_steps(ckpt)) >= 2 and list(ckpt.glob("*.orbax-checkpoint-tmp*")):
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.001)
        finally:
            proc.kill()
            proc.wait()
        writing = [p.name for p in ckpt.glob("*.orbax-checkpoint-tmp*")]
        if writing:
            partial, steps = writing[0], checkpoint.all_steps(ckpt)
            break
    assert partial, "the run was never caught mid-save"
    assert int(partial.split(".")[0]) not in steps and len(steps) >= 2
    last = steps[-1]
    resumed = run_train(*args, "--train-iters", str(last + 2))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from iteration {last}" in resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["iterations"] == 2
    assert not list(ckpt.glob("*.orbax-checkpoint-tmp*"))  # the partial step was cleaned up


def _main(*args):
    """ptd-train in this process: (exit code, stderr, summary or None)."""
    import contextlib
    import io

    from ptd_jax.cli.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    lines = out.getvalue().splitlines()
    return code, err.getvalue(), json.loads(lines[-1]) if code == 0 and lines else None


@pytest.mark.slow  # 60 s: four training runs
def test_resume_options_no_load_optim_override_data_config_and_finetune(small_corpus, tmp_path):
    """In this process (8 devices, d = 8): --no-load-optim keeps the parameters and the learning rate's position
    but not Adam's moments; --override-data-config takes another seed and says so; --finetune starts at 0. The
    refusals are in tests/cli/test_bad_input_train.py."""
    ckpt = str(tmp_path / "ckpt")
    base = [
        *SMALL,
        "--micro-batch-size",
        "1",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--data-path",
        small_corpus,
        "--lr-decay-iters",
        "6",
    ]
    code, err, _ = _main(*base, "--train-iters", "2", "--save", ckpt, "--keep-checkpoints", "1", "--save-interval", "1")
    assert code == 0, err
    assert checkpoint.all_steps(ckpt) == [2]  # --keep-checkpoints 1 dropped step 1

    runs = {}
    for name, extra in {
        "resume": [],
        "no-optim": ["--no-load-optim", "--save", str(tmp_path / "no-optim"), "--save-interval", "1"],
        "override": ["--seed", "7", "--override-data-config", "--save", str(tmp_path / "override")],
    }.items():
        metrics = str(tmp_path / f"{name}.jsonl")
        code, err, summary = _main(*base, "--train-iters", "4", "--load", ckpt, "--metrics-file", metrics, *extra)
        assert code == 0 and summary["start_iteration"] == 2 and summary["iterations"] == 2, err
        runs[name] = (_losses(metrics), err)
    resume, no_optim, override = (runs[k][0] for k in ("resume", "no-optim", "override"))
    assert resume[3][0] == no_optim[3][0]  # the same parameters and batch: the same loss at iteration 3 ...
    assert resume[4][0] != no_optim[4][0]  # ... but a fresh Adam moves them differently
    assert "optimizer state not loaded" in runs["no-optim"][1]
    # Adam's first step moves every weight by about the learning rate: lr(2) = 1e-3 after 2 warm-up iterations
    # (a fresh optimizer whose schedule restarted at 0 would move nothing in this warm-up step)
    (_, before), (_, after) = checkpoint.read_params(ckpt, 2), checkpoint.read_params(tmp_path / "no-optim", 3)
    moved = np.abs(after["layers"]["mlp"]["fc1_kernel"] - before["layers"]["mlp"]["fc1_kernel"])
    assert np.median(moved) == pytest.approx(1e-3, rel=0.02)
    assert "the data configuration changes (saved, now): {'seed': (1234, 7)}" in runs["override"][1]
    assert override[3][0] != resume[3][0]  # another seed: other samples at iteration 3
    # ... but the dropout key (the RNG state) goes on from the checkpoint, not from the new seed
    assert checkpoint.read_meta(tmp_path / "override", 4)["rng_key"] == checkpoint.read_meta(ckpt, 2)["rng_key"]
    assert checkpoint.read_meta(tmp_path / "override", 4)["data"]["seed"] == 7

    code, err, summary = _main(*base, "--train-iters", "3", "--load", ckpt, "--finetune")
    assert code == 0 and summary["start_iteration"] == 0 and summary["iterations"] == 3, err
    assert "fine-tuning from iteration 2" in err
