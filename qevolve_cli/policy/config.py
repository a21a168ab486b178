"""``PolicyConfig``: configuration of ``qevolve policy`` (BC, BPPO, AWR, RFT, DPO).

Mirrored by ``configs/policy.yaml`` (named presets per environment and
iteration from the paper's tables "Hyperparameters" and "Iteration 1 vs
Iteration 2"). Where the paper gives no value (KL weight alpha, thought weight,
AWR temperature) the defaults below are our documented choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.config import ConfigBase, configs_dir, field
from qevolve_cli.errors import ConfigError

OBJECTIVES = ("bc", "bppo", "awr", "rft", "dpo")


@dataclass
class PolicyConfig(ConfigBase):
    HASH_OMIT_AT_DEFAULT = ("logits", "shared_prefix", "window_context")  # added 2026-11-28/29: older runs resume
    OPERATIONAL = ("checkpoint_every_steps",)
    objective: str = field("bc", help="Training objective: bc (NLL on expert actions), bppo, awr, rft (NLL on "
                                      "expert + successful self trajectories), dpo (ETO trajectory preferences).",
                           choices=OBJECTIVES)
    # optimisation (paper Table "Hyperparameters")
    lr: float = field(1e-5, help="Peak learning rate (paper: 1e-5 SFT/iter 1 ALFWorld, 5e-6 otherwise).", gt=0)
    epochs: int = field(3, help="Training epochs (paper: 3 BC/ALFWorld iter 1, 2 otherwise).", ge=1)
    weight_decay: float = field(0.0, help="AdamW weight decay.", ge=0)
    warmup_ratio: float = field(0.03, help="Linear warm-up as a fraction of all optimiser steps.", ge=0, le=1)
    lr_scheduler: str = field("cosine", help="Learning-rate schedule after warm-up.", choices=("cosine", "constant"))
    max_grad_norm: float = field(1.0, help="Gradient-norm clipping (0 = off).", ge=0)
    seed: int = field(0, help="Random seed (initialisation of LoRA, batch order).")
    # batching ("dynamic" batch size: a padded-token budget per forward pass)
    max_length: int = field(4096, help="Maximum tokens of one training sequence. A longer trajectory is split "
                                       "into windows (the head + recent turns; each action trained once; dpo: "
                                       "a trajectory's log-ratio sums its windows). docs/policy.md, 'Long "
                                       "trajectories'.", ge=16)
    window_context: float = field(0.5, help="Share of max_length (after the head) a new window of a long "
                                            "trajectory starts with as context: 1 = the most turns that fit (the "
                                            "rollout's context, one window per step: most tokens); lower = "
                                            "windows shared by several steps (fewer tokens, shorter contexts).",
                                  gt=0.0, le=1.0)
    micro_batch_tokens: int = field(8192, help="Padded-token budget of one forward pass (dynamic batching).",
                                    ge=16)
    micro_batch_size: int = field(8, help="Maximum trajectories per forward pass (0 = only the token budget).",
                                  ge=0)
    grad_accum_steps: int = field(1, help="Micro-batches accumulated per optimiser step.", ge=1)
    batch_layout: str = field("auto", help="padded: one forward over the right-padded micro-batch; per_sequence: "
                              "one forward per sequence (no padding computed, no attention mask: the fused causal "
                              "kernel), the same loss; auto: per_sequence on CPU, padded on GPU (docs/performance.md).",
                              choices=("auto", "padded", "per_sequence"))
    shared_prefix: bool = field(True, help="The prompt prefix every sequence of the micro-batch shares (system "
                                "prompt, in-context example) is computed once, and each sequence's rest (or the "
                                "padded batch of the rests) runs on its keys and values; the same loss up to "
                                "rounding (docs/performance.md). Needs logits auto; off under "
                                "gradient_checkpointing and on models under 20 M parameters.")
    logits: str = field("auto", help="auto: the output layer and the log-softmax run only at the positions the "
                        "loss reads (the action and thought tokens), where the model supports it (transformers' "
                        "logits_to_keep as a mask); all: at every position. The same loss and gradient; auto is "
                        "1.7-2.8x faster on the tiny model (docs/performance.md).", choices=("auto", "all"))
    # model
    lora: bool = field(False, help="Train a PEFT LoRA adapter instead of all weights.")
    lora_r: int = field(16, help="LoRA rank.", ge=1)
    lora_alpha: int = field(32, help="LoRA alpha.", ge=1)
    lora_dropout: float = field(0.0, help="LoRA dropout.", ge=0, lt=1)
    lora_target_modules: str = field("all-linear", help="LoRA target modules: 'all-linear' or a comma list.")
    gradient_checkpointing: bool = field(False, help="Recompute activations in backward (saves GPU memory).")
    # BPPO (paper Eq. final_policy_loss)
    eps_low: float = field(0.8, help="Lower clip range: eta >= 1 - eps_low (paper best 0.8).", ge=0, le=1)
    eps_high: float = field(0.4, help="Upper clip range: eta <= 1 + eps_high (paper best 0.4).", ge=0)
    kl_coef: float = field(0.01, help="alpha: weight of KL(pi || pi_ref) (paper: alpha in [0, 1]; our default).",
                           ge=0, le=1)
    kl_estimator: str = field("k3", help="Per-token KL estimator: k3 = exp(r) - r - 1 (default), k1, k2.",
                              choices=("k1", "k2", "k3"))
    thought_weight: float = field(0.5, help="Weight of thought tokens (< 1 down-weights them; action tokens 1).",
                                  ge=0, le=1)
    old_refresh_steps: int = field(0, help="Refresh pi_old from the current policy every N optimiser steps "
                                           "(0 = never; paper iter 1: no/50/200 for ALFWorld/SciWorld/WebShop).",
                                   ge=0)
    normalize_advantage: bool = field(True, help="Standardise advantages over the training steps (mean 0, std 1). "
                                                 "Off, an accurate critic's advantages (mostly < 0: IQL's V is an "
                                                 "upper expectile) only push actions down and the policy collapses "
                                                 "(docs/compare.md, 'Oracle diagnosis').")
    # AWR ablation
    awr_beta: float = field(1.0, help="AWR temperature beta in exp(A / beta).", gt=0)
    awr_max_weight: float = field(20.0, help="AWR weights are clipped to this maximum.", gt=0)
    # RFT / DPO baselines (docs/policy.md "Baselines")
    rft_min_reward: float = field(1.0, help="rft: a self trajectory is successful (trained on) when its final "
                                            "reward (sum of reward_env) is >= this.", ge=0)
    dpo_beta: float = field(0.1, help="dpo: beta of the DPO loss (ETO's value in its first iteration: 0.1).", gt=0)
    dpo_nll_weight: float = field(0.0, help="dpo: weight alpha of an NLL term on the chosen trajectories, loss = DPO "
                                            "+ alpha * token-mean NLL(chosen) (RPO; TRL's rpo_alpha); 0 = plain DPO. "
                                            "Keeps the chosen trajectories likely (docs/compare.md, ETO).", ge=0,
                                  le=100)
    dpo_pairs: str = field("expert", help="dpo: anchor of each task's pairs: expert (ETO: the expert trajectory; "
                                         "tasks without one give no pair) or expert_or_best (else the task's "
                                         "highest-reward self trajectory).", choices=("expert", "expert_or_best"))
    # data
    bc_source: str = field("expert", help="Rows used by bc: expert rows only, or all rows.",
                           choices=("expert", "all"))
    drop_failed: bool = field(True, help="Drop trajectories whose 'error' column is set (crashed episodes).")
    # runtime
    device: str = field("auto", help="cpu, cuda or auto.", choices=("auto", "cpu", "cuda"))
    precision: str = field("auto", help="auto (bf16 autocast over fp32 weights on GPU, fp32 on CPU; docs/performance.md), fp32 or bf16.",
                           choices=("auto", "fp32", "bf16"))
    save_dtype: str = field("auto", help="dtype of saved full weights: auto (the initial model's), float32, "
                                         "bfloat16.", choices=("auto", "float32", "bfloat16"))
    deepspeed: str | None = field(None, help="DeepSpeed config (configs/deepspeed/zero2.json or zero3.json); "
                                             "launch with accelerate/deepspeed/torchrun.")
    max_steps: int = field(0, help="Stop after this many optimiser steps (0 = all epochs; for smoke tests).",
                           ge=0)
    checkpoint_every_steps: int = field(0, help="Also checkpoint every N optimiser steps, not only at epoch ends "
                                               "(0 = epoch ends only); an interrupted run resumes at the next step "
                                               "(docs/evolve.md#what-survives-a-failure).", ge=0)

    @property
    def uses_advantage(self) -> bool:
        """bppo and awr train on the table's ``advantage`` column (required, standardised when
        ``normalize_advantage``); the other objectives ignore it."""
        return self.objective in ("bppo", "awr")

    def validate(self, source: Any = None, prefix: str = "") -> None:
        if self.eps_low >= 1.0 and self.objective == "bppo":
            raise ConfigError(source, prefix + "eps_low", "must be < 1 (the ratio lower bound 1 - eps_low > 0)")
        if self.dpo_nll_weight and self.objective != "dpo":
            raise ConfigError(source, prefix + "dpo_nll_weight", f"only used by objective dpo (objective is "
                                                                 f"{self.objective}); set it to 0")
        if self.micro_batch_tokens < 16:
            raise ConfigError(source, prefix + "micro_batch_tokens", "must be >= 16")


def default_config_path() -> Path:
    return configs_dir() / "policy.yaml"


def preset_stage(preset: str | None, objective: str | None) -> str:
    """The evolve stage a ``--preset`` of ``configs/presets/`` gives ``qevolve policy``: ``bc`` (the BC warm-up)
    for bc and rft (RFT trains with the BC settings, as ``qevolve compare`` does), unless the preset names an
    iteration (``sciworld_iter1``); else ``policy`` (the BPPO stage, also for awr and dpo)."""
    return "bc" if objective in (None, "bc", "rft") and "_iter" not in (preset or "") else "policy"


def policy_layers(path: str | Path | None = None, preset: str | None = None, objective: str | None = None) -> list:
    """The YAML layers of a policy config (:func:`qevolve_cli.config.stage_preset_layers`)."""
    from qevolve_cli.config import stage_preset_layers

    stage = preset_stage(preset, objective)
    return stage_preset_layers(path, preset, default_config_path(), (stage,),
                               implied={"objective": "bppo"} if stage == "policy" else None)


def load_policy_config(path: str | Path | None = None, preset: str | None = None,
                       overrides: dict[str, Any] | None = None) -> PolicyConfig:
    """Load a policy config: ``path`` (a flat mapping, or a file of named presets) + ``preset`` + overrides.

    A presets file (like ``configs/policy.yaml``) maps names to partial configs; without ``preset`` its
    ``default`` section is used, and every preset inherits it. A preset of ``configs/presets/`` (``cpu``,
    ``sciworld_iter2``) gives the stage what ``qevolve evolve`` gives it (:func:`preset_stage`).
    """
    from qevolve_cli.config import Layer, resolve_layers

    layers = policy_layers(path, preset, (overrides or {}).get("objective"))
    return resolve_layers(PolicyConfig, layers + [Layer("overrides", overrides or {}, keep_none=False)]).config
