"""The `tandem` command line.

Each top-level command is added by its own `add_*_command(subparsers)` function that registers
a handler with `set_defaults(handler=...)`; `main` only parses and dispatches. A new command
(`generate`, `bench`, `serve`) is one more `add_*_command` plus its handler.
"""

import argparse
import sys
from collections.abc import Sequence

from cluster import environment
from cluster.cli.draft_head import add_draft_head_command
from cluster.cli.generate import add_generate_command
from cluster.cli.serve import add_serve_command
from workers import catalog


def add_models_command(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="list, pull and locate catalog models")
    actions = models.add_subparsers(dest="models_action", required=True)

    actions.add_parser("list", help="show the catalog").set_defaults(handler=models_list)

    pull = actions.add_parser("pull", help="download and convert a model into the cache")
    pull.add_argument("name", help="catalog name (see `tandem models list`)")
    pull.set_defaults(handler=models_pull)

    path = actions.add_parser("path", help="print a model's folder, pulling it first if needed")
    path.add_argument("name", help="catalog name (see `tandem models list`)")
    path.set_defaults(handler=models_path)


def models_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "ARCHITECTURE", "PARAMS", "GGUF", "PULLED")]
    for entry in catalog.list_models():
        pulled = "yes" if catalog.is_pulled(entry.name, environment.cache_dir()) else "no"
        default = " (default)" if entry.name == catalog.DEFAULT_MODEL else ""
        rows.append((entry.name + default, entry.architecture, entry.num_params,
                     entry.quantization, pulled))  # fmt: skip
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    return 0


def models_pull(args: argparse.Namespace) -> int:
    was_pulled = catalog.is_pulled(args.name, environment.cache_dir())
    folder = catalog.pull(args.name, environment.cache_dir())
    print(f"{args.name}: {'already pulled' if was_pulled else 'pulled'} at {folder}")
    return 0


def models_path(args: argparse.Namespace) -> int:
    print(catalog.model_path(args.name, environment.cache_dir()))
    return 0


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    from cluster.bench.args import add_bench_parsers  # torch and transformers: only when run

    add_bench_parsers(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem LLM serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_models_command(subparsers)
    add_bench_command(subparsers)
    add_generate_command(subparsers)
    add_serve_command(subparsers)
    add_draft_head_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    # Unknown model names and bad downloads are the user's to fix: a message, not a traceback.
    except (ValueError, catalog.ChecksumError) as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
