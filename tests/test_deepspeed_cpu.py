"""DeepSpeed ZeRO-2/3 for real, on CPU: two ranks launched with torchrun (DeepSpeed's CPU accelerator,
gloo communication), compared with the plain single-process run of the same configuration.

What must hold (fp32, same data order, same effective batch): the ranks' share of every optimiser
step is weighted so that the averaged gradient is the step's exact weighted mean, hence the
trained weights and the logged loss curve equal the single-process ones up to float rounding.

The kill-and-resume runs (BPPO under ZeRO-3, the critic under ZeRO-2) are simulated two-node launches
(:func:`two_nodes`: two torchrun agents with ``--nnodes 2 --nproc-per-node 1`` and a c10d rendezvous on
127.0.0.1, as on two machines; issue 27) in which node 1's rank alone is SIGKILLed mid-epoch.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, ds_env, run_qevolve
from tests.test_critic import labelled
from tests.test_policy import make_baseline_table, make_table

pytest.importorskip("deepspeed", reason="deepspeed is not installed (`make setup` installs the dev extra)")
pytestmark = pytest.mark.usefixtures("deepspeed_cpu")  # its CPU comm op built once (conftest)

ZERO2 = ROOT / "configs" / "deepspeed" / "zero2.json"
ZERO3 = ROOT / "configs" / "deepspeed" / "zero3.json"
KILL = "QEVOLVE_KILL_AFTER_CHECKPOINT"


def torchrun(*args, nproc: int = 2, timeout: float = 300, kill_after: int | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m qevolve_cli ARGS`` (the launch line a GPU user runs too).

    ``kill_after=K``: every rank SIGKILLs itself right after the checkpoint of step K is committed
    (``QEVOLVE_KILL_AFTER_CHECKPOINT``, training.kill_after_checkpoint); the launch must then fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "qevolve_cli", *map(str, args)]
    env = ds_env()
    if kill_after is not None:
        env[KILL] = str(kill_after)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if kill_after is not None:
        assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
        return proc
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-5000:]}"
    # the exit used to abort a rank now and then (SIGABRT in interpreter finalization, see
    # training.shutdown_distributed); a clean teardown prints nothing about it
    assert "terminate called" not in proc.stderr and "destroy_process_group" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def policy_table(tmp_path_factory):
    p = tmp_path_factory.mktemp("ds_pol") / "hybrid.parquet"
    make_table(p, n_traj=8, steps=2)
    return p


def curve(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# bc on the 4 expert trajectories, 1 per micro-batch, 2 micro-batches per optimiser step: each rank
# takes one micro-batch of every step (the single process accumulates both)
BC = ["--set", "micro_batch_size=1", "--set", "grad_accum_steps=2", "--set", "warmup_ratio=0", "--lr", "2e-3",
      "--epochs", "2", "--seed", "0"]


@pytest.mark.timeout(420)
def test_policy_bc_zero2_and_zero3_equal_the_single_process_run(policy_table, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from qevolve_cli.policy.trainer import load_causal_lm

    run_qevolve("policy", "--objective", "bc", "--data", policy_table, "--model", tiny_model_dir,
                "--out", tmp_path / "plain", "--full", *BC, "--json", "--quiet", check=True)
    init = load_file(str(tiny_model_dir / "model.safetensors"))
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for name, cfg in (("zero2", ZERO2), ("zero3", ZERO3)):
        out = tmp_path / name
        proc = torchrun("policy", "--objective", "bc", "--data", policy_table, "--model", tiny_model_dir,
                        "--out", out, "--full", *BC, "--set", f"deepspeed={cfg}", "--json", "--quiet")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == 1, f"{name}: only rank 0 prints its summary, got {proc.stdout!r}"
        summary = json.loads(lines[0])
        assert summary["nll_after"] < summary["nll_before"] - 0.1
        trained = load_file(str(out / "model.safetensors"))
        assert max_diff(trained, {k: init[k] for k in trained}) > 1e-3  # it trained
        # same weights as one process (measured: 6e-8 for ZeRO-2, 2.4e-6 for ZeRO-3)
        assert max_diff(trained, plain) < 2e-5, name
        c, p = curve(out), curve(tmp_path / "plain")
        assert [r["step"] for r in c] == [r["step"] for r in p] and len(c) == 4
        assert np.allclose([r["loss"] for r in c], [r["loss"] for r in p], rtol=0, atol=1e-5)
        assert [r["tokens"] for r in c] == [r["tokens"] for r in p]  # the whole step, summed over ranks
        assert c[-1]["loss"] < c[0]["loss"]
        assert not (tmp_path / f"{name}.partial").exists()
        # the saved directory loads back with the repo's loader and generates finite logits
        m = load_causal_lm(out)
        with torch.no_grad():
            assert torch.isfinite(m(torch.tensor([[5, 6, 7]])).logits).all()


# bppo with a LoRA adapter on the 8 trajectories: 2 per micro-batch, 2 micro-batches per optimiser step
# (one per rank), 2 steps per epoch, 2 epochs; pi_old refreshed after every step
BPPO = ["--objective", "bppo", "--lora", "--set", "micro_batch_size=2", "--set", "grad_accum_steps=2", "--set",
        "warmup_ratio=0", "--set", "old_refresh_steps=1", "--lr", "2e-3", "--epochs", "2", "--json", "--quiet"]


def killed_run(ckpt_dir: Path, out: Path, pointer: str) -> dict:
    """What a killed run left: its committed checkpoint's pointer, the checkpoint's files, whether OUT exists."""
    return {"pointer": json.loads((ckpt_dir / pointer).read_text()), "out_exists": out.exists(),
            "files": sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file())}


def last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


def qevolve_here(*args) -> dict:
    """``qevolve ARGS --json`` in this process (Typer's CliRunner, the same command without another interpreter
    start, ~6 s) -> its summary. One torch thread, as the subprocesses (OMP_NUM_THREADS=1 in ds_env)."""
    from typer.testing import CliRunner

    from qevolve_cli.cli import app

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        torch.set_num_threads(n)
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
    return last_json(r.stdout)


@pytest.fixture(scope="module")
def bppo_runs(policy_table, tiny_model_dir, tmp_path_factory) -> Path:
    """BPPO in one process, uninterrupted (``plain``), and under ZeRO-3 on two simulated nodes of one rank each
    (``z3``, :func:`two_nodes`: two torchrun agents, c10d rendezvous on 127.0.0.1) whose node 1 rank is SIGKILLed
    right after the checkpoint of step 1 (``checkpoint_every_steps=1``), in the middle of epoch 1, then both
    launched again with the same command (``z3_killed.json``: what the kill left; ``z3.json``: the resumed run's
    summary, printed by node 0 alone)."""
    d = tmp_path_factory.mktemp("bppo")
    args = ["--data", policy_table, "--model", tiny_model_dir, *BPPO]
    qevolve_here("policy", *args, "--out", d / "plain")
    z3 = ["policy", *args, "--out", d / "z3", "--set", f"deepspeed={ZERO3}", "--set", "checkpoint_every_steps=1"]
    lose_node_1_and_resume(z3, d / "z3_killed.json", d / "z3.partial", d / "z3", "checkpoint.json", d / "z3.json")
    return d


def lose_node_1_and_resume(cmd: list, killed_json: Path, ckpt_dir: Path, out: Path, pointer: str,
                           summary_json: Path) -> None:
    """Run ``cmd`` on :func:`two_nodes` with node 1's rank SIGKILLed after the checkpoint of step 1 (node 0's rank
    fails on its next collective: both launches fail), record what it left, launch both nodes again and record
    node 0's summary (node 1 prints none)."""
    lost = two_nodes(*cmd, kill_node1_after=1)
    assert all(p.returncode != 0 for p in lost) and "SIGKILL" in lost[1].stderr, lost[1].stderr[-3000:]
    killed_json.write_text(json.dumps(killed_run(ckpt_dir, out, pointer)))
    resumed = two_nodes(*cmd)
    assert [p.returncode for p in resumed] == [0, 0], resumed[0].stderr[-3000:] + resumed[1].stderr[-3000:]
    assert not [ln for ln in resumed[1].stdout.splitlines() if ln.startswith("{")], resumed[1].stdout
    for p in resumed:
        assert "terminate called" not in p.stderr and "destroy_process_group" not in p.stderr, p.stderr[-3000:]
    summary_json.write_text(json.dumps(last_json(resumed[0].stdout)))


