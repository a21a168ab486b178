"""Policy training on the tiny real model: BPPO/AWR behaviour, BC, outputs, CLI and errors."""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
import torch

from qevolve_cli.envs.prompts import instruction_prompt
from qevolve_cli.schema import write_table
from qevolve_cli.transcript import build_messages
from tests.conftest import run_qevolve

torch.set_num_threads(1)

GOOD = "Thought: I need oak logs to make planks.\nAction: get 1 oak log"
BAD = "Thought: I will look around first.\nAction: inventory"


def make_table(path, n_traj=6, steps=2, with_adv=True):
    """Trajectories alternate good actions (A = +1, expert rows) and bad actions (A = -1, self rows)."""
    rows = []
    for k in range(n_traj):
        good = k % 2 == 0
        for t in range(steps):
            r = dict(traj_id=f"tr{k}", env="textcraft", task_id=str(k), split="train",
                     source="expert" if good else "self", iteration=0 if good else 1, step=t,
                     instruction=f"craft {k + 1} oak planks", observation=f"Got {t} oak log",
                     action=GOOD if good else BAD, command="get 1 oak log" if good else "inventory",
                     next_observation=f"Got {t + 1} oak log", reward_env=1.0 if (good and t == steps - 1) else 0.0,
                     done=t == steps - 1)
            if with_adv:
                r["advantage"] = 1.0 if good else -1.0
            rows.append(r)
    write_table(pl.DataFrame(rows), path)
    return pl.DataFrame(rows)


def step_logprobs(model_dir, df) -> list[tuple[str, float]]:
    """(action, summed log-prob of the action + end of turn) for every step of ``df`` (sorted by traj_id, step), computed
    independently of the trainer: prompt via the chat template with a generation prompt, then the
    action text + end-of-turn as the continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[tuple[str, float]] = []
    for (_tid,), g in df.sort("traj_id", "step").group_by("traj_id", maintain_order=True):
        obs, acts = g["observation"].to_list(), g["action"].to_list()
        for t in range(g.height):
            msgs = build_messages(instruction_prompt(g["env"][0]), g["instruction"][0], obs[: t + 1], acts[:t])
            prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            c_ids = tok(acts[t] + tok.eos_token, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + c_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            tgt = ids[0, 1:]
            out.append((acts[t], float(lp[torch.arange(len(tgt)), tgt][len(p_ids) - 1 :].sum())))
    return out


def action_logprobs(model_dir, df) -> dict[str, float]:
    """Mean summed log-prob of the good / bad actions (:func:`step_logprobs`)."""
    res: dict[str, list[float]] = {"good": [], "bad": []}
    for action, s in step_logprobs(model_dir, df):
        res["good" if action == GOOD else "bad"].append(s)
    return {k: sum(v) / len(v) for k, v in res.items()}


OK_SELF = "Thought: Two logs will do as well.\nAction: get 2 oak log"


def make_baseline_table(path, n_tasks=3, steps=2):
    """Per task: an expert trajectory (GOOD, reward 1), a failed self trajectory (BAD, reward 0) and a
    successful self trajectory (OK_SELF, reward 1: a tie with the expert for DPO)."""
    rows = []
    for k in range(n_tasks):
        for tid, source, action, reward in ((f"e{k}", "expert", GOOD, 1.0), (f"f{k}", "self", BAD, 0.0),
                                            (f"s{k}", "self", OK_SELF, 1.0)):
            for t in range(steps):
                rows.append(dict(traj_id=tid, env="textcraft", task_id=str(k), split="train", source=source,
                                 iteration=0 if source == "expert" else 1, step=t,
                                 instruction=f"craft {k + 1} oak planks", observation=f"Got {t} oak log",
                                 action=action, command=action.split("Action: ")[1],
                                 next_observation=f"Got {t + 1} oak log",
                                 reward_env=reward if t == steps - 1 else 0.0, done=t == steps - 1))
    write_table(pl.DataFrame(rows), path)
    return pl.DataFrame(rows)


def summed_logprobs(model_dir, df) -> dict[str, float]:
    """Mean summed log-prob of every step's action per distinct action text (:func:`step_logprobs`)."""
    res: dict[str, list[float]] = {}
    for action, s in step_logprobs(model_dir, df):
        res.setdefault(action, []).append(s)
    return {k: sum(v) / len(v) for k, v in res.items()}


