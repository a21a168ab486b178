"""Training: the loop of the policy stage and what every trainer shares below a loop.

The modules, bottom to top (the package re-exports every public name, so
``from qevolve_cli.training import train_loop`` is the import to use):

* ``args.py``: :class:`TrainArgs` (the loop's arguments; ``policy/config.py`` maps its fields onto
  them), :class:`Hooks`, :class:`TrainResult`;
* ``batching.py``: :func:`token_budget_batches` (items -> micro-batches under a padded-token budget)
  and :func:`group_steps` (micro-batches -> optimiser steps);
* ``backends/``: :class:`TorchBackend` (one process, CPU or one GPU), :class:`AccelerateBackend`
  (plain DDP), :class:`DeepSpeedBackend` (ZeRO-0/1/2/3), chosen by :func:`make_backend`; torch,
  accelerate and DeepSpeed are imported lazily;
* ``checkpoints.py``: write, commit (atomically), check and load a checkpoint (the policy's and the
  critic's), in the stage's work-in-progress directory ``OUT.partial/`` (docs/architecture.md, "Work in
  progress");
* ``loop.py``: :func:`train_loop`, the schedule (:func:`lr_lambda`) and seeding.

Usage (the policy trainer, ``policy/trainer.py``, is the full example)::

    from qevolve_cli.training import TrainArgs, group_steps, token_budget_batches, train_loop

    def make_steps(epoch):                    # -> the epoch's optimiser steps, each a list of micro-batches
        mbs = token_budget_batches(lengths, max_tokens=4096, max_seqs=8, seed=args.seed + epoch)
        return group_steps(mbs, grad_accum=4)

    def loss_fn(model, micro, ctx):           # -> (mean loss of the micro-batch, {metric: float})
        ...

    result = train_loop(model, make_steps, loss_fn, args, micro_weight=lambda micro: n_loss_tokens(micro))

Who uses what. ``train_loop`` runs the policy stage (bc, bppo, awr, rft, dpo) and the memory probe of
``qevolve plan`` (``planner/probe.py``). The critic (``critic/trainer.py``) has its own loop and uses the
pieces below it: :func:`lr_lambda`, the checkpoint functions (same layout and commit, its pointer is
``checkpoint.json`` too) and :class:`DeepSpeedBackend` for config resolution and engine start-up only. It
differs because its update is not one optimiser step over all trainable parameters:

* two AdamW optimisers over disjoint parameters (the Q branch: Q adapter and heads q1, q2; the V branch:
  value adapter and head v), each with two LR groups (adapter ``lr``, heads ``head_lr``);
* one update per batch, Q on odd batches and V on even ones (``schedule: alternate``; ``both``: Q then
  V), so each optimiser has its own warm-up and cosine schedule counted in its own updates;
  ``train_loop`` steps one optimiser and one scheduler over every trainable parameter, and AdamW would
  move the idle branch from its moments even with zero gradients;
* under DeepSpeed one engine per branch, ZeRO-0/1/2 and fp32 only (ZeRO-3 partitions the parameters
  inside one engine, whose optimiser steps every group on every step: it is refused,
  ``critic.optim.deepspeed_backend``);
* no gradient accumulation or token budget: a batch is ``batch_size`` trajectories with
  ``steps_per_traj`` steps drawn from an RNG that is part of the resumable epoch state; the EMA target
  follows every ``ema_every`` updates; held-out evaluation, early stopping and restoring the best epoch
  happen at epoch ends, and metrics are per epoch.

Folding these into ``train_loop`` would put a second loop inside it; the critic's stays in
:class:`qevolve_cli.critic.trainer.CriticTrainer`.
"""
from __future__ import annotations

from qevolve_cli.training.args import Hooks, TrainArgs, TrainResult
from qevolve_cli.training.backends import is_main_process, make_backend, resolve_precision
from qevolve_cli.training.backends.deepspeed import (
    DS_STAGES,
    DeepSpeedBackend,
    init_deepspeed,
    load_deepspeed_config,
    mark_completed,
    model_hidden_size,
    resolve_deepspeed_config,
    shutdown_distributed,
)
from qevolve_cli.training.backends.torch import AccelerateBackend, TorchBackend
from qevolve_cli.training.batching import (
    BATCH_LAYOUTS,
    group_steps,
    padding_fraction,
    per_sequence_layout,
    token_budget_batches,
)
from qevolve_cli.training.checkpoints import (
    KILL_AFTER_CHECKPOINT,
    POINTER,
    check_checkpoint_backend,
    check_checkpoint_files,
    checkpoint_manifest,
    checkpoint_meta,
    checkpoint_tag,
    commit_checkpoint,
    fsync_tree,
    kill_after_checkpoint,
    load_checkpoint,
    read_checkpoint_pointer,
    remove_checkpoint,
    rng_state,
    set_rng_state,
    start_checkpoint,
    write_checkpoint,
)
from qevolve_cli.training.loop import LossFn, lr_lambda, seed_everything, train_loop

__all__ = [
    "BATCH_LAYOUTS",
    "DS_STAGES",
    "KILL_AFTER_CHECKPOINT",
    "POINTER",
    "AccelerateBackend",
    "DeepSpeedBackend",
    "Hooks",
    "LossFn",
    "TorchBackend",
    "TrainArgs",
    "TrainResult",
    "check_checkpoint_backend",
    "check_checkpoint_files",
    "checkpoint_manifest",
    "checkpoint_meta",
    "checkpoint_tag",
    "commit_checkpoint",
    "fsync_tree",
    "group_steps",
    "init_deepspeed",
    "is_main_process",
    "kill_after_checkpoint",
    "load_checkpoint",
    "load_deepspeed_config",
    "lr_lambda",
    "make_backend",
    "mark_completed",
    "model_hidden_size",
    "padding_fraction",
    "per_sequence_layout",
    "read_checkpoint_pointer",
    "remove_checkpoint",
    "resolve_deepspeed_config",
    "resolve_precision",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "shutdown_distributed",
    "start_checkpoint",
    "token_budget_batches",
    "train_loop",
    "write_checkpoint",
]
