"""The shared training loop of the policy and the critic (one loop, losses passed in).

Usage (sketch)::

    from qevolve_cli.training import TrainArgs, train_loop, token_budget_batches

    def make_batches(epoch):                  # -> list of optimiser steps, each a list of micro-batches
        mbs = token_budget_batches(lengths, max_tokens=4096, max_seqs=8, seed=args.seed + epoch)
        return group_steps(mbs, grad_accum=4)

    def loss_fn(model, micro, ctx):           # -> (mean loss of the micro-batch, {metric: float})
        ...

    result = train_loop(model, make_batches, loss_fn, args,
                        micro_weight=lambda micro: n_loss_tokens(micro))

What the loop does:

* AdamW over the parameters with ``requires_grad`` (LoRA adapters, heads or
  the full model), weight decay ``args.weight_decay``;
* cosine schedule with linear warm-up over ``warmup_ratio`` of all optimiser
  steps (``lr_scheduler="constant"`` also available);
* gradient accumulation: an optimiser step is a list of micro-batches; each
  micro-batch loss (a *mean* over its own items) is scaled by
  ``micro_weight(micro) / sum(micro_weight over the step)``, so the step's
  gradient equals the gradient of the mean over all items of the step however
  the items were split ("dynamic" token-budget batching, see
  :func:`token_budget_batches`);
* gradient-norm clipping (``max_grad_norm``; 0 = off);
* precision: bf16 autocast (fp32 master weights) on CUDA and on CPUs with
  native bf16 (``avx512_bf16`` / AMX), fp32 elsewhere, unless ``precision``
  says otherwise (:mod:`qevolve_cli.precision`);
* seeding of python / numpy / torch, deterministic per-epoch batch order
  (the caller derives shuffling from ``seed + epoch``);
* metrics: one JSON line per optimiser step appended to ``args.log_path``
  (``{"epoch", "step", "lr", "loss", "grad_norm", "tokens", ...loss metrics}``),
  a rich progress bar on stderr;
* checkpoint / resume in ``args.ckpt_dir`` at epoch boundaries and, with
  ``checkpoint_every_steps`` N > 0, after every N-th optimiser step: trainable
  parameters (safetensors; under DeepSpeed the engine's own checkpoint),
  optimiser, scheduler, RNG states, the step counter and the caller's
  ``extra_state`` tensors. A run that is interrupted and started again with the
  same arguments continues at the next optimiser step: the epoch's batch order
  is rebuilt by ``make_steps(epoch)`` and the steps already done are skipped;
  the metrics log is cut back to the checkpoint's step. Each checkpoint goes
  into its own ``step########/`` directory and is committed by replacing
  ``meta.json`` atomically (the previous one is removed only then), see
  :func:`write_checkpoint`.
* ``hooks.on_step(step, model)`` after every optimiser step (the policy
  refreshes pi_old there).

Distributed / DeepSpeed ZeRO-2/3: ``args.deepspeed`` names a JSON config
(``configs/deepspeed/zero2.json`` / ``zero3.json``). The loop then runs through a
:class:`DeepSpeedBackend` (one ``deepspeed.initialize`` engine, DeepSpeed
imported lazily; on CPU its CPU accelerator with gloo). Launch with
``torchrun --standalone --nproc_per_node N -m qevolve_cli ...`` (or ``deepspeed`` /
``accelerate launch``); without a launcher a one-rank group is created. Every
``"auto"`` of the config is resolved here (:func:`resolve_deepspeed_config`).
The micro-batches of each optimiser step are dealt round-robin to the ranks
(every rank runs the same number of backward passes; a missing one is
micro-batch 0 with weight 0) and each rank's loss is scaled by
``world_size * w / (sum of w over the whole step)``, so the gradient averaged
over ranks is exactly the step's weighted mean: fp32 runs equal the
single-process run up to rounding. Logged losses/tokens are summed over ranks
and written by rank 0. Checkpoints under DeepSpeed are the engine's own
(``engine.save_checkpoint``: every rank writes its ZeRO partition of the
optimiser state, ZeRO-3 its parameter shards too) in the same committed layout;
they resume with the same number of ranks and ZeRO stage only. With ``WORLD_SIZE > 1`` and no DeepSpeed config the
loop runs plain DDP through :class:`AccelerateBackend`; otherwise
:class:`TorchBackend`.
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
from qevolve_cli.training.batching import group_steps, token_budget_batches
from qevolve_cli.training.checkpoints import (
    KILL_AFTER_CHECKPOINT,
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
    "DS_STAGES",
    "KILL_AFTER_CHECKPOINT",
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
