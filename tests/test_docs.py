"""The documentation as a reader meets it: every relative link of README.md and docs/ leads to a file (and,
with an anchor, to a heading of it), the README stays short, docs/README.md lists every page, and every
notebook entry says when it was measured and at which commit (docs/results.md, "Notebook")."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, seen, fence = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are code
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)")
    assert not bad, "\n".join(bad)


def test_slug_is_githubs():
    assert slug("The AWR policy step (`policy_step: awr`, the `cpu` preset on `lamps` and `lamps-hard`)") == \
        "the-awr-policy-step-policy_step-awr-the-cpu-preset-on-lamps-and-lamps-hard"
    assert slug("GPU: one NVIDIA H200") == "gpu-one-nvidia-h200"


def test_readme_is_short_and_its_results_link_to_their_commands():
    """The README a newcomer reads in five minutes (issue 68): at most ~150 lines, and each row of its results
    table links to a section of docs/results.md, each of whose table sections gives the command that made it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    rows = [ln for ln in readme.split("## Results", 1)[1].split("\n## ", 1)[0].splitlines() if ln.startswith("| ") and "](" in ln]
    assert len(rows) >= 4 and all("(docs/results.md#" in r for r in rows), rows
    results = (DOCS / "results.md").read_text()
    sections = re.split(r"\n(?=### )", results.split("\n## Critic", 1)[0])[1:]
    assert sections and all("```bash" in s for s in sections), [s.splitlines()[0] for s in sections if "```bash" not in s]


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    listed = {(DOCS / t).resolve() for t in links(DOCS / "README.md")}
    missing = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.name != "README.md" and p.resolve() not in listed]
    assert not missing, f"pages missing from docs/README.md (add a line for each): {missing}"
    assert "results.md" in index


def test_notebook_entries_are_dated_with_their_commit():
    entries = sorted((DOCS / "notebook").glob("*.md"))
    assert entries
    results = (DOCS / "results.md").read_text()
    for e in entries:
        assert re.match(r"\d{4}-\d{2}-\d{2}-", e.name), e.name
        head = "\n".join(e.read_text().splitlines()[:4])
        assert re.search(r"Measured \d{4}-\d{2}-\d{2}", head) and re.search(r"commit [0-9a-f]{7}", head), e.name
        assert f"(notebook/{e.name})" in results, f"docs/results.md does not link {e.name}"
