"""Calibration: fit the efficiency curve and link bandwidths to measured step times.

    commpipe plan --calibrate DIR --gpu a100-80gb --gpus-per-node 8 --profile prof.json
    commpipe plan --model llama3-70b --gpus 512 ... --profile prof.json

DIR may hold (any mix; DIR may also be a single file):
  - run folders DIR/*/config.json + metrics.jsonl (what `commpipe train --out` and `commpipe
    sweep` write): the median step_time_s after the first two steps is the measurement, priced
    as commpipe's runtime communicates with the features the run recorded (`run_features`,
    `layout.runtime_job`), on the nodes the sweep placed its ranks (`placement` in
    DIR/sweep.jsonl, when present);
  - `commpipe probe` JSON files: their link numbers are taken as measured, not fitted;
  - CSV files with one measured run per row, either vTrain's columns (ground_truth_multi.csv)
    or commpipe's names (model or layers/hidden/heads[/kv_heads/ffn_hidden/vocab], tp, cp, pp,
    dp, micro_batch_size, global_batch, seq_len, step_time_s or iter_time_ms [, schedule, vpp,
    recompute]).
Settings a source does not state (recompute, sequence parallelism, flash attention, DP overlap)
come from the command-line flags.

Fit: scipy.optimize.least_squares (trust-region reflective, e_max <= 1 as a bound) on
r_j = log(predicted_j / measured_j) over the parameters
e_max, ai_half_ridge, elementwise, overhead_s (efficiency.Efficiency; `fit(params=...)` picks any
Efficiency fields, e.g. the host terms) and, when no probe gave them and the runs use such
groups, the intra- and inter-node bandwidths; all in log space, with a weak pull (weight 0.01
per e-fold) toward the starting values so that a parameter the data cannot see stays where the
datasheets put it. Reported: mean absolute percentage error before and after.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from commpipe.models.spec import ModelSpec, parse_model_fields, resolve_model
from commpipe.plan.cluster import Cluster, Link, apply_probe, read_json
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import step_time
from commpipe.plan.layout import SCHEDULES, Job, Layout, runtime_job
from commpipe.runtime.features import Overlap, RuntimeFeatures

EFF_PARAMS = ("e_max", "ai_half_ridge", "elementwise", "overhead_s")
LINK_PARAMS = ("intra_gbps", "inter_gbps")
# the order parameters are given up in when the runs cannot support them all: the compute
# ceiling first, then fixed costs, memory-bound work, the curve's knee, then the links
PRIORITY = ("e_max", "overhead_s", "elementwise", "ai_half_ridge", "intra_gbps", "inter_gbps")
MIN_POINTS_PER_PARAM = 3
PRIOR_WEIGHT = 0.01
PROFILE_SCHEMA = "commpipe-profile/1"


@dataclass
class Point:
    spec: ModelSpec
    layout: Layout
    job: Job
    measured_s: float
    source: str
    node_of: tuple[int, ...] | None = None     # node of each rank, when not in rank order


# -- loading -------------------------------------------------------------------------------------
VTRAIN = {"# GPUs": "gpus", "global batch": "global_batch", "micro batch": "micro_batch_size",
          "hidden size": "hidden", "attention heads": "heads", "# layers": "layers",
          "sequence length": "seq_len", "tensor parallelism": "tp", "data parallelism": "dp",
          "pipeline parallelism": "pp", "iteration time (ms)": "iter_time_ms",
          "Parameters (billion)": "params_b"}


def job_defaults(args) -> dict:
    from commpipe.plan.cli_inputs import precision_of

    flash = {"auto": None, "on": True, "off": False}[getattr(args, "flash_attention", "auto")]
    return {"recompute": getattr(args, "recompute", None) or "none",
            "sequence_parallel": not getattr(args, "no_sequence_parallel", False),
            "dp_overlap": not getattr(args, "no_dp_overlap", False), "flash_attention": flash,
            "precision": precision_of(args), "zero1": getattr(args, "zero1", False),
            "grad_fp32": getattr(args, "grad_fp32", False), "vocab": 51200}


def _pipeline_schedule(pp: int, m: int, given: str | None) -> str:
    # runs with fewer micro-batches than stages fill the pipeline GPipe-style
    return given or ("1f1b" if m >= pp else "gpipe")


def points_from_csv(path: Path, defaults: dict) -> list[Point]:
    out = []
    with open(path, newline="") as fh:
        for n, raw in enumerate(csv.DictReader(fh)):
            row = {VTRAIN.get(k.strip(), k.strip()): (v or "").strip() for k, v in raw.items() if k}
            try:
                out.append(_point_from_row(row, defaults, f"{path.name}:{n + 2}"))
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path} row {n + 2}: {e}") from None
    return out


def _point_from_row(row: dict, d: dict, source: str) -> Point:
    def num(key, default=None):
        v = row.get(key, "")
        if v == "":
            if default is None:
                raise KeyError(f"missing column {key!r}")
            return default
        return float(v)

    if row.get("model"):
        spec = resolve_model(row["model"])
    else:
        fields = {k: int(num(k)) for k in ("layers", "hidden", "heads")}
        fields["vocab"] = int(num("vocab", d["vocab"]))
        for k in ("kv_heads", "ffn_hidden"):
            if row.get(k):
                fields[k] = int(num(k))
        arch = row.get("arch") or "gpt"
        spec = parse_model_fields(f"arch={arch}," + ",".join(f"{k}={v}" for k, v in fields.items()))
    tp, cp, pp, dp = (int(num(k, 1)) for k in ("tp", "cp", "pp", "dp"))
    mbs, gb = int(num("micro_batch_size")), int(num("global_batch"))
    m = gb // (dp * mbs) if dp * mbs else 0
    vpp = int(num("vpp", 1))
    layout = Layout(tp, cp, pp, dp, vpp, mbs, _pipeline_schedule(pp, m, row.get("schedule") or None),
                    row.get("recompute") or d["recompute"])
    job = Job(gb, int(num("seq_len")), precision=d["precision"], zero1=d["zero1"],
              dp_overlap=d["dp_overlap"], sequence_parallel=d["sequence_parallel"],
              flash_attention=d["flash_attention"], grad_fp32=d.get("grad_fp32", False))
    if row.get("step_time_s"):
        t = float(row["step_time_s"])
    else:
        t = num("iter_time_ms") / 1e3
    return Point(spec, layout, job, t, source)


def point_from_run(run: Path, defaults: dict) -> Point | None:
    cfg = json.loads((run / "config.json").read_text())
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [s["step_time_s"] for s in sorted(steps, key=lambda s: s.get("step", 0)) if "step_time_s" in s]
    if not times:
        return None
    times = times[2:] or times                 # the first steps include warm-up and compilation
    if cfg.get("schedule") not in SCHEDULES:   # a hand-written schedule CSV: not a searchable layout
        return None
    if (cfg.get("emulate_device") or 1.0) > 1.0:   # an emulated device's step times, not this host's
        return None
    spec = ModelSpec(**cfg["spec"]) if cfg.get("spec") else resolve_model(cfg["model"])
    dims = cfg["dims"]
    layout = Layout(dims["tp"], dims["cp"], dims["pp"], dims["dp"], cfg.get("vpp", 1) or 1,
                    cfg["micro_batch_size"], cfg["schedule"], cfg.get("recompute") or defaults["recompute"])
    job = Job(cfg["global_batch"], cfg["seq_len"], precision=defaults["precision"],
              zero1=bool(cfg.get("optim", {}).get("zero1", False)),
              flash_attention=defaults["flash_attention"], grad_fp32=defaults.get("grad_fp32", False),
              **runtime_job(run_features(cfg)))
    return Point(spec, layout, job, statistics.median(times), str(run), _node_of(run, layout))


def run_features(cfg: dict) -> RuntimeFeatures:
    """The runtime features a `commpipe train` run folder's config.json records. Runs written
    before sequence parallelism and overlap existed (no such keys) ran without them."""
    return RuntimeFeatures(sequence_parallel=bool(cfg.get("sequence_parallel", False)),
                           overlap=Overlap() if cfg.get("overlap", False) else Overlap.none(),
                           recompute=cfg.get("recompute") or "none")


def _node_of(run: Path, layout: Layout) -> tuple[int, ...] | None:
    """Where a sweep put the run's ranks (its sweep.jsonl record), when not in rank order."""
    status = run.parent / "sweep.jsonl"
    if not status.exists():
        return None
    rec = None
    for line in status.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rec = r if r.get("name") == run.name else rec
    placement = (rec or {}).get("placement")
    rpn = ((rec or {}).get("cluster") or {}).get("ranks_per_node")
    if not placement or not rpn:
        return None
    from commpipe.layout import node_of_rank

    nodes = node_of_rank(replace(layout, placement=placement), rpn)
    return None if nodes == [r // rpn for r in range(layout.gpus)] else tuple(nodes)


def _is_report_output(f: Path) -> bool:
    """`commpipe report`'s results.csv / results.json in a sweep folder (beside its report.md): a
    summary of the run folders there, which are read as runs already."""
    return f.name in ("results.csv", "results.json") and (f.parent / "report.md").exists()


def load_sources(path: str | Path, defaults: dict,
                 cluster: Cluster) -> tuple[list[Point], Cluster, list[str]]:
    """Points and the cluster with any probe's links applied; plus the list of sources read."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"calibration source {root} does not exist")
    files = [root] if root.is_file() else sorted(root.iterdir())
    points: list[Point] = []
    sources: list[str] = []
    for f in files:
        if f is not root and _is_report_output(f):
            continue
        if f.is_dir() and (f / "config.json").exists() and (f / "metrics.jsonl").exists():
            p = point_from_run(f, defaults)
            if p:
                points.append(p)
                sources.append(str(f))
        elif f.suffix == ".csv":
            points += points_from_csv(f, defaults)
            sources.append(str(f))
        elif f.suffix == ".json" and "pairs" in read_json(f, "probe"):
            cluster = apply_probe(cluster, f)
            sources.append(str(f))
    if not points and not sources:
        raise ValueError(f"{root} holds no run folders (config.json + metrics.jsonl), CSV or probe "
                         "JSON files to calibrate from")
    return points, cluster, sources


# -- fitting -------------------------------------------------------------------------------------
def _defaults(eff: Efficiency, cluster: Cluster) -> dict[str, float]:
    d = dict(eff.to_dict())
    d["intra_gbps"], d["inter_gbps"] = cluster.intra.bandwidth_gbps, cluster.inter.bandwidth_gbps
    return d


def apply_params(values: dict, eff: Efficiency, cluster: Cluster) -> tuple[Efficiency, Cluster]:
    eff = replace(eff, **{k: values[k] for k in eff.to_dict() if k in values})
    intra = Link(values.get("intra_gbps", cluster.intra.bandwidth_gbps), cluster.intra.latency_s)
    inter = Link(values.get("inter_gbps", cluster.inter.bandwidth_gbps), cluster.inter.latency_s)
    return eff, replace(cluster, intra=intra, inter=inter)


def predict(points: list[Point], eff: Efficiency, cluster: Cluster) -> np.ndarray:
    out = []
    for p in points:
        c = replace(cluster, num_gpus=p.layout.gpus, node_of=p.node_of)
        out.append(step_time(p.spec, p.layout, p.job, c, eff))
    return np.array(out)


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred), np.asarray(meas)
    return float(np.mean(np.abs(pred - meas) / meas))


def link_params_seen(points: list[Point], cluster: Cluster) -> list[str]:
    """Which link classes the runs exercise (a parameter no run touches cannot be fitted)."""
    seen = set()
    for p in points:
        lay = p.layout
        for size, stride in ((lay.tp, 1), (lay.cp, lay.tp), (lay.dp * lay.cp, lay.tp),
                             (lay.pp, lay.tp * lay.cp * lay.dp)):
            if size > 1:
                inside, _ = replace(cluster, num_gpus=lay.gpus).placement(size, stride)
                seen.add("intra_gbps" if inside else "inter_gbps")
    return [k for k in LINK_PARAMS if k in seen]


@dataclass
class FitResult:
    eff: Efficiency
    cluster: Cluster
    params: dict
    mape_before: float
    mape_after: float
    points: int
    fitted: list[str]


def fit(points: list[Point], eff: Efficiency, cluster: Cluster, fit_links: bool = True,
        iters: int = 15, params: tuple[str, ...] = EFF_PARAMS) -> FitResult:
    """Fit `params` (Efficiency fields, starting from and pulled weakly toward `eff`'s values,
    which must be positive) and, with `fit_links`, the bandwidths of the link classes used."""
    if not points:
        raise ValueError("no measured runs to fit")
    base = _defaults(eff, cluster)
    unknown = [k for k in params if k not in base or k in LINK_PARAMS]
    if unknown:
        raise ValueError(f"cannot fit {unknown}; fit Efficiency fields: {', '.join(eff.to_dict())}")
    zero = [k for k in params if base[k] <= 0]
    if zero:
        raise ValueError(f"{zero} start at 0; the fit works in log space: give a positive start value")
    names = list(params) + (link_params_seen(points, cluster) if fit_links else [])
    if len(names) > len(points):
        raise ValueError(f"{len(points)} measured runs cannot determine {len(names)} parameters "
                         f"({', '.join(names)}); give more runs or fit fewer parameters")
    theta0 = np.log([base[k] for k in names])
    meas = np.array([p.measured_s for p in points])

    # e_max <= 1 (the GPU's achievable matmul rate): a bound on its log
    upper = np.array([0.0 if k == "e_max" else np.inf for k in names])
    theta0 = np.minimum(theta0, upper)

    seen: dict[bytes, np.ndarray] = {}      # the Jacobian starts from the last point priced

    def residuals(theta):
        key = np.asarray(theta, dtype=float).tobytes()
        if key not in seen:
            e, c = apply_params(dict(zip(names, np.exp(theta))), eff, cluster)
            r = np.log(predict(points, e, c) / meas)
            seen.clear()
            seen[key] = np.concatenate([r, PRIOR_WEIGHT * (theta - theta0)])
        return seen[key]

    before = mape(np.exp(residuals(theta0)[:len(points)]) * meas, meas)

    def jacobian(theta):
        # backward differences of 0.02 e-folds: the step times come from a discrete-event
        # simulation that a tiny step can miss (scipy's default step at theta = 0 is 1.5e-8),
        # and e_max may sit on its bound, where a forward step would leave the domain
        r = residuals(theta)
        jac = np.empty((len(r), len(names)))
        for j in range(len(names)):
            t = theta.copy()
            t[j] -= 0.02
            jac[:, j] = (r - residuals(t)) / 0.02
        return jac

    # trust-region reflective least squares, with e_max's bound; `iters` bounds the iterations
    sol = least_squares(residuals, theta0, jac=jacobian, bounds=(-np.inf, upper), method="trf",
                        x_scale=1.0, ftol=1e-7, xtol=1e-7, max_nfev=2 * iters)
    theta, r = sol.x, sol.fun
    values = dict(zip(names, np.exp(theta)))
    e, c = apply_params(values, eff, cluster)
    after = mape(np.exp(r[:len(points)]) * meas, meas)
    return FitResult(e, c, {k: float(v) for k, v in values.items()}, before, after, len(points), names)


def supported_params(points: list[Point], cluster: Cluster, fit_links: bool,
                     params: tuple[str, ...] = EFF_PARAMS) -> tuple[tuple[str, ...], bool]:
    """The parameters `len(points)` runs support, at least MIN_POINTS_PER_PARAM runs each, taken
    in PRIORITY order: (efficiency parameters, whether the links may still be fitted)."""
    wanted = list(params) + (link_params_seen(points, cluster) if fit_links else [])
    wanted.sort(key=lambda k: PRIORITY.index(k) if k in PRIORITY else len(PRIORITY))
    keep = wanted[: len(points) // MIN_POINTS_PER_PARAM]
    links = [k for k in keep if k in LINK_PARAMS]
    return tuple(k for k in keep if k not in LINK_PARAMS), bool(links) and len(links) == len(
        [k for k in wanted if k in LINK_PARAMS])


@dataclass
class CrossValidation:
    method: str                 # "leave-one-model-out" or "k-fold"
    folds: list[dict]           # per fold: held-out label, runs, MAPE
    mape: float                 # over every held-out prediction


def folds_of(points: list[Point], k: int = 5) -> tuple[str, list[list[int]]]:
    """Leave-one-model-out when the runs span 3 or more models, else k-fold (index mod k)."""
    models = sorted({p.spec.name for p in points})
    if len(models) >= 3:
        return "leave-one-model-out", [[i for i, p in enumerate(points) if p.spec.name == m]
                                       for m in models]
    k = max(2, min(k, len(points)))
    return f"{k}-fold", [[i for i in range(len(points)) if i % k == j] for j in range(k)]


def cross_validate(points: list[Point], eff: Efficiency, cluster: Cluster, fit_links: bool = True,
                   params: tuple[str, ...] = EFF_PARAMS, k: int = 5) -> CrossValidation:
    """Fit on all but one fold, predict the fold, for every fold; the parameters each fit may use
    follow `supported_params` of its training runs."""
    if len(points) < 2 * MIN_POINTS_PER_PARAM:
        raise ValueError(f"cross-validation needs at least {2 * MIN_POINTS_PER_PARAM} runs, "
                         f"got {len(points)}")
    method, folds = folds_of(points, k)
    held, rows = [], []
    for idx in folds:
        train = [p for i, p in enumerate(points) if i not in set(idx)]
        test = [points[i] for i in idx]
        use, links = supported_params(train, cluster, fit_links, params)
        if use or links:
            res = fit(train, eff, cluster, fit_links=links, params=use)
            e, c = res.eff, res.cluster
        else:
            e, c = eff, cluster
        pred = predict(test, e, c)
        meas = np.array([p.measured_s for p in test])
        held += list(np.abs(pred - meas) / meas)
        label = test[0].spec.name if method.startswith("leave") else f"fold {len(rows) + 1}"
        rows.append({"held_out": label, "runs": len(test), "mape": mape(pred, meas),
                     "fitted": list(use) + (["links"] if links else [])})
    return CrossValidation(method, rows, float(np.mean(held)))


# -- profiles ------------------------------------------------------------------------------------
def save_profile(path: str | Path, result: FitResult, sources: list[str],
                 cv: CrossValidation | None = None) -> None:
    data = {"schema": PROFILE_SCHEMA, "gpu": result.cluster.gpu.name,
            "efficiency": result.eff.to_dict(),
            "links": {"intra_node": result.cluster.intra.to_dict(),
                      "inter_node": result.cluster.inter.to_dict()},
            "fit": {"points": result.points, "parameters": result.fitted,
                    "mape_before": result.mape_before, "mape_after": result.mape_after,
                    "cv_method": cv.method if cv else None, "cv_mape": cv.mape if cv else None,
                    "sources": sources}}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(path: str | Path) -> tuple[Efficiency, dict | None]:
    data = read_json(path, "profile")
    if data.get("schema") != PROFILE_SCHEMA:
        raise ValueError(f"{path} is not a commpipe profile (schema {data.get('schema')!r}); "
                         "write one with `commpipe plan --calibrate DIR --profile out.json`")
    known = set(Efficiency().to_dict())
    vals = {k: float(v) for k, v in data.get("efficiency", {}).items() if k in known}
    for k, v in vals.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{path}: efficiency.{k}={v} must be a non-negative number")
    return Efficiency(**vals), data.get("links")
