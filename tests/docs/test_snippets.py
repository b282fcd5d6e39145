"""Every python block of the README and of the docs pages runs: a page cannot drift from the
code. Each page runs in a process of its own (a fresh registry: pages register patterns and
backends), its blocks in order in one namespace, in a fresh folder for the files they write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_timeout
from pages import blocks, pages, relative

RUNNER = Path(__file__).with_name("run_snippets.py")
WITH_PYTHON = [page for page in pages() if blocks(page, "python")]


def test_pages_have_snippets_to_run():
    assert len(WITH_PYTHON) >= 8


@pytest.mark.parametrize("page", WITH_PYTHON, ids=relative)
def test_python_blocks_run(page, tmp_path):
    if "transformers" in page.read_text() and not _imports("transformers"):
        pytest.skip("the page uses transformers, which is not installed (pip install -e '.[hf]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(page)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=subprocess_timeout(120),
    )
    assert done.returncode == 0, f"{relative(page)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True