@pytest.fixture(scope="module")
def baseline_table(tmp_path_factory):
    p = tmp_path_factory.mktemp("base") / "expert_and_rollout.parquet"
    make_baseline_table(p)
    return p


def test_rft_clones_experts_and_successful_self_trajectories_only(baseline_table, tiny_model_dir, tmp_path):
    from qevolve_cli.policy import PolicyConfig, train_policy

    cfg = PolicyConfig(objective="rft", lr=2e-3, epochs=4, micro_batch_size=2, warmup_ratio=0.0, seed=0)
    m = train_policy(cfg, baseline_table, tiny_model_dir, tmp_path / "rft", quiet=True)
    assert m["trajectories"] == 6 and (m["rft_expert"], m["rft_self_kept"], m["rft_self_dropped"]) == (3, 3, 3)
    df = pl.read_parquet(baseline_table)
    before = summed_logprobs(tiny_model_dir, df)
    after = summed_logprobs(tmp_path / "rft", df)
    gain = {k: after[k] - before[k] for k in before}
    # the successful self action is cloned like the expert's; the failed one is not trained on
    assert gain[OK_SELF] > 5 and gain[GOOD] > 5, gain
    assert gain[OK_SELF] > gain[BAD] + 3 and gain[GOOD] > gain[BAD] + 3, gain
    # bc on the same table clones the expert rows only: the successful self action gains much less
    cfg_bc = PolicyConfig(objective="bc", lr=2e-3, epochs=4, micro_batch_size=2, warmup_ratio=0.0, seed=0)
    train_policy(cfg_bc, baseline_table, tiny_model_dir, tmp_path / "bc", quiet=True)
    bc = summed_logprobs(tmp_path / "bc", df)
    assert after[OK_SELF] > bc[OK_SELF] + 3, (after, bc)


def test_dpo_raises_chosen_relative_to_rejected(baseline_table, tiny_model_dir, tmp_path):

    from qevolve_cli.policy import PolicyConfig, train_policy

    cfg = PolicyConfig(objective="dpo", lr=2e-3, epochs=4, micro_batch_size=2, warmup_ratio=0.0, seed=0)
    m = train_policy(cfg, baseline_table, tiny_model_dir, tmp_path / "dpo", quiet=True)
    # 3 tasks: expert (reward 1) > failed self (0) -> 3 pairs; the successful self trajectories tie
    assert (m["dpo_pairs"], m["dpo_lose"], m["dpo_win"], m["dpo_tie"]) == (3, 3, 0, 3)
    # micro_batch_size counts sequences: 2 = one pair (chosen + rejected) per optimiser step
    assert m["trajectories"] == 6 and m["optimizer_steps"] == 4 * 3
    lines = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    # the frozen reference is the starting policy: the first step's loss is -log sigmoid(0) = ln 2
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert lines[-1]["loss"] < 0.3 and lines[-1]["reward_accuracy"] == 1.0
    df = pl.read_parquet(baseline_table)
    before = summed_logprobs(tiny_model_dir, df)
    after = summed_logprobs(tmp_path / "dpo", df)
    rel_gain = (after[GOOD] - before[GOOD]) - (after[BAD] - before[BAD])
    assert rel_gain > 5, (before, after)
    assert m["dpo_chosen_logp_delta"] - m["dpo_rejected_logp_delta"] > 5
    assert m["dpo_margin_after"] > m["dpo_margin_before"] and m["dpo_accuracy_after"] == 1.0


