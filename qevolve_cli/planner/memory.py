"""The memory model of the planner: bytes per GPU of each stage's parts, from the model's shape only.

A decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, SmolLM2): hidden size h, L layers,
a attention heads of which a_kv key/value heads (head size d = h / a), MLP width m, vocabulary V. Parameters:
``V h`` (embedding) + ``V h`` (LM head, unless tied) + L (2 h^2 + 2 h a_kv d + 3 h m + 2 h) + h.

Training (policy, critic) with DeepSpeed on N ranks, parameters in ``b`` bytes (bf16: 2 on GPU; fp32: 4 on
CPU), T trainable parameters (all of them, or the LoRA adapters):

==================  =====================================  ==========================================
part                bytes per rank                          divided by N under
==================  =====================================  ==========================================
weights             P b                                     ZeRO-3
trainable copy      T b (LoRA adapters; in P when full)     ZeRO-3
fp32 master         4 T (DeepSpeed keeps one even when b=4) ZeRO-1/2/3 (absent at ZeRO-0 with fp32)
Adam moments        8 T                                     ZeRO-1/2/3
gradients           T b                                     ZeRO-2/3
activations         per micro-batch, below                  no (data parallel: every rank its own)
==================  =====================================  ==========================================

Activations of a micro-batch of ``n`` tokens kept for the backward pass: per layer and token the tensors
autograd saves in a Llama block (the RMSNorm inputs and outputs, q, k and v, the attention output, the
MLP's gate, up, SiLU(gate) and product), ``(8 h + 2 a_kv d + 4 m) b``, and for the LM head the logits
and the loss's fp32 log-softmax, ``V (b + 4)`` per token; fused attention (SDPA's flash kernels, on GPU
and on CPU) keeps no ``s x s`` matrix. These constants were measured (forward peaks of the tiny and
SmolLM2 shapes at 64-512 tokens, fp32, CPU; within 5 %). Gradient checkpointing keeps only every
layer's input (``L n h b``) plus one layer's activations while it is recomputed. ZeRO-3 keeps up to
``stage3_max_live_parameters`` (1e9 in configs/deepspeed/zero3.json) parameters gathered during a step.

Generation (rollout, eval) with vLLM at tensor-parallel size ``tp``: weights ``2 P / tp``, the KV cache
``2 L a_kv d 2 / tp`` bytes per token of every live sequence (bf16), vLLM's activation workspace and
CUDA graphs (a stated constant). vLLM takes ``gpu_memory_utilization`` of the GPU and gives the rest of
it after the weights to the KV cache; it fits when that is at least the live batch's full contexts.

The model is checked against peaks measured on CPU under DeepSpeed with 2 ranks
(``tests/test_plan.py``, :mod:`qevolve_cli.planner.probe`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError

GiB = 1024**3

# usable device memory in GiB (what CUDA can allocate: the nominal size less the driver's share)
GPUS: dict[str, float] = {
    "h100-80gb": 79.1,
    "h200-141gb": 139.8,
    "a100-80gb": 79.1,
    "a100-40gb": 39.4,
    "l40s-48gb": 44.4,
    "a10-24gb": 22.1,
}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer of one block."""
        h, kv, m = self.hidden, self.kv_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}

    def params(self) -> int:
        h = self.hidden
        block = sum(i * o for i, o in self.linear_shapes().values()) + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * block + h

    def lora_params(self, rank: int, targets: str | list[str] | tuple[str, ...] = "all-linear") -> int:
        """Parameters of one LoRA adapter of rank ``rank`` on ``targets`` ('all-linear': every linear layer of
        the blocks, the LM head excluded, as PEFT does)."""
        names = ALL_LINEAR if targets in ("all-linear", ["all-linear"], ("all-linear",)) else tuple(targets)
        unknown = [n for n in names if n not in ALL_LINEAR]
        if unknown:
            raise QevolveError(f"lora target modules: {unknown[0]!r} is not a linear layer of a Llama-family block "
                               f"({', '.join(ALL_LINEAR)})")
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """The shape from a Hugging Face ``config.json`` (a file or the model directory); no weights are read."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        try:
            raw = json.loads(f.read_text())
        except FileNotFoundError:
            raise QevolveError(f"{f}: no such model config (give a model directory with a config.json)") from None
        except ValueError as e:
            raise QevolveError(f"{f}: not a JSON model config ({e})") from None
        if isinstance(raw.get("text_config"), dict):  # multimodal wrappers keep the LM's shape here
            raw = {**raw, **raw["text_config"]}
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for k in need:
            if not isinstance(raw.get(k), int) or raw[k] <= 0:
                raise QevolveError(f"{f}: field {k}: missing or not a positive integer (the planner models "
                                   "Llama-family decoders)")
        kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
        return cls(hidden=raw["hidden_size"], layers=raw["num_hidden_layers"], heads=raw["num_attention_heads"],
                   kv_heads=int(kv), intermediate=raw["intermediate_size"], vocab=raw["vocab_size"],
                   tied=bool(raw.get("tie_word_embeddings", False)),
                   max_positions=int(raw.get("max_position_embeddings") or 4096))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params()}


@dataclass(frozen=True)
class TrainSetting:
    """One way of running a training stage: what the planner judges."""

    zero: int  # DeepSpeed ZeRO stage 0-3
    ranks: int  # data-parallel ranks (GPUs) sharing the ZeRO partitions
    gradient_checkpointing: bool = False

    def name(self) -> str:
        return f"zero{self.zero}" + ("+gc" if self.gradient_checkpointing else "")


def activation_bytes(shape: ModelShape, tokens: int, b: int, *, checkpointing: bool = False,
                     logits: bool = True) -> int:
    """Bytes of the activations kept for the backward pass of one micro-batch of ``tokens`` tokens (see the
    module docstring; fused attention: SDPA's flash kernels on GPU and CPU keep no s x s matrix)."""
    per_layer_token = (8 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) * b
    head = tokens * shape.vocab * (b + 4) if logits else 0  # the critic reads hidden states: no logits
    if checkpointing:
        return shape.layers * tokens * shape.hidden * b + tokens * per_layer_token + head
    return shape.layers * tokens * per_layer_token + head


def training_memory(shape: ModelShape, setting: TrainSetting, *, trainable: int | None, tokens: int,
                    b: int = 2, frozen_extra: int = 0, zero3_max_live: float = 1e9,
                    logits: bool = True) -> dict[str, int]:
    """Bytes per rank of a training stage -> its parts and ``peak``.

    ``trainable`` None = full fine-tuning, else the trained (LoRA, heads) parameters on the frozen model;
    ``frozen_extra``: untrained parameters beside the model (the critic's EMA target adapter); ``tokens``:
    the padded tokens of one micro-batch; ``zero3_max_live``: the DeepSpeed config's
    ``stage3_max_live_parameters`` (ZeRO-3 keeps up to that many parameters gathered).

    The peak is the largest of three moments: the engine's construction (ZeRO-1/2 flatten the trained
    parameters into one buffer while the originals still exist), the backward pass of a step after the
    first (weights, optimiser state, gradient partition, activations, and under full fine-tuning the
    embedding's and LM head's dense ``V h`` gradients before they reach their bucket), and the optimiser
    step (ZeRO-1/2 copy the rank's gradient partition to fp32 for it)."""
    P = shape.params()
    n, z = max(1, setting.ranks), setting.zero
    full = trainable is None
    T = P if full else int(trainable)
    weights = P * b / (n if z == 3 else 1)
    adapters = 0 if full else (T + frozen_extra) * b / (n if z == 3 else 1)
    master = 0 if (z == 0 and b == 4) else 4 * T / (n if z >= 1 else 1)
    adam = 8 * T / (n if z >= 1 else 1)
    grads = T * b / (n if z >= 2 else 1)
    act = activation_bytes(shape, tokens, b, checkpointing=setting.gradient_checkpointing, logits=logits)
    gathered = min(P, zero3_max_live) * b if z == 3 else 0
    vh = shape.vocab * shape.hidden * b
    dense = 2 * vh if full else 0  # the embedding's and the LM head's dense gradients (tied or not)
    states = weights + adapters + master + adam + grads + gathered
    init = weights + adapters + (T * b if z in (1, 2) else 0)
    step_copy = 4 * T / n if z in (1, 2) else 0
    parts = {"weights": weights, "lora": adapters, "optimizer": master + adam, "gradients": grads,
             "activations": act, "zero3_gathered": gathered, "backward_transient": dense}
    parts["peak"] = max(init, states + act + dense, states + step_copy)
    return {k: int(v) for k, v in parts.items()}


def inference_memory(shape: ModelShape, *, tokens: int, b: int = 2, adapters: int = 0) -> dict[str, int]:
    """Bytes of a forward pass without gradients (critic scoring in ``label --critic``): the weights and one
    layer's activations at a time, plus the logits-free pooled heads (the critic reads hidden states)."""
    per_layer = tokens * (9 * shape.hidden + 4 * shape.kv_dim + 4 * shape.intermediate) * b
    parts = {"weights": shape.params() * b, "lora": adapters * b, "activations": int(2 * per_layer)}
    return {**parts, "peak": sum(parts.values())}


def kv_bytes_per_token(shape: ModelShape, tp: int = 1, b: int = 2) -> int:
    """KV cache bytes of one token on one GPU at tensor-parallel size ``tp`` (keys and values, every layer)."""
    kv_heads_per_gpu = max(1, -(-shape.kv_heads // tp))  # vLLM replicates KV heads when tp > a_kv
    return 2 * shape.layers * kv_heads_per_gpu * shape.head_dim * b


def vllm_memory(shape: ModelShape, *, tp: int, live_seqs: int, context: int, gpu_gib: float,
                utilization: float = 0.9, workspace_gib: float = 2.0) -> dict[str, Any]:
    """vLLM at tensor-parallel size ``tp``: weights per GPU, the KV cache it needs (``live_seqs`` sequences of
    ``context`` tokens, spread over the tp GPUs of one engine), and what it has after the weights."""
    weights = 2 * shape.params() / tp
    need_kv = live_seqs * context * kv_bytes_per_token(shape, tp)
    budget = utilization * gpu_gib * GiB
    have_kv = budget - weights - workspace_gib * GiB
    return {"weights": int(weights), "kv_cache_needed": int(need_kv), "kv_cache_available": int(max(0, have_kv)),
            "workspace": int(workspace_gib * GiB), "budget": int(budget),
            "fits": bool(have_kv >= need_kv and have_kv > 0),
            "max_live_seqs": int(max(0, have_kv) // max(1, context * kv_bytes_per_token(shape, tp)))}
