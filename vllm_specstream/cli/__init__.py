"""The ``specstream`` command: one module per subcommand, each with ``add_parser(sub)``.

Each subcommand imports what it needs only when it runs, so ``specstream --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from vllm_specstream import SUPPORTED_VLLM, __version__
from vllm_specstream.cli import (
    bench,
    data,
    deploy,
    doctor,
    draft_vocab,
    evaluate,
    export,
    install_vllm_cli,
    prepare_base,
    train,
)

_DESCRIPTION = f"""\
vllm-specstream {__version__}: Speculative Streaming (arXiv 2402.11131) for vLLM {SUPPORTED_VLLM}.

Serve a specstream checkpoint with vLLM itself (`vllm serve CKPT ...` or `LLM(model=CKPT)`);
this command trains and exports checkpoints, evaluates and benchmarks them, and prepares the
environment around vLLM.
"""

#: The subcommands in the order ``--help`` lists them.
COMMANDS = (
    prepare_base,
    install_vllm_cli,
    train,
    export,
    draft_vocab,
    deploy,
    evaluate,
    bench,
    data,
    doctor,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstream",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vllm-specstream {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error in a file, field or flag, show the traceback too (default: one line)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from vllm_specstream.logger import configure_cli_logging

    configure_cli_logging()
    from vllm_specstream.checkpoint.config import ConfigError

    try:
        return func(args)
    except ConfigError as e:
        # A bad file, field or flag: the message names it and the fix; no traceback.
        if args.debug:
            raise
        print(f"specstream {args.command}: error: {e}", file=sys.stderr)
        return 2
