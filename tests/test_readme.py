"""The README states what the code does: its variant table and its quick start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zoo.views.describe import TABLES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", list(TABLES))
def test_tables_are_generated_from_the_registry(name):
    block = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert block, f"README lacks the {name} markers"
    assert block.group(1).strip() == TABLES[name]().strip(), "run: python -m zoo readme"


def test_quick_start_test_command_is_what_ci_runs():
    commands = re.search(r"## Quick start.*?```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert len(commands) == 2, "the quick start has exactly two commands"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
