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

HELP = """Create a tiny Hugging Face causal LM offline (no network).

\b
Writes a real LlamaForCausalLM / Qwen2ForCausalLM (random init, safetensors),
a byte-level BPE tokenizer trained on built-in environment text, and a ChatML
chat template (eos = <|im_end|>, the end of a turn). Loadable with
AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR). OUT must not exist
or be empty; it is written atomically.
\b
Examples:
  qevolve init-model --out models/tiny
  qevolve init-model --out models/small-qwen --arch qwen2 --size small --seed 1 --json
  qevolve init-model --out models/tiny64 --size tiny64      # loads in vLLM (head size 64)
  qevolve init-model --out models/tiny-tc --size tiny-tc --quiet
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
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.models.tiny import ARCHS, SIZES

            check_choice(arch, ARCHS, "--arch")
            check_choice(size, SIZES, "--size")
            import json

            from qevolve_cli.models.tiny import create_tiny_model

            t0 = time.perf_counter()
            if quiet:
                import transformers

                transformers.utils.logging.set_verbosity_error()
            else:
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
