"""Human-readable output of `commpipe plan` and `commpipe estimate`."""

from __future__ import annotations

from commpipe.plan.estimate import Estimate
from commpipe.plan.search import SearchResult, describe, explain_loss
from commpipe.report.tables import flops_unit


def header(unit: str = "TFLOP/s") -> str:
    return (f"{'#':>2}  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>5} {'vpp':>3} {'mbs':>3} {'schedule':<11} "
            f"{'recomp':<9} {'zero':>4} {'step s':>8} {unit:>8} {'MFU':>6} {'mem GB':>7} {'bubble':>7} "
            f"{'comm':>6}")


HEADER = header()


def row(n: int | str, e: Estimate, factor: float = 1.0) -> str:
    """One layout's line; `factor` scales TFLOP/s to the table's unit (flops_unit)."""
    lay = e.layout
    b = e.breakdown.get("pp_bubble", 0.0) / e.step_time_s if e.breakdown else float("nan")
    return (f"{n:>2}  {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.dp:>5} {lay.vpp:>3} "
            f"{lay.micro_batch_size:>3} {lay.schedule if lay.pp > 1 else '-':<11} "
            f"{lay.recompute:<9} {_zero(lay):>4} "
            f"{e.step_time_s:>8.4g} "
            f"{e.tflops_per_gpu * factor:>8.1f} {e.mfu:>6.1%} {e.memory_gb_per_gpu:>7.1f} {b:>7.1%} "
            f"{e.exposed_comm_fraction:>6.1%}" + (f" {lay.ep:>3}" if e.moe is not None else ""))


def unit_of(estimates: list[Estimate]) -> tuple[float, str]:
    """(factor, unit) that writes the best throughput with digits before the point: TFLOP/s on
    GPUs, GFLOP/s for a CPU's ranks (commpipe.report.tables.flops_unit)."""
    return flops_unit([{"tflops_per_gpu": e.tflops_per_gpu} for e in estimates
                       if e.tflops_per_gpu == e.tflops_per_gpu])


def _zero(lay) -> str:
    """ZeRO stage, with the HSDP shard group when it is not the whole dp*cp group."""
    if lay.zero and lay.dp_shard and lay.dp_shard != lay.dp * lay.cp:
        return f"{lay.zero}/{lay.dp_shard}"
    return str(lay.zero)


def print_plan(result: SearchResult, spec, job, cluster) -> None:
    print(f"{spec.name} on {cluster.num_gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node; "
          f"links: intra {cluster.intra.bandwidth_gbps:.0f} GB/s, inter {cluster.inter.bandwidth_gbps:.0f}"
          f" GB/s per GPU, from {cluster.source}); global batch {job.global_batch} x {job.seq_len} tokens")
    print(f"layouts considered {result.considered}, fit in memory {result.feasible}, "
          f"simulated {result.simulated}")
    if not result.top:
        why = result.explanation or {}
        print(why.get("reason") or "no layout fits in memory" + (
            f"; e.g. {result.example_rejection}" if result.example_rejection else ""))
        if why.get("fixes"):
            print("what would make it fit:")
            for fix in why["fixes"]:
                print(f" - {fix}")
        return
    print()
    factor, unit = unit_of(result.top)
    print(header(unit) + (f" {'ep':>3}" if result.top[0].moe is not None else ""))
    for n, e in enumerate(result.top, 1):
        print(row(n, e, factor))
    print(f"(step s: predicted step time; {unit}: model FLOPs per GPU; mem GB: largest stage; "
          "bubble: pipeline idle share; comm: exposed communication share)")
    if result.top[0].interval:
        print(f"best: {interval_line(result.top[0])}")
    print()
    best = result.top[0]
    for n, e in enumerate(result.top, 1):
        why = describe(e, cluster) if n == 1 else explain_loss(e, best, cluster)
        print(f" {n}. {why}")
    if result.alternatives:
        print("\nwhy common alternatives lose:")
        for label, alt, why in result.alternatives:
            if alt is None:
                continue
            what = alt.layout.short()
            if alt.feasible:
                print(f" - {label}: best is {what}, {alt.step_time_s:.4g} s; {why}")
            else:
                print(f" - {label}: {what}: {why}")


