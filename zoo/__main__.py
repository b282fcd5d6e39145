"""``zoo`` / ``python -m zoo``: look at the registry from the command line.

zoo list            the variants as a markdown table (the README's table is this output)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zoo", description="The attention zoo's registry.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print the registry as a markdown table")
    readme = commands.add_parser("readme", help="write the variant table into a README")
    readme.add_argument("path", nargs="?", default="README.md")
    args = parser.parse_args(argv)
    from . import describe

    if args.command == "list":
        print(describe.variant_table())
    elif args.command == "readme":
        changed = describe.update_readme(args.path)
        print(f"{args.path}: {'updated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
