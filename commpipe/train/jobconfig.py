"""Job config files: `commpipe train --config job.toml`, or a run folder's config.json.

    [model]
    model = "tiny"             # or preset = "tiny"
    precision = "fp32"
    [parallelism]
    tp = 2
    pp = 2
    [schedule]
    schedule = "1f1b"
    microbatches = 4
    [training]
    steps = 100
    seq-len = 128              # the flag's name; seq_len works too
    [monitor]
    comm-monitor = "sample=0.1"
    tensorboard = true
    [job]
    out = "runs/job"
    [adapt]
    adapt = true
    min-steps = 5              # --adapt-min-steps (the prefix may be dropped here)

    torchrun --nproc-per-node 4 -m commpipe train --config job.toml --steps 20  # flags win

Keys are `commpipe train` flags, each in one section (SECTIONS). The file only sets the train
parser's defaults (`parser.set_defaults`) before the command line is parsed, so every flag
given explicitly wins and the file's values go through the same validation as flags. A
config.json that a run wrote into its folder loads the same way: its fields map back to the
flags that set them (`--config runs/x/config.json --out runs/y` repeats run x). Every rank of a
torchrun job reads the same file before any process group starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path

# section -> the train parser's destinations it holds (tests/test_jobconfig.py checks that
# every flag of `commpipe train` is in exactly one section)
SECTIONS = {
    "model": ("model", "precision", "recompute"),
    "parallelism": ("tp", "cp", "pp", "dp", "ep", "rank_order", "stage_layers", "zero1",
                    "sequence_parallel", "overlap", "tp_forward_overlap", "dp_bucket_mb"),
    "schedule": ("schedule", "vpp", "microbatches", "dp_microbatches", "strict_order"),
    "training": ("steps", "seq_len", "micro_batch_size", "global_batch", "seed", "lr", "min_lr",
                 "warmup", "clip"),
    "data": ("data", "tokenizer", "vocab_size", "eval_every", "eval_batches"),
    "checkpoint": ("save_every", "resume", "init_from", "fail_at"),
    "monitor": ("comm_monitor", "trace", "tensorboard", "log_every"),
    "job": ("out", "overwrite", "device", "emulate_device", "timeout_s", "hang_timeout_s", "elastic",
            "peer_copy_every"),
    "adapt": ("adapt", "adapt_min_steps", "adapt_min_shift", "adapt_horizon", "adapt_margin",
              "adapt_trials", "adapt_switch_cost", "adapt_resplit_only", "adapt_relaunch",
              "slow_rank"),
}


def parse_known_args(parser: argparse.ArgumentParser, argv: list[str], owner=None):
    """`parser.parse_known_args(argv)`, with a `--config FILE` among argv setting the defaults
    of `owner` (the parser holding the train flags; default `parser`) first."""
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "config", None):
        (owner or parser).set_defaults(**load_defaults(args.config, owner or parser))
        args, rest = parser.parse_known_args(argv)
    return args, rest


def load_defaults(path, parser: argparse.ArgumentParser) -> dict:
    """{parser destination: value} from a job TOML file or a run's config.json. Raises
    ValueError naming the file, section and key, or FileNotFoundError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    flags = _flag_table(parser)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: malformed JSON ({e})") from None
        out = {}
        for dest, (field, value) in _from_run_config(data, path).items():
            if dest not in flags:
                raise ValueError(f"{path}: {field} is not a flag of this commpipe train")
            out[dest] = _convert(flags[dest], value, f"{path}: {field}", False)
        return out
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: malformed TOML ({e})") from None
    keys = {section: _keys(section, flags) for section in SECTIONS}
    out: dict = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            home = _home(section, keys)
            where = f"under [{home}]" if home else "in a section"
            raise ValueError(f"{path}: {section} = {table!r} is outside any section; put it "
                             f"{where} ([{'], ['.join(SECTIONS)}])")
        if section not in SECTIONS:
            raise ValueError(f"{path}: unknown section [{section}]"
                             f"{_closest(section, SECTIONS, '[', ']')}")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in keys[section]:
                home = _home(key, keys)
                hint = f"; {key} belongs in [{home}]" if home and home != section else \
                    _closest(name, keys[section])
                raise ValueError(f"{path}: [{section}] {key}: unknown key{hint}")
            dest, negate = keys[section][name]
            if dest in out:
                raise ValueError(f"{path}: [{section}] {key} sets {dest} a second time")
            value = _convert(flags[dest], value, f"{path}: [{section}] {key}", negate)
            out[dest] = value
    return out


