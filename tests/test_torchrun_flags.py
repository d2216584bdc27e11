"""Every `commpipe train` option survives torchrun's own argument parser.

torchrun's parser accepts unambiguous abbreviations of its options and reads them even after
the script name, so a `commpipe train` flag that is a prefix of a torchrun option (the old
`--monitor`, of `--monitor-interval`) is taken by torchrun, or rejected as ambiguous, and never
reaches commpipe. The check runs each long option through `torch.distributed.run`'s parser as
`torchrun --nproc-per-node 2 -m commpipe train OPTION [VALUE]`, with no `--` in between.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from torch.distributed.run import get_args_parser

from commpipe.train.cli import add_arguments


def train_options() -> list[tuple[str, bool]]:
    """(long option, takes a value) for every option of `commpipe train`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                out.append((opt, action.nargs != 0))
    return out


def reaches_commpipe(option: str, takes_value: bool) -> bool:
    tail = ["train", option] + (["1"] if takes_value else [])
    argv = ["--nproc-per-node", "2", "-m", "commpipe", *tail]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except SystemExit:          # argparse: "ambiguous option" and the like
        return False
    return args.training_script == "commpipe" and args.training_script_args == tail


OPTIONS = train_options()


def test_the_options_are_all_there():
    names = {opt for opt, _ in OPTIONS}
    assert {"--tp", "--pp", "--comm-monitor", "--trace", "--out", "--resume"} <= names
    assert len(OPTIONS) > 30


@pytest.mark.parametrize("option,takes_value", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_option_survives_torchrun(option, takes_value):
    assert reaches_commpipe(option, takes_value), (
        f"torchrun's parser takes `{option}` for one of its own options; rename it in "
        "commpipe/train/cli.py so that it is no prefix of a torchrun option")


def test_the_check_catches_a_swallowed_flag():
    # the flag commpipe used to have: an abbreviation of torchrun's --monitor-interval
    assert not reaches_commpipe("--monitor", True)
    assert not reaches_commpipe("--nproc", True)
