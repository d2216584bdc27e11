"""`commpipe <verb>`: one entry point, one small module per verb.

Each verb module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when its verb runs, so `commpipe plan` never imports torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "train": ("commpipe.train.cli", "train a model under a TP x CP x PP x DP layout"),
    "demo": ("commpipe.demo", "train a tiny LLaMA under 8 layouts on an emulated cluster and compare them"),
    "simulate": ("commpipe.sim.cli", "time a pipeline schedule on a cost table"),
    "plan": ("commpipe.plan.cli", "rank every layout for a model on a cluster"),
    "estimate": ("commpipe.plan.cli_estimate", "predict memory and speed of one layout"),
    "probe": ("commpipe.monitor.probe", "measure link bandwidth and latency before training"),
    "sweep": ("commpipe.cluster.sweep", "train a grid of layouts and collect the results"),
    "report": ("commpipe.report.cli", "tables, figures and report.html from a sweep folder"),
    "cluster": ("commpipe.cluster.cli", "build or tear down an emulated multi-node cluster"),
    "tokenize": ("commpipe.data.cli", "train a tokenizer and cache a corpus as token files"),
    "convert": ("commpipe.convert", "Hugging Face checkpoints to commpipe's and back"),
}


def build_parser(verbs: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    parser.verb_parsers = sub.choices   # verb -> its parser (a --config file sets its defaults)
    for verb, (module, help_text) in (verbs or VERBS).items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("commpipe"):
                raise
            p.set_defaults(_missing=str(e))
        show_defaults(p)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option with a default says it in --help, unless its help text already does."""
    for action in parser._actions:
        if (action.option_strings and action.help is not argparse.SUPPRESS
                and not any(action.default is x for x in (None, False, argparse.SUPPRESS))
                and "default" not in (action.help or "")):
            action.help = ((action.help or "").rstrip() + " (default: %(default)s)").lstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # build only the parser of the verb asked for: fast --help and no heavy imports
    verbs = VERBS if not argv or argv[0] not in VERBS else {argv[0]: VERBS[argv[0]]}
    parser = build_parser(verbs)
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        parser.error(f"{args.verb} is not available in this build ({args._missing})")
    try:
        if getattr(args, "config", None):   # a job config file: the verb's defaults, flags win
            from commpipe.train.jobconfig import parse_known_args

            args, _ = parse_known_args(parser, argv, parser.verb_parsers[args.verb])
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # under torchrun every rank meets the same bad input: one of them reports it
        from commpipe.errors import report_shared

        report_shared(f"commpipe {args.verb}: error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
