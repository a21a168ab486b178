"""The feature critic (``CriticConfig.kind: features``): weighted IQL heads on cached frozen features.

The backbone runs once, without gradients, over the table (:mod:`qevolve_cli.critic.features`); the heads
g_v, g_q1, g_q2 and their EMA copies are then trained on the cached (N, d) feature rows with the critic's
losses (:func:`qevolve_cli.algos.td_target`, :func:`~qevolve_cli.algos.critic_q_loss`,
:func:`~qevolve_cli.algos.critic_v_loss`, :func:`~qevolve_cli.algos.ema_update_`), many epochs of
minibatches of steps, which costs seconds where a LoRA epoch costs the backbone's forward and backward
per update (docs/critic.md, "The feature critic"). The design follows Digi-Q (Bai et al., 2025): TD on
frozen intermediate-layer features with small heads.

Saved layout (the same directory contract as the LoRA critic's, ``kind: features`` in ``critic.json``)::

    DIR/critic.json          kind, base model, layer, view (context_turns, max_length), time input, norm
    DIR/heads.safetensors    v.*, q1.*, q2.*, q1_target.*, q2_target.*, norm.mean, norm.std
    DIR/tokenizer files      the base model's tokenizer
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

from qevolve_cli.algos import critic_q_loss, critic_v_loss, ema_update_, td_target
from qevolve_cli.critic.model import CRITIC_META, HEADS, HEADS_FILE, MLPHead
from qevolve_cli.errors import QevolveError

FORMAT = "qevolve-critic-features/1"


def feature_dtype(dtype: str, device: str, **kw: object) -> str:
    """The dtype of the frozen backbone's no-grad feature pass: ``auto`` follows the generation rule of
    :mod:`qevolve_cli.precision` (bfloat16 on CUDA and on a CPU with avx512_bf16/AMX, float32 elsewhere; the
    LoRA critic, which trains through its backbone, stays float32 on CPU); ``float32``/``bfloat16`` as given.
    ``kw`` (``flags``, ``env``) is for tests."""
    from qevolve_cli import precision

    return precision.resolve(dtype, device, training=False, **kw).dtype


def is_feature_critic(critic_dir: str | Path) -> bool:
    p = Path(critic_dir) / CRITIC_META
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("kind") == "features"
    except (OSError, ValueError):
        return False


class FeatureHeads(nn.Module):
    """g_v, g_q1, g_q2, bar-g_q1, bar-g_q2 on standardised features (+ the time input)."""

    def __init__(self, d: int, hidden: int, time_input: str = "none", time_scale: float = 16.0):
        super().__init__()
        self.d = d
        self.time_input = time_input
        self.time_scale = float(time_scale) if time_input != "none" else 0.0
        d_in = d + (1 if self.time_scale > 0 else 0)
        self.heads = nn.ModuleDict({h: MLPHead(d_in, hidden) for h in HEADS})
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("std", torch.ones(d))
        for h in ("q1_target", "q2_target"):
            self.heads[h].requires_grad_(False)
        self.hard_update_target()

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tgt = [p for h in ("q1_target", "q2_target") for p in self.heads[h].parameters()]
        onl = [p for h in ("q1", "q2") for p in self.heads[h].parameters()]
        return tgt, onl

    def hard_update_target(self) -> None:
        ema_update_(*self._pairs(), 1.0)

    def ema_update(self, lam: float) -> None:
        ema_update_(*self._pairs(), lam)

    def forward(self, name: str, h: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """Head ``name`` on raw features ``h`` (N, d) with time input ``t`` (N,) -> (N,)."""
        x = (h - self.mean) / self.std
        if self.time_scale > 0:
            x = torch.cat([x, (t.to(x.dtype) / self.time_scale).unsqueeze(-1)], dim=-1)
        return self.heads[name](x)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().cpu().contiguous() for k, v in self.heads.state_dict().items()}
        out["norm.mean"], out["norm.std"] = self.mean.detach().cpu(), self.std.detach().cpu()
        return out

    def load_tensors(self, state: dict[str, torch.Tensor]) -> None:
        st = dict(state)
        self.mean.copy_(st.pop("norm.mean"))
        self.std.copy_(st.pop("norm.std"))
        self.heads.load_state_dict(st)


def time_inputs(df: pl.DataFrame, time_input: str) -> tuple[np.ndarray, np.ndarray]:
    """(t of s_t, t of s_{t+1}) per row: steps left (one fewer for s') or the step index (one more)."""
    if time_input == "steps_left":
        t = df["steps_left"].to_numpy().astype(np.float32)
        return t, t - 1
    t = df["step"].to_numpy().astype(np.float32)
    return t, t + 1


class FeatureCritic:
    """A trained feature critic: heads + the view its features were made with; scores a table."""

    def __init__(self, heads: FeatureHeads, meta: dict[str, Any]):
        self.heads = heads
        self.meta = meta

    @property
    def base_path(self) -> str:
        return str(self.meta["base_model"])

    def features(self, df: pl.DataFrame, tokenizer: Any, cache_dir: str | Path | None = None,
                 device: str = "cpu") -> tuple[dict[str, np.ndarray], dict]:
        from qevolve_cli.critic.features import cached_features

        m = self.meta
        return cached_features(df, tokenizer, m["base_model"], layer=int(m["feature_layer"]),
                               context_turns=int(m["context_turns"]), max_length=m.get("max_length"),
                               window_context=float(m.get("window_context", 1.0)), device=device,
                               dtype=m.get("feature_dtype", "float32"), cache_dir=cache_dir)

    def score_features(self, feats: dict[str, np.ndarray], df: pl.DataFrame) -> dict[str, np.ndarray]:
        return score_arrays(self.heads, feats, *time_inputs(df, self.heads.time_input))

    def save(self, out: Path, tokenizer: Any = None) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file(self.heads.state_tensors(), str(out / HEADS_FILE), metadata={"format": "pt"})
        (out / CRITIC_META).write_text(json.dumps(self.meta, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))

    @classmethod
    def load(cls, critic_dir: str | Path, base_model: str | Path | None = None) -> FeatureCritic:
        from safetensors.torch import load_file

        d = Path(critic_dir)
        meta = json.loads((d / CRITIC_META).read_text())
        if meta.get("kind") != "features":
            raise QevolveError(f"{d / CRITIC_META}: field 'kind': not a feature critic")
        base_dir = Path(base_model or meta["base_model"])
        if not base_dir.is_absolute() and not base_dir.is_dir():
            base_dir = d / base_dir
        if not base_dir.is_dir():
            raise QevolveError(f"{d / CRITIC_META}: field 'base_model': {base_dir} is not a directory (the "
                               "features are the base model's hidden states: it must be there)")
        meta["base_model"] = str(base_dir)
        heads = FeatureHeads(int(meta["hidden_size"]), int(meta["head_hidden"]), meta.get("time_input", "none"),
                             float(meta.get("time_scale", 16.0)))
        try:
            heads.load_tensors(load_file(str(d / HEADS_FILE)))
        except (KeyError, RuntimeError) as e:
            raise QevolveError(f"{d / HEADS_FILE}: heads do not match critic.json ({str(e).splitlines()[0]})") from None
        return cls(heads, meta)


@torch.no_grad()
def score_arrays(heads: FeatureHeads, feats: dict[str, np.ndarray], t: np.ndarray, t_next: np.ndarray,
                 chunk: int = 8192) -> dict[str, np.ndarray]:
    """value V(s), next_value V(s'), q1, q2 (online) and q_value min(Qbar1, Qbar2) per row."""
    n = len(t)
    out = {k: np.zeros(n, np.float32) for k in ("value", "next_value", "q1", "q2", "q_value")}
    for a in range(0, n, chunk):
        sl = slice(a, min(a + chunk, n))
        hs, hsa, hn = (torch.as_tensor(feats[k][sl]) for k in ("h_s", "h_sa", "h_next"))
        ts, tn = torch.as_tensor(t[sl]), torch.as_tensor(t_next[sl])
        out["value"][sl] = heads("v", hs, ts).numpy()
        out["next_value"][sl] = heads("v", hn, tn).numpy()
        out["q1"][sl] = heads("q1", hsa, ts).numpy()
        out["q2"][sl] = heads("q2", hsa, ts).numpy()
        out["q_value"][sl] = torch.minimum(heads("q1_target", hsa, ts), heads("q2_target", hsa, ts)).numpy()
    return out


def train_heads(heads: FeatureHeads, feats: dict[str, np.ndarray], train_rows: np.ndarray, reward: np.ndarray,
                done: np.ndarray, weight: np.ndarray, t: np.ndarray, t_next: np.ndarray, cfg: Any,
                on_epoch: Any = None) -> list[dict[str, float]]:
    """Weighted IQL on the cached rows ``train_rows``: per minibatch of ``cfg.feature_batch_steps`` steps a Q
    update then a V update (each V update reads Qbar from before its batch's EMA step), the EMA target every
    ``cfg.ema_every`` batches. ``on_epoch(epoch, metrics) -> bool``: True stops early. Returns per-epoch
    training losses."""
    g = torch.Generator().manual_seed(int(cfg.seed))
    torch.manual_seed(int(cfg.seed))
    rows = np.asarray(train_rows, np.int64)
    # standardise with the training rows' statistics (states and state-actions together)
    both = np.concatenate([feats["h_s"][rows], feats["h_sa"][rows]])
    heads.mean.copy_(torch.as_tensor(both.mean(0)))
    heads.std.copy_(torch.as_tensor(both.std(0) + 1e-4))
    lr = cfg.head_lr or cfg.lr
    opt_q = torch.optim.AdamW([p for h in ("q1", "q2") for p in heads.heads[h].parameters()], lr=lr,
                              weight_decay=cfg.weight_decay)
    opt_v = torch.optim.AdamW(heads.heads["v"].parameters(), lr=lr, weight_decay=cfg.weight_decay)
    T = {k: torch.as_tensor(feats[k]) for k in ("h_s", "h_sa", "h_next")}
    r_t, d_t, w_t = (torch.as_tensor(x, dtype=torch.float32) for x in (reward, done.astype(np.float32), weight))
    t_t, tn_t = torch.as_tensor(t, dtype=torch.float32), torch.as_tensor(t_next, dtype=torch.float32)
    B = int(cfg.feature_batch_steps)
    n_batches = max(1, math.ceil(len(rows) / B))
    total = cfg.epochs * n_batches
    warm = int(cfg.warmup_ratio * total)

    def lr_at(step: int) -> float:
        if warm and step < warm:
            return lr * (step + 1) / warm
        if cfg.lr_scheduler == "constant":
            return lr
        frac = (step - warm) / max(1, total - warm)
        return lr * (0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_scheduler == "cosine" else 1 - frac)

    history: list[dict[str, float]] = []
    n = 0
    rows_t = torch.as_tensor(rows)
    for epoch in range(cfg.epochs):
        perm = rows_t[torch.randperm(len(rows_t), generator=g)]
        lq_sum = lv_sum = 0.0
        for b in range(n_batches):
            idx = perm[b * B:(b + 1) * B]
            for o in (opt_q, opt_v):
                for grp in o.param_groups:
                    grp["lr"] = lr_at(n)
            hs, hsa, hn = T["h_s"][idx], T["h_sa"][idx], T["h_next"][idx]
            ts, tn = t_t[idx], tn_t[idx]
            mask = torch.ones(1, len(idx), dtype=torch.bool)
            w = w_t[idx].unsqueeze(0)
            with torch.no_grad():
                y = td_target(r_t[idx], d_t[idx], heads("v", hn, tn), cfg.gamma).unsqueeze(0)
                qb1, qb2 = heads("q1_target", hsa, ts).unsqueeze(0), heads("q2_target", hsa, ts).unsqueeze(0)
            lq = critic_q_loss(heads("q1", hsa, ts).unsqueeze(0), heads("q2", hsa, ts).unsqueeze(0), y, w, mask,
                               "mean")
            opt_q.zero_grad(set_to_none=True)
            lq.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for h in ("q1", "q2") for p in heads.heads[h].parameters()],
                                               cfg.grad_clip)
            opt_q.step()
            lv = critic_v_loss(heads("v", hs, ts).unsqueeze(0), qb1, qb2, w, mask, cfg.expectile, "mean")
            opt_v.zero_grad(set_to_none=True)
            lv.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(heads.heads["v"].parameters(), cfg.grad_clip)
            opt_v.step()
            n += 1
            if n % cfg.ema_every == 0:
                heads.ema_update(cfg.ema_lambda)
            lq_sum += float(lq.detach())
            lv_sum += float(lv.detach())
        m = {"epoch": epoch + 1, "loss_q": lq_sum / n_batches, "loss_v": lv_sum / n_batches, "updates": n}
        history.append(m)
        if on_epoch is not None and on_epoch(epoch + 1, m):
            break
    return history


