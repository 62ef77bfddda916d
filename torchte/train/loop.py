"""One recipe's training run: model, AdamW, learning-rate schedule, evaluation, checkpoints.

A run is reproducible from its seed: torch's generator is seeded before the model is built,
batches come from the sampler's own generator, and evaluation leaves the FP8 scaling state as
it found it, so the training losses do not depend on how often validation runs. A run resumed
from a checkpoint continues with the same losses, bit for bit, as one never interrupted, on
a device whose kernels are deterministic (the CPU; on a GPU some kernels add in an order that
varies between runs, so two runs of one seed drift apart in their last bits).

A row is logged every `log_every` steps, every `eval_every` steps (with the validation loss),
at step 0 (validation only) and at the last step. Its train loss is the mean over the steps
since the previous row; its tokens/s counts training time only (not evaluation or saving).

With config.cuda_graph the blocks are captured as CUDA graphs at the first training step and
replayed by the steps after it (cuda_graph.py); evaluation runs them eagerly, and run() frees
the graphs when it ends.

Ctrl-C (KeyboardInterrupt) ends a run early: run() returns what was logged up to the last
step that finished, marked interrupted, and saves nothing (a step cut short leaves the weights
half updated); the last checkpoint written before it stays.

A loss that becomes inf or nan ends it too: run() raises divergence.Diverged, found where the
loss is read anyway (a logged row's mean, a validation, a checkpoint; once more at the end for
steps after the last row), never by a read of every step's loss.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import torchte as te
from torchte import recipe as te_recipe
from torchte.distributed import fsdp as te_fsdp
from torchte.distributed.context_parallel import split_for_cp_rank
from torchte.optimizers import FusedAdam

from . import checkpoint, cuda_graph
from .config import ModelConfig, RunConfig
from .data import BatchSampler, Corpus, validation_batches
from .divergence import Diverged, first_non_finite
from .ep_run import is_expert, reduce_dense_grads, shard_experts_from
from .fsdp_run import DataParallel, local_rows, shard_model
from .fsdp_state import load_sharded, read_position, save_sharded
from .model import GPT, restore_scaling, scaling_snapshot, shard_from
from .optimizer_choice import (
    check_same_optimizer,
    make_optimizer,
    optimizer_record,
    params_dtype,
)
from .progress import Progress
from .throughput import Throughput
from .tp_state import expert_index, split_state, whole_state

# fp32 master weights and AdamW state (--master-weights: bf16 weights, their fp32 masters in
# FusedAdam, optimizer_choice.py); the model computes in RunConfig.compute_dtype: bf16
# under torch.autocast, or fp32 with autocast off (te modules then compute in their parameters'
# dtype), with FP8 GEMMs where a recipe is on (emulated in fp32 on the CPU).
PARAMS_DTYPE = torch.float32
MIN_LR_FRACTION = 0.1
GRAD_CLIP = 1.0
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


def make_recipe(name: str) -> te_recipe.Recipe | None:
    """The FP8 recipe called `name`; None for bf16."""
    if name == "delayed":
        return te_recipe.DelayedScaling()
    if name == "current":
        return te_recipe.Float8CurrentScaling()
    if name == "block":
        return te_recipe.Float8BlockScaling()
    if name == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    if name == "nvfp4":
        return te_recipe.NVFP4BlockScaling()
    return None


def learning_rate(step: int, config: RunConfig) -> float:
    """The learning rate of step `step` (1-based): linear warmup, then cosine to lr / 10."""
    if step <= config.warmup:
        return config.lr * step / config.warmup
    span = max(config.steps - config.warmup, 1)
    progress = min((step - config.warmup) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)


@dataclass
class RunResult:
    """What one recipe's run produced."""

    recipe: str
    """The run's label: the FP8 recipe, or the compute dtype of the run without FP8."""
    rows: list[dict]
    """Logged rows: recipe (the label), step, train_loss, val_loss, tokens_per_s, elapsed_s
    (None where not measured)."""
    steps: int
    """The step the run stopped at (the last one that finished)."""
    tokens_per_s: float
    """Training throughput of this process's steps (the first one, which compiles, left out
    when there are others; nan without steps)."""
    interrupted: bool = False
    """Whether Ctrl-C ended the run before config.last_step."""
    saved: tuple[Path, int] | None = None
    """(file, step) of the last checkpoint this process wrote; None if it wrote none."""


