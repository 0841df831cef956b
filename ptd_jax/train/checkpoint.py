"""Orbax checkpoints in a canonical form that no layout leaks into (`--save`, `--load`, `--keep-checkpoints`).

A checkpoint is one orbax step folder with three items:
- "params" and "opt_state": the state in the canonical form of `parallel/sharding.py` (layers [L, ...] in model
  order, the unpadded vocabulary, Adam moments alike), so a step written under any (d, p, t, v) loads under any
  other;
- "meta" (JSON): iteration, the learning-rate schedule's step (the updates applied: skipped iterations do not
  count), consumed samples, the dropout key, the data configuration, the data's tokenizer (for
  ptd-generate) and the run's configs.

Saving is asynchronous: `Checkpointer.save` blocks only for the device-to-host copy, and orbax writes the step under
a temporary name that it renames when complete, so a crash (SIGKILL included) mid-save leaves the previous step
loadable and `latest_step` never sees the partial one. The last K steps are kept. In a multi-process run the
canonical form is taken on the devices and every process writes the shards it holds (orbax's multi-process
save: replicated shards are split among their holders); the files are the same canonical arrays, so a step
written by N processes loads in any number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zlib
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, schedule_spec
from ptd_jax.data import DataError, parse_split
from ptd_jax.optimizer import at_schedule_step, schedule_count
from ptd_jax.parallel import sharding
from ptd_jax.runtime.failures import RunError

FORMAT_VERSION = 2
"""2: the fused QKV stored per query group, [L, D, G, R+2, K] (1 stored [L, D, 3, H, K] and is refused: read it with
the ptd_jax that wrote it, `ptd-convert to-hf`, then `ptd-convert from-hf` here)."""
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "ffn_hidden_size",
    "max_position_embeddings",
    "normalization",
    "layernorm_epsilon",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "num_query_groups",
    "kv_channels",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "add_qkv_bias",
    "window_size",
)
"""Fields that fix the canonical shapes or the function the weights compute; everything else (padding, dtype,
dropout, layout, kernels) may change on load. A checkpoint written before a field existed has its default."""


FILES_RECORD = "ptd_files.json"
"""Written into a step's folder once orbax has committed it: every file's size, and the CRC-32 of the small ones
(metadata, manifests), checked before a restore reads anything (`check_intact`)."""
CHECKSUM_MAX_BYTES = 1 << 20
"""Files up to this size get a CRC-32 besides their size (the data files, often GBs, their size only)."""


def record_files(step_dir) -> None:
    """Write `FILES_RECORD` for the committed step folder `step_dir` (through a temporary name: a crash leaves
    no half-written record, and a step without one is restored unverified)."""
    step_dir = Path(step_dir)
    files = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != FILES_RECORD and not path.name.startswith(f"{FILES_RECORD}."):
            size = path.stat().st_size
            crc = zlib.crc32(path.read_bytes()) if size <= CHECKSUM_MAX_BYTES else None
            files[path.relative_to(step_dir).as_posix()] = [size, crc]
    tmp = step_dir / f"{FILES_RECORD}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"version": 1, "files": files}))
    os.replace(tmp, step_dir / FILES_RECORD)


def damage(directory, step: int) -> str | None:
    """What is wrong with step `step` of `directory` against its `FILES_RECORD` (None: intact, or saved without a
    record)."""
    step_dir = Path(directory) / str(step)
    record_file = step_dir / FILES_RECORD
    if not record_file.exists():
        return None
    try:
        files = json.loads(record_file.read_text())["files"]
        entries = [(name, int(size), crc) for name, (size, crc) in files.items()]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its file list {FILES_RECORD} is unreadable"
    for name, size, crc in entries:
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} when saved"
        if crc is not None and zlib.crc32(path.read_bytes()) != crc:
            return f"{name} changed since it was saved"
    return None


def check_intact(directory, step: int, flag: str = "--load") -> None:
    """Refuse a damaged step (a file truncated, missing or changed since the save) in one line naming it and the
    newest intact step before it."""
    problem = damage(directory, step)
    if problem is None:
        return
    earlier = next((s for s in reversed(all_steps(directory)) if s < step and damage(directory, s) is None), None)
    hint = (
        f"; step {earlier} is intact: move {Path(directory) / str(step)} aside to use it"
        if earlier is not None
        else "; no earlier step is intact"
    )
    raise ConfigError(f"{flag} {directory} step {step} is damaged: {problem}{hint}")


def _manager(directory, *, create: bool, keep: int | None = None, async_save: bool = False):
    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, cleanup_tmp_directories=create, enable_async_checkpointing=async_save
        ),
    )


def latest_step(directory) -> int | None:
    """The newest complete step in `directory` (None when it holds none, or does not exist)."""
    return max(all_steps(directory), default=None)


def all_steps(directory) -> list[int]:
    if not Path(directory).is_dir():
        return []
    with _manager(directory, create=False) as manager:
        return sorted(manager.all_steps())


def _v_shape(parallel: ParallelConfig) -> bool:
    """A V-shaped schedule (ZB-V) stores chunk 1 of rank r as virtual stage 2p − 1 − r (`sharding.stage_layers`)."""
    return schedule_spec(parallel.pipeline_schedule).stage_map == "v" and parallel.pipeline_model_parallel_size > 1


def _pipelined(parallel: ParallelConfig) -> bool:
    return parallel.pipeline_model_parallel_size > 1


def _canonical_shardings(mesh, optimizer, canonical_abstract, parallel: ParallelConfig):
    specs = sharding.canonical_specs(optimizer, canonical_abstract, parallel.pipeline_model_parallel_size)
    return sharding.named(mesh, specs)


class Checkpointer:
    """Saves a run's state every `save` call, asynchronously, keeping the newest `keep` steps (None: all)."""

    def __init__(
        self,
        directory,
        *,
        optimizer,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        keep: int | None = None,
        async_save: bool = True,
        mesh=None,
        on_devices: bool | None = None,
    ):
        """`on_devices`: take the canonical form on the devices (None: when several processes run, which must)."""
        self.directory = Path(directory)
        self._manager = _manager(directory, create=True, keep=keep, async_save=async_save)
        self._optimizer, self._model_cfg, self._parallel, self._mesh = optimizer, model_cfg, parallel, mesh
        self._on_devices = jax.process_count() > 1 if on_devices is None else on_devices
        self._convert = None  # the jitted conversion, built at the first save on the devices
        self._unrecorded: list[int] = []  # steps written whose file list (`record_files`) is still to write

    def save(self, iteration: int, state, meta: dict) -> None:
        """Write `state` as step `iteration` (returns once the arrays are copied to the host)."""
        body = {"params": state["params"], "opt_state": state["opt_state"]}
        to_canonical = partial(
            sharding.to_canonical,
            self._optimizer,
            vocab_size=self._model_cfg.vocab_size,
            pipelined=_pipelined(self._parallel),
            v_shape=_v_shape(self._parallel),
        )
        if self._on_devices:  # several processes: none sees every shard; convert on the devices, each writes its own
            canonical = self._canonical_on_devices(to_canonical, body)
        else:
            # The one blocking part: copy the state to the host as it lies. The canonical form is then numpy views
            # of that copy (a reshape and a slice), so it costs no device memory and no device time; orbax writes
            # it in the background.
            canonical = to_canonical(jax.device_get(body))
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "schedule_step": int(schedule_count(state["opt_state"])),
            **meta,
        }
        self._record_finished()  # orbax's save would wait for the previous one anyway
        try:
            self._manager.save(
                iteration,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(canonical["params"]),
                    opt_state=ocp.args.StandardSave(canonical["opt_state"]),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except (OSError, ValueError) as err:  # orbax's synchronous part; the earlier steps stay as they were
            raise self._failed(iteration, err) from None
        self._unrecorded.append(iteration)

    def _failed(self, iteration, err: Exception) -> RunError:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        return RunError(
            f"--save {self.directory}: cannot write step {iteration} ({why[:200]}); the earlier steps are kept"
        )

    def _record_finished(self) -> None:
        """Wait for the asynchronous write, then record the files of the steps it committed (process 0 only)."""
        steps, self._unrecorded = self._unrecorded, []
        try:
            self._manager.wait_until_finished()
            if jax.process_index() == 0:
                for step in steps:
                    if (self.directory / str(step)).is_dir():  # not deleted by --keep-checkpoints meanwhile
                        record_files(self.directory / str(step))
        except OSError as err:  # a full disk: the step is not committed, or has no file list (restored unverified)
            raise self._failed(steps[-1] if steps else "?", err) from None

    def _canonical_on_devices(self, to_canonical, body):
        """The canonical form as global arrays in the restore's shardings (one jit; a second copy of the state on
        the devices until orbax has copied it to the host)."""
        if self._convert is None:
            mesh = self._mesh if self._mesh is not None else jax.tree.leaves(body)[0].sharding.mesh
            shardings = _canonical_shardings(mesh, self._optimizer, jax.eval_shape(to_canonical, body), self._parallel)
            self._convert = jax.jit(to_canonical, out_shardings=shardings)
        return self._convert(body)

    def wait(self) -> None:
        self._record_finished()

    def close(self) -> None:
        self._record_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_meta(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    train_cfg: TrainConfig,
    *,
    consumed_samples: int,
    rng_key,
    data_config: dict,
    tokenizer: dict | None = None,
) -> dict:
    """The "meta" item of a step (JSON): what a resume needs besides the arrays, and the data's tokenizer (for
    ptd-generate)."""
    return {
        "consumed_samples": consumed_samples,
        "tokenizer": tokenizer,
        "rng_key": [int(x) for x in jax.device_get(jax.random.key_data(rng_key)).ravel()],
        "data": data_config,
        "model": dataclasses.asdict(model_cfg),
        "parallel": dataclasses.asdict(parallel),
        "train": dataclasses.asdict(train_cfg),
    }


def read_meta(directory, step: int, flag: str = "--load") -> dict:
    """Step `step`'s "meta" item, once the step is checked intact (`check_intact`)."""
    check_intact(directory, step, flag)
    path = Path(directory).absolute()
    try:
        with _manager(path, create=False) as manager:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # orbax and tensorstore raise many kinds; a damaged step gets one line
        raise ConfigError(
            f"--load {directory} step {step} has no readable metadata ({type(err).__name__}: {err})".splitlines()[0]
        ) from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        hint = (
            " (QKV stored [D, 3, H, K]: convert it with the ptd_jax that wrote it, ptd-convert to-hf, then ptd-convert "
            "from-hf here)"
            if version == 1
            else ""
        )
        raise ConfigError(
            f"--load {directory} step {step} has format_version={version}, this ptd_jax reads {FORMAT_VERSION}{hint}"
        )
    missing = [k for k in ("iteration", "consumed_samples", "rng_key", "data", "model", "train") if k not in meta]
    if missing or not isinstance(meta["model"], dict):
        raise ConfigError(f"--load {directory} step {step} has incomplete metadata (missing {missing or ['model']})")
    return meta


def _shape_fields(model: dict) -> dict:
    """The fields that fix the architecture, defaults resolved (ffn 4h, positions = seq_length, G = heads, K = h/a;
    no position table under RoPE, so its length does not matter)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields = {k: model.get(k, defaults[k]) for k in ARCHITECTURE_FIELDS}
    fields["ffn_hidden_size"] = fields["ffn_hidden_size"] or 4 * model["hidden_size"]
    fields["max_position_embeddings"] = fields["max_position_embeddings"] or model["seq_length"]
    fields["num_query_groups"] = fields["num_query_groups"] or model["num_attention_heads"]
    fields["kv_channels"] = fields["kv_channels"] or model["hidden_size"] // model["num_attention_heads"]
    if fields["position_embedding_type"] == "rope":
        fields["max_position_embeddings"] = None
    else:  # the rotary settings change nothing without RoPE
        fields.update(
            {k: None for k in ARCHITECTURE_FIELDS if k.startswith(("rotary_", "rope_")) or k == "use_rope_scaling"}
        )
    if fields["add_qkv_bias"] is None:
        fields["add_qkv_bias"] = fields["add_bias_linear"]
    return fields


def check_architecture(directory, step: int, meta: dict, model_cfg: ModelConfig) -> None:
    saved, wanted = _shape_fields(meta["model"]), _shape_fields(dataclasses.asdict(model_cfg))
    mismatched = {k: (saved[k], wanted[k]) for k in ARCHITECTURE_FIELDS if saved[k] != wanted[k]}
    if mismatched:
        raise ConfigError(
            f"--load {directory} step {step} has a different architecture (saved, requested): {mismatched}"
        )


def data_config_changes(saved: dict, current: dict) -> dict:
    """{key: (saved, current)} for every data setting that differs. The data is known by its file name and its
    sizes, not its folder (a job may stage it elsewhere), and the split by its fractions ("969, 30, 1" is
    "969,30,1")."""

    def comparable(config: dict) -> dict:
        out = {k: v for k, v in config.items() if k != "data_path"}
        out["data_name"] = Path(config.get("data_path") or "").name
        if "split" in out:
            with contextlib.suppress(DataError):  # an unparsable split is compared as written
                out["split"] = tuple(round(x, 12) for x in parse_split(out["split"]))
        return out

    a, b = comparable(saved), comparable(current)
    return {
        k: (saved.get(k, a.get(k)), current.get(k, b.get(k))) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    }


def restore(
    directory,
    step: int,
    like_state,
    *,
    optimizer,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    mesh,
    fresh_optimizer_at: int | None = None,
):
    """{"params", "opt_state"} of step `step` of `directory`, in the layout (and shardings) of `like_state`.
    `fresh_optimizer_at`: an iteration to keep the optimizer state of `like_state` instead (Megatron's
    --no-load-optim), its schedule counter set to that iteration (None: the checkpoint's optimizer state)."""
    load_optim = fresh_optimizer_at is None
    pipelined = _pipelined(parallel)
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    body = {"params": like_state["params"]}
    if load_optim:
        body["opt_state"] = like_state["opt_state"]
    canonical = jax.eval_shape(
        partial(
            sharding.to_canonical,
            optimizer,
            vocab_size=model_cfg.vocab_size,
            pipelined=pipelined,
            v_shape=_v_shape(parallel),
        ),
        body,
    )
    shardings = _canonical_shardings(mesh, optimizer, canonical, parallel)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), canonical, shardings)
    items = {name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}
    try:
        with _manager(directory, create=False) as manager:
            restored = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # orbax and tensorstore raise many kinds; a damaged step gets one line
        raise ConfigError(
            f"--load {directory} step {step} cannot be restored into this model "
            f"({type(err).__name__}: {err})".splitlines()[0]
        ) from None
    restored = {name: restored[name] for name in abstract}
    to_layout = partial(
        sharding.from_canonical,
        optimizer,
        padded_vocab_size=model_cfg.padded_vocab_size(parallel.tensor_model_parallel_size),
        p=p,
        v=v,
        v_shape=_v_shape(parallel),
    )
    out_shardings = jax.tree.map(lambda x: x.sharding, body)
    state = jax.jit(to_layout, out_shardings=out_shardings)(restored)
    if not load_optim:  # fresh moments, but the learning rate goes on from the checkpoint's iteration
        state["opt_state"] = at_schedule_step(like_state["opt_state"], fresh_optimizer_at)
    return state


