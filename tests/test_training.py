"""The shared training loop: schedule, dynamic batching, accumulation, logging, checkpoint/resume."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from qevolve_cli.training import Hooks, TrainArgs, group_steps, lr_lambda, token_budget_batches, train_loop

torch.set_num_threads(1)


def test_lr_schedule_warmup_then_cosine():
    total, warm = 10, 2
    vals = [lr_lambda(s, total, warm) for s in range(total)]
    assert vals[:2] == [0.5, 1.0]
    assert vals[2] == pytest.approx(1.0)
    for s in range(2, total):
        assert vals[s] == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - 2) / 8)))
    assert all(a >= b for a, b in zip(vals[1:], vals[2:], strict=False))
    assert lr_lambda(7, 10, 0, "constant") == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_batches_partition_and_budget(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(57)]
    batches = token_budget_batches(lengths, max_tokens=600, max_seqs=5, seed=seed)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(57))  # every item exactly once
    for b in batches:
        assert len(b) <= 5
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 600
    assert token_budget_batches(lengths, 600, 5, seed=seed) == batches  # deterministic
    assert group_steps(batches, 4)[0] == batches[:4]


def _data(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    return x, y


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _loss_fn(x, y, fail_at_epoch=None, fail_at_step=None):
    def fn(model, idx, ctx):
        if (fail_at_epoch is not None and ctx["epoch"] == fail_at_epoch) or ctx["step"] == fail_at_step:
            raise KeyboardInterrupt
        pred = model(x[idx]).squeeze(-1)
        return ((pred - y[idx]) ** 2).mean(), {"mse": 0.0}
    return fn


def _args(tmp_path, **kw):
    base = dict(epochs=3, lr=0.5, warmup_ratio=0.1, max_grad_norm=0.0, seed=3, device="cpu", quiet=True,
                log_path=tmp_path / "log.jsonl", ckpt_dir=tmp_path / "ckpt")
    base.update(kw)
    return TrainArgs(**base)


def test_accumulation_equals_one_big_batch(tmp_path):
    x, y = _data()
    # one optimiser step over all 12 items vs the same step split into micro-batches of 5, 4, 3
    m1, m2 = _model(), _model()
    train_loop(m1, lambda e: [[list(range(12))]], _loss_fn(x, y), _args(tmp_path / "a", epochs=1, warmup_ratio=0))
    train_loop(m2, lambda e: [[list(range(5)), list(range(5, 9)), list(range(9, 12))]], _loss_fn(x, y),
               _args(tmp_path / "b", epochs=1, warmup_ratio=0), micro_weight=len)
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=False):
        assert torch.allclose(p1, p2, atol=1e-6)


def steps_for(n=12):
    def make(epoch):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        return group_steps([order[i : i + 3] for i in range(0, n, 3)], 2)
    return make


def test_interrupted_run_resumes_after_last_finished_epoch(tmp_path):
    x, y = _data()
    ref = _model()
    r_ref = train_loop(ref, steps_for(), _loss_fn(x, y), _args(tmp_path / "ref"))
    assert r_ref.steps == 6 and r_ref.history[-1]["loss"] < r_ref.history[0]["loss"]

    extra_saved = {}
    hooks = Hooks(extra_state=lambda: {"old": torch.arange(3.0)}, load_extra_state=extra_saved.update)
    m = _model()
    with pytest.raises(KeyboardInterrupt):
        train_loop(m, steps_for(), _loss_fn(x, y, fail_at_epoch=2), _args(tmp_path / "run"), hooks=hooks)
    assert (tmp_path / "run" / "ckpt" / "checkpoint.json").exists()
    m = _model()  # a fresh process would rebuild the initial model
    r = train_loop(m, steps_for(), _loss_fn(x, y), _args(tmp_path / "run"), hooks=hooks)
    assert r.resumed_from_epoch == 2 and r.steps == 6
    assert torch.equal(extra_saved["old"], torch.arange(3.0))
    for p1, p2 in zip(ref.parameters(), m.parameters(), strict=False):
        assert torch.allclose(p1, p2, atol=1e-7)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]  # no duplicated or missing curve points
    ref_log = [json.loads(x) for x in (tmp_path / "ref" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx([r["loss"] for r in ref_log])


def test_mid_epoch_checkpoint_resumes_at_the_next_step(tmp_path):
    """checkpoint_every_steps=3 (4 steps per epoch): the checkpoint after step 6 is in the middle of epoch 2;
    a run that dies in step 8 resumes at step 7 with the same batch order, the latest extra state, the
    same weights and a curve without duplicated or missing steps; a directory left by a checkpoint that
    was never committed is ignored and then removed."""
    from qevolve_cli.errors import QevolveError

    x, y = _data(24)
    ref = _model()
    train_loop(ref, steps_for(24), _loss_fn(x, y), _args(tmp_path / "ref"))
    seen = {"step": 0}
    got = {}
    hooks = Hooks(on_step=lambda step, m: seen.update(step=step),
                  extra_state=lambda: {"old": torch.tensor([float(seen["step"])])}, load_extra_state=got.update)
    args = _args(tmp_path / "run", checkpoint_every_steps=3)
    with pytest.raises(KeyboardInterrupt):
        train_loop(_model(), steps_for(24), _loss_fn(x, y, fail_at_step=7), args, hooks=hooks)
    ck = tmp_path / "run" / "ckpt"
    meta = json.loads((ck / "checkpoint.json").read_text())
    assert {k: meta[k] for k in ("epoch", "epoch_step", "step", "backend")} == \
        {"epoch": 1, "epoch_step": 2, "step": 6, "backend": "torch"}
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint.json", "step00000006"]  # the earlier ones were replaced
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 7  # step 7 ran after the checkpoint
    (ck / "step00000007").mkdir()  # an uncommitted checkpoint of a run that died while writing it
    m = _model()
    r = train_loop(m, steps_for(24), _loss_fn(x, y), args, hooks=hooks)
    assert (r.resumed_from_epoch, r.resumed_from_step, r.steps) == (1, 6, 12)
    assert float(got["old"][0]) == 6.0  # the extra state of step 6
    for p1, p2 in zip(ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=1e-7)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    ref_log = [json.loads(x) for x in (tmp_path / "ref" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["epoch"] for r in log] == [r["epoch"] for r in ref_log]
    for k in ("loss", "lr", "grad_norm"):
        assert [r[k] for r in log] == pytest.approx([r[k] for r in ref_log], rel=1e-6), k
    # committed again (the last step's checkpoint), the leftover gone
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint.json", "step00000012"]
    # the checkpoint of another run (config, data, model: the caller's fingerprint) is refused with one line
    with pytest.raises(QevolveError, match="another configuration, data or model"):
        train_loop(_model(), steps_for(24), _loss_fn(x, y), dataclasses.replace(args, fingerprint="other"))
    # a checkpoint resumes only under the backend that wrote it (one-line error, nothing trained)
    meta9 = json.loads((ck / "checkpoint.json").read_text())
    (ck / "checkpoint.json").write_text(json.dumps({**meta9, "backend": "deepspeed"}))
    with pytest.raises(QevolveError, match="written by a deepspeed run, this is a torch run"):
        train_loop(_model(), steps_for(24), _loss_fn(x, y), args)


@pytest.mark.parametrize("max_steps", [0, 3])
def test_a_run_stopped_after_its_last_step_resumes_without_training(tmp_path, max_steps):
    """The last optimiser step is checkpointed (the end of the last epoch, or a ``max_steps`` cut mid-epoch): a run
    killed after it (in the caller's closing pass over the data, before its output) comes back with the trained
    weights and the last step's metrics without a single forward pass, and its log as it was."""
    x, y = _data()
    args = _args(tmp_path, max_steps=max_steps)
    m = _model()
    r = train_loop(m, steps_for(), _loss_fn(x, y), args)
    total = max_steps or 6
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert (meta["epoch"], meta["epoch_step"], meta["step"]) == ((3, 0, 6) if not max_steps else (1, 1, 3))
    log = (tmp_path / "log.jsonl").read_text()

    def no_training(model, idx, ctx):
        raise AssertionError(f"step {ctx['step']} trained again")

    m2 = _model()
    r2 = train_loop(m2, steps_for(), no_training, args)
    assert (r2.steps, r2.resumed_from_step, r2.tokens, r2.history) == (total, total, 0, [])
    assert r2.last_metrics == r.last_metrics and r2.last_metrics["step"] == total
    for p1, p2 in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)
    assert (tmp_path / "log.jsonl").read_text() == log


