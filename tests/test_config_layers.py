"""One source of truth for every default (the dataclasses), presets that only override, one meaning of
`--preset NAME` for `qevolve policy` / `qevolve critic` and `qevolve evolve`, `--print-config` naming the
layer of every value, and errors naming the layer that set the bad value (docs/commands.md)."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from typer.testing import CliRunner

from qevolve_cli.cli import app
from qevolve_cli.config import configs_dir, load_yaml
from qevolve_cli.critic.config import CriticConfig, load_critic_config
from qevolve_cli.env_names import ENV_NAMES, MAX_STEPS
from qevolve_cli.evolve.compare import CompareConfig
from qevolve_cli.evolve.config import SCALES, resolve, resolve_with_origin
from qevolve_cli.policy.config import PolicyConfig, load_policy_config
from qevolve_cli.rollout.config import RolloutConfig

runner = CliRunner()
SCALE_PRESETS = [s for s in SCALES if s != "paper"]


def test_stage_preset_files_hold_no_copy_of_the_defaults():
    for name, cls in (("policy.yaml", PolicyConfig), ("critic.yaml", CriticConfig)):
        data = load_yaml(configs_dir() / name)
        assert data["default"] == {}, f"configs/{name}: defaults live in {cls.__name__} only"
        for preset in data:  # every preset names known fields with valid values
            (load_policy_config if cls is PolicyConfig else load_critic_config)(preset=preset)


def test_stage_presets_set_only_what_differs_from_the_defaults():
    for name, cls in (("policy.yaml", PolicyConfig), ("critic.yaml", CriticConfig)):
        default = cls()
        for preset, values in load_yaml(configs_dir() / name).items():
            copies = [k for k, v in values.items() if getattr(default, k) == v]
            assert not copies, f"configs/{name}: preset {preset} repeats the default of {copies}"


def _leaves(d: dict, path: tuple = ()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, (*path, k))
        elif k == "iterations" and isinstance(v, list):
            for i, entry in enumerate(v):
                yield from _leaves(entry, (*path, k, i))
        else:
            yield (*path, k)


def _without(d: dict, path: tuple) -> dict:
    d = copy.deepcopy(d)
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]
    return d


def _trained_with(env: str, env_data: dict, scale: str, scale_data: dict | None):
    """Everything `qevolve evolve --env ENV --preset SCALE` runs with: its own fields and every stage config of
    every iteration, under the preset's policy step and the other one (`--policy-step`: the bppo values of a
    preset whose step is awr still count), or the error a broken preset gives."""
    from qevolve_cli.evolve.config import STAGE_SECTIONS, EvolveConfig, merge_presets

    try:
        cfg = EvolveConfig.from_dict({**merge_presets(env, env_data, scale, scale_data), "env": env, "preset": scale,
                                      "model": "m"})
    except Exception as e:  # noqa: BLE001 - a removed key that breaks the config is not a copy
        return repr(e)
    own = {k: v for k, v in cfg.to_dict().items() if k not in (*STAGE_SECTIONS, "iterations")}
    k_max = max(cfg.iters, len(cfg.iterations), 1)
    return own, [c.stage(s, k) for c in (cfg, cfg.replace(policy_step="awr" if cfg.policy_step == "bppo" else "bppo"))
                 for k in range(k_max + 1) for s in STAGE_SECTIONS]


def test_presets_hold_no_copy_of_a_value_the_layers_below_give():
    """A value in configs/presets/*.yaml is there because it changes what some run trains with: dropping any
    single one of them changes a resolved stage config of some environment x scale (else it is a copy of a
    dataclass default or of another preset's value, which could drift from its source)."""
    files = {p.stem: load_yaml(p) for p in (configs_dir() / "presets").glob("*.yaml")}
    assert set(files) == set(ENV_NAMES) | set(SCALE_PRESETS)
    copies = []
    for name, data in files.items():
        runs = ([(name, s) for s in ["paper", *SCALE_PRESETS]] if name in ENV_NAMES
                else [(e, name) for e in ENV_NAMES])

        def trained(env, scale, edited=None, name=name):
            pick = lambda n: edited if (edited is not None and n == name) else files[n]  # noqa: E731
            return _trained_with(env, pick(env), scale, pick(scale) if scale != "paper" else None)

        base = {r: trained(*r) for r in runs}
        for leaf in _leaves(data):
            edited = _without(data, leaf)
            if all(trained(*r, edited) == base[r] for r in runs):
                copies.append(f"configs/presets/{name}.yaml: {'.'.join(map(str, leaf))}")
    assert not copies, "values that change nothing (copies of a default or of a lower preset): " + ", ".join(copies)


@pytest.mark.parametrize("name,cls", [("rollout.yaml", RolloutConfig), ("compare.yaml", CompareConfig)])
def test_flat_example_files_equal_the_dataclass_defaults(name, cls):
    """configs/rollout.yaml and configs/compare.yaml show every field with its default: the same keys, the
    same values as the dataclass (a changed default fails here until the file follows)."""
    data = load_yaml(configs_dir() / name)
    assert list(data) == [f.name for f in dataclasses.fields(cls)]
    assert cls.from_dict(data) == cls()


@pytest.mark.parametrize("env", ENV_NAMES)
def test_paper_presets_give_stage_commands_and_evolve_the_same_configs(env):
    """`qevolve policy/critic --preset ENV_iterK` (and `--preset ENV` for bc) == what `qevolve evolve --env ENV`
    trains at iteration K, field by field."""
    cfg = resolve(env, "paper", overrides={"model": "m"})
    assert load_policy_config(preset=env) == cfg.stage("bc", 0)
    for k in range(1, cfg.iters + 1):
        assert load_policy_config(preset=f"{env}_iter{k}") == cfg.stage("policy", k), k
        assert load_critic_config(preset=f"{env}_iter{k}") == cfg.stage("critic", k), k


def test_critic_iteration_presets_are_the_sciworld_and_webshop_values():
    for k in (1, 2):
        assert load_critic_config(preset=f"iter{k}") == load_critic_config(preset=f"sciworld_iter{k}") \
            == load_critic_config(preset=f"webshop_iter{k}")


@pytest.mark.parametrize("scale", SCALE_PRESETS)
def test_scale_preset_means_the_same_numbers_for_stage_commands_and_evolve(scale):
    """`--preset cpu` (smoke, cpu-smol): every value the scale preset sets for `qevolve policy` (bc with bc/rft,
    the policy stage with bppo/awr/dpo), `qevolve critic` and their `_iterK` forms is the value `qevolve evolve
    --preset cpu` trains with, in every environment; where they differ, the preset's `envs: {ENV: ...}` block
    says so (tests below show the lamps learning-check values)."""
    from qevolve_cli.config import resolve_layers
    from qevolve_cli.critic.config import critic_layers
    from qevolve_cli.policy.config import policy_layers

    iterations = len(load_yaml(configs_dir() / "presets" / f"{scale}.yaml").get("iterations", [])) or 1
    checked = 0
    for env in ENV_NAMES:
        ecfg, origin = resolve_with_origin(env, scale, overrides={"model": "m"})
        ecfg = ecfg.replace(iters=iterations)
        cases = [("bc", 0, PolicyConfig, policy_layers(None, scale, "bc"))]
        for k in range(1, iterations + 1):
            name = f"{scale}_iter{k}"
            cases += [("policy", k, PolicyConfig, policy_layers(None, name, "bppo")),
                      ("critic", k, CriticConfig, critic_layers(None, name))]
        step_cfg = ecfg  # the policy stage of `qevolve policy --preset` is bppo's: compare with the bppo step
        if ecfg.policy_step != "bppo":  # set by the preset's per-environment block, a documented difference
            assert f"envs.{env}" in origin[("policy_step",)], (env, origin[("policy_step",)])
            step_cfg = ecfg.replace(policy_step="bppo")
        for stage, k, cls, layers in cases:
            mine = resolve_layers(cls, layers)
            c = step_cfg if stage == "policy" else ecfg
            theirs, where = c.stage(stage, k), c.stage_origin(stage, k, origin)
            for f, value, layer in mine.rows():
                if not layer.startswith(f"preset {scale}"):
                    continue
                checked += 1
                if f"envs.{env}" in where[f]:
                    continue  # the preset's per-environment block: a documented difference
                assert getattr(theirs, f) == value, (env, stage, k, f, value, getattr(theirs, f), where[f])
    assert checked > 100


def test_cpu_preset_keeps_the_measured_learning_check_values():
    """docs/learning_check.md: lamps under --preset cpu --policy-step bppo trains BPPO at 1e-4 then 5e-5 and the
    critic 6 epochs; the preset's own step there is awr (docs/compare.md), with the bc stage's lr; the same
    preset without an environment (qevolve policy --preset cpu --objective bppo) is the generic 2e-4."""
    cfg = resolve("lamps", "cpu", overrides={"policy_step": "bppo"})
    assert [cfg.stage("policy", k).lr for k in (1, 2)] == [1e-4, 5e-5]
    awr = resolve("lamps", "cpu")
    assert awr.policy_step == "awr" and [awr.stage("policy", k).lr for k in (1, 2)] == [2e-3, 2e-3]
    assert [cfg.stage("critic", k).epochs for k in (1, 2)] == [6, 6]
    assert load_policy_config(preset="cpu", overrides={"objective": "bppo"}).lr == 2e-4
    assert load_policy_config(preset="cpu").lr == cfg.stage("bc", 0).lr == 2e-3


@pytest.mark.parametrize("scale", ["cpu", "cpu-smol"])
@pytest.mark.parametrize("env", ["lamps-hard", "lamps-habit"])
def test_cpu_scales_keep_the_step_and_length_limits_of_the_longer_lamps(env, scale):
    """lamps-hard's and lamps-habit's own presets allow 25 / 26 steps (their longest stated step budget) in 3,072
    tokens; a CPU scale preset's generic limits (lamps' 16 steps in 2,048 tokens) must not cut them, or tasks with
    a longer budget become unsolvable and long trajectories are truncated in training."""
    own = resolve(env, "paper", overrides={"model": "m"})
    cfg = resolve(env, scale, overrides={"model": "m"})
    for k in (1, 2):
        assert cfg.stage("rollout", k).max_steps == own.stage("rollout", k).max_steps >= 25
        assert cfg.stage("rollout", k).max_context >= own.stage("rollout", k).max_context
        assert cfg.stage("critic", k).max_length >= own.stage("critic", k).max_length
        assert cfg.stage("policy", k).max_length >= own.stage("policy", k).max_length
    assert cfg.stage("bc", 0).max_length >= own.stage("bc", 0).max_length
    assert cfg.eval_max_tasks == 0  # the whole held-out splits


@pytest.mark.parametrize("scale", SCALES)
def test_a_scale_never_lengthens_an_environments_episodes(scale):
    """An episode's step limit is part of the task (the paper's "maximum episode length"): a scale made for a
    small machine may shorten it where it says so (smoke: 3 steps; the CPU scales: TextCraft's 20 of 40), never
    lengthen it. The CPU scales used to set lamps' 12-16 steps for every environment, which gave WebShop 12-16
    turns where its limit is 10 and cut ALFWorld's 30 and SciWorld's 24 to 12-16: they keep them now."""
    for env in ENV_NAMES:
        cfg = resolve(env, scale, overrides={"model": "m"})
        for k in (1, 2):
            steps = cfg.stage("rollout", k).max_steps or MAX_STEPS[env]
            assert 0 < steps <= MAX_STEPS[env], (env, k, steps)
            if scale in ("paper", "cpu", "cpu-smol") and env != "textcraft":
                assert steps == MAX_STEPS[env], (env, k, steps)


def test_print_config_names_the_layer_of_every_value():
    r = runner.invoke(app, ["policy", "--preset", "cpu", "--objective", "bppo", "--set", "lr=3e-4", "--epochs", "4",
                            "--print-config", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["config"]["lr"] == 3e-4 and d["origin"]["lr"] == "--set lr"
    assert d["origin"]["epochs"] == "--epochs" and d["origin"]["objective"] == "--objective"
    assert d["origin"]["max_length"] == "preset cpu (configs/presets/cpu.yaml: policy)"
    assert d["origin"]["old_refresh_steps"] == "preset cpu (configs/presets/cpu.yaml: iterations[0].policy)"
    assert d["origin"]["kl_coef"] == "default (PolicyConfig)"
    assert set(d["config"]) == {f.name for f in dataclasses.fields(PolicyConfig)}
    text = runner.invoke(app, ["critic", "--preset", "iter2", "--print-config"]).stdout
    assert any(line.split()[:2] == ["lr", "5e-06"] and line.endswith("critic.yaml (preset iter2)")
               for line in text.splitlines()), text
    ev = runner.invoke(app, ["evolve", "--env", "lamps", "--preset", "cpu", "--policy-step", "bppo", "--print-config",
                             "--json"])
    assert ev.exit_code == 0, ev.output
    d = json.loads(ev.stdout)
    assert d["config"]["policy (iteration 2)"]["lr"] == 5e-5
    assert d["origin"]["policy (iteration 2)"]["lr"] == \
        "preset cpu (configs/presets/cpu.yaml: envs.lamps), iterations[1].policy"
    assert d["origin"]["bc"]["objective"] == "evolve: the bc stage"
    assert d["origin"]["init_model"] == "preset cpu (configs/presets/cpu.yaml)"
    for cmd in (["rollout", "--max-tasks", "3"], ["eval"], ["label"], ["compare"]):
        r = runner.invoke(app, [*cmd, "--print-config", "--json"])
        assert r.exit_code == 0, (cmd, r.output)
        assert "default (" in json.dumps(json.loads(r.stdout)["origin"])


def test_errors_name_the_layer_that_set_the_value(tmp_path):
    def err(*args):
        r = runner.invoke(app, list(map(str, args)))
        assert r.exit_code == 2, r.output
        return r.output.strip()

    assert err("compare", "--set", "arms=rft") == \
        "error: --set arms: expected a list, got 'rft' (write --set 'arms=[rft]')"
    assert err("critic", "--set", "weighted=maybe", "--print-config") == \
        "error: --set weighted: expected true/false, got 'maybe' (write --set weighted=true or --set weighted=false)"
    assert err("policy", "--preset", "cpu", "--set", "lr=-1", "--print-config") == "error: --set lr: must be > 0, got -1.0"
    presets = tmp_path / "mine.yaml"
    presets.write_text("default: {epochs: 2}\nfast: {lr: -1}\n")
    assert err("policy", "--config", presets, "--preset", "fast", "--print-config") == \
        f"error: {presets} (preset fast): field 'lr': must be > 0, got -1.0"
    assert err("policy", "--config", presets, "--preset", "fast", "--lr", "0.1", "--data", "d", "--model", "m") == \
        "error: missing option --out (required unless --print-config)"
    flat = tmp_path / "r.yaml"
    flat.write_text("rollout: {n_per_task: 0}\n")
    assert err("rollout", "--config", flat, "--print-config") == f"error: {flat} (rollout): field 'n_per_task': must be >= 1, got 0"
    assert err("critic", "--preset", "nope").startswith("error: ") and "no such preset" in err("critic", "--preset", "nope")
    mine = tmp_path / "ev.yaml"  # evolve: a stage value of an iteration, blamed on the file and its path there
    mine.write_text("iterations:\n  - policy: {eps_low: 2}\n")
    assert err("evolve", "--env", "lamps", "--preset", "cpu", "--config", mine, "--print-config") == \
        f"error: {mine}: field 'iterations[0].policy.eps_low': must be <= 1, got 2.0"
    mine.write_text("critic: {expectile: 2.0}\n")
    assert err("evolve", "--env", "lamps", "--preset", "cpu", "--config", mine, "--print-config") == \
        f"error: {mine}: field 'critic.expectile': must be < 1, got 2.0"
    assert err("evolve", "--env", "lamps", "--preset", "cpu", "--iters", "-1") == "error: --iters: must be >= 0, got -1"
