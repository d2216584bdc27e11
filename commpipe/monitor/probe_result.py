"""What `commpipe probe` reports (commpipe.monitor.probe measures): the JSON file, the table it
prints, and per node the cores other processes kept busy while it measured.
"""

from __future__ import annotations

import json

from commpipe.monitor.host_load import busy_warning, other_cores


def host_load(spans: list[dict], node_of: list[int]) -> list[dict]:
    """Per node, the cores processes other than the probe's ranks kept busy while it measured
    (commpipe.monitor.host_load; None where /proc/stat is not there to read)."""
    out = []
    for node in sorted(set(node_of)):
        mine = [s for s, n in zip(spans, node_of) if n == node]
        out.append({"node": node, "cores": mine[0]["cores"], "other_cores": other_cores(mine)})
    return out


def write_result(path: str, result: dict) -> None:
    from commpipe.files import StorageError, os_reason

    try:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)
    except OSError as e:   # the measurement is printed above: it is not lost
        raise StorageError(f"--out {path}: cannot write the results: {os_reason(e)}; the table "
                           "above holds them") from None


def format_table(result: dict) -> str:
    lines = [f"probe: {result['world_size']} ranks on {result.get('nodes', '?')} node(s), "
             f"{result['ranks_per_node']} on rank 0's node, "
             f"{result['backend']} on {result['device']}  ({result['fit']})", ""]
    lines.append(f"{'link':<22}{'ranks':>8}{'latency ms':>12}{'GB/s':>10}   per size: bytes -> GB/s")
    for name, p in result["pairs"].items():
        if p is None:
            lines.append(f"{name:<22}{'-':>8}   (not measured: no such pair where the ranks run)")
            continue
        per = "  ".join(f"{_human(s['bytes'])}:{s['bandwidth_gbps']:.3g}" for s in p["sizes"])
        lines.append(f"{name:<22}{'-'.join(map(str, p['ranks'])):>8}{p['latency_ms']:>12.4f}"
                     f"{p['bandwidth_gbps']:>10.3f}   {per}")
    for a in result["allreduce"]:
        per = "  ".join(f"{_human(s['bytes'])}:{s['busbw_gbps']:.3g}" for s in a["sizes"])
        lines.append(f"{'all-reduce n=' + str(a['group_size']) + ' (busbw)':<22}"
                     f"{'0-' + str(a['group_size'] - 1):>8}{a['latency_ms']:>12.4f}"
                     f"{a['busbw_gbps']:>10.3f}   {per}")
    calls = result.get("calls")
    if calls:
        per = "  ".join(f"{op} {v['mean_ms']:.3f} (median {v['median_ms']:.3f})"
                        for op, v in calls["ops"].items())
        lines.append(f"calls after {calls['gap_ms']:g} ms of compute, {_human(calls['bytes'])}, "
                     f"ranks 0-1, mean ms: {per}")
    for load in result.get("host_load") or []:
        line = busy_warning(load["other_cores"], load["cores"], "the probe ran")
        if line:
            lines.append(f"node {load['node']}: {line}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
