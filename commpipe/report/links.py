"""Measured bandwidth per link and per link class (intra_node, inter_node) of one run, and the
rank x rank bandwidth matrix of each dimension.

Reads OUT/monitor/links.jsonl (rank 0's join of both sides of every link per step) and
OUT/monitor/nodes.json (node of every rank). As everywhere in the report, a link's bandwidth
and transfer time are medians over the steps after warm-up in which it had timed calls (a
class's, over all its links' steps): on a shared host a sender's I/O thread is sometimes not
scheduled for tens of milliseconds, which the median leaves out. Point-to-point links (PP) give the
receiver's per-message bandwidth; collective groups (TP, CP, DP) the nccl-tests bus bandwidth
of the group's slowest member, entered in the matrix for every pair of the group; so do
expert parallelism's all-to-all exchanges (EP: dispatch and combine, one record per group and
step; a group's other EP calls, the row counts before them (op all_to_all_counts) and the
gradient norm's scalar sum, are not a link) and, as DP, the expert gradients' all-reduce over
the ranks holding the same experts (edp). Steps whose timed calls were smaller than
MIN_BANDWIDTH_BYTES (scalar reductions, a tiny model's sharded activations) time latency, not the
link, and are left out of bandwidth; a link class with only such steps is named in the results
row's `small_messages` (the terminal table prints "small" there).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from commpipe.report.tables import read_jsonl

CLASSES = ("intra_node", "inter_node")


def _median(values):
    values = list(values)
    return statistics.median(values) if values else None

LINK_DIMS = {"pp": "pp", "tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp", "edp": "dp", "ep": "ep"}
DIM_ORDER = ("pp", "tp", "cp", "dp", "ep")


def is_link(rec: dict) -> bool:
    """False for the calls of a dimension that do not measure its links: an EP group's
    all-reduce (the gradient norm's experts term) beside its all-to-all."""
    return not (LINK_DIMS.get(rec.get("dim")) == "ep" and rec.get("op") != "all_to_all")

# A call this small times the per-call latency, not the link: the training loop's 8-byte loss
# all-reduce shares the gradient all-reduce's stream (dp_cp), and 8 bytes over a 10 ms call read
# as 0.0008 MB/s on a 1 Gbit/s link. Bandwidth counts only calls of at least this many bytes.
MIN_BANDWIDTH_BYTES = 4096


def bytes_per_timed_call(rec: dict) -> float | None:
    """The size of a record's timed calls (nccl-tests S for collectives): the monitor's
    bandwidth_gbps is their bytes over their summed transfer time and transfer_ms that time per
    call, so their product is bytes per call (None when the record lacks either)."""
    bw, ms = rec.get("bandwidth_gbps"), rec.get("transfer_ms", rec.get("latency_ms"))
    return None if bw is None or ms is None else bw * 1e9 * ms / 1e3


def measures_bandwidth(rec: dict) -> bool:
    """False for a record whose timed calls were too small to say anything about bandwidth."""
    size = bytes_per_timed_call(rec)
    return size is None or size >= MIN_BANDWIDTH_BYTES


def link_rows(run_dir, warmup: int = 1) -> list[dict]:
    """One dict per link: dim, kind, src/dst or group, link_class, gbps, transfer_ms, timed."""
    acc: dict = {}
    records = read_jsonl(Path(run_dir) / "monitor" / "links.jsonl")
    first = min((r["step"] for r in records), default=0)
    for r in records:
        dim = LINK_DIMS.get(r.get("dim"))
        if dim is None or r["step"] < first + warmup or not is_link(r):
            continue
        if r["kind"] == "p2p":
            if dim != "pp":
                continue
            key = (dim, "p2p", r["src"], r["dst"])
            n, bw = r.get("matched") or 0, r.get("bandwidth_gbps")
        else:
            if dim == "pp":         # the loss and grad-norm reductions, not a link
                continue
            key = (dim, r["op"], tuple(r["group"]))
            n, bw = r.get("sampled") or 0, r.get("busbw_gbps")
        a = acc.setdefault(key, {"link_class": r.get("link_class"), "steps": [], "n": 0,
                                 "small": 0})
        if n and bw and r.get("transfer_ms"):
            if measures_bandwidth(r):
                a["steps"].append((bw, r["transfer_ms"]))
                a["n"] += n
            else:
                a["small"] += 1
    out = []
    for key, a in sorted(acc.items(), key=lambda kv: str(kv[0])):
        row = {"dim": key[0], "kind": "p2p" if key[1] == "p2p" else "collective",
               "link_class": a["link_class"], "timed": a["n"], "steps": a["steps"],
               "small_steps": a["small"],
               "gbps": _median(bw for bw, _ in a["steps"]),
               "transfer_ms": _median(ms for _, ms in a["steps"])}
        if key[1] == "p2p":
            row.update(src=key[2], dst=key[3])
        else:
            row.update(op=key[1], group=list(key[2]))
        out.append(row)
    return out


def small_only(links: list[dict]) -> set[tuple[str, str]]:
    """(dim, link class) pairs whose timed calls were all under MIN_BANDWIDTH_BYTES: measured,
    but no bandwidth to give (a tp2 x cp2 pipeline of the tiny preset sends 2 KiB messages)."""
    small = {(lk["dim"], lk["link_class"]) for lk in links if lk.get("small_steps")}
    timed = {(lk["dim"], lk["link_class"]) for lk in links if lk["gbps"] is not None}
    return small - timed


def class_summary(links: list[dict]) -> list[dict]:
    """One row per (dim, link class): medians over every step of every link of the class."""
    acc: dict = {}
    for lk in links:
        if lk["gbps"] is None or lk["link_class"] not in CLASSES:
            continue
        a = acc.setdefault((lk["dim"], lk["link_class"]), {"steps": [], "n": 0, "links": 0})
        a["steps"] += lk["steps"]
        a["n"] += lk["timed"]
        a["links"] += 1
    order = {d: i for i, d in enumerate(DIM_ORDER)}
    return [{"dim": d, "link_class": c, "gbps": _median(bw for bw, _ in a["steps"]),
             "transfer_ms": _median(ms for _, ms in a["steps"]), "timed": a["n"], "links": a["links"]}
            for (d, c), a in sorted(acc.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def class_columns(run_dir, warmup: int = 1) -> dict:
    """{f"{dim}_intra_gbps": .., f"{dim}_inter_gbps": ..} for a results row."""
    out = {}
    links = link_rows(run_dir, warmup)
    for s in class_summary(links):
        out[f"{s['dim']}_{s['link_class'].split('_')[0]}_gbps"] = s["gbps"]
    # no rate, but measured: every message was too small to time the link (terminal_table)
    out["small_messages"] = sorted(f"{d}_{c.split('_')[0]}" for d, c in small_only(links)
                                   if c in CLASSES)
    return out


def node_of_rank(run_dir) -> list[int] | None:
    try:
        return json.loads((Path(run_dir) / "monitor" / "nodes.json").read_text())["node_of_rank"]
    except (OSError, ValueError, KeyError):
        return None


def rank_matrices(links: list[dict], world: int) -> dict[str, list[list]]:
    """{dim: world x world matrix}: [src][dst] GB/s of PP links; for a collective dimension the
    group's bus bandwidth in every [i][j] of two members (the op with the most timed calls)."""
    out: dict[str, list[list]] = {}
    best: dict = {}
    for lk in links:
        if lk["gbps"] is None:
            continue
        m = out.setdefault(lk["dim"], [[None] * world for _ in range(world)])
        if lk["kind"] == "p2p":
            if max(lk["src"], lk["dst"]) < world:
                m[lk["src"]][lk["dst"]] = lk["gbps"]
            continue
        group = tuple(lk["group"])
        if lk["timed"] <= best.get((lk["dim"], group), -1) or max(group) >= world:
            continue
        best[(lk["dim"], group)] = lk["timed"]
        for i in group:
            for j in group:
                if i != j:
                    m[i][j] = lk["gbps"]
    return out


CLASS_HEADER = ["Layout", "Dim", "Link class", "GB/s", "Transfer (ms/call)", "Links", "Timed calls"]


def class_table(sweep_dir, rows: list[dict], warmup: int = 1) -> list[list[str]]:
    """Cells of the per-class summary: one line per layout, dimension and link class."""
    from commpipe.report.tables import fmt, run_path

    out = []
    for r in rows:
        if r["status"] != "ok":
            continue
        for c in class_summary(link_rows(run_path(sweep_dir, r), warmup)):   # one run: its dir
            out.append([r.get("label") or r["name"], c["dim"].upper(), c["link_class"].replace("_", "-"),
                        fmt(c["gbps"]), fmt(c["transfer_ms"]), str(c["links"]), str(c["timed"])])
    return out
