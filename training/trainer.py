"""Training: AdamW (warmup + cosine), clipping, gradient accumulation, evaluation in bits per byte,
JSON-lines metrics, a progress bar, orbax checkpoints and exact resume, on any device mesh."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx, struct

from kvjax.architectures import Decoder
from kvjax.config import Config, ConfigError, ModelConfig, TrainConfig, from_dict
from kvjax.interrupt import Interrupted, deferred_interrupt
from kvjax.progress import progress
from kvjax.training.checkpoint import Checkpointer, CheckpointError, abstract
from kvjax.training.data import BatchIterator, TrainingMix, load_corpus, pack, split_documents
from kvjax.training.distributed import (
    any_process,
    global_batch,
    is_primary,
    local_rows,
    replicated,
    same_everywhere,
    shared_directory,
    summed,
    whole_here,
)
from kvjax.training.sharding import batch_sharding, make_mesh, shard_params
from kvjax.training.tokenizer import Tokenizer
from kvjax.training.vocab import get_tokenizer


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says what is kept and what to do."""


class TrainingInterrupted(TrainingError, Interrupted):
    """Ctrl-C during training: the step in progress finished and was checkpointed (or, after a second
    Ctrl-C, training stopped at once; the message says which steps that lost)."""


RUN_CONFIG = "config.yaml"  # the resolved config of a run, beside its checkpoints


def write_run_config(run_dir: Path, config: Config) -> None:
    """The resolved config as readable YAML (`kvjax train RUN_DIR` resumes from it), written atomically."""
    tree = json.loads(json.dumps(config.to_dict()))  # tuples -> lists
    tmp = run_dir / f".{RUN_CONFIG}.tmp"
    tmp.write_text(
        "# Written by kvjax train: the resolved config of this run.\n" + yaml.safe_dump(tree, sort_keys=False)
    )
    os.replace(tmp, run_dir / RUN_CONFIG)


def drop_superseded_metrics(path: Path, step: int) -> None:
    """Remove the metrics rows after `step` (logged by a run that stopped before checkpointing them and
    is now resumed from `step`), and a last line cut short by a crash, so the file holds each step once."""
    if not path.is_file():
        return

    def row_step(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return math.inf  # unreadable: dropped

    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if row_step(line) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


STOPPING = "kvjax: stopping after this step, which will be checkpointed; Ctrl-C again to abort without saving"


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 key data, saved so that stochastic parts resume exactly


def learning_rate(cfg: TrainConfig, lr=None) -> optax.Schedule:
    """Linear warmup from 0 to lr (default train.lr; inside a train step, a traced scalar), then cosine
    decay to min_lr_ratio * lr at the last step."""
    lr = cfg.lr if lr is None else lr
    shape = optax.warmup_cosine_decay_schedule(0.0, 1.0, cfg.warmup_steps, cfg.steps, end_value=cfg.min_lr_ratio)
    return lambda count: lr * shape(count)


KV_PARAMS = ("k", "v", "kv_norm")  # module names of the K/V projections and norms (`train.trainable=kv`)


def trainable_labels(params, trainable: str):
    """'train' or 'freeze' per parameter: with trainable=kv only those under a K/V module are trained."""

    def label(path, _):
        names = {str(getattr(p, "key", "")) for p in path}
        return "train" if trainable == "all" or names & set(KV_PARAMS) else "freeze"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: TrainConfig, lr=None) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; weight decay only on matrices (not on norm scales or biases).
    With train.trainable=kv every other parameter is frozen (no update, no optimizer state). The state's
    structure does not depend on the learning rate (`lr`, default train.lr), so a train step may take it
    as an argument."""
    decay = partial(jax.tree.map, lambda p: p.ndim >= 2)
    train = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate(cfg, lr), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay),
    )
    if cfg.trainable == "all":
        return train
    return optax.multi_transform(
        {"train": train, "freeze": optax.set_to_zero()}, partial(trainable_labels, trainable=cfg.trainable)
    )


def master(params, dtype: str | None):
    """The weights the optimizer keeps: every floating parameter in `dtype` (`train.master_dtype`), or the
    parameters as they are (None)."""
    if dtype is None:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def computed(params, dtypes: tuple[str, ...] | None):
    """The parameters the model computes with: each leaf in its own dtype of the model (`dtypes`, in leaf
    order), so a gradient through this cast reaches the master weights in theirs; None: as they are."""
    if dtypes is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([x.astype(d) for x, d in zip(leaves, dtypes, strict=True)])


def token_losses(graphdef, params, windows: jax.Array) -> jax.Array:
    """Next-token negative log-likelihood (nats) of windows `[B, L+1]`: predict tokens 1..L from 0..L-1."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits, _ = nnx.merge(graphdef, params)(inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def _train_step(graphdef, cfg: TrainConfig, dtypes, state: TrainState, batch, weights, lr):
    """One optimizer step on windows `[B, L+1]` at peak learning rate `lr` (an argument, not a constant of
    the program); with `weights` `[B, L]` (a TrainingMix's) the objective is the mean of weighted token
    losses, while the logged `loss` stays the plain mean NLL. With master weights the model computes with
    them cast to its `dtypes`."""
    tx, schedule, accum = make_optimizer(cfg, lr), learning_rate(cfg, lr), cfg.grad_accum

    def loss_fn(params, windows, weights):
        nll = token_losses(graphdef, computed(params, dtypes), windows)
        return (nll if weights is None else nll * weights).mean(), nll.mean()

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum == 1:
        (_, loss), grads = grad_fn(state.params, batch, weights)
    else:

        def add(carry, micro):
            (_, loss), grads = grad_fn(state.params, *micro)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        split = lambda x: None if x is None else x.reshape(accum, -1, x.shape[-1])  # noqa: E731
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(add, zero, (split(batch), split(weights)))
        loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1)
    return new, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}


