"""`commpipe plan --calibrate DIR`: fit the cost model to measured runs, with cross-validation.

    commpipe plan --calibrate runs/ --gpu a100-80gb --gpus-per-node 8 [--profile prof.json] [--json]

Fits only as many parameters as the runs support (`calibrate.supported_params`: at least
MIN_POINTS_PER_PARAM runs each, in PRIORITY order), prints the in-sample error and the
cross-validated error on held-out runs (leave-one-model-out when the runs span 3 or more models,
else k-fold), and writes the profile `plan`/`estimate --profile` read.
"""

from __future__ import annotations

import json
from dataclasses import replace

from commpipe.plan.calibrate import (
    EFF_PARAMS,
    MIN_POINTS_PER_PARAM,
    FitResult,
    cross_validate,
    fit,
    job_defaults,
    link_params_seen,
    load_sources,
    save_profile,
    supported_params,
)
from commpipe.plan.cli_inputs import DEFAULT_GPUS_PER_NODE, cluster_from_args
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.gpus import resolve_gpu


def run_calibration(args) -> int:
    n = args.gpus or args.gpus_per_node or DEFAULT_GPUS_PER_NODE
    cluster, eff = cluster_from_args(args, num_gpus=n)
    cluster = replace(cluster, gpu=resolve_gpu(args.gpu))
    if eff.overhead_s <= 0:
        # a CPU prices its passes' ops (runtime_ops.py) and no per-pass overhead; the fit works
        # in log space, so what the runs add to it starts from the untuned 20 us
        eff = replace(eff, overhead_s=Efficiency().overhead_s)
    points, cluster, sources = load_sources(args.calibrate, job_defaults(args), cluster)
    fixed_links = args.cluster is not None or any(
        getattr(args, k) is not None for k in ("intra_node_gbps", "inter_node_gbps"))
    fixed_links = fixed_links or any(s.endswith(".json") for s in sources)
    use, links = supported_params(points, cluster, not fixed_links)
    wanted = len(EFF_PARAMS) + (0 if fixed_links else len(link_params_seen(points, cluster)))
    if points and not (use or links):
        raise ValueError(f"{len(points)} measured run(s) support no fitted parameter (at least "
                         f"{MIN_POINTS_PER_PARAM} runs per parameter); give more runs")
    cv = None
    if points:
        result = fit(points, eff, cluster, fit_links=links, params=use)
        if len(points) >= 2 * MIN_POINTS_PER_PARAM:
            cv = cross_validate(points, eff, cluster, fit_links=not fixed_links)
    else:
        result = FitResult(eff, cluster, {}, float("nan"), float("nan"), 0, [])
    report = {"points": result.points, "fitted": result.fitted, "params": result.params,
              "mape_before": result.mape_before, "mape_after": result.mape_after,
              "cv_method": cv.method if cv else None, "cv_mape": cv.mape if cv else None,
              "cv_folds": cv.folds if cv else [],
              "links": {"intra_node": result.cluster.intra.to_dict(),
                        "inter_node": result.cluster.inter.to_dict()}, "sources": sources}
    if args.profile:
        save_profile(args.profile, result, sources, cv)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"calibrated on {result.points} measured runs from {len(sources)} source(s)")
    if result.points:
        if len(result.fitted) < wanted:
            print(f"fitting {len(result.fitted)} of {wanted} parameters: {result.points} runs support "
                  f"{result.points // MIN_POINTS_PER_PARAM} (at least {MIN_POINTS_PER_PARAM} runs each); "
                  "the rest keep their defaults")
        print(f"fit error (MAPE): {result.mape_before:.1%} with defaults -> {result.mape_after:.1%} fitted "
              "(in-sample)")
        if result.mape_after > result.mape_before:
            print("note: the fit minimises the squared log error, which weighs a prediction too fast "
                  "and one too slow alike; MAPE weighs too slow more, and rose. With few or noisy runs, "
                  "check the cross-validated error (or measure more runs) before using this profile")
        if cv:
            print(f"cross-validated error ({cv.method}, {len(cv.folds)} folds): {cv.mape:.1%} "
                  "on held-out runs")
            for f in cv.folds:
                print(f"  held out {f['held_out']:>16}: {f['runs']:3d} runs, MAPE {f['mape']:.1%}")
        else:
            print(f"(no cross-validation: needs at least {2 * MIN_POINTS_PER_PARAM} runs)")
        for k, v in result.params.items():
            print(f"  {k:>14} = {v:.4g}")
    print(f"links: intra {result.cluster.intra.bandwidth_gbps:.1f} GB/s "
          f"{result.cluster.intra.latency_s * 1e3:.4f} ms, inter {result.cluster.inter.bandwidth_gbps:.1f} "
          f"GB/s {result.cluster.inter.latency_s * 1e3:.4f} ms")
    if args.profile:
        print(f"wrote {args.profile}; use it with `commpipe plan ... --profile {args.profile}`")
    return 0
