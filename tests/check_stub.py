"""Check that the hand-written stub qevolve_cli/_core.pyi and the extension agree (names and parameters)."""
from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stub_functions() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "qevolve_cli" / "_core.pyi").read_text())
    return {n.name: [a.arg for a in n.args.args] for n in tree.body if isinstance(n, ast.FunctionDef)}


def module_functions() -> dict[str, list[str]]:
    from qevolve_cli import _core

    out = {}
    for name, obj in vars(_core).items():
        if callable(obj) and not isinstance(obj, type) and not name.startswith("_"):
            out[name] = list(inspect.signature(obj).parameters)
    return out


def stub_classes() -> dict[str, set[str]]:
    tree = ast.parse((ROOT / "qevolve_cli" / "_core.pyi").read_text())
    return {n.name: {f.name for f in n.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
            for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")
            and not any(getattr(b, "id", "").endswith("Error") for b in n.bases)}


def module_classes() -> dict[str, set[str]]:
    from qevolve_cli import _core

    return {name: {a for a in vars(obj) if not a.startswith("_")}
            for name, obj in vars(_core).items() if isinstance(obj, type) and not issubclass(obj, BaseException)}


def problems() -> list[str]:
    s, m = stub_functions(), module_functions()
    sc, mc = stub_classes(), module_classes()
    cls_errs = [f"class missing in stub: {n}" for n in sorted(set(mc) - set(sc))]
    cls_errs += [f"stub has no such class: {n}" for n in sorted(set(sc) - set(mc))]
    cls_errs += [f"{n}: stub methods {sorted(sc[n])} != module methods {sorted(mc[n])}"
                 for n in sorted(set(sc) & set(mc)) if sc[n] != mc[n]]
    errs = [f"missing in stub: {n}" for n in sorted(set(m) - set(s))]
    errs += [f"stub has no such function: {n}" for n in sorted(set(s) - set(m))]
    errs += [f"{n}: stub params {s[n]} != module params {m[n]}" for n in sorted(set(s) & set(m)) if s[n] != m[n]]
    return cls_errs + errs


if __name__ == "__main__":
    errs = problems()
    for e in errs:
        print(e)
    sys.exit(1 if errs else 0)
