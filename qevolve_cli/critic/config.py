"""``CriticConfig``: the weighted IQL critic's configuration (mirrored by ``configs/critic.yaml``).

Paper values (Tables "Hyperparameters" and "Iteration 1 vs Iteration 2"):
epochs 20 (iteration 1) / 2 (iteration 2), learning rate 1e-5 (iteration 1;
iteration 2: 1e-5 ALFWorld, 5e-6 SciWorld / WebShop), gamma 0.95, EMA
lambda 0.005 every K = 2 optimisation steps, weight decay 0, warm-up ratio
0.03, cosine schedule. The paper gives no expectile m, LoRA rank or head
width: the defaults below (m = 0.7, rank 16, head width 256) are our choices,
documented in ``docs/critic.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qevolve_cli.config import ConfigBase, field
from qevolve_cli.errors import ConfigError
from qevolve_cli.rewards import CRITIC_REDUCTIONS


@dataclass
class CriticConfig(ConfigBase):
    # added 2026-11-27 (time_*), 2026-11-28 (share_value_forward, shared_prefix), 2026-11-29 (window_context):
    # older runs resume
    # 2026-12-02 (kind, feature_*, context_turns, fit_ladder): older runs resume
    HASH_OMIT_AT_DEFAULT = ("time_input", "time_scale", "share_value_forward", "shared_prefix", "window_context",
                            "kind", "feature_layer", "context_turns", "feature_batch_steps", "feature_eval_every",
                            "fit_ladder")
    OPERATIONAL = ("checkpoint", "checkpoint_every_steps")

    kind: str = field("lora", help="lora: LoRA adapters value / q / q_target on the backbone, trained through it "
                                   "(the paper); features: the backbone runs once without gradients, its hidden "
                                   "states are cached beside the table, and only the MLP heads train on them, "
                                   "many epochs in seconds (docs/critic.md, 'The feature critic').",
                      choices=("lora", "features"))
    feature_layer: int = field(-1, help="kind features: the hidden-state layer the heads read (0 = embeddings, "
                                        "-1 = the last, after the final norm; benchmarks/bench_probe.py measures "
                                        "which layer holds the value).")
    context_turns: int = field(0, help="kind features: what a state's features see. 0 = the whole transcript "
                                       "(windows of max_length for long ones); K >= 1 = the task (system prompt, "
                                       "example, first observation) plus the last K turns, so that equal recent "
                                       "text gives equal features and the critic pools equal states across "
                                       "trajectories (docs/critic.md, 'Pooling').", ge=0)
    feature_batch_steps: int = field(256, help="kind features: steps per minibatch of the heads' updates.", ge=1)
    feature_eval_every: int = field(10, help="kind features: held-out diagnostics (and early stopping) every N "
                                             "epochs.", ge=1)
    fit_ladder: bool = field(True, help="Score the critic's own training steps at the end and report the fit "
                                        "ladder (terminal fit, TD residual, V along failures, and on environments "
                                        "with a solver the tabular fixed point and the step credit; "
                                        "docs/critic.md, 'The fit ladder'). The LoRA critic pays one more scoring "
                                        "pass over its training trajectories for it.")
    # optimisation
    epochs: int = field(20, help="Passes over the trajectories (paper: 20 in iteration 1, 2 in iteration 2).", ge=1)
    lr: float = field(1e-5, help="Learning rate of the LoRA adapters (paper: 1e-5; 5e-6 in iteration 2 on SciWorld/WebShop).", gt=0)
    head_lr: float | None = field(None, help="Learning rate of the MLP heads (null: same as lr).", gt=0)
    weight_decay: float = field(0.0, help="AdamW weight decay.", ge=0)
    warmup_ratio: float = field(0.03, help="Fraction of the updates spent in linear warm-up.", ge=0, lt=1)
    lr_scheduler: str = field("cosine", help="Learning-rate schedule after warm-up.", choices=("cosine", "linear", "constant"))
    grad_clip: float = field(1.0, help="Clip the gradient norm of each update (0: off).", ge=0)
    batch_size: int = field(4, help="Trajectories per batch (right-padded, one forward per adapter).", ge=1)
    steps_per_traj: int = field(0, help="Steps K sampled per trajectory per update (0: all steps).", ge=0)
    schedule: str = field(
        "alternate",
        help="alternate: each batch is one Q or one V update, alternating (paper's Algorithm 'Critic optimization'); "
        "both: a Q update then a V update on every batch.",
        choices=("alternate", "both"),
    )
    reduction: str = field(
        "traj_sum",
        help="Loss reduction: traj_sum (sum over a trajectory's sampled steps, mean over trajectories; the paper), "
        "sum, or mean (over steps).",
        choices=CRITIC_REDUCTIONS,
    )
    seed: int = field(0, help="Random seed (head init, step sampling, batch order).")
    # IQL
    gamma: float = field(0.95, help="Discount factor gamma of the TD target.", ge=0, le=1)
    expectile: float = field(0.7, help="Expectile m of L2^m (paper: not given; 0.7 as in IQL's locomotion setting).", gt=0, lt=1)
    ema_lambda: float = field(0.005, help="EMA rate of the delayed Q adapter and heads.", gt=0, le=1)
    ema_every: int = field(2, help="Apply the EMA update every K optimisation steps.", ge=1)
    # weights and rewards (ablations)
    weighted: bool = field(True, help="Weighted IQL; false = standard IQL (ablation 'w/o W-IQL', all w_t = 1).")
    weight_temporal: bool = field(True, help="Keep the temporal term t/T of w_t (false: ablation 'w/o temporal term').")
    weight_success: bool = field(True, help="Keep the success term d of w_t (false: ablation 'w/o success term').")
    shaping: bool = field(True, help="Critic reward r = r_env + r_aux; false = r_env only (ablation 'no retrospective labels').")
    # model
    lora_rank: int = field(16, help="LoRA rank r of the value, Q and delayed-Q adapters.", ge=1)
    lora_alpha: int = field(32, help="LoRA alpha.", ge=1)
    lora_dropout: float = field(0.0, help="LoRA dropout.", ge=0, lt=1)
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        help="Modules that get LoRA adapters (PEFT names; ['all-linear'] = every linear layer but the LM head).",
    )
    head_hidden: int = field(256, help="Hidden width of the MLP heads g_v, g_q1, g_q2.", ge=1)
    time_input: str = field("none", help="none: the heads see the pooled state only (the paper); step: the step "
                                         "index t of the state (t + 1 for s'); steps_left: the table's steps_left "
                                         "column, the steps the episode has left before its step limit (one fewer "
                                         "for s'). Divided by time_scale, it is one more input of every head, so "
                                         "that V can fall as an episode's budget runs out (a time-aware value; "
                                         "docs/critic.md, 'Time input').",
                            choices=("none", "step", "steps_left"))
    time_scale: float = field(16.0, help="Divisor of the time input (step or steps_left; about the episodes' "
                                         "step limit).", gt=0)
    max_length: int | None = field(None, help="Longest tokenised sequence (null: no limit). A longer trajectory "
                                              "is split into windows of recent turns; a step whose one turn does "
                                              "not fit is skipped. docs/critic.md, 'Long trajectories'.", gt=0)
    window_context: float = field(0.5, help="Share of max_length (after the head) a new window of a long "
                                            "trajectory starts with as context: 1 = the most turns that fit (one "
                                            "window per step: most tokens); lower = windows shared by several "
                                            "steps. Scoring uses the same windows.", gt=0.0, le=1.0)
    # hardware
    device: str = field("auto", help="auto (cuda if available), cpu or cuda.", choices=("auto", "cpu", "cuda"))
    dtype: str = field("auto", help="Frozen backbone dtype: auto (bfloat16 on GPU; on CPU float32 for the LoRA critic, which trains through "
                       "it, and for the feature critic's no-grad pass bfloat16 where the CPU has avx512_bf16/AMX; "
                       "docs/performance.md), float32, bfloat16.",
                       choices=("auto", "float32", "bfloat16"))
    batch_layout: str = field("auto", help="padded: one forward over the right-padded batch; per_sequence: one "
                              "forward per trajectory (no padding computed, no attention mask: the fused causal "
                              "kernel), the same losses; auto: per_sequence on CPU, padded on GPU "
                              "(docs/performance.md).", choices=("auto", "padded", "per_sequence"))
    gradient_checkpointing: bool = field(False, help="Recompute backbone activations in the backward pass (long sequences on GPU).")
    shared_prefix: bool = field(True, help="The prompt prefix every trajectory of the batch shares (system prompt, "
                                "in-context example) is computed once, and each trajectory's rest (or the padded "
                                "batch of the rests) runs on its keys and values; the same values up to rounding "
                                "(docs/performance.md). Off under gradient_checkpointing and on models under 20 M "
                                "parameters, where the extra forward costs more than it saves.")
    share_value_forward: bool = field(True, help="schedule both: one value-adapter forward per batch for V(s') of the "
                                      "Q update and V(s) of the V update (3 backbone forwards a batch, not 4; the "
                                      "same weights); holds its activations during the Q update (SmolLM2 on lamps: "
                                      "1.12x faster, peak memory 6.9 -> 10.5 GiB; docs/critic.md). false when "
                                      "memory is tight.")
    # held-out diagnostics and convergence (docs/critic.md "Diagnostics")
    heldout_fraction: float = field(0.1, help="Share of trajectories held out by traj_id (stratified by outcome, "
                                              "deterministic) for the diagnostics and early stopping; 0: none.",
                                    ge=0, lt=1)
    early_stop_patience: int = field(0, help="Stop when the held-out Bellman error has not improved by "
                                             "early_stop_min_delta for this many epochs (0: run all epochs).", ge=0)
    early_stop_min_delta: float = field(0.0, help="Smallest relative decrease of the held-out Bellman error that "
                                                  "counts as an improvement (0.01 = 1 %).", ge=0)
    early_stop_metric: str = field("bellman_q", help="Held-out error watched by early stopping: bellman_q (the Q "
                                                     "regression's TD error, the default), bellman (bellman_q + the "
                                                     "expectile error of V) or td_v (V's own TD error).",
                                   choices=("bellman_q", "bellman", "td_v"))
    restore_best: bool = field(False, help="With early stopping: keep the epoch with the lowest held-out Bellman "
                                           "error instead of the last one. Off by default: a flat critic has a "
                                           "low Bellman error, so the lowest is often an early, unlearned epoch "
                                           "(docs/critic.md#diagnostics).")
    diag_lambda: float = field(0.95, help="GAE lambda of the advantages in the diagnostics (r_env only, as the "
                                          "paper's process reward).", ge=0, le=1)
    checkpoint: bool = field(True, help="Save a resumable checkpoint after every epoch into OUT.partial/ (under "
                                        "DeepSpeed too); an interrupted run resumes when started again.")
    checkpoint_every_steps: int = field(0, help="Also checkpoint every N optimisation steps (Q and V updates counted "
                                               "together; written after the batch that reaches it; 0 = epoch ends "
                                               "only). The run then resumes mid-epoch at the next batch.", ge=0)
    deepspeed: str | None = field(None, help="DeepSpeed config for data-parallel training (ZeRO stage 0-2, e.g. "
                                             "configs/deepspeed/zero2.json; stage 3 is refused); launch with torchrun.")

    def validate(self, source: Any = None, prefix: str = "") -> None:
        if not self.lora_target_modules:
            raise ConfigError(source, prefix + "lora_target_modules", "must name at least one module")
        if self.checkpoint_every_steps and not self.checkpoint:
            raise ConfigError(source, prefix + "checkpoint_every_steps", "needs checkpoint: true (checkpoints are off)")

    def peft_target_modules(self) -> str | list[str]:
        t = list(self.lora_target_modules)
        return "all-linear" if t == ["all-linear"] else t


def default_config_path():
    from qevolve_cli.config import configs_dir

    return configs_dir() / "critic.yaml"


def critic_layers(path: Any = None, preset: str | None = None) -> list:
    """The YAML layers of a critic config (:func:`qevolve_cli.config.stage_preset_layers`)."""
    from qevolve_cli.config import stage_preset_layers

    return stage_preset_layers(path, preset, default_config_path(), ("critic",))


def load_critic_config(path: Any = None, preset: str | None = None,
                       overrides: dict[str, Any] | None = None) -> CriticConfig:
    """``path`` (a flat mapping, or a file of named presets like ``configs/critic.yaml``) + ``preset`` + overrides.

    Without ``path`` the defaults of :class:`CriticConfig` apply (= the paper's iteration 1), unless a
    ``preset`` is named, which is then looked up in ``configs/critic.yaml`` (every preset inherits ``default``)
    or, failing that, in ``configs/presets/`` (``cpu``, ``sciworld_iter2``: the critic stage of
    ``qevolve evolve --preset NAME``).
    """
    from qevolve_cli.config import Layer, resolve_layers

    layers = critic_layers(path, preset) + [Layer("overrides", overrides or {}, keep_none=False)]
    return resolve_layers(CriticConfig, layers).config
