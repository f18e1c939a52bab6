"""The benchmark tables and figures in README.md and docs/*.md match docs/bench/*.json
(``scripts/render_docs.py``), and ``--check`` catches a table or a JSON file edited alone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "render_docs.py"


def _render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """README.md, docs/*.md and docs/bench/*.json copied under a temporary root."""
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for md in (REPO / "docs").glob("*.md"):
        shutil.copy(md, tmp_path / "docs" / md.name)
    for js in (REPO / "docs" / "bench").glob("*.json"):
        shutil.copy(js, tmp_path / "docs" / "bench" / js.name)
    return tmp_path


def test_docs_match_their_json():
    r = _render("--check")
    assert r.returncode == 0, r.stderr + r.stdout


def test_every_doc_block_names_a_known_table_or_figure():
    sys.path.insert(0, str(REPO / "scripts"))
    import render_docs

    names = set()
    for path in render_docs.doc_files(REPO):
        names |= set(re.findall(r"<!-- (table|fig):([a-z0-9_]+) -->", path.read_text()))
    assert names, "no marked block in the docs"
    for kind, name in names:
        assert name in (render_docs.TABLES if kind == "table" else render_docs.FIGURES), (kind, name)
    assert {n for k, n in names if k == "table"} == set(render_docs.TABLES), "a table is rendered nowhere"


def test_check_fails_when_a_table_is_edited(docs_copy: Path):
    doc = docs_copy / "docs" / "benchmark.md"
    text = doc.read_text()
    block = re.search(r"<!-- table:tau_peers -->.*?<!-- /table:tau_peers -->", text, re.S).group(0)
    edited = re.sub(r"\| (\d+\.\d\d) \|", lambda m: f"| {float(m.group(1)) + 0.01:.2f} |", block, count=1)
    assert edited != block
    doc.write_text(text.replace(block, edited))
    r = _render("--check", "--root", str(docs_copy))
    assert r.returncode == 1 and "docs/benchmark.md" in r.stderr
    assert _render("--root", str(docs_copy)).returncode == 0          # rendering restores the table
    assert doc.read_text() == text
    assert _render("--check", "--root", str(docs_copy)).returncode == 0


def test_check_fails_when_a_figure_is_edited(docs_copy: Path):
    readme = docs_copy / "README.md"
    text = readme.read_text()
    m = re.search(r"<!-- fig:cuda_graphs_ms -->(.*?)<!-- /fig:cuda_graphs_ms -->", text)
    assert m, "README.md quotes the CUDA-graph step time through the renderer"
    readme.write_text(text.replace(m.group(0), m.group(0).replace(m.group(1), "9.9-9.9")))
    r = _render("--check", "--root", str(docs_copy))
    assert r.returncode == 1 and "README.md" in r.stderr


def test_check_fails_when_the_json_changes(docs_copy: Path):
    path = docs_copy / "docs" / "bench" / "tau_default.json"
    data = json.loads(path.read_text())
    row = next(r for r in data["rows"] if r["method"] == "graft_fixed")
    row["tau"] += 0.5
    path.write_text(json.dumps(data))
    assert _render("--check", "--root", str(docs_copy)).returncode == 1


def test_unknown_block_is_an_error(docs_copy: Path):
    doc = docs_copy / "docs" / "benchmark.md"
    doc.write_text(doc.read_text() + "\n<!-- table:no_such_table -->\n<!-- /table:no_such_table -->\n")
    r = _render("--check", "--root", str(docs_copy))
    assert r.returncode != 0 and "no_such_table" in r.stderr
