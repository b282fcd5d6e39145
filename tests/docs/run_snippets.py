"""Run one page's python blocks, in order, in one namespace: ``python run_snippets.py PAGE``,
from the folder the blocks may write files into (the test gives each page a fresh one).

A block whose first line is ``# NAME.py`` is a file the page asks the reader to save: it is
written as NAME.py and imported as a module (so its registrations run). A block whose first line
is ``# torchrun ... NAME.py`` is a script for several processes: it is written and run with that
command, as ``python -m torch.distributed.run ...`` (give it ``--standalone``: a rendezvous on the
loopback at a free port). Every other block runs in the
page's namespace; a failure names the page and the line."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pages import ROOT, blocks

FILE = re.compile(r"# (?P<name>\w+)\.py\s*$")
LAUNCH = re.compile(r"# torchrun (?P<args>[^\n]*?)(?P<name>\w+)\.py\s*$")


def main(page: Path) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__snippets__"}
    for block in blocks(page, "python"):
        first = block.code.splitlines()[0] if block.code else ""
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if launch := LAUNCH.match(first):
            Path(f"{launch['name']}.py").write_text(block.code)
            args = launch["args"].split()
            command = [sys.executable, "-m", "torch.distributed.run", *args]
            script = f"{launch['name']}.py"
            done = subprocess.run([*command, script], capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{where}: {' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        elif file := FILE.match(first):
            Path(f"{file['name']}.py").write_text(block.code)
            importlib.import_module(file["name"])
        else:
            exec(compile(block.code, where, "exec", dont_inherit=True), namespace)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