def clip_grad_norm(params: list, max_norm: float, tp_group, dp_group=None) -> None:
    """torch.nn.utils.clip_grad_norm_ over the whole model (over every shard of a model sharded
    by FSDP, whose gradients are DTensors); with a tensor-parallel group, the
    squares of the split parameters' gradients (tensor_model_parallel) are summed over its ranks
    and the others counted once, so every rank scales by the same factor; with FSDP over
    dp_group as well (2-D), each rank's rows of every gradient, summed over dp_group."""
    if tp_group is None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    with_grad = [p for p in params if p.grad is not None]
    grads = [_local(p.grad) for p in with_grad]
    # split over tp_group: tensor-parallel pieces, or (expert parallelism) this rank's experts
    is_split = [getattr(p, "tensor_model_parallel", False) or is_expert(p) for p in with_grad]
    split = [g for g, s in zip(grads, is_split, strict=True) if s]
    whole = [g for g, s in zip(grads, is_split, strict=True) if not s]
    zero = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    squares = [sum((g.float().square().sum() for g in part), zero) for part in (split, whole)]
    dist.all_reduce(squares[0], group=tp_group)
    total = squares[0] + squares[1]
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    torch._foreach_mul_(grads, (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t: the local shard of a DTensor (FSDP's), else t."""
    return t.to_local() if isinstance(t, DTensor) else t


def _mean_over(value: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """The mean of `value` over the `ranks` ranks of `group` (a new tensor)."""
    total = value.clone()
    dist.all_reduce(total, group=group)
    return total / ranks


class Trainer:
    """A GPT trained under one recipe; `run()` trains it up to config.steps."""

    def __init__(
        self,
        name: str,
        model_config: ModelConfig,
        config: RunConfig,
        corpus: Corpus,
        tp_group=None,
        dp: DataParallel | None = None,
        ep_group=None,
    ) -> None:
        """tp_group: tensor parallelism over its ranks (each draws the same batches; the model
        starts from the one-rank model's weights of the seed); with config.sequence_parallel
        each rank computes the loss of its rows of the batch (see _backward). dp: the model
        sharded by FSDP over its ranks (fsdp_run.py), each training on its rows of the batch;
        the delayed-scaling amaxes are reduced over them. ep_group: the MoE layers' experts
        split over its ranks (ep_run.py), each training on its rows of the batch."""
        self.name, self.config, self.corpus = name, config, corpus
        self.label = config.label(name)
        self.device = torch.device(config.device)
        self.autocast_bf16 = config.compute_dtype == "bf16"
        self.recipe = make_recipe(name)
        # CUDA graphs (cuda_graph.py): captured at the first training step, freed after run()
        self.graph_plan = cuda_graph.plan_graphs(name, model_config, config)
        self.graphed: tuple[torch.nn.Module, ...] | None = None
        splits = self.graph_plan.moe_device_splits if self.graph_plan else None
        torch.manual_seed(config.seed)
        weights = params_dtype(config.master_weights)
        self.model = GPT(model_config, weights, self.device, moe_device_splits=splits)
        self.tp_group = (
            tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        )
        self.sp_ranks = 1
        self.ep_group, self.ep_ranks = None, 1
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            self.ep_group, self.ep_ranks = ep_group, dist.get_world_size(ep_group)
        if self.tp_group is not None:  # with experts: split over the same ranks (ep_run.py)
            whole = self.model
            sp = config.sequence_parallel
            self.model = GPT(
                model_config, PARAMS_DTYPE, self.device, self.tp_group, sp, ep_group=self.ep_group
            )
            self.sp_ranks = dist.get_world_size(self.tp_group) if sp else 1
            shard_from(
                self.model, whole, dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
            )
        elif self.ep_group is not None:
            whole = self.model
            self.model = GPT(model_config, PARAMS_DTYPE, self.device, ep_group=self.ep_group)
            shard_experts_from(self.model, whole, dist.get_rank(ep_group), self.ep_ranks)
        # Expert parallelism splits the batch's rows itself unless FSDP or sequence
        # parallelism split them over the same ranks.
        self.ep_splits_rows = self.ep_group is not None and dp is None and self.sp_ranks == 1
        self.dp = dp
        # context parallelism (config.cp, torchrun's processes): each rank its share of every
        # sequence, the weights whole on every rank
        self.cp_group, self.cp_ranks = None, config.cp
        if config.cp > 1:
            self.cp_group = dist.group.WORLD
            self.model.set_context_parallel_group(self.cp_group)
        # The loss is divided by every rank its batch is split over before backward (see
        # _backward), and the data-parallel ranks' gradients are summed.
        self.loss_parts = self.sp_ranks * (dp.size if dp is not None else 1) * self.cp_ranks
        self.loss_parts *= self.ep_ranks if self.ep_splits_rows else 1
        if dp is not None:
            fp8_gather = config.fp8_all_gather and self.recipe is not None
            shard_model(
                self.model, dp.mesh, fp8_gather, config.fsdp_gather_dtype,
                keep_gathered=config.fsdp_keep_gathered,
                ignored={p for p in self.model.parameters() if is_expert(p)} or None,
            )  # fmt: skip
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = make_optimizer(groups, config, config.lr, BETAS, self.device)
        packed = model_config.packed  # batches then say where their documents start
        self.sampler = BatchSampler(
            corpus.train, config.batch_size, model_config.seq_len, config.seed,
            corpus.train_docs, packed,
        )  # fmt: skip
        self.val_batches = validation_batches(
            corpus.val, config.batch_size, model_config.seq_len, config.eval_batches,
            corpus.val_docs, packed,
        )  # fmt: skip
        self.tokens_per_step = config.batch_size * model_config.seq_len
        self.step = 0
        self.rows: list[dict] = []
        self.window: list[torch.Tensor] = []  # train losses since the last row
        self.elapsed = 0.0
        self.saved: tuple[Path, int] | None = None

    # -- one step, one evaluation -------------------------------------------------------------

    def _loss(self, *batch: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy (fp32) of the model on one batch (inputs, targets [, doc_starts
        of a packed batch]), under the run's recipe and in its compute dtype."""
        if self.dp is not None:  # this rank's rows of the batch
            batch = tuple(local_rows(t, self.dp.rank, self.dp.size) for t in batch)
        if self.sp_ranks > 1:  # this rank's rows of the batch
            rank = dist.get_rank(self.tp_group)
            batch = tuple(local_rows(t, rank, self.sp_ranks) for t in batch)
        if self.ep_splits_rows:  # this rank's rows of the batch
            rank = dist.get_rank(self.ep_group)
            batch = tuple(local_rows(t, rank, self.ep_ranks) for t in batch)
        if self.cp_ranks > 1:  # this rank's share of every sequence
            rank = dist.get_rank(self.cp_group)
            batch = tuple(split_for_cp_rank(t, self.cp_ranks, rank, 1) for t in batch)
        inputs, targets, *doc_starts = (t.to(self.device, non_blocking=True) for t in batch)
        # Delayed scaling's amaxes: over every rank (the data-parallel copies of a tensor and
        # its tensor-parallel pieces).
        amax_group = None if self.dp is None and self.ep_group is None else dist.group.WORLD
        fp8 = te.autocast(
            self.recipe is not None, recipe=self.recipe, amax_reduction_group=amax_group
        )
        with self.autocast(), fp8:
            logits = self.model(inputs, *doc_starts)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def autocast(self) -> torch.autocast:
        """torch.autocast to bf16 under compute dtype "bf16"; a disabled one under "fp32"."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    def train_step(self) -> torch.Tensor:
        """One optimizer step on the next batch; returns its loss (detached). self.step counts
        it once it is done. With a graph plan, the first step captures the blocks first."""
        if self.graph_plan is not None and self.graphed is None:
            self.capture_graphs()
        lr = learning_rate(self.step + 1, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self._loss(*self.sampler.next())
        self.optimizer.zero_grad(set_to_none=True)
        self._backward(loss)
        if isinstance(self.optimizer, FusedAdam):  # one process (optimizer_choice.py)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
            self.optimizer.step()
        else:
            self._clip_and_step()
        if self.dp is not None:  # FP8-gathered weights: their scales in one all-reduce
            te_fsdp.precompute_fp8_scales(self.model)
        self.step += 1
        return self._batch_mean(loss.detach())

    def _clip_and_step(self) -> None:
        """ClippedAdamW's clip and step over whatever the gradients are split or sharded
        over."""
        split_group = self.tp_group if self.ep_group is None else self.ep_group
        if self.dp is not None and self.ep_group is not None:
            split_group = None  # the experts: this rank's own pieces, as FSDP's shards are
        if split_group is None:  # whole gradients, or FSDP's shards of them over dp's group
            shard_group = self.dp.group if self.dp is not None else None
            self.optimizer.clip_and_step(GRAD_CLIP, torch.nn.utils.clip_grad_norm_, shard_group)
        elif self.dp is not None:  # 2-D: FSDP's shards of tensor-parallel pieces
            clip = functools.partial(clip_grad_norm, tp_group=split_group, dp_group=self.dp.group)
            self.optimizer.clip_and_step(GRAD_CLIP, clip, self.dp.group, split_group)
        else:
            dp_group = self.dp.group if self.dp is not None else None
            clip_grad_norm(list(self.model.parameters()), GRAD_CLIP, split_group, dp_group)
            self.optimizer.step()

    def capture_graphs(self) -> None:
        """Capture the blocks as the graph plan says (cuda_graph.capture_blocks), for batches
        of this run's shape in the residual stream's dtype."""
        stream_dtype = torch.bfloat16 if self.autocast_bf16 else PARAMS_DTYPE
        self.graphed = cuda_graph.capture_blocks(
            self.model, self.graph_plan, self.recipe, self.config.batch_size, stream_dtype,
            self.autocast_bf16,
        )  # fmt: skip

    def release_graphs(self) -> None:
        """Free the captured graphs (the blocks run eagerly again; the next training step
        captures anew)."""
        if self.graphed is not None:
            graphed, self.graphed = self.graphed, None
            cuda_graph.release(graphed)

    def _backward(self, loss: torch.Tensor) -> None:
        """loss.backward(); where the batch's rows are split over P ranks (sequence and data
        parallelism), each rank's loss is the mean over its rows and the batch's loss their
        mean: each rank back-propagates loss / P, so every gradient inside the backward (and
        each FP8 cast of one) has the values one process gives it, and the ranks' parts are
        summed: by the collectives into the split weights' gradients, by FSDP2 (shard_model
        sums) over the data-parallel ranks, and here for the parameters whole on every
        tensor-parallel rank, partial sums of its rows."""
        if self.loss_parts == 1:
            loss.backward()
            return
        (loss / self.loss_parts).backward()
        if self.ep_splits_rows:  # the dense parts summed (else FSDP2 or the sequence-parallel
            reduce_dense_grads(self.model, self.ep_group)  # sums below); the experts' whole
        if self.cp_group is not None:  # each rank's sequence shares' partial sums
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(_local(p.grad), group=self.cp_group)
        if self.sp_ranks == 1:
            return
        whole = [
            p.grad
            for p in self.model.parameters()
            if p.grad is not None
            and not getattr(p, "tensor_model_parallel", False)
            and not is_expert(p)  # split over the same ranks: whole already
        ]
        for grad in whole:
            dist.all_reduce(_local(grad), group=self.tp_group)

    def _batch_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss from this rank's (the mean of the ranks' means under sequence
        or data parallelism, whose row counts are equal)."""
        if self.sp_ranks > 1:
            loss = _mean_over(loss, self.tp_group, self.sp_ranks)
        if self.ep_splits_rows:
            loss = _mean_over(loss, self.ep_group, self.ep_ranks)
        if self.cp_ranks > 1:
            loss = _mean_over(loss, self.cp_group, self.cp_ranks)
        if self.dp is not None and self.dp.size > 1:
            loss = _mean_over(loss, self.dp.group, self.dp.size)
        return loss

    def evaluate(self, batches: list | None = None) -> float:
        """Mean validation loss over the fixed batches (or `batches` of them); the FP8 scaling
        state is restored afterwards, so evaluation does not change training."""
        batches = self.val_batches if batches is None else batches
        snapshot = scaling_snapshot(self.model)
        self.model.eval()
        try:
            with torch.no_grad():
                losses = [self._batch_mean(self._loss(*batch)) for batch in batches]
        finally:
            self.model.train()
            restore_scaling(self.model, snapshot)
        return torch.stack(losses).double().mean().item()

    # -- the run ------------------------------------------------------------------------------

    def run(self, progress: Progress) -> RunResult:
        """Train from self.step to config.last_step, logging, evaluating and saving on
        schedule; save at the end when config.save is set. Ctrl-C ends it early (see the
        module's docstring)."""
        start = time.perf_counter() - self.elapsed
        meter = Throughput(self.tokens_per_step)
        interrupted = False
        try:
            self._train(progress, start, meter)
        except KeyboardInterrupt:
            interrupted = True
        finally:  # after Diverged too
            self.release_graphs()  # the graphs' memory is free for the next recipe's run
            progress.close()
        self.elapsed = time.perf_counter() - start
        return RunResult(self.label, self.rows, self.step, meter.rate(), interrupted, self.saved)

    def _train(self, progress: Progress, start: float, meter: Throughput) -> None:
        """The body of run(): evaluate step 0 on a fresh run, then train, log and save."""
        config = self.config
        if self.step == 0:
            self._log(progress, 0, self.evaluate(), None, start)
        first = self.step + 1
        meter.restart()
        while self.step < config.last_step:
            loss = self.train_step()
            self.window.append(loss)
            step = self.step
            is_eval = step % config.eval_every == 0 or step == config.steps
            is_log = is_eval or step % config.log_every == 0
            if is_log or step == first:
                self._sync()  # what the clock reads next includes the device's work
            # The first step compiles and warms up: left out of the speed unless it is all.
            meter.tick(counted=step != first or config.last_step == first)
            if is_log:
                window_speed = meter.window_rate()
                val = self.evaluate() if is_eval else None
                self._log(progress, step, val, window_speed, start)
                meter.restart()
            progress.update(step, loss.item, meter.rate())
            if config.save_every and step % config.save_every == 0 and step < config.last_step:
                self.save(start)
                meter.restart()
        self._check_window()  # the steps after the last logged row (with --stop-at)
        if config.save is not None:
            self.save(start)

    def _log(self, progress: Progress, step: int, val, speed, start: float) -> None:
        train = torch.stack(self.window).mean().item() if self.window else None
        self.elapsed = time.perf_counter() - start
        row = {
            "recipe": self.label,
            "step": step,
            "train_loss": train,
            "val_loss": val,
            "tokens_per_s": speed,
            "elapsed_s": self.elapsed,
        }
        self.rows.append(row)
        progress.log(row)
        self._check_finite(step, train, val)
        self.window = []

    def _check_finite(self, step: int, train: float | None, val: float | None) -> None:
        """Diverged if `train` (the mean training loss of self.window, the steps up to `step`)
        or `val` (the validation loss at `step`) is inf or nan."""
        if train is not None and not math.isfinite(train):
            bad_step, value = first_non_finite(self.window, step)
            raise Diverged(self.label, bad_step, "training", value, self.config.lr)
        if val is not None and not math.isfinite(val):
            raise Diverged(self.label, step, "validation", val, self.config.lr)

    def _check_window(self) -> None:
        """_check_finite of the training losses since the last logged row (one read)."""
        if self.window:
            self._check_finite(self.step, torch.stack(self.window).mean().item(), None)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint_path(self, path: Path) -> Path:
        """This recipe's file for the checkpoint path given on the command line."""
        return checkpoint.recipe_path(path, self.name, len(self.config.recipes) > 1)

    def save(self, start: float) -> None:
        """Write the checkpoint of the current step (see checkpoint.py for its contents; under
        FSDP a folder of every rank's shards, fsdp_state.py); Diverged instead of saving a
        loss that became inf or nan."""
        self._check_window()
        self.elapsed = time.perf_counter() - start
        path = self.checkpoint_path(self.config.save)
        if self.dp is not None:
            save_sharded(
                path, self._position(), self.model, self.optimizer, self.tp_group,
                self._expert_mesh(),
            )  # fmt: skip
        else:
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
            if self.tp_group is not None:  # the whole model's (experts too), by rank 0 (tp_state)
                model, optim = whole_state(self.model, self.optimizer, self.tp_group)
            elif self.ep_group is not None:  # every expert, written by rank 0
                model, optim = whole_state(self.model, self.optimizer, self.ep_group, expert_index)
            parallel = (self.tp_group, self.cp_group, self.ep_group)
            if all(group is None for group in parallel) or dist.get_rank() == 0:
                state = {**self._position(), "model": model, "optimizer": optim}
                checkpoint.save_checkpoint(path, state)
        self.saved = (path, self.step)

    def _expert_mesh(self):
        """The mesh this rank's experts are pieces over in a --fsdp folder (with --ep: FSDP's,
        the same ranks), else None."""
        return self.dp.mesh if self.dp is not None and self.ep_group is not None else None

    def _position(self) -> dict:
        """Everything a checkpoint holds besides the model's and AdamW's state."""
        run = {k: getattr(self.config, k) for k in ("steps", "batch_size", "lr", "warmup", "seed")}
        return {
            "recipe": self.name,
            "compute_dtype": self.config.compute_dtype,
            "optimizer_choice": optimizer_record(self.config),
            "step": self.step,
            "model_config": self.model.config.as_dict(),
            "corpus": self.corpus.fingerprint(),
            "run": run,
            "rng": checkpoint.rng_states(self.device, self.sampler.get_state()),
            "history": self.rows,
            "window": [loss.item() for loss in self.window],
            "elapsed_s": self.elapsed,
        }

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint of this recipe at `path` (SystemExit if it does not
        fit this run)."""
        path = self.checkpoint_path(path)
        state = read_position(path) if self.dp is not None else checkpoint.load_checkpoint(path)
        check_resumable(state, path, self.name, self.model.config, self.config, self.corpus)
        if self.dp is not None:  # DCP reshards whatever rank count saved it
            load_sharded(path, self.model, self.optimizer, self.tp_group, self._expert_mesh())
        else:
            model, optim = state["model"], state["optimizer"]
            if self.tp_group is not None:  # this rank's pieces (and experts) of the whole state
                model, optim = split_state(self.model, self.optimizer, model, optim, self.tp_group)
            elif self.ep_group is not None:  # this rank's experts
                model, optim = split_state(
                    self.model, self.optimizer, model, optim, self.ep_group, expert_index
                )
            self.model.load_state_dict(model)
            self.optimizer.load_state_dict(optim)
        self.sampler.set_state(checkpoint.restore_rng(state["rng"]))
        self.step = int(state["step"])
        self.rows = list(state["history"])
        self.window = [torch.tensor(v, device=self.device) for v in state["window"]]
        self.elapsed = float(state["elapsed_s"])


def check_resumable(
    state: dict,
    path: Path,
    recipe: str,
    model_config: ModelConfig,
    config: RunConfig,
    corpus: Corpus,
) -> None:
    """SystemExit unless the checkpoint `state` (read from `path`) fits this run of `recipe`:
    the same model, recipe, corpus and compute dtype, the same learning-rate schedule, and
    steps left to train (checkpoint.check_schedule)."""
    checkpoint.check_compatible(
        state, path, model_config.as_dict(), recipe, corpus.fingerprint(), config.compute_dtype
    )
    check_same_optimizer(state, path, config)
    schedule = {"steps": config.steps, "warmup": config.warmup, "lr": config.lr}
    checkpoint.check_schedule(state, path, schedule, config.stop_at)
