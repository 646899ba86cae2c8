"""The documentation as a reader meets it: a short README whose first screen says how to start,
a docs index that names every document, links that lead somewhere, and the README's Python
example running as written. (The docs' tables and option names are checked by the tests of
what they describe: test_spec.py, test_hf_zoo.py, test_tensorrt.py.)"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOCUMENTS = [README, *sorted(DOCS.glob("*.md")), ROOT / "plugins" / "tensorrt" / "README.md"]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a link inside one is an example, not a link)."""
    return FENCE.sub("", path.read_text())


def _links(path: Path):
    return LINK.findall(_prose(path))


def _anchors(markdown: str) -> set:
    """The anchors GitHub gives the headings of a Markdown text: lower case, punctuation
    dropped, spaces as hyphens, a -N suffix for the Nth repeat."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines: move detail into docs/"
    first_screen = "\n".join(lines[:40])
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", first_screen, re.M), f"`{command}` is not in README.md's first 40 lines"


def test_every_doc_is_in_the_index():
    index = {target.split("#")[0] for target in _links(DOCS / "README.md")}
    missing = [doc.name for doc in sorted(DOCS.glob("*.md")) if doc.name != "README.md" and doc.name not in index]
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _links(path):
        if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_anchors_follow_githubs_rule():
    """The anchor rule above, on headings whose anchors GitHub renders (checked by hand)."""
    text = ("# A\n## The model zoo\n### Two flavors of attention node: `--onnx-attention custom|standard`\n"
            "```\n# not a heading\n```\n## A\n")
    assert _anchors(text) == {"a", "the-model-zoo", "two-flavors-of-attention-node---onnx-attention-customstandard",
                              "a-1"}


@pytest.mark.slow  # end to end: exports and validates a model
def test_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "README.md should have one Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md example", "exec"), {"__name__": "__readme_example__"})
    assert (tmp_path / "model.onnx").is_file()
