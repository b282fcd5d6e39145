"""``zoo`` / ``python -m zoo``: look at the registry from the command line.

zoo list                           the variants, mechanisms and positional encodings as tables
zoo show NAME [--seq-len N] [--causal] [--out FILE.png] [key=value ...]
                                   the variant's allowed pairs as a heatmap
zoo gallery [--seq-len N] [--out FILE.png]
                                   every variant's allowed pairs in one picture
zoo table [--seq-len N] [--layers L]
                                   the seeds' comparison table, computed for every variant
zoo attention-map NAME [--seq-len N] [--out FILE.png] [key=value ...]
                                   one head's weights of a random model with that variant
                                   (python -m eval attention-map draws a trained one)
zoo encoding NAME [--length N] [--dim D] [--out FILE.png]
                                   an absolute encoding's table P and a few of its columns
zoo readme [PATH ...]              fill the generated tables of the README and the docs pages
                                   (run from the repository's root; default: every page that
                                   has one)
zoo check NAME [--lengths N,N,...] [key=value ...] | zoo check --all
                                   check that a pattern's three views agree (exit 1 if not);
                                   NAME: a variant, a pattern family or package.module:factory
                                   (the module imports from the working directory too)

Bad arguments (a length of 0, a word that is not key=value) exit 2 with a message, before any
output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import yaml


def parse_params(items: list[str]) -> dict[str, object]:
    """``key=value`` words as pattern parameters (values read as YAML: 64, [0, 3]); ValueError
    for a word that is not key=value."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"parameter {item!r} must look like key=value (e.g. window_size=64)")
        try:
            params[key] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            message = f"parameter {item!r}: {value!r} is not a YAML value ({error})"
            raise ValueError(message) from None
    return params


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for an int option >= ``minimum``: a bad value exits 2 before the
    command runs, argparse naming the option, e.g. "argument --seq-len: must be a positive int,
    got 0". The eval commands (``python -m eval demo``, ``attention-map``) use it too."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)


