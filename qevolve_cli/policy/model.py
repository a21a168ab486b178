"""The policy model: check a model directory, load a causal LM (or a PEFT adapter over its base), put LoRA on
it, save it back as a directory that transformers and vLLM load. torch, transformers and peft are imported
inside the functions."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.models import adapter_base, record_adapter_base
from qevolve_cli.policy.config import PolicyConfig


def check_model_dir(path: str | Path, what: str = "--model") -> Path:
    p = Path(path)
    if not p.exists():
        raise QevolveError(f"{what} {p}: no such model directory")
    if not p.is_dir():
        raise QevolveError(f"{what} {p}: not a directory")
    if not (p / "config.json").exists() and not (p / "adapter_config.json").exists():
        raise QevolveError(f"{what} {p}: not a Hugging Face model directory (no config.json or adapter_config.json)")
    return p


def load_causal_lm(path: str | Path, trainable_lora: bool = False, what: str = "--model"):
    """Load a causal LM (or a PEFT adapter over its base) in float32 from safetensors, no remote code."""
    import torch
    from transformers import AutoModelForCausalLM

    from qevolve_cli.progress import quiet_transformers

    quiet_transformers()
    p = check_model_dir(path, what)
    kw = dict(dtype=torch.float32, trust_remote_code=False, use_safetensors=True)
    try:
        base_path = adapter_base(p)
        if base_path is not None:
            from peft import PeftModel

            if not base_path:
                raise QevolveError(f"{p}/adapter_config.json: no base_model_name_or_path")
            base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
            model = PeftModel.from_pretrained(base, str(p), is_trainable=trainable_lora)
            if not trainable_lora:
                model = model.merge_and_unload()
            return model
        return AutoModelForCausalLM.from_pretrained(str(p), **kw)
    except QevolveError:
        raise
    except (OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QevolveError(f"{what} {p}: cannot load the model ({msg})") from None


def apply_lora(model, cfg: PolicyConfig):
    """LoRA adapters on ``cfg.lora_target_modules`` (a PEFT model is returned as it is)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    targets: Any = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lc = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                    target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, lc)


def save_model(model, tok, out_dir: Path, cfg: PolicyConfig, init_dtype, state: dict) -> None:
    """Save full weights (safetensors) or the LoRA adapter, plus tokenizer files.

    ``state``: the model's full state dict (gathered from the ranks under DeepSpeed ZeRO-3).
    """
    import torch

    if cfg.lora:
        model.save_pretrained(str(out_dir), safe_serialization=True, state_dict=state)
        record_adapter_base(out_dir)  # the base found again when the run directory moves
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.save_dtype)
        if dtype is None:
            dtype = init_dtype if isinstance(init_dtype, torch.dtype) else torch.float32
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        model.config.dtype = dtype
        model.config.save_pretrained(str(out_dir))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
