"""The `tfmixprec` console script (`main`), outside the package.

It parses the arguments with `_tfmixprec_args.build_parser` before anything imports
TensorFlow, so `tfmixprec --help` and usage errors answer in about 0.05 s; then it starts
TensorFlow with its start-up log lines silenced and runs the subcommand from
`tfmixprec.tools.cli`, which owns the subcommands and their exit codes. The imports run one
way: this module reads `_tfmixprec_args` and `tfmixprec.tools.cli`; `tfmixprec.tools.cli`
reads `_tfmixprec_args`; none reads this module.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from _tfmixprec_args import build_parser, start_tensorflow

__all__ = ["main", "run"]


def run(argv: Sequence[str] | None = None) -> int:
    """Runs the `tfmixprec` command in this process and returns its exit code; a usage error
    raises `SystemExit(2)` before TensorFlow is imported."""
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and usage errors end here, quickly
    if args.command is None:  # bare `tfmixprec`: what it can do, not a usage error
        parser.print_help()
        return 0
    start_tensorflow()
    from tfmixprec.tools import cli

    return cli.run_parsed(args)


def _format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    return f"tfmixprec: {category.__name__}: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: `run`, with Python warnings shown as one line each, without the
    file and line inside tfmixprec they were raised from."""
    warnings.formatwarning = _format_warning
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