def schedule_step(meta: dict) -> int:
    """The learning-rate schedule's position at a checkpoint: the updates applied so far, which skipped iterations
    (a non-finite loss or gradients) do not advance (Megatron's OptimizerParamScheduler steps only after a successful
    update). What --no-load-optim restarts the schedule at; a checkpoint written before it was recorded gives its
    iteration."""
    return int(meta.get("schedule_step", meta["iteration"]))


def set_step(state, iteration: int, mesh):
    """state["step"] = iteration (the learning-rate schedule's position), replicated."""
    return {**state, "step": jax.device_put(jnp.asarray(iteration, jnp.int32), jax.sharding.NamedSharding(mesh, P()))}


def save_params(directory, model_cfg: ModelConfig, params, step: int = 0, tokenizer: dict | None = None) -> None:
    """A parameters-only checkpoint of canonical `params` (what `ptd-convert from-hf` writes); it loads with
    `--load D --finetune` under any layout."""
    meta = {
        "format_version": FORMAT_VERSION,
        "iteration": step,
        "consumed_samples": 0,
        "rng_key": None,
        "data": {},
        "model": dataclasses.asdict(model_cfg),
        "parallel": {},
        "train": {},
        "params_only": True,
        "tokenizer": tokenizer,
    }
    with _manager(directory, create=True) as manager:
        manager.save(
            step,
            args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        manager.wait_until_finished()
    record_files(Path(directory) / str(step))


def read_params(directory, step: int | None = None, flag: str = "--load"):
    """(ModelConfig, canonical params as numpy) of `step` (default: the newest) — on the host, no mesh needed.
    `flag`: the flag that named `directory`, for messages."""
    import numpy as np

    step = latest_step(directory) if step is None else step
    if step is None:
        raise ConfigError(f"{flag} {directory} holds no checkpoint")
    meta = read_meta(directory, step, flag)
    try:  # numpy targets: the saved shardings name devices (another process's, say) that need not exist here
        saved = ocp.StandardCheckpointer().metadata(Path(directory).absolute() / str(step) / "params").item_metadata
        target = jax.tree.map(lambda leaf: np.empty(leaf.shape, leaf.dtype), saved)
        with _manager(directory, create=False) as manager:
            params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    except Exception as err:  # orbax and tensorstore raise many kinds; a damaged step gets one line
        raise ConfigError(
            f"{flag} {directory} step {step} has no readable parameters ({type(err).__name__}: {err})".splitlines()[0]
        ) from None
    try:
        cfg = ModelConfig(**meta["model"])
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"{flag} {directory} step {step} has a model configuration this ptd_jax cannot read ({err})".splitlines()[0]
        ) from None
    return cfg, jax.tree.map(np.asarray, params)
