"""vLLM 0.28.0's own command-line parsers, for tests that check an argv of ours the way vLLM reads it.

Both methods take a whole command line (`vllm serve ...`, `python -m vllm.entrypoints.cli.main serve ...`)
or just what follows the subcommand's launcher (`serve MODEL ...`; for bench, the flags alone).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def after_launcher(argv: Sequence[str]) -> list[str]:
    """argv without the program that runs the vllm CLI."""
    argv = list(argv)
    if argv[:1] == ["vllm"]:
        return argv[1:]
    if argv[1:3] == ["-m", "vllm.entrypoints.cli.main"]:  # after a python executable
        return argv[3:]
    return argv


class VllmCli:
    def __init__(self) -> None:
        from vllm.benchmarks import serve as bench_serve
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self._serve_command = ServeSubcommand()
        self.serve_parser = FlexibleArgumentParser(prog="vllm")
        self._serve_command.subparser_init(self.serve_parser.add_subparsers(dest="subparser"))
        self.bench_serve_parser = FlexibleArgumentParser(prog="vllm bench serve")
        bench_serve.add_cli_args(self.bench_serve_parser)

    def serve(self, argv: Sequence[str]):
        """Parse and validate like `vllm serve` does; returns (namespace, EngineArgs)."""
        from vllm.engine.arg_utils import EngineArgs

        args = after_launcher(argv)
        assert args[:1] == ["serve"], f"not a vllm serve command line: {list(argv)}"
        ns = self.serve_parser.parse_args(args)
        if ns.model_tag is not None:
            ns.model = ns.model_tag  # what ServeSubcommand.cmd does before it starts the server
        self._serve_command.validate(ns)
        return ns, EngineArgs.from_cli_args(ns)

    def bench_serve(self, argv: Sequence[str]) -> argparse.Namespace:
        """Parse like `vllm bench serve` does."""
        args = after_launcher(argv)
        if args[:2] == ["bench", "serve"]:
            args = args[2:]
        return self.bench_serve_parser.parse_args(args)
