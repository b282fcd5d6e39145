"""The README and the docs pages state what the code and the committed results say: their
generated tables are up to date, the quick start's commands are what CI runs, and the README's
headline figures are in the files they link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pages import ROOT, pages, relative

from zoo.views.describe import MARKED, TABLES, generated_table, table_in_file, update_generated

README = (ROOT / "README.md").read_text()
MARKED_PAGES = [page for page in pages() if MARKED.search(page.read_text())]


@pytest.mark.parametrize("page", MARKED_PAGES, ids=relative)
def test_generated_tables_are_up_to_date(page):
    for match in MARKED.finditer(page.read_text()):
        expected = generated_table(match["name"], ROOT).strip()
        assert match["body"].strip() == expected, (
            f"{relative(page)}: the table {match['name']!r} is stale; run: python -m zoo readme"
        )


def test_every_registry_table_appears_somewhere():
    names = {m["name"] for page in MARKED_PAGES for m in MARKED.finditer(page.read_text())}
    assert set(TABLES) <= names, f"no page shows {sorted(set(TABLES) - names)}"


def test_a_results_table_is_the_first_table_under_its_heading(tmp_path):
    text = "# A\n\n| x |\n|---|\n| 1 |\n\n## B\n\ntext\n\n| y |\n|---|\n| 2 |\n"
    (tmp_path / "r.md").write_text(text)
    assert table_in_file(tmp_path / "r.md", "B") == "| y |\n|---|\n| 2 |"
    assert table_in_file(tmp_path / "r.md") == "| x |\n|---|\n| 1 |"
    with pytest.raises(ValueError, match="has no heading 'C'"):
        table_in_file(tmp_path / "r.md", "C")
    page = tmp_path / "page.md"
    page.write_text('<!-- from r.md "B":start -->\nold\n<!-- from r.md "B":end -->\n')
    assert update_generated(page, tmp_path) is True
    assert "| 2 |" in page.read_text() and "old" not in page.read_text()
    assert update_generated(page, tmp_path) is False
    with pytest.raises(ValueError, match="neither one of variants"):
        generated_table("nonsense", tmp_path)


def test_a_marker_naming_a_missing_result_file_is_a_value_error(tmp_path):
    """``zoo readme`` on a page whose ``from PATH`` marker named no file ended in read_text's
    FileNotFoundError traceback (exit 1) instead of a sentence naming the path (exit 2)."""
    page = tmp_path / "page.md"
    page.write_text('<!-- from nosuch.md "B":start -->\nold\n<!-- from nosuch.md "B":end -->\n')
    with pytest.raises(ValueError, match=r"nosuch\.md is not a file"):
        update_generated(page, tmp_path)
    with pytest.raises(ValueError, match="is not a file"):
        table_in_file(tmp_path)  # a folder
    assert "old" in page.read_text()


def test_quick_start_test_command_is_what_ci_runs():
    commands = re.search(r"## Quick start.*?```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert len(commands) == 2, "the quick start has exactly two commands"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_the_readme_is_a_front_page():
    assert len(README.encode()) < 12 * 1024, "the README grew past 12 KB: move detail to docs/"


def test_headline_figures_are_in_the_files_they_link():
    """Every number in the measured columns of the README's headline table occurs in the
    committed result file that its row links."""
    table = table_in_file(ROOT / "README.md", "Measured").splitlines()[2:]
    assert len(table) >= 3
    for row in table:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        target = re.search(r"\]\(([^)]+)\)", cells[-1])
        assert target, f"row {cells[0]!r} links no result file"
        source = (ROOT / target.group(1)).read_text()
        figures = [f for cell in cells[1:-1] for f in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", cell)]
        assert figures, f"row {cells[0]!r} quotes no figure"
        for figure in figures:
            assert re.search(rf"(?<![\w.]){re.escape(figure)}(?![\d])", source), (
                f"README headline {cells[0]!r}: {figure} is not in {target.group(1)}"
            )


@pytest.mark.parametrize("page", pages(), ids=relative)
def test_links_to_committed_results_exist(page):
    """A page's link into the results points at a committed file (mkdocs checks the docs' links;
    the README's are checked here)."""
    base = page.parent
    for target in re.findall(r"\]\(((?:\.\./)*(?:eval/)?results/[^)#]+)\)", page.read_text()):
        assert (base / target).exists(), f"{relative(page)} links {target}, which does not exist"


def test_zoo_readme_fills_every_page(tmp_path, monkeypatch):
    """``zoo readme`` with no path finds the README and the docs pages with tables."""
    from zoo.views.describe import pages_with_tables

    found = {Path(p).resolve() for p in pages_with_tables(ROOT)}
    assert found == {p.resolve() for p in MARKED_PAGES}