def positive_ints(text: str) -> list[int]:
    """``--lengths``: comma-separated ints >= 1, e.g. 37,100."""
    try:
        values = [int(word) for word in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        message = f"must be comma-separated positive ints (e.g. 37,100), got {text!r}"
        raise argparse.ArgumentTypeError(message)
    return values


WITH_PARAMS = ("show", "attention-map", "check")  # commands that take key=value words

# The Python arguments that each command passes itself: a key=value word of the same name gave
# "draw_pattern() got multiple values for argument 'seq_len'", naming no option to use.
_DRAWN = {"name": "NAME argument", "seq_len": "--seq-len option", "path": "--out option"}
OWN_ARGUMENTS = {
    "show": {**_DRAWN, "causal": "--causal flag"},
    "attention-map": _DRAWN,
    "check": {"pattern_or_name": "NAME argument", "lengths": "--lengths option"},
}


def command_params(args: argparse.Namespace) -> dict[str, object]:
    """The command's key=value words as parameters; ValueError for a word that names one of the
    command's own arguments, saying which option sets it."""
    params = parse_params(args.params)
    own = OWN_ARGUMENTS[args.command]
    for key in params:
        if key in own:
            raise ValueError(f"{key} is zoo {args.command}'s {own[key]}, not a key=value parameter")
    return params


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description="The attention zoo's registry.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the variants, mechanisms and encodings as tables")
    show = commands.add_parser("show", help="draw a variant's allowed pairs as a PNG heatmap")
    show.add_argument("name")
    show.add_argument("--seq-len", type=positive_int, default=256)
    show.add_argument("--causal", action="store_true")
    show.add_argument("--out", default=None, help="PNG path (default: NAME.png)")
    gallery = commands.add_parser("gallery", help="every variant's allowed pairs in one PNG")
    gallery.add_argument("--seq-len", type=positive_int, default=256)
    gallery.add_argument("--out", default="variants.png", help="PNG path (default: variants.png)")
    table = commands.add_parser("table", help="the seeds' comparison table for every variant")
    table.add_argument("--seq-len", type=positive_int, default=1024)
    table.add_argument("--layers", type=positive_int, default=2)
    maps = commands.add_parser("attention-map", help="one head's weights of a random model")
    maps.add_argument("name")
    maps.add_argument("--seq-len", type=positive_int, default=128)
    maps.add_argument("--out", default=None, help="PNG path (default: NAME-attention.png)")
    encoding = commands.add_parser("encoding", help="draw a positional encoding's table as PNG")
    encoding.add_argument("name")
    encoding.add_argument("--length", type=positive_int, default=128)
    encoding.add_argument("--dim", type=positive_int, default=64)
    encoding.add_argument("--out", default=None, help="PNG path (default: NAME.png)")
    readme = commands.add_parser(
        "readme", help="fill the generated tables of the README and the docs pages"
    )
    readme.add_argument("paths", nargs="*", help="pages (default: every page with a table)")
    check = commands.add_parser("check", help="check that a pattern's three views agree")
    check.add_argument("name", nargs="?", help="a variant, a family or package.module:factory")
    check.add_argument(
        "--all",
        action="store_true",
        help="check every registry variant with its defaults (graph on an example graph)",
    )
    check.add_argument(
        "--lengths",
        type=positive_ints,
        default=None,
        help="comma-separated, e.g. 100,1000 (default: 37,100,300,600)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # key=value words after the options
    args.params = [word for word in extra if "=" in word]
    if len(args.params) != len(extra) or (extra and args.command not in WITH_PARAMS):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        parse_params(args.params)  # checked here, before any command prints
    except ValueError as error:
        parser.error(str(error))
    try:
        with working_directory_importable():
            failed = run(args)
        sys.stdout.flush()  # a reader that went away shows here, not in a traceback at exit
    except BrokenPipeError:  # `zoo table | head`: stop quietly, as other CLIs do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError) as error:
        print(f"zoo {args.command}: {error}", file=sys.stderr)
        return 2
    return 1 if failed else 0


@contextlib.contextmanager
def working_directory_importable() -> Iterator[None]:
    """``package.module:factory`` names import from the working directory, as under ``python -m
    zoo`` (whose sys.path starts with it) and as the README's ``zoo check my_patterns:...`` needs:
    the ``zoo`` console script's sys.path lacks it. Appended, so an installed module of the same
    name still wins, and taken off again afterwards."""
    cwd = os.getcwd()
    if any(isinstance(p, str) and os.path.abspath(p or ".") == cwd for p in sys.path):
        yield
        return
    sys.path.append(cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread for the duration, restored after. ``zoo check`` works on small
    tensors (at most 600 x 600 per shape), where a second OpenMP thread only adds waiting: on a
    busy 2-core machine ``zoo check --all`` ran several times slower with torch's default of two
    threads than with one (measured: eval/results/design-notes-cpu.md#zoo-check-one-thread)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> bool | None:
    """Run a command; True means it found a problem (exit status 1)."""
    from .views import describe

    if args.command == "list":
        tables = describe.variant_table(), describe.mechanism_table(), describe.encoding_table()
        print(*tables, sep="\n\n")
    elif args.command == "gallery":
        from .views.pictures import draw_gallery

        print(draw_gallery(args.out, args.seq_len))
    elif args.command == "show":
        from .views.pictures import draw_pattern

        out = args.out or f"{args.name}.png"
        params = command_params(args)
        print(draw_pattern(args.name, args.seq_len, out, causal=args.causal, **params))
    elif args.command == "table":
        from .views.comparison import comparison_table

        table = comparison_table(args.seq_len, args.layers)  # a bad length fails before output
        print(f"n = {args.seq_len}, receptive field after {args.layers} layers\n")
        print(table)
    elif args.command == "attention-map":
        from .views.pictures import attention_map_of_random_model

        out = args.out or f"{args.name}-attention.png"
        print(attention_map_of_random_model(args.name, args.seq_len, out, **command_params(args)))
    elif args.command == "encoding":
        from .core.arguments import check_png_path
        from .functional import build_encoding
        from .positional import draw_encoding
        from .registry import get_encoding_spec

        spec = get_encoding_spec(args.name)
        # Checked before drawing, as zoo show does: savefig's own error is a traceback.
        out = check_png_path(args.out or f"{args.name}.png")
        # A table of positions (learned) is built long enough to draw --length positions: the
        # command has no max_len of its own to raise.
        held = spec.parameters().get("max_len")
        longer = {"max_len": args.length} if held is not None and args.length > held else {}
        enc = build_encoding(args.name, dim=args.dim, num_heads=1, **longer)
        print(draw_encoding(enc, args.length, out))
    elif args.command == "readme":
        paths = args.paths or describe.pages_with_tables(".")
        if not paths:  # run outside the repository's root: say so, not exit 0 with nothing done
            raise ValueError(
                f"no README.md or docs/*.md page under {os.getcwd()} has a generated table; "
                "run zoo readme from the repository's root, or name the pages"
            )
        for path, changed in zip(paths, describe.update_pages(paths, "."), strict=True):
            print(f"{path}: {'updated' if changed else 'already up to date'}")
    elif args.command == "check":
        with one_thread():
            return check(args)
    return None


def check(args: argparse.Namespace) -> bool:
    """``zoo check``: one line per pattern, ok on stdout or the first disagreement on stderr.

    ``--all`` checks every registry variant with its defaults at
    ``zoo.testing.pattern_views.LENGTHS`` (37, 100, 300, 600: small, none a multiple of a block
    size, and 600 above moba's default block of 512, so the last blocks are partial), a pattern
    chosen by content on a seeded random input and ``graph`` on an example graph
    (``zoo.testing.routed_views``); seconds on one core
    (measured: eval/results/design-notes-cpu.md#zoo-check-one-thread). Under ``--all``, a
    variant that fits none of the lengths (a 2-D grid at a prime ``--lengths``) is listed as
    skipped, with the reason, and fails nothing unless every variant was skipped; a NAME that
    fits none fails, since nothing was checked."""
    from .registry import list_variants
    from .testing.pattern_views import LENGTHS, NoLengthFits, PatternCheckError, check_pattern

    if args.all == bool(args.name):
        raise ValueError("give a pattern NAME or --all, not both or neither")
    if args.all and args.params:
        raise ValueError("--all checks the variants with their defaults; key=value needs a NAME")
    lengths = LENGTHS if args.lengths is None else args.lengths
    params = command_params(args)
    failed, checked = False, 0
    for name in list_variants() if args.all else [args.name]:
        try:
            shapes = check_pattern(name, lengths=lengths, **params)
        except NoLengthFits as error:  # --all at lengths a variant cannot take: not its fault
            if not args.all:
                print(f"zoo check: {error}", file=sys.stderr)
                failed = True
            else:
                print(f"skipped: {name}: {error}")
        except PatternCheckError as error:
            print(f"zoo check: {error}", file=sys.stderr)
            failed = True
        else:
            print(f"ok: {name}: three views agree at {shapes} shapes")
            checked += 1
    if args.all and not checked and not failed:
        print(f"zoo check: no variant fits the lengths {lengths}", file=sys.stderr)
        failed = True
    return failed


if __name__ == "__main__":
    sys.exit(main())