def test_dpo_nll_weight_keeps_the_chosen_trajectories_likely(baseline_table, tiny_model_dir, tmp_path):
    """RPO's NLL term (dpo_nll_weight): the chosen (expert) trajectories gain log-prob where plain DPO's
    gain less; the per-step log has both terms and their sum is the loss."""
    from qevolve_cli.errors import ConfigError
    from qevolve_cli.policy import PolicyConfig, train_policy

    cfg = PolicyConfig(objective="dpo", lr=2e-3, epochs=2, micro_batch_size=2, warmup_ratio=0.0, seed=0)
    plain = train_policy(cfg, baseline_table, tiny_model_dir, tmp_path / "dpo", quiet=True)
    rpo = train_policy(cfg.replace(dpo_nll_weight=1.0), baseline_table, tiny_model_dir, tmp_path / "rpo",
                       quiet=True)
    assert rpo["dpo_chosen_logp_delta"] > plain["dpo_chosen_logp_delta"] + 1.0, (plain, rpo)
    assert rpo["dpo_chosen_logp_delta"] > 0
    lines = [json.loads(x) for x in (tmp_path / "rpo" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] == pytest.approx(lines[0]["dpo_loss"] + lines[0]["nll_chosen"], rel=1e-5)
    assert lines[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)
    with pytest.raises(ConfigError, match="dpo_nll_weight.*only used by objective dpo"):
        PolicyConfig(objective="bppo").replace(dpo_nll_weight=0.5)
    with pytest.raises(ConfigError, match="dpo_nll_weight.*>= 0"):
        PolicyConfig(objective="dpo").replace(dpo_nll_weight=-1.0)


def test_cli_stacks_several_data_tables_and_rejects_duplicates(tiny_model_dir, tmp_path):
    df = make_baseline_table(tmp_path / "all.parquet", n_tasks=2)
    write_table(df.filter(pl.col("source") == "expert"), tmp_path / "expert.parquet")
    write_table(df.filter(pl.col("source") == "self"), tmp_path / "rollout.parquet")
    p = run_qevolve("policy", "--objective", "dpo", "--data", tmp_path / "expert.parquet", "--data",
                    tmp_path / "rollout.parquet", "--model", tiny_model_dir, "--out", tmp_path / "eto",
                    "--set", "max_steps=1", "--json", "--quiet", timeout=300)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout.strip().splitlines()[-1])
    assert m["dpo_pairs"] == 2 and m["optimizer_steps"] == 1
    # the same trajectory in two tables is refused, naming the second file
    p = run_qevolve("policy", "--objective", "rft", "--data", tmp_path / "all.parquet", "--data",
                    tmp_path / "rollout.parquet", "--model", tiny_model_dir, "--out", tmp_path / "x", "--quiet",
                    timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: {tmp_path / 'rollout.parquet'}: column 'traj_id': trajectory "
                                             "'f0' also appears in an earlier --data table"]
    # dpo without any pair (experts only): one line naming the problem
    p = run_qevolve("policy", "--objective", "dpo", "--data", tmp_path / "expert.parquet", "--model", tiny_model_dir,
                    "--out", tmp_path / "y", "--quiet", timeout=300)
    assert p.returncode == 2 and "no preference pair" in p.stderr and not (tmp_path / "y").exists()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    p = tmp_path_factory.mktemp("pol") / "hybrid.parquet"
    make_table(p)
    return p


@pytest.fixture(scope="module")
def trained(table, tiny_model_dir, tmp_path_factory):
    from qevolve_cli.policy import PolicyConfig, train_policy

    out = tmp_path_factory.mktemp("runs")
    res = {}
    for obj in ("bppo", "awr"):
        cfg = PolicyConfig(objective=obj, lr=2e-3, epochs=4, micro_batch_size=2, warmup_ratio=0.0,
                           thought_weight=0.5, kl_coef=0.01, old_refresh_steps=4, seed=0)
        res[obj] = (train_policy(cfg, table, tiny_model_dir, out / obj, quiet=True), out / obj)
    return res