# -- the train parser's flags ------------------------------------------------------------------
def _flag_table(parser) -> dict:
    """{destination: action} of every flag that a config file may set."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config")}


def _keys(section: str, flags: dict) -> dict:
    """{key (underscores): (destination, negate)} of one section: each destination's own name
    and its flags' names (`no-overlap = true` sets overlap to false); in [adapt] the `adapt-`
    prefix may be dropped."""
    out = {}
    for dest in SECTIONS[section]:
        action = flags.get(dest)
        if action is None:
            continue
        out[dest] = (dest, False)
        for opt in action.option_strings:
            name = opt.lstrip("-").replace("-", "_")
            out[name] = (dest, name != dest and name.startswith("no_") and _is_switch(action))
    if section == "adapt":
        out.update({k.removeprefix("adapt_"): v for k, v in list(out.items())
                    if k.startswith("adapt_")})
    return out


def _home(key: str, keys: dict) -> str | None:
    name = key.replace("-", "_")
    return next((s for s, k in keys.items() if name in k), None)


def _closest(name: str, names, left: str = "", right: str = "") -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f"; did you mean {left}{close[0].replace('_', '-')}{right}?" if close else \
        f"; valid: {', '.join(left + n.replace('_', '-') + right for n in sorted(names))}"


def _is_switch(action) -> bool:
    return action.nargs == 0


def _convert(action, value, where: str, negate: bool):
    """A file value as the flag's parsed value, type-checked like the command line would be."""
    if value is None:        # config.json: a flag left at no value
        return None
    if _is_switch(action):   # store_true / store_false / --x/--no-x
        if not isinstance(value, bool):
            raise ValueError(f"{where} = {value!r}: expected true or false")
        return not value if negate else value
    if action.nargs == "?":  # --resume [PATH]: true is the flag alone
        if isinstance(value, bool):
            return action.const if value else None
    if action.dest == "stage_layers" and isinstance(value, list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{where} = {value!r}: expected layer counts like [3, 3, 2]")
        return ",".join(str(v) for v in value)
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} = {value!r}: expected an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} = {value!r}: expected a number")
        value = float(value)
    elif not isinstance(value, str):
        raise ValueError(f"{where} = {value!r}: expected a string")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} = {value!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


# -- a run folder's config.json -----------------------------------------------------------------
# TrainConfig fields that are the flag of the same name
SAME = ("model", "ep", "schedule", "vpp", "micro_batch_size", "global_batch", "seq_len", "steps",
        "seed", "data", "tokenizer", "vocab_size", "eval_every", "eval_batches", "save_every",
        "init_from",
        "resume", "overwrite", "timeout_s", "out", "trace", "log_every", "device", "precision",
        "strict_order", "recompute", "sequence_parallel", "overlap", "dp_bucket_mb",
        "tp_forward_overlap", "tensorboard", "hang_timeout_s", "elastic", "peer_copy_every",
        "emulate_device")
# derived when the config resolves (the model's shape, the vocabulary of --data, the balanced
# split's costs) or fixed without a flag (AdamW's decay, betas, eps): not read back.
# microbatches: the global batch is kept and the micro-batch count follows from it, so that
# `--dp` or `--micro-batch-size` on the command line can change it
DERIVED = ("spec", "vocab", "stage_balance", "microbatches")
OPTIM = {"lr": "lr", "min_lr": "min_lr", "warmup_steps": "warmup", "clip": "clip", "zero1": "zero1"}
ADAPT = {"min_steps": "adapt_min_steps", "min_shift": "adapt_min_shift", "horizon": "adapt_horizon",
         "margin": "adapt_margin", "trials": "adapt_trials", "switch_cost_s": "adapt_switch_cost",
         "relaunch": "adapt_relaunch"}


def _from_run_config(data: dict, path) -> dict:
    """{destination: (field, value)} from TrainConfig.to_dict()'s JSON."""
    if not isinstance(data, dict) or "dims" not in data:
        raise ValueError(f"{path}: not a commpipe run's config.json (no dims); give a job TOML "
                         "file or the config.json of a run folder")
    out = {}
    for field, value in data.items():
        if field in SAME:
            out[field] = (field, value)
        elif field == "dims":
            out.update({d: (f"dims.{d}", value[d]) for d in ("tp", "cp", "pp", "dp")})
            if "order" in value:
                out["rank_order"] = ("dims.order", value["order"])
        elif field == "optim":
            out.update({flag: (f"optim.{k}", value[k]) for k, flag in OPTIM.items() if k in value})
        elif field == "monitor":
            text = "off" if value is None else "all" if value == 1.0 else f"sample={value}"
            out["comm_monitor"] = (field, text)
        elif field == "fail_at":
            out["fail_at"] = (field, None if value is None else f"{value[0]}:{value[1]}")
        elif field == "slow_rank":
            out["slow_rank"] = (field, None if value is None else
                                f"{value['rank']}:{value['factor']}@{value['step']}")
        elif field == "dp_microbatches":
            out[field] = (field, None if value is None else ",".join(str(v) for v in value))
        elif field == "stage_layers":
            balance = data.get("stage_balance")
            if balance:   # --stage-layers auto: balance again (the same costs give the same split)
                value = "auto:measured" if balance.get("wanted") == "measured" else "auto"
            elif isinstance(value, list):
                value = ",".join(str(v) for v in value)
            out["stage_layers"] = (field, value)
        elif field == "adapt":
            out["adapt"] = (field, value is not None)
            if value is not None:
                out.update({flag: (f"adapt.{k}", value[k]) for k, flag in ADAPT.items() if k in value})
                out["adapt_resplit_only"] = ("adapt.layouts", not value.get("layouts", True))
        elif field not in DERIVED:
            raise ValueError(f"{path}: unknown field {field}{_closest(field, SAME)}")
    return out
