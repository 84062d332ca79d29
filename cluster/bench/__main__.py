"""`python -m cluster.bench ...` = `tandem bench ...`, without the rest of the CLI's imports
(the serving commands need pydantic, which a bare GPU machine may lack)."""

import argparse
import sys

from cluster.bench.args import add_bench_parsers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parsers(subparsers)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
