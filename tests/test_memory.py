"""A finished stage's freed memory goes back to the operating system (qevolve_cli/memory.py): glibc keeps a
fragmented heap resident until ``malloc_trim``; ``RunDir.run_stage`` trims after every stage, so that a
long ``evolve`` does not hold its largest stage's peak for the rest of the run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, qevolve_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")

# A fragmented heap: 16,000 blocks of 32 KiB (below glibc's mmap threshold, so on the heap; written, so
# resident), every 40th kept: the free space lies between live blocks, where no heap shrink reaches it.
SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    from qevolve_cli.memory import release_memory
    from qevolve_cli.evolve.rundir import RunDir

    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def fragment():
        blocks = [bytearray(b"x" * 32768) for _ in range(16000)]
        return blocks[::40]

    out = {"base": rss_mib()}
    kept = fragment()
    gc.collect()
    out["held"] = rss_mib()
    if sys.argv[1] == "function":
        out["trimmed"] = release_memory()
    else:  # a stage of a run directory that allocates and frees the same way
        def stage():
            global kept2
            kept2 = fragment()
            (run.path / "out").write_text("done")
            return {}
        run = RunDir(sys.argv[2])
        run.run_stage("s", stage, inputs=[], outputs=["out"], config_hash="h", iteration=0, echo=lambda m: None)
    out["after"] = rss_mib()
    print(json.dumps(out))
""")


def _run(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=qevolve_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_release_memory_returns_a_fragmented_heap() -> None:
    r = _run("function")
    assert r["trimmed"] is True
    assert r["held"] - r["base"] > 350, r  # 500 MiB written, 12.5 MiB still live: freeing alone returned little
    assert r["held"] - r["after"] > 300, r  # the trim gave it back


def test_every_stage_of_a_run_ends_with_its_memory_returned(tmp_path) -> None:
    r = _run("stage", str(tmp_path / "run"))
    assert r["held"] - r["base"] > 350, r
    # the stage made and freed another such heap; after run_stage both are back with the system
    assert r["held"] - r["after"] > 300, r
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["s"]["status"] == "done"