def qevolve_killed_after(step: int, *args) -> None:
    """``qevolve ARGS`` in one process that SIGKILLs itself right after the checkpoint of ``step``."""
    env = {**ds_env(), KILL: str(step)}  # one torch thread (OMP_NUM_THREADS=1), as the other runs
    proc = subprocess.run([sys.executable, "-m", "qevolve_cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str,
                        atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a, what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.timeout(300)
def test_policy_bppo_lora_zero3_killed_and_resumed_equals_uninterrupted_single_process(bppo_runs):
    """BPPO with a LoRA adapter under ZeRO-3 on two simulated nodes (docs/cluster.md): pi_ref / pi_old log-probs come from the full initial model
    (before DeepSpeed partitions it), pi_old is refreshed through the partitioned engine every step on
    all ranks, and the adapter is gathered on rank 0 to be saved. The run was SIGKILLed after the
    checkpoint of step 1 (DeepSpeed's engine checkpoint: each rank wrote its partition) and started again:
    it resumed at step 2 and still ends with the adapter and the loss curve of the uninterrupted
    one-process run, every step logged once (a lost or repeated step, stale Adam moments or a pi_old of
    another step would move the weights by ~1e-3)."""
    from safetensors.torch import load_file

    from qevolve_cli.policy.trainer import load_causal_lm

    killed = json.loads((bppo_runs / "z3_killed.json").read_text())
    meta = killed["pointer"]
    assert (meta["step"], meta["epoch"], meta["epoch_step"]) == (1, 0, 1) and not killed["out_exists"]
    assert (meta["backend"], meta["world_size"], meta["zero_stage"]) == ("deepspeed", 2, 3)
    files = killed["files"]
    assert all(f in ("checkpoint.json", "metrics.jsonl") or f.startswith("step00000001/") for f in files)  # one checkpoint
    assert sum(f.endswith("optim_states.pt") for f in files) == 2  # one ZeRO-3 partition per rank
    assert {"step00000001/state.pt", "step00000001/extra.safetensors", "step00000001/rng_rank1.pt"} <= set(files)
    summary = json.loads((bppo_runs / "z3.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["optimizer_steps"] == 4
    a = load_file(str(bppo_runs / "plain" / "adapter_model.safetensors"))
    b = load_file(str(bppo_runs / "z3" / "adapter_model.safetensors"))
    assert_same_tensors(b, a, "z3 vs plain", atol=1e-5)  # measured 2e-6 (ZeRO-3 vs one process, uninterrupted)
    assert max(float(t.abs().max()) for k, t in b.items() if "lora_B" in k) > 1e-4  # lora_B starts at 0
    c, p = curve(bppo_runs / "z3"), curve(bppo_runs / "plain")
    assert [r["step"] for r in c] == [1, 2, 3, 4] and [r["epoch"] for r in c] == [0, 0, 1, 1]
    assert np.allclose([r["loss"] for r in c], [r["loss"] for r in p], rtol=0, atol=1e-5)
    assert np.allclose([r["kl"] for r in c], [r["kl"] for r in p], rtol=0, atol=1e-6)
    assert [r["tokens"] for r in c] == [r["tokens"] for r in p]
    assert not (bppo_runs / "z3.partial").exists()  # the checkpoint is removed with the finished stage
    assert load_causal_lm(bppo_runs / "z3") is not None


@pytest.mark.timeout(300)
def test_policy_bppo_killed_mid_epoch_in_one_process_resumes_like_the_uninterrupted_run(bppo_runs, policy_table,
                                                                                       tiny_model_dir, tmp_path):
    """The same in one process: SIGKILLed after the checkpoint of step 3 (``checkpoint_every_steps=3``; the
    epoch-end one of step 2 is replaced), the first step of epoch 2, and started again: the adapter and the
    curve of the uninterrupted run (to float rounding), every step once."""
    from safetensors.torch import load_file

    out = tmp_path / "plain"
    cmd = ["policy", "--data", policy_table, "--model", tiny_model_dir, *BPPO, "--out", out,
           "--set", "checkpoint_every_steps=3"]
    qevolve_killed_after(3, *cmd)
    killed = killed_run(tmp_path / "plain.partial", out, "checkpoint.json")
    assert (killed["pointer"]["step"], killed["pointer"]["epoch"], killed["pointer"]["epoch_step"]) == (3, 1, 1)
    assert not killed["out_exists"] and {f.split("/")[0] for f in killed["files"]} == {"checkpoint.json", "metrics.jsonl", "step00000003"}
    assert "step00000003/optimizer.pt" in killed["files"] and not killed["pointer"]["weights_only"]  # training goes on
    summary = qevolve_here(*cmd)
    assert summary["resumed_from_step"] == 3 and summary["optimizer_steps"] == 4
    assert_same_tensors(load_file(str(out / "adapter_model.safetensors")),
                        load_file(str(bppo_runs / "plain" / "adapter_model.safetensors")), "plain")
    c, ref = curve(out), curve(bppo_runs / "plain")
    assert [r["step"] for r in c] == [1, 2, 3, 4]
    for key in ("loss", "kl", "lr", "tokens"):
        assert np.allclose([r[key] for r in c], [r[key] for r in ref], rtol=0, atol=1e-6), key
    assert not (tmp_path / "plain.partial").exists()


@pytest.mark.timeout(400)
def test_policy_zero3_killed_after_its_last_step_resumes_from_the_weights_alone(bppo_runs, policy_table,
                                                                                tiny_model_dir, tmp_path):
    """BPPO with LoRA under ZeRO-3 on two ranks, both SIGKILLed right after the checkpoint of the last step (4):
    that checkpoint holds the trainable weights gathered on rank 0, no ZeRO shard of the optimiser, and started
    again the run trains nothing, loads them into the partitioned module and writes the uninterrupted
    one-process run's adapter and summary figures."""
    from safetensors.torch import load_file

    out = tmp_path / "z3"
    cmd = ["policy", "--data", policy_table, "--model", tiny_model_dir, *BPPO, "--out", out,
           "--set", f"deepspeed={ZERO3}"]
    torchrun(*cmd, kill_after=4)
    killed = killed_run(tmp_path / "z3.partial", out, "checkpoint.json")
    meta = killed["pointer"]
    assert (meta["step"], meta["weights_only"], meta["zero_stage"], meta["world_size"]) == (4, True, 3, 2)
    assert not killed["out_exists"] and "step00000004/trainable.safetensors" in killed["files"]
    assert not [f for f in killed["files"] if "optim_states" in f or "/engine/" in f], killed["files"]
    saved = load_file(str(tmp_path / "z3.partial" / "step00000004" / "trainable.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapter alone, whole (gathered), not a rank's shard
    summary = last_json(torchrun(*cmd).stdout)
    ref = json.loads((bppo_runs / "plain" / "train_summary.json").read_text())
    assert (summary["resumed_from_step"], summary["optimizer_steps"], summary["train_tokens"]) == (4, 4, 0)
    for key in ("final_loss", "nll_before", "nll_after", "logp_delta_pos_adv", "logp_delta_neg_adv"):
        assert summary[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), key
    plain = load_file(str(bppo_runs / "plain" / "adapter_model.safetensors"))
    assert_same_tensors(load_file(str(out / "adapter_model.safetensors")), plain, "z3 vs plain", atol=1e-5)
    assert [r["step"] for r in curve(out)] == [1, 2, 3, 4]
    assert not (tmp_path / "z3.partial").exists()


@pytest.mark.timeout(300)
def test_policy_killed_after_its_last_step_resumes_without_training(bppo_runs, policy_table, tiny_model_dir, tmp_path):
    """SIGKILLed right after the checkpoint of its last step (4, the end of epoch 2), i.e. in the closing pass over
    the data that fills train_summary.json, before OUT exists: started again it trains nothing (no step
    logged twice, no training token) and writes the uninterrupted run's adapter, curve and summary figures."""
    from safetensors.torch import load_file

    out = tmp_path / "plain"
    cmd = ["policy", "--data", policy_table, "--model", tiny_model_dir, *BPPO, "--out", out]
    qevolve_killed_after(4, *cmd)
    killed = killed_run(tmp_path / "plain.partial", out, "checkpoint.json")
    assert (killed["pointer"]["step"], killed["pointer"]["epoch"], killed["pointer"]["epoch_step"]) == (4, 2, 0)
    assert not killed["out_exists"]
    # nothing trains from the last step's checkpoint: the weights without the optimiser state
    assert killed["pointer"]["weights_only"] and "step00000004/trainable.safetensors" in killed["files"]
    assert not [f for f in killed["files"] if f.endswith("optimizer.pt")], killed["files"]
    summary = qevolve_here(*cmd)
    ref = json.loads((bppo_runs / "plain" / "train_summary.json").read_text())
    assert (summary["resumed_from_step"], summary["optimizer_steps"], summary["train_tokens"]) == (4, 4, 0)
    for key in ("final_loss", "nll_before", "nll_after", "logp_delta_pos_adv", "logp_delta_neg_adv"):
        assert summary[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key
    assert_same_tensors(load_file(str(out / "adapter_model.safetensors")),
                        load_file(str(bppo_runs / "plain" / "adapter_model.safetensors")), "plain")
    assert [r["step"] for r in curve(out)] == [1, 2, 3, 4]
    assert not (tmp_path / "plain.partial").exists()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_policy_rft_zero2_and_dpo_zero3_equal_the_single_process_run(tiny_model_dir, tmp_path):
    """The baselines through the same DeepSpeed path: rft (6 trajectories, one per micro-batch, 2 per step)
    under ZeRO-2 and dpo (3 pairs, one pair per micro-batch, 2 per step: the last step leaves rank 1 a
    weight-0 micro-batch; reference log-probs from the full starting model) under ZeRO-3."""
    from safetensors.torch import load_file

    data = tmp_path / "expert_and_rollout.parquet"
    make_baseline_table(data, n_tasks=3)
    common = ["--data", data, "--model", tiny_model_dir, "--full", "--set", "grad_accum_steps=2", "--set",
              "warmup_ratio=0", "--lr", "2e-3", "--seed", "0", "--json", "--quiet"]
    runs = {"rft": (ZERO2, ["--objective", "rft", "--set", "micro_batch_size=1", "--epochs", "1"]),
            "dpo": (ZERO3, ["--objective", "dpo", "--set", "micro_batch_size=2", "--epochs", "2"])}
    for obj, (cfg, args) in runs.items():
        run_qevolve("policy", *args, *common, "--out", tmp_path / f"{obj}_plain", check=True)
        proc = torchrun("policy", *args, *common, "--out", tmp_path / f"{obj}_ds", "--set", f"deepspeed={cfg}")
        summary = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
        plain = load_file(str(tmp_path / f"{obj}_plain" / "model.safetensors"))
        ds = load_file(str(tmp_path / f"{obj}_ds" / "model.safetensors"))
        assert max_diff(ds, plain) < 2e-5, obj
        c, p = curve(tmp_path / f"{obj}_ds"), curve(tmp_path / f"{obj}_plain")
        assert len(c) == len(p) == (3 if obj == "rft" else 4)
        assert np.allclose([r["loss"] for r in c], [r["loss"] for r in p], rtol=0, atol=1e-5), obj
        assert [r["tokens"] for r in c] == [r["tokens"] for r in p]
        if obj == "dpo":
            assert summary["dpo_pairs"] == 3 and summary["dpo_accuracy_after"] == 1.0
            assert c[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # reference = the starting policy
            assert np.allclose([r["reward_margin"] for r in c], [r["reward_margin"] for r in p], rtol=0, atol=1e-5)
        else:
            assert summary["rft_self_kept"] == 3 and summary["nll_after"] < summary["nll_before"] - 0.1


CRITIC = ["--epochs", "2", "--batch-size", "3", "--lr", "1e-3", "--set", "lora_rank=4", "--set", "head_hidden=16",
          "--set", "device=cpu", "--set", "warmup_ratio=0", "--set", "ema_every=1", "--set", "ema_lambda=0.5",
          # a held-out slice with early stopping: the stop decision is all-reduced over the ranks
          "--set", "heldout_fraction=0.4", "--set", "early_stop_patience=1", "--json", "--quiet"]
CRITIC_FILES = ("heads.safetensors", "adapters/value/adapter_model.safetensors",
                "adapters/q/adapter_model.safetensors", "adapters/q_target/adapter_model.safetensors")


@pytest.fixture(scope="module")
def critic_runs(tiny_model_dir, tmp_path_factory) -> Path:
    """The critic on 7 trajectories (4 trained on, 3 held out: batches of 3 and 1, 2 epochs, 4 updates) in one
    process, uninterrupted (``plain``), and with ZeRO-2 on two simulated nodes of one rank each (``z2``,
    :func:`two_nodes`) whose node 1 rank is SIGKILLed right after the checkpoint of update 1
    (``checkpoint_every_steps=1``), in the middle of epoch 1, then both launched again (``z2_killed.json``: what
    the kill left; ``z2.json``: the resumed run's summary)."""
    from qevolve_cli import schema

    d = tmp_path_factory.mktemp("critic")
    schema.write_table(labelled(n_traj=7, mean_steps=3, seed=1), d / "lab.parquet")
    args = ["--data", d / "lab.parquet", "--model", tiny_model_dir, *CRITIC]
    qevolve_here("critic", *args, "--out", d / "plain")
    z2 = ["critic", *args, "--out", d / "z2", "--set", f"deepspeed={ZERO2}", "--set", "checkpoint_every_steps=1"]
    lose_node_1_and_resume(z2, d / "z2_killed.json", d / "z2.partial", d / "z2", "checkpoint.json", d / "z2.json")
    return d


def epoch_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_epoch_metrics(got: list[dict], ref: list[dict], rtol: float, updates: int = 2) -> None:
    """Per-epoch metrics equal (timings aside): every update of every epoch counted once."""
    assert [m["epoch"] for m in got] == [m["epoch"] for m in ref] == [1, 2]
    for g, r in zip(got, ref, strict=True):
        assert g["q_updates"] + g["v_updates"] == r["q_updates"] + r["v_updates"] == updates
        for k in ("loss_q", "loss_v", "mean_q", "mean_v", "mean_y", "td_error", "transitions", "lr_q", "lr_v"):
            assert g[k] == pytest.approx(r[k], rel=rtol, abs=1e-6), k
        for k in ("bellman_q", "ev_return", "auc_v"):
            x, y = g["heldout"][k], r["heldout"][k]
            assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, rel=max(rtol, 1e-4), abs=1e-6)), k


@pytest.mark.timeout(300)
def test_critic_zero2_killed_and_resumed_equals_uninterrupted_single_process(critic_runs):
    """Two DeepSpeed engines (Q branch, V branch) over one critic, on two simulated nodes: alternating updates, per-branch
    clipping and LR schedules, EMA of q_target; a batch of 3 trajectories is split 2 / 1 over the ranks.
    The run was SIGKILLed after the checkpoint of update 1 (each branch's engine checkpoint, one ZeRO-2
    partition per rank; the EMA target in the Q engine's client state) and started again: it resumed at
    the next batch and still ends with the adapters, heads and EMA target of the uninterrupted
    one-process run, and its per-epoch metrics."""
    from safetensors.torch import load_file

    from qevolve_cli import schema
    from qevolve_cli.critic.score import score_table

    killed = json.loads((critic_runs / "z2_killed.json").read_text())
    prog = killed["pointer"]
    assert (prog["tag"], prog["epoch"], prog["epoch_state"]["batch"], prog["metrics"]) == ("step00000001", 0, 1, [])
    assert (prog["backend"], prog["world_size"], prog["zero_stage"]) == ("deepspeed", 2, 2)
    assert not killed["out_exists"]
    for branch in ("q", "v"):
        assert sum(f.startswith(f"step00000001/{branch}/") and f.endswith("optim_states.pt")
                   for f in killed["files"]) == 2
    summary = json.loads((critic_runs / "z2.json").read_text())
    assert (summary["resumed_from_epoch"], summary["resumed_from_step"]) == (0, 1)
    assert summary["deepspeed"] == {"config": str(ZERO2), "stage": 2, "world_size": 2}
    for f in CRITIC_FILES:
        assert_same_tensors(load_file(str(critic_runs / "z2" / f)), load_file(str(critic_runs / "plain" / f)),
                            f, atol=1e-5)  # measured < 1e-6
    assert_same_epoch_metrics(epoch_metrics(critic_runs / "z2"), epoch_metrics(critic_runs / "plain"), rtol=1e-5)
    assert summary["heldout_trajectories"] >= 1 and summary["trajectories"] + summary["heldout_trajectories"] == 7
    assert not (critic_runs / "z2.partial").exists()
    df = schema.read_table(critic_runs / "lab.parquet")
    sc = score_table(df, critic_runs / "z2", device="cpu")
    assert np.isfinite(sc["value"].to_numpy()).all() and np.isfinite(sc["q_value"].to_numpy()).all()


@pytest.mark.timeout(300)
def test_critic_schedule_both_under_zero2_on_two_ranks_equals_one_process(critic_runs, tiny_model_dir, tmp_path):
    """``schedule: both`` (the CPU presets'): each batch's V update backpropagates the value forward that gave the
    Q update its V(s'), after the Q branch's engine has stepped. Under ZeRO-2 on two ranks (one engine per branch)
    that ends with the adapters, heads and per-epoch metrics of the one-process run."""
    from safetensors.torch import load_file

    args = ["--data", critic_runs / "lab.parquet", "--model", tiny_model_dir, *CRITIC, "--set", "schedule=both"]
    qevolve_here("critic", *args, "--out", tmp_path / "plain")
    runs = two_nodes("critic", *args, "--out", tmp_path / "z2", "--set", f"deepspeed={ZERO2}")
    assert [p.returncode for p in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    for f in CRITIC_FILES:
        assert_same_tensors(load_file(str(tmp_path / "z2" / f)), load_file(str(tmp_path / "plain" / f)), f, atol=1e-5)
    got, ref = epoch_metrics(tmp_path / "z2"), epoch_metrics(tmp_path / "plain")
    assert_same_epoch_metrics(got, ref, rtol=1e-5, updates=4)
    assert [m["forward_calls"] for m in ref] == [3 * 2, 3 * 2]  # 2 batches an epoch, 3 forwards each


@pytest.mark.timeout(300)
def test_critic_killed_mid_epoch_in_one_process_resumes_like_the_uninterrupted_run(critic_runs, tiny_model_dir,
                                                                                  tmp_path):
    """The same in one process: SIGKILLed after the checkpoint of update 3 (the middle of epoch 2; the
    sampling RNG and the epoch's running sums come back from it) and started again."""
    from safetensors.torch import load_file

    out = tmp_path / "plain"
    cmd = ["critic", "--data", critic_runs / "lab.parquet", "--model", tiny_model_dir, *CRITIC, "--out", out,
           "--set", "checkpoint_every_steps=1"]
    qevolve_killed_after(3, *cmd)
    killed = killed_run(tmp_path / "plain.partial", out, "checkpoint.json")
    prog = killed["pointer"]
    assert (prog["tag"], prog["epoch"], prog["epoch_state"]["batch"], len(prog["metrics"])) == ("step00000003", 1, 1, 1)
    assert not killed["out_exists"] and {f.split("/")[0] for f in killed["files"]} == {"checkpoint.json", "step00000003"}
    summary = qevolve_here(*cmd)
    assert (summary["resumed_from_epoch"], summary["resumed_from_step"]) == (1, 3)
    for f in CRITIC_FILES:
        assert_same_tensors(load_file(str(out / f)), load_file(str(critic_runs / "plain" / f)), f)
    assert_same_epoch_metrics(epoch_metrics(out), epoch_metrics(critic_runs / "plain"), rtol=1e-6)
    assert not (tmp_path / "plain.partial").exists()


@pytest.mark.timeout(300)
def test_critic_killed_after_its_last_epoch_resumes_without_training(critic_runs, tiny_model_dir, tmp_path):
    """SIGKILLed right after the checkpoint of its last epoch (update 4), i.e. in the final held-out diagnostics
    (bootstrap intervals included) before OUT exists: started again it trains nothing and writes the
    uninterrupted run's adapters, heads, per-epoch metrics and diagnostics."""
    from safetensors.torch import load_file

    out = tmp_path / "plain"
    cmd = ["critic", "--data", critic_runs / "lab.parquet", "--model", tiny_model_dir, *CRITIC, "--out", out]
    qevolve_killed_after(4, *cmd)
    killed = killed_run(tmp_path / "plain.partial", out, "checkpoint.json")
    prog = killed["pointer"]
    assert (prog["tag"], prog["epoch"], prog["epoch_state"], len(prog["metrics"])) == ("step00000004", 2, None, 2)
    assert not killed["out_exists"]
    summary = qevolve_here(*cmd)
    assert (summary["resumed_from_epoch"], summary["resumed_from_step"], summary["epochs_run"]) == (2, 4, 2)
    for f in CRITIC_FILES:
        assert_same_tensors(load_file(str(out / f)), load_file(str(critic_runs / "plain" / f)), f)
    assert_same_epoch_metrics(epoch_metrics(out), epoch_metrics(critic_runs / "plain"), rtol=1e-6)
    got, ref = (json.loads((d / "diagnostics.json").read_text()) for d in (out, critic_runs / "plain"))
    for k in ("bellman_q", "ev_return", "auc_v", "n_success", "n_failed", "problems"):
        assert got[k] == (pytest.approx(ref[k], rel=1e-6) if isinstance(ref[k], float) else ref[k]), k
    assert not (tmp_path / "plain.partial").exists()


def test_deepspeed_configs_resolve_every_auto():
    from qevolve_cli.training.backends.deepspeed import (
        _flatten,
        load_deepspeed_config,
        resolve_deepspeed_config,
    )

    for path, stage in ((ZERO2, 2), (ZERO3, 3)):
        raw = load_deepspeed_config(path)
        kw = dict(precision="fp32", world_size=2, grad_accum=3, max_grad_norm=0.5, hidden_size=64,
                  managed_accumulation=False)
        cpu = resolve_deepspeed_config(raw, device="cpu", **kw)
        assert "auto" not in _flatten(cpu).values()
        assert cpu["zero_optimization"]["stage"] == stage and cpu["bf16"]["enabled"] is False
        assert cpu["zero_optimization"]["overlap_comm"] is False  # CPU accelerator: no side streams
        assert cpu["train_batch_size"] == 6 and cpu["gradient_clipping"] == 0.5
        assert cpu["managed_gradient_accumulation"] is False
        gpu = resolve_deepspeed_config(raw, device="cuda", **{**kw, "precision": "bf16"})
        assert gpu["bf16"]["enabled"] is True and gpu["zero_optimization"]["overlap_comm"] is True
        assert gpu["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_bad_deepspeed_configs_fail_with_one_line(tmp_path, tiny_model_dir):
    from qevolve_cli.critic.config import CriticConfig
    from qevolve_cli.critic.trainer import train_critic
    from qevolve_cli.errors import QevolveError
    from qevolve_cli.training import load_deepspeed_config

    with pytest.raises(QevolveError, match="no such DeepSpeed config"):
        load_deepspeed_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(QevolveError, match="not a JSON DeepSpeed config"):
        load_deepspeed_config(tmp_path / "bad.json")
    (tmp_path / "s4.json").write_text(json.dumps({"zero_optimization": {"stage": 4}}))
    with pytest.raises(QevolveError, match=r"zero_optimization\.stage"):
        load_deepspeed_config(tmp_path / "s4.json")
    (tmp_path / "opt.json").write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(QevolveError, match="field optimizer"):
        load_deepspeed_config(tmp_path / "opt.json")
    # the critic refuses ZeRO-3 and 16-bit engines before anything is launched
    df = labelled(n_traj=2, mean_steps=2)
    with pytest.raises(QevolveError, match="ZeRO stages 0-2"):
        train_critic(CriticConfig(device="cpu", deepspeed=str(ZERO3)), df, tiny_model_dir, tmp_path / "c")
    (tmp_path / "bf16.json").write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(QevolveError, match="bf16.enabled"):
        train_critic(CriticConfig(device="cpu", deepspeed=str(tmp_path / "bf16.json")), df, tiny_model_dir,
                     tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.timeout(120)
def test_plain_checkpoint_is_not_resumed_under_deepspeed(policy_table, tiny_model_dir, tmp_path):
    """The checkpoint of an interrupted one-process run is refused under DeepSpeed with one line, before
    anything is trained or written (one process, no launcher: qevolve creates a one-rank process group)."""
    ck = tmp_path / "out.partial"
    (ck / "step00000002").mkdir(parents=True)
    (ck / "checkpoint.json").write_text(json.dumps({"tag": "step00000002", "epoch": 1, "epoch_step": 0, "step": 2,
                                              "backend": "torch"}))
    proc = subprocess.run([sys.executable, "-m", "qevolve_cli", "policy", "--objective", "bc", "--data",
                           str(policy_table), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
                           "--set", f"deepspeed={ZERO2}", "--quiet"],
                          cwd=ROOT, env=ds_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "written by a torch run, this is a deepspeed run" in err[0], err
    assert not (tmp_path / "out").exists() and (ck / "checkpoint.json").exists()


def two_nodes(*args, kill_node1_after: int | None = None, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """A simulated two-node launch: two torchrun agents on this machine, ``--nnodes 2 --nproc-per-node 1``,
    meeting at a c10d rendezvous on 127.0.0.1 (node 0 hosts its store), as two machines would
    (docs/cluster.md). ``kill_node1_after=K``: only node 1's rank SIGKILLs itself after the checkpoint of
    step K (a node lost mid-epoch); node 0's rank then fails on its next collective."""
    from qevolve_cli.training.backends.deepspeed import _free_port

    port = _free_port()
    procs = []
    for node in (0, 1):
        env = ds_env()
        if kill_node1_after is not None and node == 1:
            env[KILL] = str(kill_node1_after)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "-m", "qevolve_cli", *map(str, args)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return done

