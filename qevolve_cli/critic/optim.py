"""The critic's two optimisers: one AdamW and LR schedule per branch (:class:`BranchOptimizer`, the Q branch
and the V branch), and the DeepSpeed backend they run under (:func:`deepspeed_backend`, one engine per branch).
Why the critic does not use :func:`qevolve_cli.training.train_loop`: docs/architecture.md, "The training loop
and the critic"."""
from __future__ import annotations

from typing import Any

import torch

from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.errors import QevolveError
from qevolve_cli.training import lr_lambda


class BranchOptimizer:
    """One optimiser + schedule over (adapter params, head params).

    Under DeepSpeed (``ds``) the optimiser is the client optimiser of its OWN engine over the
    critic module: ZeRO registers gradient hooks, partitions optimiser state and clips only for
    this branch's parameters, so a Q update never touches the V branch's parameters or Adam
    moments and vice versa (exactly the two independent optimisers of the paper).
    """

    def __init__(self, adapter: list, heads: list, cfg: CriticConfig, total: int, ds: Any = None,
                 module: Any = None):
        groups = [{"params": adapter, "lr": cfg.lr}, {"params": heads, "lr": cfg.head_lr or cfg.lr}]
        self.opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        self.engine = None
        if ds is not None:
            conf = ds.resolve(module, grad_accum=1, max_grad_norm=cfg.grad_clip, managed_accumulation=True)
            self.engine, _ = ds.initialize(module, self.opt, conf)
        self.base = [g["lr"] for g in groups]
        self.total = max(1, total)
        self.warmup = int(round(cfg.warmup_ratio * self.total))
        self.kind = cfg.lr_scheduler
        self.step_i = 0
        self.clip = cfg.grad_clip
        self.params = adapter + heads
        self.set_lr()

    def set_lr(self) -> None:
        f = lr_lambda(self.step_i, self.total, self.warmup, self.kind)
        for g, b in zip(self.opt.param_groups, self.base, strict=True):
            g["lr"] = b * f

    def step(self, loss: torch.Tensor) -> None:
        if self.engine is not None:  # DeepSpeed: gradient averaging over ranks, clipping (grad_clip), step
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
        else:
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.opt.step()
        self.step_i += 1
        self.set_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"opt": self.opt.state_dict(), "step": self.step_i}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.opt.load_state_dict(s["opt"])
        self.step_i = int(s["step"])
        self.set_lr()


def deepspeed_backend(cfg: CriticConfig):
    """The DeepSpeed backend of ``cfg.deepspeed`` (None without one); refuses what the critic cannot do exactly.

    ZeRO-3 is refused: it partitions parameters inside ONE engine, whose optimiser steps every
    parameter group on every step (Adam moves the inactive branch from its moments even with zero
    gradients), so the alternating Q / V updates with two independent optimisers cannot be kept
    exact; stages 0-2 use one engine per branch. bf16/fp16 engines are refused: DeepSpeed would
    cast the adapters and heads (and the q_target EMA, lambda 0.005) to 16 bits; ``dtype`` sets
    the frozen backbone's precision instead.
    """
    if not cfg.deepspeed:
        return None
    from qevolve_cli.training import DeepSpeedBackend, load_deepspeed_config

    raw = load_deepspeed_config(cfg.deepspeed, "deepspeed")
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise QevolveError(f"{cfg.deepspeed}: field zero_optimization.stage: the critic supports ZeRO stages 0-2 "
                           "(stage 3 cannot keep the two alternating optimisers exact; use configs/deepspeed/zero2.json)")
    for key in ("bf16", "fp16"):
        if isinstance(raw.get(key), dict) and raw[key].get("enabled") is True:
            raise QevolveError(f"{cfg.deepspeed}: field {key}.enabled: the critic trains its adapters and heads in "
                               "fp32 (set it to auto or false; `dtype` sets the frozen backbone's precision)")
    return DeepSpeedBackend(cfg.deepspeed, "fp32", cfg.device, 1, cfg.grad_clip)