def test_a_ref_that_is_the_starting_model_costs_no_second_pass(table, tiny_model_dir, tmp_path, monkeypatch):
    """--ref naming --model's own directory (evolve's iteration 1: --model bc/policy --ref bc/policy) reuses the
    starting policy's log-probs: one pass over the data fewer, the same run as with a copy of the directory."""
    import shutil

    from qevolve_cli.policy import PolicyConfig, train_policy
    from qevolve_cli.policy import trainer as trainer_mod

    passes = []
    real = trainer_mod.compute_logprobs
    monkeypatch.setattr(trainer_mod, "compute_logprobs", lambda m, *a, **k: passes.append(type(m).__name__) or real(m, *a, **k))
    cfg = PolicyConfig(objective="bppo", lr=2e-3, epochs=1, micro_batch_size=2, warmup_ratio=0.0, kl_coef=0.1, seed=0)
    same = train_policy(cfg, table, tiny_model_dir, tmp_path / "same", ref=tiny_model_dir, quiet=True)
    n_same, passes[:] = len(passes), []
    copy = shutil.copytree(tiny_model_dir, tmp_path / "ref_copy")
    other = train_policy(cfg, table, tiny_model_dir, tmp_path / "copy", ref=copy, quiet=True)
    assert (n_same, len(passes)) == (2, 3)  # start + end, and the copy's own pass in between
    for k in ("final_loss", "nll_after", "logp_delta_pos_adv", "logp_delta_neg_adv"):
        assert same[k] == pytest.approx(other[k], rel=1e-5, abs=1e-7), k
    kl = [json.loads(x)["kl"] for x in (tmp_path / "same" / "metrics.jsonl").read_text().splitlines()]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and max(kl) > 0  # the reference is the start, and it is used


def test_bppo_raises_positive_and_lowers_negative_actions(table, tiny_model_dir, trained):
    df = pl.read_parquet(table)
    before = action_logprobs(tiny_model_dir, df)
    metrics, out = trained["bppo"]
    after = action_logprobs(out, df)
    assert after["good"] > before["good"] + 0.5, (before, after)
    assert after["bad"] < before["bad"] - 0.5, (before, after)
    # the trainer's own measurement agrees in sign
    assert metrics["logp_delta_pos_adv"] > 0 > metrics["logp_delta_neg_adv"]
    assert metrics["optimizer_steps"] == 4 * 3


def test_awr_does_not_lower_negative_actions_as_much(table, tiny_model_dir, trained):
    df = pl.read_parquet(table)
    before = action_logprobs(tiny_model_dir, df)
    bppo = action_logprobs(trained["bppo"][1], df)
    awr = action_logprobs(trained["awr"][1], df)
    assert awr["bad"] - before["bad"] > bppo["bad"] - before["bad"] + 0.5, (before, bppo, awr)
    assert awr["good"] > before["good"]


def test_output_directory_is_a_loadable_model_with_config_and_curves(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qevolve_cli.policy.config import load_policy_config

    metrics, out = trained["bppo"]
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template
    cfg = load_policy_config(out / "config.yaml")
    assert cfg.objective == "bppo" and cfg.old_refresh_steps == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert all({"loss", "lr", "pg_loss", "kl", "clip_frac"} <= set(r) for r in lines)
    assert not list(out.parent.glob(".bppo.*"))  # no temp or work dirs left behind


def test_cli_bc_lora_adapter_lowers_nll(table, tiny_model_dir, tmp_path):
    import shutil

    run = tmp_path / "run"  # a run directory holding its base model, as `qevolve evolve` makes
    shutil.copytree(tiny_model_dir, run / "base_model")
    out = run / "bc"
    p = run_qevolve("policy", "--objective", "bc", "--data", table, "--model", run / "base_model", "--out", out,
                    "--lora", "--lr", "1e-2", "--epochs", "6", "--set", "lora_r=4", "--set", "micro_batch_size=2",
                    "--json", "--quiet", timeout=600)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout.strip().splitlines()[-1])
    assert m["trajectories"] == 3  # bc uses the expert rows only
    # a random tiny base with a rank-4 adapter learns slowly; the NLL must still clearly fall
    assert m["nll_after"] < m["nll_before"] - 0.2
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert not (out / "model.safetensors").exists()
    from qevolve_cli.policy.config import load_policy_config

    cfg = load_policy_config(out / "config.yaml")  # the resolved config: flags and --set both applied
    assert (cfg.lora, cfg.lora_r, cfg.micro_batch_size, cfg.lr, cfg.epochs) == (True, 4, 2, 1e-2, 6)
    from peft import AutoPeftModelForCausalLM

    peft_model = AutoPeftModelForCausalLM.from_pretrained(out)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b)  # the trained adapter was saved
    # the run directory moves (another disk, another machine): PEFT's absolute base path is stale, the adapter
    # still loads over the base beside it, in the policy loader and in the rollout backends
    from qevolve_cli.models import adapter_base
    from qevolve_cli.policy.model import load_causal_lm
    from qevolve_cli.rollout.backends import split_adapter

    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    run.rename(moved)
    assert json.loads((moved / "bc" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(run / "base_model")
    assert adapter_base(moved / "bc") == str((moved / "base_model").resolve())
    assert split_adapter(moved / "bc", None) == (str((moved / "base_model").resolve()), moved / "bc")
    merged = load_causal_lm(moved / "bc")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--objective", "bppo"], "column 'advantage': missing column"),
        (["--objective", "nope"], "--objective: unknown value 'nope'"),
        (["--objective", "bc", "--model-missing"], "no such model directory"),
        (["--objective", "bc", "--set", "eps_high=-1"], "error: --set eps_high: must be >= 0"),
    ],
)
def test_cli_bad_inputs_give_one_line_errors(args, needle, tiny_model_dir, tmp_path):
    data = tmp_path / "noadv.parquet"
    make_table(data, n_traj=2, with_adv=False)
    model = tiny_model_dir
    if "--model-missing" in args:
        args = [a for a in args if a != "--model-missing"]
        model = tmp_path / "does-not-exist"
    out = tmp_path / "out"
    p = run_qevolve("policy", *args, "--data", data, "--model", model, "--out", out, "--quiet", timeout=300)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], p.stderr
    assert not out.exists()