@functools.lru_cache(maxsize=32)
def _programs(graphdef, cfg: TrainConfig, dtypes: tuple[str, ...] | None):
    """The jitted train step and evaluation of one model structure under one optimizer setting, shared by
    every Trainer of them: the learning rate is an argument and the seed only sets values, so an LR grid
    or another seed compiles nothing new (`cfg` comes with lr and seed fixed, see `Trainer`). `dtypes`:
    the model's own parameter dtypes when the optimizer keeps master weights in others."""
    step = jax.jit(partial(_train_step, graphdef, cfg, dtypes), donate_argnums=(0,))
    return step, jax.jit(lambda params, *rest: _eval_sums(graphdef, computed(params, dtypes), *rest))


def _eval_sums(graphdef, params, windows, weights, token_bytes):
    """Summed nats, predicted tokens and the UTF-8 bytes they stand for, over weighted windows."""
    nll = token_losses(graphdef, params, windows) * weights[:, None]
    n_bytes = token_bytes[windows[:, 1:]] * weights[:, None]
    return nll.sum(), weights.sum() * nll.shape[1], n_bytes.sum()


def evaluate_windows(
    eval_fn,
    params,
    windows: np.ndarray,
    tokenizer: Tokenizer,
    batch_size: int,
    *,
    shared: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Mean loss (nats per predicted token), bits per UTF-8 byte and perplexity over windows `[n, L+1]`,
    batched (the last batch padded with zero-weight rows); `eval_fn` is a jitted `_eval_sums`. `shared`
    (params this process holds whole): over several processes each scores every n-th window and the sums
    are added, the same scores in 1/n of the time. `on_batch(windows)` follows each batch scored here."""
    if shared:
        windows = windows[jax.process_index() :: jax.process_count()]
    token_bytes = jnp.asarray(tokenizer.token_bytes())
    totals = np.zeros(3)
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        weights = np.zeros(batch_size, np.float32)
        weights[: len(chunk)] = 1
        chunk = np.concatenate([chunk, np.zeros((batch_size - len(chunk), chunk.shape[1]), chunk.dtype)])
        totals += np.array(eval_fn(params, chunk, weights, token_bytes), np.float64)
        if on_batch is not None:
            on_batch(min(batch_size, len(windows) - start))
    nats, tokens, n_bytes = summed(totals) if shared else totals
    return {
        "eval_loss": float(nats / tokens),
        "eval_bpb": float(nats / math.log(2) / n_bytes),
        "eval_ppl": float(math.exp(nats / tokens)),
    }


def evaluate_model(
    model: Decoder, windows: np.ndarray, tokenizer: Tokenizer, batch_size: int = 1, on_batch=None
) -> dict:
    """`evaluate_windows` for any model this process holds whole (e.g. one imported from GGUF), its windows
    shared out between the processes of a multi-process run."""
    graphdef, params = nnx.split(model)
    fn = jax.jit(partial(_eval_sums, graphdef))
    return evaluate_windows(fn, params, windows, tokenizer, batch_size, shared=True, on_batch=on_batch)


@dataclasses.dataclass
class Corpus:
    tokenizer: Tokenizer
    train: np.ndarray  # [n, seq_len + 1] windows
    val: np.ndarray
    mix: TrainingMix | None = None  # applied to training batches (data.passkey, data.repeats); validation stays plain


def prepare_corpus(cfg: Config) -> Corpus:
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} must be >= {tokenizer.vocab_size}, the vocabulary of "
            f"data.tokenizer={cfg.data.tokenizer!r}"
        )
    train_docs, val_docs = split_documents(load_corpus(cfg.data.corpus), cfg.data.val_fraction)
    window = cfg.data.seq_len + 1
    d = cfg.data
    mix = TrainingMix(tokenizer, d.passkey, d.passkey_weight, d.repeats) if d.passkey or d.repeats else None
    return Corpus(tokenizer, pack(train_docs, tokenizer, window), pack(val_docs, tokenizer, window), mix)


class Trainer:
    """Trains `config` in `run_dir`, resuming from its latest checkpoint when there is one."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        devices: list | None = None,
        progress: bool = True,
        corpus: Corpus | None = None,
        init: Decoder | None = None,
    ):
        """`corpus` reuses data prepared (by `prepare_corpus`) for the same data config; `init` is the
        model a new run starts from (a converted one, for uptraining) instead of a random one."""
        self.config = config
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.mesh = make_mesh(config.mesh, devices)
        same_everywhere("config", json.dumps(config.to_dict(), sort_keys=True))
        shared_directory(self.run_dir)
        self.batches = batch_sharding(self.mesh, config.train.batch_size)
        self.corpus = prepare_corpus(config) if corpus is None else corpus
        cfg = config.train
        saved = self.run_dir / "checkpoints"
        resuming = saved.is_dir() and Checkpointer(saved, create=False).latest_step() is not None
        if init is None and cfg.init is not None and not resuming:
            init = init_from_run(cfg.init, config.model)
        if init is not None and init.config != config.model:
            raise ValueError("init's model config differs from config.model")
        model = Decoder(config.model, rngs=nnx.Rngs(cfg.seed)) if init is None else init
        self.graphdef, params = nnx.split(model)
        self.dtypes = _model_dtypes(params, cfg.master_dtype)
        tx = make_optimizer(cfg)
        with jax.set_mesh(self.mesh):
            params = shard_params(master(params, cfg.master_dtype), self.mesh)
            self.state = TrainState(
                params=params,
                opt_state=jax.jit(tx.init)(params),
                step=replicated(np.int32(0), self.mesh),
                rng=replicated(jax.random.key_data(jax.random.key(cfg.seed)), self.mesh),
            )
        self._step, self._eval = _programs(
            self.graphdef, dataclasses.replace(cfg, lr=1.0, seed=0, init=None), self.dtypes
        )
        self.checkpoints = Checkpointer(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        self.position = None
        self.extended_from = None  # train.steps of the checkpoint, when this run changes it
        if resuming:
            self.state, record = self.checkpoints.restore(
                abstract(self.state), expect_config=config.to_dict(), may_differ=("train.steps",)
            )
            self.position = record["data_position"]
            saved_steps = record["config"]["train"]["steps"]
            self.extended_from = saved_steps if saved_steps != cfg.steps else None

    @property
    def step(self) -> int:
        return int(self.state.step)

    def model(self) -> Decoder:
        """The model being trained; over several processes a whole copy on this process (`whole_here`: every
        process calls this together)."""
        return nnx.merge(self.graphdef, computed(whole_here(self.state.params), self.dtypes))

    def evaluate(self, windows: np.ndarray | None = None) -> dict:
        """Validation scores on the first eval_windows windows of the validation documents (the reported
        split), or on other `windows` (e.g. a selection split)."""
        val = self.corpus.val[: self.config.data.eval_windows] if windows is None else windows
        return evaluate_windows(self._eval, self.state.params, val, self.corpus.tokenizer, self.config.train.batch_size)

    def final_scores(self, history: list[dict]) -> dict:
        """Validation scores at the current step: those `run` logged at its last step when it evaluated
        there (it does at train.steps), else evaluated now."""
        if history and history[-1]["step"] == self.step and "eval_loss" in history[-1]:
            return {k: v for k, v in history[-1].items() if k.startswith("eval_")}
        return self.evaluate()

    def _save(self, iterator: BatchIterator) -> None:
        record = {"step": self.step, "data_position": iterator.position, "config": self.config.to_dict()}
        self.checkpoints.save(self.step, self.state, record)

    def run(self, log: Callable[[dict], None] | None = None, stop_at: int | None = None) -> list[dict]:
        """Train up to train.steps (or stop early at `stop_at`, checkpointing there, as an interruption
        would); returns one metrics dict per step taken, with the loss of every step. Ctrl-C finishes
        the step in progress, checkpoints it and raises TrainingInterrupted."""
        cfg = self.config.train
        stop_at = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        rows = local_rows(self.batches, cfg.batch_size)  # this process's part of every batch
        iterator = BatchIterator(self.corpus.train, cfg.batch_size, cfg.seed, self.position, self.corpus.mix, rows)
        primary = is_primary()  # writes the run's files and logs; every process checkpoints its shards
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if primary:
            write_run_config(self.run_dir, self.config)
            drop_superseded_metrics(self.run_dir / "metrics.jsonl", self.step)
        history: list[dict] = []
        self._done = self.step  # steps taken, readable on the host even while a step's buffers are donated
        tokens_per_step = cfg.batch_size * self.config.data.seq_len
        bar = progress(cfg.steps, initial=self.step, enabled=self.progress and primary)
        last_time, last_step = time.perf_counter(), self.step
        lr = replicated(np.float32(cfg.lr), self.mesh)
        with (
            open(self.run_dir / "metrics.jsonl", "a") if primary else contextlib.nullcontext() as metrics_file,
            jax.set_mesh(self.mesh),
            deferred_interrupt(STOPPING) as interrupted,
            self._aborted(interrupted, bar),
        ):
            while self.step < stop_at:
                windows, weights = next(iterator)
                batch = global_batch(windows, self.batches, cfg.batch_size)
                weights = None if weights is None else global_batch(weights, self.batches, cfg.batch_size)
                self.state, metrics = self._step(self.state, batch, weights, lr)
                self._done = self.step
                row = {"step": self._done, **{k: float(v) for k, v in metrics.items()}}
                if not math.isfinite(row["loss"]):
                    kept = self.checkpoints.latest_step()
                    where = f"step {kept} in {self.checkpoints.directory}" if kept is not None else "none yet"
                    raise TrainingError(
                        f"loss became {row['loss']} at step {self.step}; training stopped and nothing was saved "
                        f"after it. Last good checkpoint: {where}. Lower train.lr or raise train.warmup_steps."
                    )
                history.append(row)
                bar.update(1)
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    row.update(self.evaluate())
                if self.step % cfg.log_every == 0 or "eval_loss" in row:
                    now = time.perf_counter()
                    row["tokens_per_s"] = tokens_per_step * (self.step - last_step) / (now - last_time)
                    last_time, last_step = now, self.step
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
                    if primary:
                        metrics_file.write(json.dumps(row) + "\n")
                        metrics_file.flush()
                    if log is not None and primary:
                        log(row)
                stopping = any_process(interrupted.is_set())  # a Ctrl-C that reached any process stops all here
                if self.step % cfg.checkpoint_every == 0 or self.step == stop_at or stopping:
                    self._save(iterator)
                if stopping:
                    bar.close()
                    raise TrainingInterrupted(
                        f"stopped at step {self.step} of {cfg.steps} (Ctrl-C); last checkpoint: step {self.step} in "
                        f"{self.checkpoints.directory}"
                    )
        self.position = iterator.position
        bar.close()
        return history

    @contextlib.contextmanager
    def _aborted(self, interrupted: threading.Event, bar):
        """A second Ctrl-C (KeyboardInterrupt after the first set `interrupted`) as TrainingInterrupted
        saying which steps were lost and where the last checkpoint is."""
        try:
            yield
        except KeyboardInterrupt:
            if not interrupted.is_set():
                raise
            bar.close()
            kept, done = self.checkpoints.latest_step(), self._done
            start = kept or 0
            lost = f"steps {start + 1}-{done}" if done > start else "no step"
            where = (
                "none yet (a rerun starts from step 0)"
                if kept is None
                else f"step {kept} in {self.checkpoints.directory}"
            )
            raise TrainingInterrupted(
                f"aborted at step {done} of {self.config.train.steps} without saving "
                f"(Ctrl-C twice): {lost} lost; last checkpoint: {where}"
            ) from None


def init_from_run(run_dir: str | Path, model: ModelConfig) -> Decoder:
    """`train.init`: the trained model of another run, which must have this run's model config (the
    data and training settings may differ: that is what a curriculum's next stage changes)."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"train.init={str(run_dir)!r} is not a directory; it must name a run directory to start from")
    config, trained, _ = load_trained(run_dir)
    if config.model != model:
        theirs, ours = dataclasses.asdict(config.model), dataclasses.asdict(model)
        changed = sorted(k for k in ours if theirs.get(k) != ours[k])
        raise ConfigError(
            f"train.init={str(run_dir)!r} holds a model whose config differs from this run's in "
            f"{', '.join('model.' + k for k in changed)}; a run starts only from a model of its own shape"
        )
    return trained


def load_trained(run_dir: str | Path) -> tuple[Config, Decoder, Tokenizer]:
    """The config, model (latest checkpoint) and tokenizer of a finished or interrupted run."""
    checkpoints = Checkpointer(Path(run_dir) / "checkpoints", create=False)
    if checkpoints.latest_step() is None:
        raise CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}: is {run_dir} a run directory?")
    _, record = checkpoints.read_record()
    config = from_dict(Config, record["config"])
    model = Decoder(config.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    dtypes = _model_dtypes(params, config.train.master_dtype)
    params = master(params, config.train.master_dtype)
    tx = make_optimizer(config.train)
    state = TrainState(params, jax.eval_shape(tx.init, params), jnp.int32(0), jnp.zeros((2,), jnp.uint32))
    # Onto this process's first device, whatever mesh or process count saved it (orbax restores a checkpoint
    # written by several processes only into arrays that say where they go).
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), state)
    restored, _ = checkpoints.restore(target)
    return config, nnx.merge(graphdef, computed(restored.params, dtypes)), get_tokenizer(config.data.tokenizer)


def _model_dtypes(params, master_dtype: str | None) -> tuple[str, ...] | None:
    """The dtypes of a model's parameters in leaf order when the optimizer keeps master weights, else None."""
    return None if master_dtype is None else tuple(str(x.dtype) for x in jax.tree.leaves(params))