def train_feature_critic(cfg: Any, data: Any, model: str | Path, out: str | Path, *, tokenizer: Any = None,
                         progress: Any = None, resume: bool = True) -> dict[str, Any]:
    """``train_critic`` for ``kind: features``: features (cached beside the table), heads, diagnostics, the fit
    ladder; writes ``out/`` atomically and returns the same summary keys as the LoRA critic's."""
    from qevolve_cli.atomic import atomic_dir
    from qevolve_cli.config import dump_yaml
    from qevolve_cli.critic.data import fit_reward, load_table, step_weights_for
    from qevolve_cli.critic.diagnostics import caveats, verdict, warning_line
    from qevolve_cli.critic.heldout import diagnose_scored, heldout_ids
    from qevolve_cli.critic.ladder import fit_ladder
    from qevolve_cli.device import resolve_device
    from qevolve_cli.tokenizer import load_tokenizer

    out = Path(out)
    t_start = time.perf_counter()
    df, source = load_table(data)
    if cfg.time_input == "steps_left":
        if "steps_left" not in df.columns or df["steps_left"].null_count():
            from qevolve_cli.errors import TableError

            raise TableError(source, "steps_left", "missing or null: the critic's time input reads it (label with "
                                                   "--step-limit N; docs/critic.md, 'Time input')")
    if cfg.shaping and "reward_aux" not in df.columns:
        from qevolve_cli.errors import TableError

        raise TableError(source, "reward_aux", "missing column: label the table first (qevolve label), or set "
                                               "shaping: false")
    tok = tokenizer if tokenizer is not None else load_tokenizer(model, require_chat_template=True)
    device = resolve_device(cfg.device)
    dtype = feature_dtype(cfg.dtype, device)
    cache_dir = Path(source).parent / "features" if source is not None else None
    t_feat = time.perf_counter()
    from qevolve_cli.critic.features import cached_features

    feats, finfo = cached_features(df, tok, model, layer=cfg.feature_layer, context_turns=cfg.context_turns,
                                   max_length=cfg.max_length, window_context=cfg.window_context, device=device,
                                   dtype=dtype, cache_dir=cache_dir)
    feat_seconds = time.perf_counter() - t_feat
    reward = fit_reward(df, cfg)
    done = df["done"].to_numpy().astype(bool)
    weight = step_weights_for(df, cfg)
    t, t_next = time_inputs(df, cfg.time_input)
    # held out by trajectory, as the LoRA critic (stratified by outcome)
    tid = df["traj_id"].to_numpy()
    held_ids = heldout_ids(df, cfg.heldout_fraction)
    is_held = np.array([str(x) in held_ids for x in tid], bool)
    train_rows, held_rows = np.flatnonzero(~is_held), np.flatnonzero(is_held)
    d = int(feats["h_s"].shape[1])
    torch.manual_seed(int(cfg.seed))
    heads = FeatureHeads(d, cfg.head_hidden, cfg.time_input, cfg.time_scale)
    stop = {"best": None, "best_epoch": 0, "bad": 0, "stopped_at": None}
    eval_every = max(1, int(cfg.feature_eval_every))

    def on_epoch(epoch: int, m: dict[str, float]) -> bool:
        if not len(held_rows) or (epoch % eval_every and epoch != cfg.epochs):
            return False
        cols = score_arrays(heads, feats, t, t_next)
        hd = diagnose_scored(df, cols, held_rows, cfg)
        m["heldout"] = hd
        b = hd.get(cfg.early_stop_metric)
        if b is None or cfg.early_stop_patience <= 0:
            return False
        if stop["best"] is None or b < stop["best"] * (1.0 - cfg.early_stop_min_delta):
            stop.update(best=b, best_epoch=epoch, bad=0)
        else:
            stop["bad"] += 1
        if stop["bad"] >= cfg.early_stop_patience:
            stop["stopped_at"] = epoch
            return True
        return False

    t_train = time.perf_counter()
    metrics = train_heads(heads, feats, train_rows, reward, done, weight, t, t_next, cfg, on_epoch)
    train_seconds = time.perf_counter() - t_train
    cols = score_arrays(heads, feats, t, t_next)
    if len(held_rows):
        diagnostics = {"on": "heldout", "trajectories_held_out": len(held_ids),
                       **diagnose_scored(df, cols, held_rows, cfg, full=True)}
    else:
        diagnostics = {"on": "train", **diagnose_scored(df, cols, train_rows, cfg, full=True)}
    ladder = fit_ladder(df, cols, train_rows, reward, weight, cfg, source=source)
    diagnostics["fit_ladder"] = ladder
    diagnostics["problems"] = verdict(diagnostics)  # the ladder's failing rungs first
    diagnostics["caveats"] = caveats(diagnostics)
    warning = warning_line(diagnostics, "held-out" if len(held_rows) else "training data, nothing held out")
    meta = {"format": FORMAT, "kind": "features", "base_model": str(model), "hidden_size": d,
            "head_hidden": cfg.head_hidden, "time_input": cfg.time_input, "time_scale": cfg.time_scale,
            "feature_layer": cfg.feature_layer, "context_turns": cfg.context_turns, "max_length": cfg.max_length,
            "window_context": cfg.window_context, "feature_dtype": dtype, "heads": list(HEADS),
            "trained_on": str(source) if source else None, "gamma": cfg.gamma, "expectile": cfg.expectile,
            "pooling": "hidden state of layer feature_layer at pos_s (V), pos_sa (Q), and s' (V)"}
    summary = {
        "out": str(out), "kind": "features", "base_model": str(model), "trajectories": df["traj_id"].n_unique() - len(held_ids),
        "heldout_trajectories": len(held_ids), "steps": int(len(train_rows)), "skipped_steps": 0,
        "epochs": cfg.epochs, "epochs_run": len(metrics), "resumed_from_epoch": 0, "resumed_from_step": 0,
        "early_stopped_at": stop["stopped_at"], "best_epoch": stop["best_epoch"] if len(held_rows) else None,
        "restored_epoch": None, "final": metrics[-1] if metrics else None,
        "features": {**finfo, "layer": cfg.feature_layer, "context_turns": cfg.context_turns,
                     "seconds": round(feat_seconds, 3)},
        "train_seconds": round(train_seconds, 3), "diagnostics": diagnostics, "warning": warning,
        "seconds": round(time.perf_counter() - t_start, 3),
    }
    with atomic_dir(out) as tmp:
        FeatureCritic(heads, meta).save(tmp, tok)
        dump_yaml(cfg, tmp / "config.yaml")
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        (tmp / "diagnostics.json").write_text(json.dumps(diagnostics, indent=1) + "\n")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["metrics"] = metrics
    return summary
