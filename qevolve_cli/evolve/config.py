"""``EvolveConfig``: the whole Q-Evolve loop, resolved from presets.

Resolution order (later wins): ``configs/presets/<env>.yaml`` (the paper's
hyper-parameters for that environment) → ``configs/presets/<scale>.yaml`` when
``--preset`` names a scale (``smoke``, ``cpu``) → ``--config FILE`` → command
line flags. Stage sections (``bc``, ``rollout``, ``label``, ``critic``,
``policy``) are overrides of the stage configs (:class:`PolicyConfig`,
:class:`RolloutConfig`, :class:`LabelConfig`, :class:`CriticConfig`);
``iterations[k-1]`` overrides them again for iteration k (paper table
"Iteration 1 vs Iteration 2"). All of them are validated when the config is
resolved, before any work starts.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.config import ConfigBase, configs_dir, default_layer_name, field, load_yaml, scale_parts
from qevolve_cli.env_names import ENV_NAMES as ENVS  # noqa: E402 - one list of environments
from qevolve_cli.errors import ConfigError
from qevolve_cli.evolve.select import DEFAULT_BC_CANDIDATES, DEFAULT_POLICY_CANDIDATES
from qevolve_cli.precision import DTYPE_OF

SCALES = ("paper", "smoke", "cpu", "cpu-smol")
STAGE_SECTIONS = ("bc", "rollout", "label", "critic", "policy")
POLICY_STEPS = ("bppo", "awr")
AWR_FIELDS = ("awr_beta", "awr_max_weight", "normalize_advantage")
"""Fields of the policy sections that the awr policy step keeps (the rest of its config is the bc stage's)."""


@dataclass
class EvolveConfig(ConfigBase):
    env: str = field("textcraft", help="Environment.", choices=ENVS)
    preset: str = field("paper", help="Scale preset applied over the environment preset: paper, smoke, cpu, cpu-smol "
                        "(cpu with the pretrained SmolLM2-135M-Instruct and LoRA).",
                        choices=SCALES)
    iters: int = field(2, help="Evolving iterations K (paper: 2 for SciWorld/ALFWorld, 3 for WebShop).", ge=0)
    precision: str = field("auto", help="fp32 or bf16 for every stage (sets bc/policy precision and rollout/critic "
                           "dtype); auto: each stage's own field (docs/performance.md).", choices=("auto", "fp32", "bf16"))
    seed: int = field(0, help="Seed of every stage (rollout sampling, training order, initialisation).")
    model: str | None = field(None, help="Base model directory (HF checkpoint): backbone of the critic and "
                                         "initial policy of BC.")
    init_model: str | None = field(None, help="When no model is given: build a tiny offline model 'ARCH:SIZE' "
                                              "(e.g. llama:tiny) into the run directory, or 'from:NAME' to convert "
                                              "a pretrained one (from:smollm2-135m-instruct; `qevolve init-model "
                                              "--from`).")
    start_policy: str | None = field(None, help="Start from this policy (skips BC).")
    critic_backbone: str = field("base", help="Frozen backbone of each iteration's critic: base (the pretrained "
                                              "base model, the paper) or policy (the iteration's starting policy).",
                                 choices=("base", "policy"))
    policy_step: str = field("bppo", help="Policy step of every iteration: bppo (the paper: BPPO from the previous "
                             "iteration's policy, which is also pi_ref, with the policy stage's config) or awr "
                             "(advantage-weighted regression on the critic's standardised advantages, from the base "
                             "model with the BC warm-up's budget, as `compare` trains RFT; only awr_beta, "
                             "awr_max_weight and normalize_advantage come from the policy sections). awr departs "
                             "from the paper: docs/compare.md, 'The AWR policy step'.", choices=POLICY_STEPS)
    expert_data: str | None = field(None, help="Existing expert table (default: collected with `qevolve expert`).")
    expert_limit: int = field(0, help="Expert trajectories to collect from the train split (0 = all tasks).", ge=0)
    expert_workers: int = field(2, help="Worker processes for expert collection.", ge=1)
    eval_splits: list[str] = field(default_factory=lambda: ["test_seen", "test_unseen"],
                                   help="Splits evaluated after BC and every iteration.")
    eval_max_tasks: int = field(0, help="Evaluate only the first N tasks of each split (0 = all).", ge=0)
    eval_bc: bool = field(True, help="Evaluate the BC policy (iteration 0 of the score table).")
    log_to: list[str] = field(default_factory=list, help="Extra metric sinks: tensorboard, wandb (when installed).")
    bc: dict[str, Any] = field(default_factory=dict, help="PolicyConfig overrides of the BC warm-up.")
    rollout: dict[str, Any] = field(default_factory=dict, help="RolloutConfig overrides (rollout and eval).")
    label: dict[str, Any] = field(default_factory=dict, help="LabelConfig overrides.")
    critic: dict[str, Any] = field(default_factory=dict, help="CriticConfig overrides.")
    policy: dict[str, Any] = field(default_factory=dict, help="PolicyConfig overrides of the BPPO stage.")
    iterations: list[dict[str, Any]] = field(default_factory=list,
                                             help="Per-iteration overrides: iterations[k-1] = {rollout/critic/policy: {...}}.")
    select_on_validation: bool = field(False, help="Train every candidate of bc_candidates (BC) and of "
                                       "policy_candidates (each iteration's policy step) and keep the one with the "
                                       "highest greedy reward on the validation tasks (docs/compare.md).")
    validation_tasks: int = field(40, help="--select-on-validation: the last N tasks of the train split (never a "
                                  "test split) are the validation tasks, left out of the expert data, the rollouts "
                                  "and an expert_data table (its rows of them dropped).", ge=1)
    bc_candidates: list[dict[str, float]] = field(default_factory=lambda: [dict(c) for c in DEFAULT_BC_CANDIDATES],
                                                  help="--select-on-validation: BC candidates, multipliers of the bc "
                                                  "stage's fields ({} = the stage itself; epochs, lr).")
    policy_candidates: list[dict[str, float]] = field(
        default_factory=lambda: [dict(c) for c in DEFAULT_POLICY_CANDIDATES],
        help="--select-on-validation: policy-step candidates of every iteration, multipliers of the policy stage's "
             "fields ({} = the stage itself; lr, epochs).")

    SELECT_FIELDS = ("select_on_validation", "validation_tasks", "bc_candidates", "policy_candidates")

    def validate(self, source: Any = None, prefix: str = "") -> None:
        for s in self.eval_splits:
            if s not in ("train", "test_seen", "test_unseen", "test"):
                raise ConfigError(source, prefix + "eval_splits", f"unknown split {s!r}")
        for sink in self.log_to:
            if sink not in ("tensorboard", "wandb"):
                raise ConfigError(source, prefix + "log_to", f"unknown sink {sink!r} (tensorboard, wandb)")
        if self.model is None and self.init_model is None and self.start_policy is None:
            raise ConfigError(source, prefix + "model", "no base model: pass --model DIR (or a preset with init_model)")
        if self.policy_step == "awr" and self.model is None and self.init_model is None:
            raise ConfigError(source, prefix + "policy_step", "awr trains every iteration from the base model, and "
                              "there is none (only --policy): pass --model DIR")
        if self.init_model is not None:
            parts = self.init_model.split(":")
            if len(parts) != 2:
                raise ConfigError(source, prefix + "init_model", f"expected ARCH:SIZE or from:NAME, got {self.init_model!r}")
            if parts[0] == "from":
                from qevolve_cli.models.pretrained import SOURCES

                if parts[1] not in SOURCES:
                    raise ConfigError(source, prefix + "init_model",
                                      f"unknown pretrained model {parts[1]!r} (choose from {', '.join(SOURCES)})")
        from qevolve_cli.evolve.select import check_grid

        check_grid(self.bc_candidates, source, prefix + "bc_candidates")
        check_grid(self.policy_candidates, source, prefix + "policy_candidates")
        if self.select_on_validation and len(self.bc_candidates) != len(self.policy_candidates):
            raise ConfigError(source, prefix + "policy_candidates", f"{len(self.policy_candidates)} candidates but "
                              f"bc_candidates has {len(self.bc_candidates)}: every arm gets the same number")
        if self.select_on_validation:  # validation is carved out of the train split: something must be left
            from qevolve_cli.evolve.select import carve

            try:
                carve(self.env, self.validation_tasks)
            except ConfigError as e:
                raise ConfigError(source, prefix + "validation_tasks", e.problem) from None
        for i, it in enumerate(self.iterations):
            unknown = sorted(set(it) - set(STAGE_SECTIONS))
            if unknown:
                raise ConfigError(source, f"{prefix}iterations[{i}].{unknown[0]}",
                                  f"unknown section (known: {', '.join(STAGE_SECTIONS)})")
        # validate every stage config now, for every iteration
        for k in range(0, max(self.iters, 1) + 1):
            for section in STAGE_SECTIONS:
                try:
                    self.stage(section, k)
                    if section == "policy" and self.policy_step != "bppo":  # what awr ignores is still checked
                        self.stage(section, k, policy_step="bppo")
                except ConfigError as e:
                    err = ConfigError(source, None, f"{section} (iteration {k}): {e}")
                    err.stage = (section, k, e)  # resolve_with_origin names the layer that set the field
                    raise err from None

    #: top-level fields that say how the run reports, not what it makes
    OPERATIONAL = ("log_to",)

    def operational_changes(self, other: EvolveConfig) -> list[str] | None:
        """What ``other`` changes of this configuration when it differs only in operational fields (the
        stages' ``OPERATIONAL`` ones, such as checkpoint_every_steps, and :data:`OPERATIONAL`): one
        ``"bc.checkpoint_every_steps 0 -> 10"`` per changed field and stage; None when it changes anything else
        (the work itself: its finished stages would not be this configuration's)."""
        if self.work_hash() != other.work_hash():
            return None
        out = [f"{k} {getattr(self, k)} -> {getattr(other, k)}" for k in self.OPERATIONAL
               if getattr(self, k) != getattr(other, k)]
        for name in OPERATIONAL_SECTIONS:
            for k in (0,) if name == "bc" else range(1, self.iters + 1):
                a, b = self.stage(name, k), other.stage(name, k)
                where = "bc" if name == "bc" else f"iter_{k}/{name}"
                out += [f"{where}.{f} {getattr(a, f)} -> {getattr(b, f)}" for f in type(a).OPERATIONAL
                        if getattr(a, f) != getattr(b, f)]
        return out

    def work_hash(self) -> str:
        """:meth:`hash` of the configuration's work: equal for two configurations whose
        :meth:`operational_changes` is not None (they make the same stages)."""
        return self._work().hash()

    def _work(self) -> EvolveConfig:
        """This configuration with every operational field taken out (a stage's falls back to its default)."""
        d = copy.deepcopy(self.to_dict())
        for k in self.OPERATIONAL:
            d.pop(k, None)
        for name in OPERATIONAL_SECTIONS:
            for part in [d[name]] + [it.get(name, {}) for it in d["iterations"]]:
                for f in _operational_fields(name):
                    part.pop(f, None)
        return EvolveConfig.from_dict(d, source="operational check")

    # ---------------------------------------------------------------- stage configs
    def section(self, name: str, iteration: int) -> dict[str, Any]:
        """The overrides of stage ``name`` at ``iteration`` (the rule of :func:`qevolve_cli.config.scale_parts`,
        which `qevolve policy/critic --preset` follow too)."""
        base: dict[str, Any] = {}
        for _, part in scale_parts({name: getattr(self, name), "iterations": self.iterations}, name, iteration):
            base.update(copy.deepcopy(part))
        return base

    def stage_origin(self, name: str, iteration: int, origin: dict[tuple, str]) -> dict[str, str]:
        """For each field of :meth:`stage` ``(name, iteration)``: the layer that set it (``origin`` from
        :func:`resolve_with_origin`); what evolve itself supplies (objective, seed, env) is named so."""
        cfg = self.stage(name, iteration)
        awr = name == "policy" and self.policy_step == "awr"
        implied = {"bc": {"objective": "the bc stage", "seed": "seed"},
                   "policy": {"objective": f"policy_step ({self.policy_step})" if awr else "the policy stage (bppo)",
                              "seed": "seed"},
                   "rollout": {"env": "env", "iteration": "the iteration", "seed": "seed + 1000 x iteration"},
                   "critic": {"seed": "seed"},
                   "label": {"step_limit": "the rollout's step limit (the critic's time_input is steps_left)"}
                   if getattr(cfg, "step_limit", None) is not None else {}}[name]
        out = {}
        for f in dataclasses.fields(cfg):
            key = None
            src = "bc" if awr and f.name not in AWR_FIELDS else name  # awr: the bc stage's budget
            if src != "bc" and 1 <= iteration <= len(self.iterations) and f.name in self.iterations[iteration - 1].get(src, {}):
                key = ("iterations", iteration - 1, src, f.name)
            elif f.name in getattr(self, src):
                key = (src, f.name)
            switched = "precision" if name in ("bc", "policy") else "dtype" if name in ("rollout", "critic") else None
            if self.precision != "auto" and f.name == switched:  # the one precision switch wins (stage())
                out[f.name] = f"evolve: precision ({origin.get(('precision',), 'resolved config')})"
            elif key is not None and not (src == "bc" and f.name == "objective"):
                part = f"iterations[{key[1]}].{src}" if key[0] == "iterations" else src
                out[f.name] = f"{origin.get(key, 'resolved config')}, {part}"
            elif f.name in implied:
                what = implied[f.name]
                top = {"seed": ("seed",), "env": ("env",)}.get(f.name, None) if what in ("seed", "env") else None
                out[f.name] = f"evolve: {what}" + (f" ({origin[top]})" if top and top in origin else "")
            else:
                out[f.name] = default_layer_name(type(cfg))
        return out

    def stage(self, name: str, iteration: int = 1, policy_step: str | None = None):
        """The validated stage config of ``name`` for ``iteration``. Under ``policy_step: awr`` (the run's, or the
        argument's) the policy stage is the bc stage's config with objective awr and the :data:`AWR_FIELDS` of the
        policy sections."""
        d = self.section(name, iteration)
        if name == "policy" and (policy_step or self.policy_step) == "awr":
            d = {**self.section("bc", 0), **{k: v for k, v in d.items() if k in AWR_FIELDS}, "objective": "awr"}
        if self.precision != "auto":  # one switch for every stage
            if name in ("bc", "policy"):
                d["precision"] = self.precision
            elif name in ("rollout", "critic"):
                d["dtype"] = DTYPE_OF[self.precision]
        if name == "bc":
            from qevolve_cli.policy.config import PolicyConfig

            return PolicyConfig.from_dict({**d, "objective": "bc", "seed": d.get("seed", self.seed)},
                                          source="evolve config: bc")
        if name == "policy":
            from qevolve_cli.policy.config import PolicyConfig

            d.setdefault("objective", "bppo")
            d.setdefault("seed", self.seed)
            return PolicyConfig.from_dict(d, source="evolve config: policy")
        if name == "rollout":
            from qevolve_cli.rollout.config import RolloutConfig

            if d.get("shard"):
                raise ConfigError("evolve config: rollout", "shard", "evolve plays and evaluates whole splits; "
                                  "shard `qevolve rollout` / `qevolve eval` runs instead (docs/rollout.md)")
            d.update(env=self.env, iteration=iteration)
            d.setdefault("seed", self.seed + 1000 * iteration)
            return RolloutConfig.from_dict(d, source="evolve config: rollout")
        if name == "critic":
            from qevolve_cli.critic.config import CriticConfig

            d.setdefault("seed", self.seed)
            return CriticConfig.from_dict(d, source="evolve config: critic")
        if name == "label":
            from qevolve_cli.labeling import LabelConfig

            if d.get("step_limit") is None and self.section("critic", iteration).get("time_input") == "steps_left":
                # the rollouts write steps_left; the expert demonstrations get the same limit's (the sections, not
                # the stages: a bad critic or rollout field is their stage's error, not the label stage's)
                from qevolve_cli.env_names import MAX_STEPS

                d["step_limit"] = self.section("rollout", iteration).get("max_steps") or MAX_STEPS[self.env]
            return LabelConfig.from_dict(d, source="evolve config: label")
        raise KeyError(name)


OPERATIONAL_SECTIONS = ("bc", "critic", "policy")
"""The stage sections with operational fields (their config class's ``OPERATIONAL``)."""


def _operational_fields(section: str) -> tuple[str, ...]:
    """The ``OPERATIONAL`` fields of a stage section's config class (imported here, as :meth:`stage` does)."""
    from qevolve_cli.critic.config import CriticConfig
    from qevolve_cli.policy.config import PolicyConfig

    return (CriticConfig if section == "critic" else PolicyConfig).OPERATIONAL


def deep_merge(a: dict[str, Any], b: dict[str, Any], origin: dict[tuple, str] | None = None,
               name: str = "", path: tuple = ()) -> dict[str, Any]:
    """``b`` over ``a``: mappings merge recursively, ``iterations`` lists merge entry by entry.

    ``origin``: records ``name`` as the layer of every value ``b`` sets, keyed by its path
    (``("policy", "lr")``, ``("iterations", 0, "critic", "epochs")``)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        here = (*path, k)
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v, origin, name, here)
        elif k == "iterations" and isinstance(v, list) and isinstance(out.get(k), list):
            old = out[k]
            out[k] = [deep_merge(old[i] if i < len(old) else {}, v[i] if i < len(v) else {}, origin, name, (*here, i))
                      for i in range(max(len(old), len(v)))]
        else:
            out[k] = copy.deepcopy(v)
            if origin is not None:
                _record(origin, name, here, v)
    return out


def _record(origin: dict[tuple, str], name: str, path: tuple, v: Any) -> None:
    if isinstance(v, dict):
        for k, x in v.items():
            _record(origin, name, (*path, k), x)
    elif path[-1:] == ("iterations",) and isinstance(v, list):
        for i, x in enumerate(v):
            _record(origin, name, (*path, i), x)
    else:
        origin[path] = name


def preset_path(name: str) -> Path:
    p = configs_dir() / "presets" / f"{name}.yaml"
    if not p.exists():
        raise ConfigError(p, None, f"no preset named {name!r}")
    return p


def merge_presets(env: str, env_data: dict[str, Any], scale: str = "paper", scale_data: dict[str, Any] | None = None,
                  origin: dict[tuple, str] | None = None) -> dict[str, Any]:
    """The environment's preset, then the scale's, then the scale's ``envs: {<env>: {...}}`` block (the mappings
    of ``configs/presets/<env>.yaml`` and ``<scale>.yaml``); ``origin`` records the layer of every value."""
    data = deep_merge({}, env_data, origin, f"preset {env} (configs/presets/{env}.yaml)")
    if scale_data is not None:
        scale_data = dict(scale_data)
        per_env = (scale_data.pop("envs", None) or {}).get(env, {})
        rel = f"configs/presets/{scale}.yaml"
        data = deep_merge(data, scale_data, origin, f"preset {scale} ({rel})")
        data = deep_merge(data, per_env, origin, f"preset {scale} ({rel}: envs.{env})")
    return data


def resolve(env: str, preset: str = "paper", config_file: str | Path | None = None,
            overrides: dict[str, Any] | None = None) -> EvolveConfig:
    """Env preset, then scale preset, then config file, then flags -> validated EvolveConfig."""
    return resolve_with_origin(env, preset, config_file, overrides)[0]


def resolve_with_origin(env: str, preset: str = "paper", config_file: str | Path | None = None,
                        overrides: dict[str, Any] | None = None, flags: dict[str, str] | None = None
                        ) -> tuple[EvolveConfig, dict[tuple, str]]:
    """:func:`resolve`, and the layer that set each value, by path (``("policy", "lr")``); ``flags`` names
    the command-line flag of an override key (``{"iters": "--iters"}``)."""
    if env not in ENVS:
        raise ConfigError(None, "env", f"unknown environment {env!r} (choose from {', '.join(ENVS)})")
    if preset not in SCALES:
        raise ConfigError(None, "preset", f"unknown preset {preset!r} (choose from {', '.join(SCALES)})")
    origin: dict[tuple, str] = {}
    data = merge_presets(env, load_yaml(preset_path(env)), preset,
                         load_yaml(preset_path(preset)) if preset != "paper" else None, origin)
    if config_file is not None:
        data = deep_merge(data, load_yaml(config_file), origin, str(config_file))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    for k, v in given.items():
        data = deep_merge(data, {k: v}, origin, (flags or {}).get(k, "--" + k.replace("_", "-")))
    data["env"], data["preset"] = env, preset
    origin[("env",)], origin[("preset",)] = "--env", "--preset"
    try:
        return EvolveConfig.from_dict(data, source=config_file or f"preset {env}/{preset}"), origin
    except ConfigError as e:
        raise _blame_layer(e, origin) from None


def _blame_layer(err: ConfigError, origin: dict[tuple, str]) -> ConfigError:
    """``err`` re-addressed to the layer that set the offending value (a preset, ``--config``, a flag)."""
    if getattr(err, "stage", None) is not None:
        section, k, inner = err.stage
        key = (inner.field or "").split(".")[0].split("[")[0]
        paths = [(("iterations", k - 1, section, key), f"iterations[{k - 1}].{section}")] if k >= 1 else []
        paths.append(((section, key), section))
        for path, where in paths:
            if path in origin:
                return ConfigError(origin[path], f"{where}.{inner.field}", inner.problem)
        return err
    key = (err.field or "").split(".")[0].split("[")[0]
    layer = origin.get((key,)) or next((v for p, v in origin.items() if p[:1] == (key,)), None)
    if layer is None:
        return err
    if layer.startswith("--"):
        return ConfigError(layer, None, err.problem)
    return ConfigError(layer, err.field, err.problem)
