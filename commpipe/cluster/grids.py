"""Layout grids for `commpipe sweep`: a TOML file or a named preset.

A grid file has one `[[layout]]` table per layout and an optional `[train]` table of training
flags every layout shares (command-line flags override it); its `config` names a job config
file (`commpipe train --config`, relative to the grid file) that the [train] keys override:

    [train]
    config = "job.toml"
    preset = "tiny"
    seq_len = 64
    steps = 10

    [[layout]]
    tp = 2
    pp = 4                      # missing degrees default to 1
    schedule = "1f1b"           # optional: schedule (gpipe, 1f1b, interleaved, zbh1, zbv, stp,
                                # dualpipev or a .csv), vpp, microbatches, name, placement

    [[layout]]
    name = "tp2-across-pp4"
    tp = 2
    pp = 4
    placement = "cp-dp-pp-tp"   # fill nodes with TP outermost: TP partners land on different nodes

`placement` is the order (innermost first, as Megatron-LM's --rank-order) in which ranks fill
the nodes; the default "tp-cp-dp-pp" is commpipe's rank grid itself (TP partners share a node).
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from commpipe.files import read_text
from commpipe.layout import DEFAULT_ORDER, Layout, node_of_rank, parse_order
from commpipe.schedules.registry import SCHEDULES

__all__ = ["DEFAULT_ORDER", "LAYOUT_KEYS", "Layout", "Grid", "load_grid", "layouts_from_dicts",
           "node_of_rank", "parse_order", "PRESETS", "STUDY_LAYOUTS", "DEMO_MODEL", "study", "demo8"]

LAYOUT_KEYS = {"name", "tp", "cp", "pp", "dp", "schedule", "vpp", "microbatches", "placement"}


def _int(value, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key} = {value!r} must be an integer")
    return value


def layouts_from_dicts(entries: list[dict], where: str = "grid") -> list[Layout]:
    layouts, names = [], set()
    for i, entry in enumerate(entries):
        at = f"{where} layout #{i + 1}"
        extra = _renamed({k: v for k, v in entry.items() if k not in LAYOUT_KEYS})
        kwargs = {}
        for key in ("tp", "cp", "pp", "dp", "vpp", "microbatches"):
            if key in entry:
                kwargs[key] = _int(entry[key], key, at)
        for key in ("schedule", "placement", "name"):
            if key in entry:
                kwargs[key] = str(entry[key])
        sched = kwargs.get("schedule", "")
        if sched and not sched.endswith(".csv") and sched not in SCHEDULES:
            raise ValueError(f"{at}: unknown schedule {sched!r}; use one of {', '.join(SCHEDULES)} "
                             "or a schedule .csv")
        try:
            layout = Layout(**kwargs, extra=extra)
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
        if layout.name in names:
            raise ValueError(f"{at}: two layouts are named {layout.name!r}; give each a unique name")
        names.add(layout.name)
        layouts.append(layout)
    if not layouts:
        raise ValueError(f"{where} has no [[layout]] tables; add at least one")
    return layouts


@dataclass
class Grid:
    layouts: list[Layout]
    train: dict = field(default_factory=dict)       # shared training flags (name -> value)
    source: str = ""


def load_grid(text_or_path: str) -> Grid:
    """A preset name (see PRESETS) or a TOML file path."""
    if text_or_path in PRESETS:
        return PRESETS[text_or_path]()
    path = Path(text_or_path)
    if not path.exists():
        raise FileNotFoundError(f"grid {text_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                                "nor an existing TOML file")
    try:
        data = tomllib.loads(read_text(path, "grid"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: malformed TOML ({e})") from None
    unknown = set(data) - {"layout", "train"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; use [[layout]] and [train]")
    if not isinstance(data.get("train", {}), dict) or not isinstance(data.get("layout", []), list):
        raise ValueError(f"{path}: write [train] as one table and each layout as a [[layout]] "
                         "table")
    entries = [_config_path(dict(e), path, f"{path} layout #{i + 1}")
               for i, e in enumerate(data.get("layout", []))]
    return Grid(layouts_from_dicts(entries, str(path)),
                _config_path(_renamed(dict(data.get("train", {}))), path, f"{path} [train]"),
                str(path))


def _config_path(flags: dict, grid_path: Path, where: str) -> dict:
    """`config = "job.toml"` (a `commpipe train --config` file, in [train] or in one layout)
    names a file relative to the grid file; it becomes an absolute path, checked now."""
    if "config" not in flags:
        return flags
    value = flags["config"]
    if not isinstance(value, str):
        raise ValueError(f"{where}: config = {value!r} must be the path of a job TOML file or "
                         "a run's config.json")
    config = (grid_path.parent / value).resolve()
    if not config.is_file():
        raise ValueError(f"{where}: config = {value!r}: no such file {config}")
    job_file_flags(config)          # a wrong key fails here, naming file, section and key
    return {**flags, "config": str(config)}


def _train_parser() -> argparse.ArgumentParser | None:
    """`commpipe train`'s argument parser; None in a build without the trainer (the layouts'
    runs will say)."""
    try:
        from commpipe.train import cli as train_cli
    except ModuleNotFoundError:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    train_cli.add_arguments(parser)
    return parser


def job_file_flags(path) -> dict | None:
    """The flags a `commpipe train --config` file sets ({destination: value}), read as train
    reads them (commpipe.train.jobconfig.load_defaults, which fails on a wrong key); None in a
    build without the trainer."""
    parser = _train_parser()
    if parser is None:
        return None
    from commpipe.train.jobconfig import load_defaults

    return load_defaults(path, parser)


def check_train_values(flags: dict, where: str) -> None:
    """Each value must read as its `commpipe train` flag does (`steps = "two"` is refused here,
    naming the file and key, not by the first layout's launch), and a key that is no flag of
    `commpipe train` is refused with the closest ones."""
    import difflib

    parser = _train_parser()
    if parser is None:
        return
    by_key = {opt.lstrip("-").replace("-", "_"): a for a in parser._actions
              for opt in a.option_strings}
    for key, value in flags.items():
        action = by_key.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(by_key) + sorted(LAYOUT_KEYS), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else \
                "; the keys are commpipe train's flags without their dashes (commpipe train --help)"
            raise ValueError(f"{where}: {key} is not a flag of commpipe train{hint}")
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if action.nargs == 0:          # an on/off flag
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} = {value!r}: expected true or false "
                                 f"(the {flag} switch of commpipe train)")
            continue
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: {key} = {value!r}: expected one value for {flag}")
        kind = {int: "an integer", float: "a number"}.get(action.type)
        if kind is not None:
            if isinstance(value, bool) or (action.type is int and isinstance(value, float)):
                raise ValueError(f"{where}: {key} = {value!r}: expected {kind} ({flag})")
            try:
                action.type(str(value))
            except ValueError:
                raise ValueError(f"{where}: {key} = {value!r}: expected {kind} ({flag})") from None
        if action.choices and str(value) not in action.choices:
            raise ValueError(f"{where}: {key} = {value!r}: expected one of "
                             f"{', '.join(map(str, action.choices))} ({flag})")


def shared_global_batch(layouts: list[Layout], train: dict) -> int | None:
    """The global batch every layout trains when the grid leaves it to each one, or None when
    it is set (global_batch or microbatches in [train], its config file or any layout). Left to
    itself, `commpipe train` takes 2*pp micro-batches per pipeline (at least 2) of
    micro_batch_size on each of dp replicas, so layouts would train batches of different sizes
    and their step times and losses would not compare. The shared batch is the smallest common
    multiple of every layout's micro_batch_size x dp that is at least the largest batch a
    layout would pick alone."""
    import math

    keys = ("global_batch", "microbatches")
    if any(train.get(k) is not None for k in keys) or any(
            lay.microbatches is not None or any(k in lay.extra for k in keys + ("config",))
            for lay in layouts):
        return None
    if train.get("config"):
        set_there = job_file_flags(train["config"])
        if set_there is None or any(set_there.get(k) is not None for k in keys):
            return None
    step, largest = 1, 1
    for lay in layouts:
        per_replica = int(lay.extra.get("micro_batch_size", train.get("micro_batch_size") or 1))
        unit = per_replica * lay.dp
        step = math.lcm(step, unit)
        largest = max(largest, max(2 * lay.pp, 2) * unit)
    return -(-largest // step) * step


# training keys of older grid files -> the `commpipe train` flag each became
RENAMED_TRAIN_KEYS = {"monitor": "comm_monitor"}


def _renamed(flags: dict) -> dict:
    return {RENAMED_TRAIN_KEYS.get(k, k): v for k, v in flags.items()}


# -- presets ----------------------------------------------------------------------------------
# The study's grid (9 layouts swept with Megatron-LM on NERSC Perlmutter): 16 GPUs, 4 nodes x 4.
STUDY_LAYOUTS = [(4, 1, 4, 1), (2, 2, 4, 1), (1, 4, 4, 1), (1, 1, 8, 2), (1, 2, 8, 1),
                 (2, 1, 8, 1), (4, 1, 2, 2), (2, 2, 2, 2), (1, 1, 16, 1)]   # (tp, cp, pp, dp)


def study() -> Grid:
    """The 9 layouts of the Perlmutter study (16 ranks; 4 nodes x 4 GPUs), LLaMA-8B-32k shape."""
    layouts = [Layout(tp=tp, cp=cp, pp=pp, dp=dp) for tp, cp, pp, dp in STUDY_LAYOUTS]
    return Grid(layouts, {"model": "llama-8b-32k", "seq_len": 8192, "micro_batch_size": 1}, "study")


# demo8 runs on 8 ranks (an emulated 4 nodes x 2 ranks) with a tiny 8-layer model, so that PP8
# is possible; each layout is the study's counterpart at half the scale.
DEMO_MODEL = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"


def demo8() -> Grid:
    layouts = [
        Layout(tp=2, pp=4, name="tp2-pp4"),                     # TP inside a node (study best TP4/PP4)
        Layout(tp=2, pp=4, placement="cp-dp-pp-tp", name="tp2x-pp4"),   # same, TP across nodes
        Layout(tp=2, cp=2, pp=2, name="tp2-cp2-pp2"),           # TP2/CP2/PP4 counterpart
        Layout(cp=2, pp=4, name="cp2-pp4"),                     # TP1/CP4/PP4 counterpart
        Layout(pp=4, dp=2, name="pp4-dp2"),                     # TP1/CP1/PP8/DP2 counterpart
        Layout(tp=2, pp=2, dp=2, name="tp2-pp2-dp2"),           # TP4/CP1/PP2/DP2 counterpart
        Layout(pp=2, dp=4, name="pp2-dp4"),                     # shallow pipeline, DP heavy
        Layout(pp=8, name="pp8"),                               # pure PP (study worst, PP16)
    ]
    return Grid(layouts, {"model": DEMO_MODEL, "seq_len": 32, "global_batch": 8, "steps": 10}, "demo8")


PRESETS = {"study": study, "demo8": demo8}
