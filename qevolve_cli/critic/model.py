"""The critic (paper Appendix "Critic Model Structure").

One frozen causal-LM backbone f_theta carrying three PEFT LoRA adapters on the
SAME model object: ``value`` (phi_v), ``q`` (phi_q) and ``q_target`` (the
delayed bar-phi_q, updated only by EMA). A forward pass activates one adapter
(PEFT adapter switching); the backbone is never copied. The last hidden states
of the adapter are pooled at per-step prefix end positions (last-token
pooling) and fed to small MLP heads: g_v, g_q1, g_q2 and the EMA copies
bar-g_q1, bar-g_q2.

Saved layout (``CriticModel.save``)::

    DIR/adapters/{value,q,q_target}/adapter_config.json + adapter_model.safetensors   (PEFT)
    DIR/heads.safetensors        v.*, q1.*, q2.*, q1_target.*, q2_target.*
    DIR/critic.json              base model, hidden size, head width, adapter names
    DIR/tokenizer files          the base model's tokenizer (``qevolve label --critic DIR`` loads it)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qevolve_cli import precision as precision_rule
from qevolve_cli.algos import ema_update_
from qevolve_cli.device import resolve_device
from qevolve_cli.errors import QevolveError
from qevolve_cli.models.kv import (
    cache_kwarg,
    cache_layers,
    cache_of_layers,
    out_cache,
    prefix_pays,
    repeat_layers,
    shared_prefix_len,
)
from qevolve_cli.training.batching import per_sequence_layout

ADAPTERS = ("value", "q", "q_target")
HEADS = ("v", "q1", "q2", "q1_target", "q2_target")
CRITIC_META = "critic.json"
HEADS_FILE = "heads.safetensors"


class MLPHead(nn.Module):
    """g: R^d -> R, Linear(d, h) -> GELU -> Linear(h, 1)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def pool_last_token(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gather hidden[b, positions[b, k]] -> (B, K, d) (last-token pooling at prefix ends)."""
    B, K = positions.shape
    idx = positions.unsqueeze(-1).expand(B, K, hidden.shape[-1])
    return torch.gather(hidden, 1, idx)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The frozen backbone's dtype: auto = bf16 on CUDA, fp32 on CPU (the training rule of
    qevolve_cli/precision.py); the adapters and heads stay fp32 either way."""
    return precision_rule.resolve_dtype(name, device.type, training=True)


def _load_base(model_dir: str | Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    from qevolve_cli.progress import quiet_transformers

    quiet_transformers()
    p = Path(model_dir)
    if not p.is_dir():
        raise QevolveError(f"{p}: model directory not found")
    try:
        base = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, trust_remote_code=False,
                                                    local_files_only=True, use_safetensors=True)
    except Exception as e:  # noqa: BLE001 - one line for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QevolveError(f"{p}: cannot load a causal LM ({msg})") from None
    base.to(device)
    base.eval()
    for prm in base.parameters():
        prm.requires_grad_(False)
    return base


def time_column(time_input: str) -> str:
    """The table column of a ``CriticConfig.time_input`` (``step`` for none and step, ``steps_left``)."""
    return "steps_left" if time_input == "steps_left" else "step"


class CriticModel(nn.Module):
    """Frozen backbone + adapters value / q / q_target + heads; see the module docstring."""

    def __init__(self, peft_model: Any, hidden_size: int, head_hidden: int, base_path: str, time_scale: float = 0.0,
                 time_input: str = "none"):
        super().__init__()
        self.backbone = peft_model
        self.hidden_size = hidden_size
        self.head_hidden = head_hidden
        self.base_path = base_path
        # CriticConfig.time_input: the heads take TrajItem.step / time_scale as one more input ("step": the step
        # index, "steps_left": the steps left before the episode's limit); time_scale 0 = none
        self.time_input = time_input if time_scale > 0 else "none"
        self.time_scale = float(time_scale) if self.time_input != "none" else 0.0
        d_in = hidden_size + (1 if self.time_scale > 0 else 0)
        self.heads = nn.ModuleDict({h: MLPHead(d_in, head_hidden) for h in HEADS})
        self._active: str | None = None
        self._trainable: list[nn.Parameter] = []
        self.per_sequence = False  # one forward per row of a padded batch (batch_layout; see pooled)
        self.shared_prefix = False  # the rows' common prompt prefix computed once (see pooled)
        self.max_length: int | None = None  # CriticConfig.max_length it trains / was trained with (critic.json)
        self.window_context = 1.0  # and CriticConfig.window_context: scoring uses the training windows

    def enable_training(self) -> None:
        """Adapters value and q (and all heads but the EMA targets) get gradients; q_target never does."""
        self._trainable = [p for _, p in self.adapter_params("value")] + [p for _, p in self.adapter_params("q")]
        self._fix_grads()
        for h in ("q1_target", "q2_target"):
            self.heads[h].requires_grad_(False)

    def _fix_grads(self) -> None:
        for p in self._trainable:
            p.requires_grad_(True)
        for _, p in self.adapter_params("q_target"):
            p.requires_grad_(False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, base_model: str | Path, cfg: Any, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> CriticModel:
        """Fresh critic: LoRA adapters on ``base_model``; q_target and the target heads start as copies of q."""
        from peft import LoraConfig, get_peft_model

        from qevolve_cli.models import enable_activation_checkpointing

        device = device or torch.device(resolve_device(cfg.device))
        dtype = dtype or resolve_dtype(cfg.dtype, device)
        torch.manual_seed(cfg.seed)
        base = _load_base(base_model, dtype, device)
        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.peft_target_modules(), bias="none", task_type="CAUSAL_LM")
        try:
            peft_model = get_peft_model(base, lcfg, adapter_name="value")
        except ValueError as e:
            raise QevolveError(f"lora_target_modules: {str(e).splitlines()[0]}") from None
        peft_model.add_adapter("q", lcfg)
        peft_model.add_adapter("q_target", lcfg)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(base, use_reentrant=False)
            base.enable_input_require_grads()
            base.train()  # HF checkpoints only in training mode (the backbone has no active dropout by default)
        model = cls(peft_model, base.config.hidden_size, cfg.head_hidden, str(base_model), cfg.time_scale,
                    cfg.time_input)
        model.max_length = cfg.max_length
        model.window_context = cfg.window_context
        model.per_sequence = per_sequence_layout(getattr(cfg, "batch_layout", "padded"), device.type)
        # a checkpointed backbone in training mode drops the cache a row's rest would start from
        model.shared_prefix = (bool(getattr(cfg, "shared_prefix", True)) and not cfg.gradient_checkpointing
                               and prefix_pays(base))
        model.heads.to(device=device, dtype=torch.float32)
        model.hard_update_target()
        return model

    @classmethod
    def load(cls, critic_dir: str | Path, base_model: str | Path | None = None, device: str | torch.device = "auto",
             dtype: str | torch.dtype = "auto", trainable: bool = False, batch_layout: str = "auto",
             shared_prefix: bool = True) -> CriticModel:
        """Load a saved critic; the base model comes from ``critic.json`` unless ``base_model`` is given.

        ``batch_layout`` as in training (:func:`qevolve_cli.training.batching.per_sequence_layout`): ``auto``
        scores a padded batch one row at a time on CPU, where the padded forward's attention mask forces
        the unfused attention kernel (quadratic memory in the trajectory's length); ``shared_prefix``: those
        rows' common prompt prefix computed once (:meth:`pooled`)."""
        from peft import PeftModel
        from safetensors.torch import load_file

        d = Path(critic_dir)
        meta_p = d / CRITIC_META
        if not meta_p.is_file():
            raise QevolveError(f"{d}: not a critic directory (no {CRITIC_META}; train one with `qevolve critic`)")
        meta = json.loads(meta_p.read_text())
        dev = device if isinstance(device, torch.device) else torch.device(resolve_device(device))
        dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
        base_dir = Path(base_model or meta["base_model"])
        if not base_dir.is_absolute() and not base_dir.is_dir():
            base_dir = d / base_dir
        base = _load_base(base_dir, dt, dev)
        ad = d / "adapters"
        for name in ADAPTERS:
            if not (ad / name / "adapter_config.json").is_file():
                raise QevolveError(f"{ad / name}: missing adapter '{name}'")
        peft_model = PeftModel.from_pretrained(base, str(ad / "value"), adapter_name="value", is_trainable=trainable)
        peft_model.load_adapter(str(ad / "q"), adapter_name="q", is_trainable=trainable)
        peft_model.load_adapter(str(ad / "q_target"), adapter_name="q_target", is_trainable=trainable)
        model = cls(peft_model, int(meta["hidden_size"]), int(meta["head_hidden"]), str(base_dir),
                    float(meta.get("time_scale", 0.0)), str(meta.get("time_input", "none")))
        model.per_sequence = per_sequence_layout(batch_layout, dev.type)
        model.shared_prefix = shared_prefix and prefix_pays(base)
        model.max_length = int(meta["max_length"]) if meta.get("max_length") else None
        model.window_context = float(meta.get("window_context", 1.0))
        model.heads.to(device=dev, dtype=torch.float32)
        state = load_file(str(d / HEADS_FILE), device=str(dev))
        missing = model.heads.load_state_dict(state, strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            raise QevolveError(f"{d / HEADS_FILE}: heads do not match (missing {missing.missing_keys[:3]}, "
                               f"unexpected {missing.unexpected_keys[:3]})")
        return model

    def save(self, out_dir: str | Path, tokenizer: Any = None, extra_meta: dict[str, Any] | None = None) -> None:
        """Write adapters (PEFT), heads (safetensors), critic.json and the tokenizer into ``out_dir``."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(out / "adapters"), selected_adapters=list(ADAPTERS))
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.heads.state_dict().items()}
        save_file(state, str(out / HEADS_FILE), metadata={"format": "pt"})
        meta = {"format": "qevolve-critic/1", "base_model": self.base_path, "hidden_size": self.hidden_size,
                "head_hidden": self.head_hidden, "time_input": self.time_input, "time_scale": self.time_scale,
                "max_length": self.max_length, "window_context": self.window_context,
                "adapters": list(ADAPTERS), "heads": list(HEADS),
                "pooling": "last-token at pos_s (value), pos_sa (q, q_target), pos_next (value)"}
        meta.update(extra_meta or {})
        (out / CRITIC_META).write_text(json.dumps(meta, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))

    # ------------------------------------------------------------------ parameters
    def adapter_params(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """(key, parameter) of one adapter, keys with the adapter name removed (aligned across adapters)."""
        tag = f".{name}."
        out = [(n.replace(tag, ".<a>."), p) for n, p in self.backbone.named_parameters() if tag in n]
        if not out:
            raise QevolveError(f"critic: adapter '{name}' has no parameters")
        return sorted(out, key=lambda kv: kv[0])

    def value_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(adapter params, head params) trained by L_V."""
        return [p for _, p in self.adapter_params("value")], list(self.heads["v"].parameters())

    def q_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(adapter params, head params) trained by L_Q."""
        return ([p for _, p in self.adapter_params("q")],
                list(self.heads["q1"].parameters()) + list(self.heads["q2"].parameters()))

    def _target_pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        q = dict(self.adapter_params("q"))
        qt = dict(self.adapter_params("q_target"))
        if q.keys() != qt.keys():
            raise QevolveError("critic: adapters 'q' and 'q_target' have different layouts")
        keys = sorted(q)
        tgt = [qt[k] for k in keys] + [p for h in ("q1_target", "q2_target") for p in self.heads[h].parameters()]
        onl = [q[k] for k in keys] + [p for h in ("q1", "q2") for p in self.heads[h].parameters()]
        return tgt, onl

    def ema_update(self, lam: float) -> None:
        """(bar-phi_q, bar-g_q1, bar-g_q2) <- (1 - lam) * target + lam * online."""
        tgt, onl = self._target_pairs()
        ema_update_(tgt, onl, lam)

    def hard_update_target(self) -> None:
        tgt, onl = self._target_pairs()
        ema_update_(tgt, onl, 1.0)

    # ------------------------------------------------------------------ forward
    def _decoder(self) -> nn.Module:
        # PeftModel -> LoraModel -> *ForCausalLM -> its base transformer (no LM head: no vocab-size logits)
        return self.backbone.base_model.model.base_model

    def activate(self, adapter: str) -> None:
        """Make ``adapter`` the active one (a no-op when it is). A backward that recomputes activations
        (gradient checkpointing) runs the forward again with the adapter active at that time."""
        if adapter not in ADAPTERS:
            raise ValueError(f"unknown adapter {adapter!r}")
        if self._active != adapter:
            # inference_mode keeps requires_grad False: the optimisers own which tensors train
            self.backbone.base_model.set_adapter(adapter, inference_mode=True)
            self._active = adapter
            if self._trainable:
                self._fix_grads()

    def hidden(self, adapter: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states (B, L, d) of the backbone with one adapter active."""
        self.activate(adapter)
        out = self._decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def pooled(self, adapter: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               *positions: torch.Tensor) -> list[torch.Tensor]:
        """One forward with ``adapter``; pooled (B, K, d) float32 states at each positions tensor.

        With ``per_sequence`` (set from ``batch_layout``) a right-padded batch of unequal rows runs one
        forward per row cut to its own length: no padding is computed and the states at the real positions
        are those of the padded forward (causal attention; positions lie inside their row). With
        ``shared_prefix`` (either layout), the leading tokens every row shares (:func:`shared_prefix_len`:
        the system prompt and in-context example) run once, and each row's rest (or the padded batch of
        the rests) runs on their keys and values."""
        lens = attention_mask.sum(dim=1).tolist()
        P = shared_prefix_len(input_ids, lens) if self.shared_prefix else 0
        pre = self._prefix(adapter, input_ids[:1, :P]) if P else None
        if self.per_sequence and (pre is not None or min(lens) < input_ids.shape[1]):
            outs: list[list[torch.Tensor]] = [[] for _ in positions]
            for b, n in enumerate(lens):
                row = input_ids[b : b + 1, :n]
                h = self.hidden(adapter, row, torch.ones_like(row)) if pre is None else self._on_prefix(row, *pre)
                for o, p in zip(outs, positions, strict=True):
                    o.append(pool_last_token(h, p[b : b + 1]).float())
            return [torch.cat(o, dim=0) for o in outs]
        if pre is not None:
            h = self._on_prefix(input_ids, *pre, attention_mask=attention_mask)
        else:
            h = self.hidden(adapter, input_ids, attention_mask)
        return [pool_last_token(h, p).float() for p in positions]

    def _prefix(self, adapter: str, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The shared prefix's forward with ``adapter`` -> (last hidden states (1, P, d), per-layer keys/values),
        in the graph when gradients are on."""
        self.activate(adapter)
        out = self._decoder()(input_ids=ids, use_cache=True)
        return out.last_hidden_state, cache_layers(out_cache(out))

    def _on_prefix(self, rows: torch.Tensor, h_pre: torch.Tensor, layers: list,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states (B, n, d) of ``rows`` (B, n) whose first P tokens are the prefix of :meth:`_prefix`:
        the prefix's states, then the rest's forward on a cache that starts from the prefix's keys and values
        (the active adapter is the prefix's; B > 1: a right-padded batch, ``attention_mask`` (B, n) over the
        prefix and the rest). Equal to the rows' whole forward up to rounding."""
        B, P = rows.shape[0], h_pre.shape[1]
        if B > 1:
            layers = repeat_layers(layers, B)
            h_pre = h_pre.expand(B, -1, -1)
        dec = self._decoder()
        out = dec(input_ids=rows[:, P:], attention_mask=attention_mask, use_cache=True,
                  **{cache_kwarg(dec): cache_of_layers(layers)})
        return torch.cat([h_pre, out.last_hidden_state], dim=1)

    @property
    def time_column(self) -> str:
        """The table column the heads' time input comes from (``step`` when the critic has none: unused)."""
        return time_column(self.time_input)

    def next_time(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The time input of s' from that of s: one step later, or one step fewer left (None stays None)."""
        if t is None:
            return None
        return t - 1 if self.time_input == "steps_left" else t + 1

    def head(self, name: str, x: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``name`` on pooled states ``x`` (B, K, d) -> (B, K). ``t`` (B, K): the step index of each state,
        an input of the head when the critic is time-aware (``time_scale`` > 0), ignored otherwise."""
        if self.time_scale > 0:
            if t is None:
                raise ValueError(f"head {name!r}: this critic takes the step index as an input (time_input: "
                                 f"{self.time_input})")
            x = torch.cat([x, (t.to(x.dtype) / self.time_scale).unsqueeze(-1)], dim=-1)
        return self.heads[name](x)