def interval_line(e: Estimate) -> str:
    """"412 TFLOP/s, 80% interval 350-440 ..." from the held-out public runs (plan.interval)."""
    iv = e.interval
    if iv.get("range_of_published_moe_runs"):
        lo, hi = iv["tflops_per_gpu_low"], iv["tflops_per_gpu_high"]
        return (f"{e.tflops_per_gpu:.0f} TFLOP/s, range {lo:.0f}-{hi:.0f} (measured over predicted "
                f"spans {lo / e.tflops_per_gpu:.2f}-{hi / e.tflops_per_gpu:.2f} on "
                f"{iv['from_public_rows']} published MoE runs; docs/moe.md)")
    return (f"{e.tflops_per_gpu:.0f} TFLOP/s, {iv['level']:.0%} interval {iv['tflops_per_gpu_low']:.0f}-"
            f"{iv['tflops_per_gpu_high']:.0f} (from {iv['from_public_rows']} published runs the "
            "planner was not fitted on)")


def print_estimate(e: Estimate, cluster) -> None:
    lay = e.layout
    print(f"layout {lay.short()} on {lay.gpus} x {cluster.gpu.name}: "
          f"{e.reason if e.feasible else 'REJECTED: ' + e.reason}")
    if e.memory:
        print("memory per pipeline rank (GB): weights grads optimizer activations logits reserve = total")
        shown = e.memory if len(e.memory) <= 8 else e.memory[:4] + e.memory[-4:]
        for s in shown:
            logits = s.logits_gb + s.loss_transient_gb
            print(f"  rank {s.rank:>3} ({s.layers:>3} layers): {s.weights_gb:7.2f} {s.grads_gb:6.2f} "
                  f"{s.optimizer_gb:8.2f} {s.activations_gb:10.2f} {logits:6.2f} {s.reserve_gb:6.2f}"
                  f" = {s.total_gb:7.2f}  ({s.inflight:g} micro-batches in flight)")
    if e.step_time_s == e.step_time_s:
        factor, unit = unit_of([e])
        print(f"step {e.step_time_s:.4f} s, {e.microbatches} micro-batches; model "
              f"{e.tflops_per_gpu * factor:.1f} {unit}/GPU (MFU {e.mfu:.1%}), hardware "
              f"{e.hw_tflops_per_gpu * factor:.1f} {unit}/GPU")
        if e.interval:
            print(interval_line(e))
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in e.breakdown.items() if v > 0)
        print(f"breakdown on the busiest rank: {parts}")
        if cluster.host_cores is not None:
            print(f"host: {lay.gpus} ranks share {cluster.host_cores:g} cores' worth of CPU; "
                  f"busy ranks slowed {e.host_contention:.2f}x by sharing them (commpipe.plan.host)")
    if e.moe is not None:
        m = e.moe
        head = (f"experts: ep {m['ep']}, edp {m['edp']}, {m['tokens_per_expert']:.0f} token copies "
                f"per local expert per micro-batch (imbalance {m['expert_imbalance']:g}); ")
        if m["ep"] == 1:      # every expert on every rank: tokens never leave it
            print(head + "no all-to-all (ep 1)")
        else:
            print(head + f"all-to-all {m['a2a_bytes_per_call'] / 1e6:.1f} MB, "
                  f"{m['a2a_s_per_call'] * 1e3:.3f} ms per call, 4 per MoE layer and micro-batch, "
                  + ("in flight behind the other pass of a braid" if m.get("a2a_braided")
                     else "exposed"))
        ops, secs = m.get("host_ops_per_layer"), m.get("host_s_per_layer")
        if ops and ops["forward"]:
            print(f"host: a MoE layer issues {ops['forward']} + {ops['backward']} operations "
                  f"(forward + backward) beyond a dense MLP's, {secs['forward'] * 1e3:.2f} + "
                  f"{secs['backward'] * 1e3:.2f} ms a micro-batch (Megatron-Core's, counted; "
                  f"commpipe.plan.moe_host)")
