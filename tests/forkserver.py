"""A fork server for the suite's ``qevolve`` subprocesses (tests/conftest.py, ``run_qevolve``).

Every ``run_qevolve`` is a real process running ``python -m qevolve_cli ARGS``: its own exit code, its
own stdout / stderr (warnings and tracebacks included), its own signals, locks and memory. What a fresh
interpreter spends before the command starts is mostly importing torch, transformers and peft: 5-10
CPU-seconds on the 2-core CI machine, about a hundred times per suite. This server imports those
libraries once and forks a child per command, which then runs exactly what ``python -m qevolve_cli``
runs: ``qevolve_cli`` itself (its environment set-up included) is imported by the child, after the
child has taken the command's environment, working directory and files.

Safe to fork: the server imports libraries and runs nothing (no torch op has started OpenMP threads;
the only threads are OpenBLAS's, which re-creates its pool after a fork). ``conftest`` uses the
server only where the command's environment equals the server's apart from ``QEVOLVE_*`` variables
(read by qevolve when its command runs) and pytest's own; anything else (``OMP_NUM_THREADS``,
``HF_HOME``, ... read when a library is imported) gets a plain subprocess.

Protocol, one command at a time: a JSON line on stdin ``{"args", "cwd", "env", "stdout", "stderr"}``;
the server answers ``pid N`` when the child has started and ``status S`` (``os.waitpid``'s status)
when it has ended. End of stdin: the server exits.
"""
from __future__ import annotations

import json
import os
import sys

PRELOAD = ("numpy", "torch", "transformers", "peft", "safetensors.torch", "yaml", "typer", "rich.console")


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this venv (the vLLM one): the child imports what it needs
            pass
    try:  # the model and tokenizer classes of the tests' tiny models (transformers imports them lazily)
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401
    except ImportError:
        pass


def serve() -> dict:
    """Answer requests until stdin ends (then exit); in a forked child, return its request."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 65536)
            if not chunk:
                os._exit(0)
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return req
        os.write(1, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"status {status}\n".encode())


def run_child(req: dict) -> None:
    """Become ``python -m qevolve_cli ARGS`` in ``cwd`` with ``env`` and the given output files."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o600)
        os.dup2(f, fd)
        os.close(f)
    import importlib.util

    spec = importlib.util.find_spec("qevolve_cli.__main__")
    # as `python -m`: argv[0] is the module's file, the working directory leads sys.path, and the module
    # is __main__ (Click names the program `python -m qevolve_cli`; "spawn" workers re-import it by name)
    sys.argv = [spec.origin, *req["args"]]
    sys.path[0] = os.getcwd()
    import qevolve_cli.__main__ as entry

    sys.modules["__main__"] = entry
    try:
        entry.main()
        code = 0
    except SystemExit as e:  # as the interpreter maps it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


def exit_now(code: int) -> None:
    """What an interpreter's exit does that a command can see (non-daemon threads joined, atexit handlers,
    stdio flushed), without tearing down the preloaded modules object by object (the bulk of a forked
    child's exit: every page those objects touch is copied)."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    preload()
    import gc

    gc.collect()
    gc.freeze()  # the children's collections leave the preloaded objects alone (no copy-on-write of their pages)
    run_child(serve())
