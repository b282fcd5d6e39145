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
    encoding = commands.add_parser("encoding", help="draw a positional encoding's table as PNG")
    encoding.add_argument("name")
    encoding.add_argument("--length", type=int, default=128)
    encoding.add_argument("--dim", type=int, default=64)
    encoding.add_argument("--out", default=None, help="PNG path (default: NAME.png)")
    args = parser.parse_args(argv)
    from . import describe

    if args.command == "list":
        print(describe.variant_table(), describe.encoding_table(), sep="\n\n")
    elif args.command == "readme":
        changed = describe.update_readme(args.path)
        print(f"{args.path}: {'updated' if changed else 'already up to date'}")
    elif args.command == "encoding":
        from .functional import build_encoding
        from .positional import draw_encoding

        enc = build_encoding(args.name, dim=args.dim, num_heads=1)
        print(draw_encoding(enc, args.length, args.out or f"{args.name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
