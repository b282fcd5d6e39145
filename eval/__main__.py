"""``python -m eval COMMAND``: the harness's commands."""

from __future__ import annotations

import sys

COMMANDS = {"demo": "eval.demo"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m eval {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