def test_resume_reads_a_checkpoint_only_through_a_complete_pointer(tmp_path):
    """The pointer that commits a checkpoint lists its files and sizes; a resume that finds the pointer cut
    short, a field missing, the checkpoint directory gone, or a listed file missing or of another size (a
    predecessor still rotating checkpoints, a copy interrupted) stops with one line before loading anything;
    the complete checkpoint then resumes."""
    import shutil

    from qevolve_cli.errors import QevolveError
    from qevolve_cli.training import read_checkpoint_pointer

    x, y = _data(24)
    args = _args(tmp_path / "run", checkpoint_every_steps=3)
    with pytest.raises(KeyboardInterrupt):
        train_loop(_model(), steps_for(24), _loss_fn(x, y, fail_at_step=3), args)
    ck = tmp_path / "run" / "ckpt"
    good = (ck / "checkpoint.json").read_text()
    meta = json.loads(good)
    assert meta["tag"] == "step00000003" and set(meta["files"]) == {"trainable.safetensors", "optimizer.pt",
                                                                    "state.pt", "rng_rank0.pt"}
    assert meta["files"]["state.pt"] == (ck / "step00000003" / "state.pt").stat().st_size > 0
    saved = tmp_path / "saved"
    shutil.copytree(ck / "step00000003", saved)

    def refused(match: str) -> None:
        with pytest.raises(QevolveError, match=match) as e:
            train_loop(_model(), steps_for(24), _loss_fn(x, y), args)
        assert "\n" not in str(e.value) and "delete" in str(e.value)

    (ck / "checkpoint.json").write_text(good[: len(good) // 2])  # half-written (a copy cut short)
    refused("unreadable checkpoint pointer")
    (ck / "checkpoint.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "step"}))
    refused("field step: missing from the checkpoint pointer")
    (ck / "checkpoint.json").write_text(good)
    with open(ck / "step00000003" / "optimizer.pt", "r+b") as f:  # truncated
        f.truncate(10)
    refused(r"step00000003 is incomplete \(optimizer.pt has 10 bytes, the pointer says \d+\)")
    (ck / "step00000003" / "optimizer.pt").unlink()
    refused(r"incomplete \(optimizer.pt is missing")
    shutil.rmtree(ck / "step00000003")
    refused("the committed checkpoint step00000003 is missing")
    shutil.copytree(saved, ck / "step00000003")
    assert read_checkpoint_pointer(ck)["step"] == 3
    r = train_loop(_model(), steps_for(24), _loss_fn(x, y), args)
    assert (r.resumed_from_step, r.steps) == (3, 12)


def test_grad_clipping_and_no_trainable_params(tmp_path):
    from qevolve_cli.errors import QevolveError

    x, y = _data()
    m = _model()
    r = train_loop(m, lambda e: [[list(range(12))]], _loss_fn(x * 100, y * 100),
                   _args(tmp_path, epochs=1, max_grad_norm=1.0, warmup_ratio=0, ckpt_dir=None))
    assert r.history[0]["grad_norm"] > 1.0  # the norm before clipping is reported
    frozen = _model().requires_grad_(False)
    with pytest.raises(QevolveError, match="no trainable parameters"):
        train_loop(frozen, lambda e: [[[0]]], _loss_fn(x, y), _args(tmp_path, ckpt_dir=None))