def test_checkpoint_every_steps_presets_and_validation():
    """Mid-epoch checkpoints: off by default (tiny runs), every 500 steps in the GPU and paper presets."""
    from qevolve_cli.errors import ConfigError
    from qevolve_cli.policy.config import PolicyConfig, load_policy_config

    assert PolicyConfig().checkpoint_every_steps == load_policy_config().checkpoint_every_steps == 0
    for preset in ("zero2", "zero3", "sciworld_iter1", "alfworld_iter2"):
        assert load_policy_config(preset=preset).checkpoint_every_steps == 500, preset
    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        load_policy_config(overrides={"checkpoint_every_steps": -1})


def test_policy_step_on_exact_oracle_advantages_does_not_collapse(tiny_model_dir, tmp_path):
    """An accurate critic's advantages are all <= 0 (V* + GAE: the optimal steps 0, the wasted ones < 0). The
    policy step as labelled (normalize_advantage off) can only push actions down: the optimal actions lose
    probability too (the collapse of docs/compare.md, 'Oracle diagnosis'). The shipped steps standardise the
    advantages first, so the optimal actions (above the mean) gain: BPPO (the paper's step) and AWR (the cpu
    preset's policy_step on lamps)."""
    from qevolve_cli.labeling import LabelConfig, label_frame
    from qevolve_cli.policy import PolicyConfig, train_policy
    from tests.test_oracle import replay_table

    tid = "lamps-hard:kitchen:bedroom+hallway+bathroom"
    plan = ["go east", "turn on lamp", "go east", "go east", "turn on lamp", "go west", "turn on lamp"]
    trajs = [plan, ["go west", *plan], ["turn on lamp", "go west", *plan], ["go west", "go west", "go west", "go east"]]
    df = pl.concat([replay_table(tid, c).with_columns(pl.lit(f"t{i}").alias("traj_id")) for i, c in enumerate(trajs)])
    lab, _ = label_frame(df, LabelConfig(value_source="oracle", retrospective=False))
    lab = lab.sort("traj_id", "step")
    adv = lab["advantage"].to_numpy()
    assert adv.max() <= 1e-6 and adv.min() < -0.1  # every advantage <= 0: nothing to raise as labelled
    optimal = adv > -1e-6  # A* = 0: the optimal plan's steps (and t3's last, hopeless one: V* = 0 before and after)
    assert 10 < optimal.sum() < len(adv)
    write_table(lab, tmp_path / "adv.parquet")

    def optimal_logp(model_dir) -> float:
        lp = [s for _a, s in step_logprobs(model_dir, lab)]
        return sum(x for x, o in zip(lp, optimal, strict=True) if o) / optimal.sum()

    before = optimal_logp(tiny_model_dir)
    after = {}
    for name, obj, norm in (("raw", "bppo", False), ("bppo", "bppo", True), ("awr", "awr", True)):
        cfg = PolicyConfig(objective=obj, lr=2e-3, epochs=3, micro_batch_size=2, warmup_ratio=0.0, eps_low=0.8,
                           normalize_advantage=norm, old_refresh_steps=2, seed=0)
        train_policy(cfg, tmp_path / "adv.parquet", tiny_model_dir, tmp_path / name, quiet=True)
        after[name] = optimal_logp(tmp_path / name)
    assert after["raw"] < before - 0.5, (before, after)  # as labelled: the optimal actions are pushed down too
    assert after["bppo"] > before + 0.5 and after["awr"] > before + 0.5, (before, after)


