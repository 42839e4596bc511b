"""The `localrun` command line: one module per command group, errors printed only here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from localrun import __version__
from localrun.errors import LocalrunError

# Each module defines register(subparsers); handlers take the parsed args and return an exit code.
COMMAND_MODULES = ("run", "models", "batch", "serve", "launch", "hub", "convert", "bench", "evaluate", "rerank", "imatrix",
                   "doctor", "tui")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that name the fix."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser (imports only the light command modules)."""
    import importlib

    parser = Parser(
        prog="localrun",
        description="Run language models locally: chat, batch, download, convert.",
    )
    parser.add_argument("--version", action="version", version=f"localrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"localrun.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"localrun.cli.{name}":
                continue  # command group not built yet
            raise
        module.register(sub)
        if hasattr(module, "default"):
            parser.set_defaults(default_func=module.default)  # `localrun` alone runs it
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `localrun` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:  # what follows -- belongs to the program a command runs (launch's agent)
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: -- {' '.join(rest)}")
    args.rest = rest
    handler = getattr(args, "func", None)
    if handler is None:
        # No command: the TUI when it is there, else the help.
        tui = getattr(args, "default_func", None)
        if tui is None:
            parser.print_help()
            return 0
        handler = tui
    try:
        return int(handler(args) or 0)
    except LocalrunError as e:
        if os.environ.get("LOCALRUN_DEBUG"):
            raise
        print(f"localrun: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("localrun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