def test_an_adopted_lora_candidate_finds_its_base_after_the_run_moves(tmp_path):
    """evolve --select-on-validation adopts a candidate (iter_1/cand_X/policy) as iter_1/policy by hard links, one
    level up: the adopted copy gets its own qevolve_adapter.json (the base's path from where it lies), the
    candidate's is left alone, and both find the base once the run directory has moved."""
    import os

    from qevolve_cli.evolve.loop import _link_tree
    from qevolve_cli.models import ADAPTER_BASE_FILE, adapter_base, record_adapter_base

    run = tmp_path / "run"
    (run / "base_model").mkdir(parents=True)
    (run / "base_model" / "config.json").write_text("{}")
    cand = run / "iter_1" / "cand_base" / "policy"
    cand.mkdir(parents=True)
    (cand / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(run / "base_model")}))
    (cand / "adapter_model.safetensors").write_bytes(b"weights")
    record_adapter_base(cand)
    _link_tree(cand, run / "iter_1" / "policy")
    adopted = run / "iter_1" / "policy"
    assert os.path.samefile(cand / "adapter_model.safetensors", adopted / "adapter_model.safetensors")
    assert json.loads((cand / ADAPTER_BASE_FILE).read_text())["base_model_relative"] == "../../../base_model"
    assert json.loads((adopted / ADAPTER_BASE_FILE).read_text())["base_model_relative"] == "../../base_model"
    moved = tmp_path / "a" / "b" / "run"
    moved.parent.mkdir(parents=True)
    run.rename(moved)
    want = str((moved / "base_model").resolve())
    assert adapter_base(moved / "iter_1" / "policy") == want
    assert adapter_base(moved / "iter_1" / "cand_base" / "policy") == want


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_is_enabled_without_a_deprecation_warning(tiny_model_dir, lora):
    """The policy loader turns on activation checkpointing by the installed transformers' own name (its old name
    is a deprecated alias in transformers 5 that prints a FutureWarning on every run), LoRA or not; the
    critic's backbone uses the same helper."""
    import warnings

    from qevolve_cli.policy.config import PolicyConfig
    from qevolve_cli.policy.trainer import load_policy

    cfg = PolicyConfig(lora=lora, gradient_checkpointing=True, lora_r=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, policy, _ = load_policy(cfg, tiny_model_dir, "cpu")
    names = [str(w.message) for w in caught if "checkpointing" in str(w.message)
             and "is_gradient_checkpointing" not in str(w.message)]  # PEFT's own call: filtered by qevolve_cli
    assert names == []
    assert any(getattr(m, "gradient_checkpointing", False) for m in policy.modules())
    assert not any(getattr(m, "gradient_checkpointing", False)
                   for m in load_policy(cfg.replace(gradient_checkpointing=False), tiny_model_dir, "cpu")[1].modules())


def long_trajectory(traj_id: str, k: int, acts: list[str], source: str = "expert", reward: float = 1.0) -> list[dict]:
    """The rows of one TextCraft trajectory of task ``k`` with long observations (12 repeated phrases per
    step) and the final reward ``reward``."""
    n = len(acts)
    return [dict(traj_id=traj_id, env="textcraft", task_id=str(k), split="train", source=source,
                 iteration=0 if source == "expert" else 1, step=t, instruction=f"craft {k + 1} oak planks",
                 observation=f"Room {t}: " + "logs and planks lie around. " * 12, action=a, command=None,
                 next_observation="ok", reward_env=reward * (t == n - 1), done=t == n - 1)
            for t, a in enumerate(acts)]


def test_bc_on_trajectories_longer_than_max_length_trains_their_first_actions(tiny_model_dir, tmp_path):
    """Each long trajectory becomes several windows (docs/policy.md, "Long trajectories"): the opening action
    (longer than the last one, so more nats to gain), which dropping the oldest turns would never train on,
    gains more than the last action does."""
    from qevolve_cli.policy import PolicyConfig, train_policy
    from qevolve_cli.policy.data import build_examples

    first = "Thought: The wooden chest must be opened before anything else.\nAction: open the wooden chest"
    last = "Thought: Done.\nAction: craft the planks"
    acts = [first] + [f"Thought: Gather more.\nAction: get {t} oak log" for t in range(1, 5)] + [last]
    df = pl.DataFrame([r for k in range(2) for r in long_trajectory(f"e{k}", k, acts)])
    data = tmp_path / "long.parquet"
    write_table(df, data)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (whole,) = build_examples(df.filter(pl.col("traj_id") == "e0"), tok, 100_000)
    max_length = len(whole) // 2
    (single,) = build_examples(df.filter(pl.col("traj_id") == "e0"), tok, max_length, windows=False)
    assert 0 not in set(single.step[single.loss_mask].tolist())  # one sequence cannot hold the opening action
    before = summed_logprobs(tiny_model_dir, df)
    cfg = PolicyConfig(objective="bc", lr=5e-3, epochs=8, micro_batch_size=2, warmup_ratio=0.0, seed=0,
                       max_length=max_length)
    m = train_policy(cfg, data, tiny_model_dir, tmp_path / "bc", quiet=True)
    assert m["trajectories"] == 2 and m["sequences"] > 2 and m["steps"] == m["steps_trained"] == 12
    assert m["truncated_trajectories"] == 2
    after = summed_logprobs(tmp_path / "bc", df)
    gain_first, gain_last = after[first] - before[first], after[last] - before[last]
    # measured: 133 vs 68 nats with windows; one sequence per trajectory (only the 4 newest steps trained)
    # gave 22 vs 31: the opening action then only gains what it shares with the others
    assert gain_last > 5 and gain_first > gain_last, (gain_first, gain_last)


def test_dpo_on_trajectories_longer_than_max_length_scores_their_first_actions(tiny_model_dir, tmp_path):
    """DPO's trajectory log-ratio sums the trajectory's windows (docs/policy.md, "Long trajectories"): chosen
    and rejected trajectories that differ only in their opening action, too old to fit one sequence with the
    last step. One sequence per trajectory (the oldest turns dropped) would give two identical sequences and
    no gradient; the windows raise the chosen opening and lower the rejected one."""
    from transformers import AutoTokenizer

    from qevolve_cli.policy import PolicyConfig, train_policy
    from qevolve_cli.policy.data import build_examples

    good = "Thought: The wooden chest must be opened before anything else.\nAction: open the wooden chest"
    bad = "Thought: The wooden chest can wait until later on.\nAction: look around the room"
    rest = [f"Thought: Gather more.\nAction: get {t} oak log" for t in range(1, 6)]
    df = pl.DataFrame([r for k in range(2) for r in long_trajectory(f"e{k}", k, [good, *rest])
                       + long_trajectory(f"f{k}", k, [bad, *rest], source="self", reward=0.0)])
    data = tmp_path / "long.parquet"
    write_table(df, data)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (whole,) = build_examples(df.filter(pl.col("traj_id") == "e0"), tok, 100_000)
    max_length = len(whole) // 2
    one = [build_examples(df.filter(pl.col("traj_id") == t), tok, max_length, windows=False)[0] for t in ("e0", "f0")]
    assert 0 not in set(one[0].step[one[0].loss_mask].tolist())  # one sequence cannot hold the opening action
    assert np.array_equal(one[0].input_ids, one[1].input_ids)  # ... and the two sides' sequences are the same
    before = summed_logprobs(tiny_model_dir, df)
    cfg = PolicyConfig(objective="dpo", lr=2e-3, epochs=4, micro_batch_size=2, warmup_ratio=0.0, seed=0,
                       max_length=max_length)
    m = train_policy(cfg, data, tiny_model_dir, tmp_path / "dpo", quiet=True)
    assert m["dpo_pairs"] == 2 and m["sequences"] > 4 and m["steps"] == m["steps_trained"] == 24
    assert m["dpo_margin_before"] != 0.0 and m["dpo_margin_after"] > m["dpo_margin_before"] + 5
    after = summed_logprobs(tmp_path / "dpo", df)
    assert after[good] - before[good] > after[bad] - before[bad] + 5, (before, after)


def test_advantages_are_normalised_over_steps_not_windows(tiny_model_dir):
    """normalize_advantage: each trajectory's steps count once, whatever its number of windows."""
    import numpy as np
    from transformers import AutoTokenizer

    from qevolve_cli.policy import PolicyConfig
    from qevolve_cli.policy.data import build_examples
    from qevolve_cli.policy.trainer import build_policy_data

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = []
    for k, (n, words, adv0) in enumerate(((6, 30, 3.0), (2, 1, -1.0))):  # a long and a short trajectory
        for t in range(n):
            rows.append(dict(traj_id=f"t{k}", env="textcraft", task_id=str(k), split="train", source="self",
                             iteration=1, step=t, instruction="craft planks", observation="logs " * words,
                             action=f"Thought: go.\nAction: get {t} oak log", command=None, next_observation="ok",
                             reward_env=0.0, done=t == n - 1, advantage=adv0 + t))
    df = pl.DataFrame(rows)
    (whole,) = build_examples(df.filter(pl.col("traj_id") == "t0"), tok, 100_000)
    cfg = PolicyConfig(objective="bppo", max_length=len(whole) * 3 // 4, normalize_advantage=True)
    pd = build_policy_data(cfg, df, {}, tok, "table")
    assert len([e for e in pd.examples if e.traj_id == "t0"]) >= 2
    a = df["advantage"].to_numpy()
    ref = {tid: (g["advantage"].to_numpy() - a.mean()) / (a.std() + 1e-8)
           for (tid,), g in df.group_by("traj_id", maintain_order=True)}
    for e in pd.examples:
        np.testing.assert_allclose(e.advantages, ref[e.traj_id], rtol=1e-5, atol=1e-6)


def test_fields_added_later_leave_the_hash_at_their_defaults():
    """Runs made before logits / shared_prefix / window_context existed resume: at their defaults these
    fields are not in the configuration hash; any other value is a new configuration."""
    import dataclasses
    import hashlib

    from qevolve_cli.policy import PolicyConfig

    plain = PolicyConfig()
    d = dataclasses.asdict(plain)
    for k in ("logits", "shared_prefix", "window_context"):
        d.pop(k)
    assert plain.hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert PolicyConfig(window_context=1.0).hash() != plain.hash()


def test_checkpoint_frequency_is_not_part_of_the_configuration():
    """checkpoint_every_steps says how a stage runs: every value hashes as the default does; legacy_hash is the
    hash older versions recorded (the field at its value: by hand, as test above), None where they agree."""
    import dataclasses
    import hashlib

    from qevolve_cli.policy import PolicyConfig

    def old_rule(cfg):
        d = dataclasses.asdict(cfg)
        for k in ("logits", "shared_prefix", "window_context"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    plain, every = PolicyConfig(), PolicyConfig(checkpoint_every_steps=10)
    assert every.hash() == plain.hash() == old_rule(plain) and plain.legacy_hash() is None
    assert every.legacy_hash() == old_rule(every) != plain.hash()
    assert PolicyConfig(checkpoint_every_steps=10, lr=2e-5).hash() != plain.hash()  # the rest is still the work
