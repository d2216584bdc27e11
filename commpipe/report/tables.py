"""Sweep folder (or one run folder) -> one summary row per layout, results.csv and a markdown table.

Reads, for each layout: the sweep's status line (OUT/sweep.jsonl), the run's metrics.jsonl and
the monitor's per-rank records (OUT/<layout>/monitor/rank*.jsonl). Times are medians over the
steps after `warmup` (the first step pays for allocation and connection set-up).

Per dimension and step, from the monitor's records (commpipe/monitor/records.py):
  bandwidth   median over the dimension's records of bandwidth_gbps for p2p (pp, receivers'
              records: a recv completes when the data is there, an isend only when waited on), of the
              nccl-tests bus bandwidth busbw_gbps for collectives (tp, cp, dp), so group sizes
              compare; only from timed calls of at least links.MIN_BANDWIDTH_BYTES (a scalar
              reduction's bytes over its time measure latency, not the link);
  latency     transfer time per call once every peer had posted (wait excluded);
  wait        time per call blocked on the peer (pipeline bubbles show up here, not in latency);
  raw         the study's "latency": post-to-done time per call, wait + latency;
              all three are means over the step's matched calls (timed on both sides), so
              raw >= wait and raw >= latency in every step and in their medians over steps;
  calls       pp: pipeline messages per step (sends summed over ranks); others: per rank.
  {dim}_intra_gbps, {dim}_inter_gbps: bandwidth of the dimension's intra- and inter-node links
              (bytes over transfer time of all timed calls, commpipe.report.links).
PP counts only send/recv (the loss and gradient-norm all-reduces over the pipeline group are
left out); DP is the gradient reduction, over the dp x cp group ("dp_cp") when CP is on, and of
a MoE model's experts over the ranks holding the same experts ("edp"); EP is expert
parallelism's all-to-all (token dispatch and combine; its groups' scalar sums are left out).
"""

from __future__ import annotations

import csv
import json
import statistics
import textwrap
from pathlib import Path

DIMS = ("pp", "tp", "cp", "dp", "ep")
P2P = ("send", "recv")
COLUMNS = ["name", "label", "tp", "cp", "pp", "dp", "ep", "schedule", "microbatches", "placement", "status",
           "reason", "steps", "tflops_per_gpu", "step_time_ms", "bubble", "tokens_per_s", "final_loss",
           "efficiency",
           "pp_bw_gbps", "pp_latency_ms", "pp_wait_ms", "pp_raw_ms", "pp_calls",
           "tp_bw_gbps", "tp_latency_ms", "tp_wait_ms", "cp_bw_gbps", "cp_latency_ms", "cp_wait_ms",
           "dp_bw_gbps", "dp_latency_ms", "dp_wait_ms", "ep_bw_gbps", "ep_latency_ms", "ep_wait_ms",
           "pp_intra_gbps", "pp_inter_gbps", "tp_intra_gbps", "tp_inter_gbps",
           "cp_intra_gbps", "cp_inter_gbps", "dp_intra_gbps", "dp_inter_gbps",
           "ep_intra_gbps", "ep_inter_gbps", "study_tflops_per_gpu"]


def read_jsonl(path) -> list[dict]:
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue       # a line cut short by a killed run
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def after_warmup(steps: list, warmup: int) -> list:
    """Steps after the warm-up; all of them when the run is too short to drop any."""
    return steps[warmup:] if len(steps) > warmup else steps


def run_path(sweep_dir, row: dict) -> Path:
    """The run folder of a report row: its own `dir` (a single-run report), else the sweep's
    sub-folder of its name."""
    return Path(row["dir"]) if row.get("dir") else Path(sweep_dir) / row["name"]


def monitor_records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "monitor").glob("rank*.jsonl")):
        out.extend(read_jsonl(path))
    return out


SELECT = {"pp": (("pp",), P2P), "tp": (("tp",), None), "cp": (("cp",), None),
          "dp": (("dp", "dp_cp", "edp"), None), "ep": (("ep",), ("all_to_all",))}


def dim_step_stats(records: list[dict], dim: str) -> dict[int, dict]:
    """{step: {"bw", "latency", "wait", "raw", "calls"}} of one column (see SELECT)."""
    from commpipe.report.links import measures_bandwidth

    dims, ops = SELECT[dim]
    by_step: dict[int, list[dict]] = {}
    for r in records:
        if r.get("dim") in dims and (ops is None or r.get("op") in ops):
            by_step.setdefault(r["step"], []).append(r)
    out = {}
    for step, recs in sorted(by_step.items()):
        p2p = dim == "pp"
        bw_key = "bandwidth_gbps" if p2p else "busbw_gbps"
        if p2p:
            calls = sum(r.get("calls") or 0 for r in recs if r.get("op") == "send")
            # timing from the receiver's side: a recv completes when the data has arrived,
            # while a non-blocking send is only seen complete when the runtime waits on it
            recs = [r for r in recs if r.get("op") == "recv"] or recs
        else:
            ranks = {r.get("rank") for r in recs}
            calls = sum(r.get("calls") or 0 for r in recs) / max(len(ranks), 1)
        # wait, transfer and raw are means per call over the same calls (those timed on both
        # sides), so raw = wait + transfer holds in every step and in the medians over steps
        timed = [r for r in recs if r.get("matched") and r.get("wait_ms_total") is not None
                 and _transfer_total(r) is not None]
        matched = sum(r["matched"] for r in timed)
        if matched:
            wait = sum(r["wait_ms_total"] for r in timed) / matched
            latency = sum(_transfer_total(r) for r in timed) / matched
            raw = wait + latency
        else:
            wait = _median(r.get("wait_ms") for r in recs)
            latency = _median(r.get("transfer_ms", r.get("latency_ms")) for r in recs)
            raw = _median(r.get("raw_ms") for r in recs)
        # bandwidth only from calls big enough to measure it (scalar reductions time latency)
        out[step] = {"bw": _median(r.get(bw_key, r.get("bandwidth_gbps")) for r in recs
                                   if measures_bandwidth(r)),
                     "latency": latency, "wait": wait, "raw": raw, "calls": calls}
    return out


def _transfer_total(rec: dict) -> float | None:
    """Transfer ms summed over a record's matched calls (older records carry the mean only)."""
    if rec.get("transfer_ms_total") is not None:
        return rec["transfer_ms_total"]
    per_call = rec.get("transfer_ms", rec.get("latency_ms"))
    return None if per_call is None else per_call * rec["matched"]


def summarize_run(run_dir: Path, warmup: int = 1) -> dict:
    """Medians of one run folder's metrics and monitor records."""
    metrics = sorted(read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m.get("step", 0))
    row: dict = {"steps": len(metrics)}
    if metrics:
        kept = after_warmup(metrics, warmup)
        row["tflops_per_gpu"] = _median(m.get("tflops_per_gpu") for m in kept)
        t = _median(m.get("step_time_s") for m in kept)
        row["step_time_ms"] = None if t is None else t * 1e3
        row["tokens_per_s"] = _median(m.get("tokens_per_s") for m in kept)
        row["final_loss"] = metrics[-1].get("loss")
        for key in ("tp", "cp", "pp", "dp", "ep", "schedule", "microbatches"):
            if key in metrics[-1]:
                row[key] = metrics[-1][key]
    row["bubble"] = _traced_bubble(run_dir)
    from commpipe.report.breakdown import run_breakdown

    row["breakdown"] = run_breakdown(run_dir, warmup)
    from commpipe.report.links import class_columns

    row.update(class_columns(run_dir, warmup))    # {dim}_{intra,inter}_gbps
    records = monitor_records(run_dir)
    for dim in DIMS:
        stats = dim_step_stats(records, dim)
        kept = [stats[s] for s in after_warmup(sorted(stats), warmup)]
        for key, col in (("bw", "bw_gbps"), ("latency", "latency_ms"), ("wait", "wait_ms"),
                         ("raw", "raw_ms"), ("calls", "calls")):
            value = _median(k[key] for k in kept)
            if value is not None:
                row[f"{dim}_{col}"] = value
    return row


def _traced_bubble(run_dir: Path) -> float | None:
    """Measured pipeline idle share of the traced last step (None without --trace)."""
    from commpipe.sim.compare import load_run, measured_bubble

    try:
        _, per_rank = load_run(run_dir)
        return measured_bubble(per_rank)
    except (FileNotFoundError, KeyError, ValueError):
        return None


def is_run_folder(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "config.json").exists()


def discover(sweep_dir) -> list[dict]:
    """The layouts of a sweep folder: status lines first (latest per name, in order), then any
    run folder (has metrics.jsonl or config.json) the status file does not mention."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"sweep folder {root} does not exist")
    entries: dict[str, dict] = {}
    for rec in read_jsonl(root / "sweep.jsonl"):
        entries.pop(rec["name"], None)
        entries[rec["name"]] = dict(rec)
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if sub.name not in entries and is_run_folder(sub):
            entries[sub.name] = {"name": sub.name, "status": "unknown"}
    if not entries:
        if is_run_folder(root):      # a single `commpipe train --out` folder: a one-row report
            return [{"name": root.resolve().name, "status": "unknown", "dir": str(root)}]
        raise FileNotFoundError(f"{root} holds no sweep.jsonl and no run folders; run `commpipe sweep` first")
    return list(entries.values())


def collect(sweep_dir, warmup: int = 1) -> list[dict]:
    """One row per layout (COLUMNS), best TFLOP/s first, failed layouts last."""
    root = Path(sweep_dir)
    rows = []
    for entry in discover(root):
        row = {k: entry.get(k) for k in ("name", "label", "tp", "cp", "pp", "dp", "ep", "schedule",
                                         "placement", "status", "reason", "dir")}
        summary = summarize_run(run_path(root, row), warmup)
        for key, value in summary.items():
            if row.get(key) is None:
                row[key] = value
        if row["status"] == "unknown":
            row["status"] = "ok" if summary.get("steps") else "failed"
        if row["status"] == "ok" and not summary.get("steps"):
            row["status"], row["reason"] = "failed", "finished without writing metrics.jsonl"
        if (run_path(root, row) / "adapt.jsonl").exists():     # its layout changed during the run
            from commpipe.report.adaptive import adaptive_label

            row["label"] = adaptive_label(run_path(root, row), row["name"]) or row.get("label")
        if not row.get("label") and row.get("tp") is not None:
            row["label"] = f"TP{row['tp']}/CP{row['cp']}/PP{row['pp']}" + (
                f"/DP{row['dp']}" if (row.get("dp") or 1) > 1 else "") + (
                f"/EP{row['ep']}" if (row.get("ep") or 1) > 1 else "")
        rows.append(row)
    # layouts that differ only in schedule (or vpp) would read alike: name it in their labels
    seen: dict = {}
    for r in rows:
        seen.setdefault(r.get("label"), set()).add((r.get("schedule"), r.get("vpp")))
    for r in rows:
        if len(seen.get(r.get("label"), ())) > 1 and r.get("schedule"):
            vpp = f" v{r['vpp']}" if r.get("schedule") == "interleaved" and r.get("vpp") else ""
            r["label"] = f"{r['label']} {r['schedule']}{vpp}"
    from commpipe.report.adaptive import mark_roles

    mark_roles(root, rows)
    best = max((r["tflops_per_gpu"] for r in rows if r["status"] == "ok" and r.get("tflops_per_gpu")),
               default=None)
    for r in rows:
        r["efficiency"] = r["tflops_per_gpu"] / best if best and r.get("tflops_per_gpu") else None
    rows.sort(key=lambda r: (r["status"] != "ok", -(r.get("tflops_per_gpu") or 0.0)))
    return rows


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value):
    """A text cell a spreadsheet would run as a formula (=, +, -, @ first; OWASP's CSV injection
    list) gets a leading `'`, which spreadsheets read as "text follows"; numbers stay numbers."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def write_csv(rows: list[dict], path) -> Path:
    """One row per layout; the csv module quotes commas, quotes and newlines inside cells."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: csv_text(r.get(k)) for k in COLUMNS})
    return path


def md_escape(text) -> str:
    """Text as markdown shows it, not as HTML or table structure: & < > as entities (markdown
    passes raw HTML through to the page), | escaped so a cell cannot split its row, and line
    breaks as spaces so a cell cannot end its table."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("|", "\\|").replace("\r", " ").replace("\n", " "))


def fmt(value, digits: int = 3) -> str:
    """Significant digits (TFLOP/s of a tiny CPU model are ~1e-4; an A100 run's ~30)."""
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def flops_unit(rows: list[dict]) -> tuple[float, str]:
    """(factor from TFLOP/s, unit) that writes the best layout's throughput with a few digits
    before the point: GFLOP/s below 1 TFLOP/s (a CPU run's ~1e-4 TFLOP/s reads 0.1 GFLOP/s)."""
    best = max((r.get("tflops_per_gpu") or 0.0 for r in rows), default=0.0)
    return (1.0, "TFLOP/s") if best >= 1 else (1e3, "GFLOP/s") if best >= 1e-3 else (1e6, "MFLOP/s")


def share(part, whole) -> str:
    return "–" if part is None or not whole else f"{part / whole:.0%}"


def main_header(rows: list[dict]) -> list[str]:
    return ["Layout", "TP", "CP", "PP", "DP", "m", "Step (ms)", "Tokens/s", f"{flops_unit(rows)[1]}/GPU",
            "Compute", "Bubble", "Exposed comm", "Final loss", "Status"]


def main_cells(r: dict, scale: float) -> list[str]:
    """The short table: throughput and where the traced step went (shares of it)."""
    b = r.get("breakdown") or {}
    status = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason') or ''}".strip()
    tf = r.get("tflops_per_gpu")
    comm = ", ".join(f"{d.upper() if d != 'other' else d} {share(b[d], b['window_ms'])}"
                     for d in ("pp", "tp", "cp", "dp", "ep", "other")
                     if b.get(d) and b[d] / b["window_ms"] >= 0.005)
    return [r.get("label") or r["name"], *(fmt(r.get(k)) for k in ("tp", "cp", "pp", "dp")),
            fmt(r.get("microbatches")), fmt(r.get("step_time_ms")), fmt(r.get("tokens_per_s")),
            fmt(None if tf is None else tf * scale), share(b.get("compute"), b.get("window_ms")),
            share(b.get("bubble_ms"), b.get("window_ms")) if b else
            ("–" if r.get("bubble") is None else f"{r['bubble']:.0%}"),
            (comm or "0%") if b else "–", fmt(r.get("final_loss"), 4), status.replace("|", "/")]


HEADER = ["Layout", "TP", "CP", "PP", "DP", "m", "TFLOP/s/GPU", "Step (ms)", "Bubble", "PP GB/s",
          "PP lat. (ms)",
          "PP calls/step", "PP wait (ms)", "PP raw (ms)", "TP GB/s", "TP lat. (ms)", "CP GB/s",
          "CP lat. (ms)", "DP GB/s", "DP lat. (ms)", "EP GB/s", "EP lat. (ms)", "Final loss",
          "Efficiency", "Status"]


def table_cells(r: dict) -> list[str]:
    eff = r.get("efficiency")
    status = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason') or ''}".strip()
    bubble = r.get("bubble")
    return [r.get("label") or r["name"], *(fmt(r.get(k)) for k in ("tp", "cp", "pp", "dp")),
            fmt(r.get("microbatches")), fmt(r.get("tflops_per_gpu")), fmt(r.get("step_time_ms")),
            "–" if bubble is None else f"{bubble:.0%}", fmt(r.get("pp_bw_gbps")),
            fmt(r.get("pp_latency_ms")), fmt(r.get("pp_calls")), fmt(r.get("pp_wait_ms")),
            fmt(r.get("pp_raw_ms")), fmt(r.get("tp_bw_gbps")), fmt(r.get("tp_latency_ms")),
            fmt(r.get("cp_bw_gbps")), fmt(r.get("cp_latency_ms")), fmt(r.get("dp_bw_gbps")),
            fmt(r.get("dp_latency_ms")), fmt(r.get("ep_bw_gbps")), fmt(r.get("ep_latency_ms")),
            fmt(r.get("final_loss"), 4),
            "–" if eff is None else f"{eff:.0%}", status]


def markdown_table(rows: list[dict], header: list[str] | None = None, cells=table_cells) -> str:
    header = header or HEADER
    return markdown_rows(header, [cells(r) for r in rows])


def markdown_rows(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table whose every cell is escaped (md_escape)."""
    lines = ["| " + " | ".join(map(md_escape, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(md_escape, cells)) + " |" for cells in rows]
    return "\n".join(lines)


TERMINAL = [("Layout", None), ("m", "microbatches"), ("Step ms", "step_time_ms"), ("Bubble", "bubble"),
            ("PP intra", "pp_intra_gbps"), ("PP inter", "pp_inter_gbps"),
            ("TP intra", "tp_intra_gbps"), ("TP inter", "tp_inter_gbps"), ("Loss", "final_loss")]
EP_TERMINAL = [("EP intra", "ep_intra_gbps"), ("EP inter", "ep_inter_gbps")]   # expert-parallel rows


def terminal_table(rows: list[dict], width: int = 100, report: str = "report.html") -> str:
    """The few columns a terminal has room for, aligned in plain text within `width` columns:
    step time, bubble, and bandwidth inside a node apart from across nodes (GB/s: per message
    for PP, nccl-tests bus bandwidth for TP, and for EP's all-to-all when a run measured it).
    Everything else is in the report."""
    def cell(r, key):
        if key is None:
            return r.get("label") or r["name"]
        if key == "bubble":
            return "–" if r.get(key) is None else f"{r[key]:.0%}"
        if r.get(key) is None and key.endswith("_gbps") and \
                key[:-len("_gbps")] in (r.get("small_messages") or ()):
            return "small"
        return fmt(r.get(key), 4 if key == "final_loss" else 3)

    ok = [r for r in rows if r["status"] == "ok"]
    # EP only in the link classes a run measured: the label keeps its room
    ep = [c for c in EP_TERMINAL if any(r.get(c[1]) is not None
                                        or c[1][:-len("_gbps")] in (r.get("small_messages") or ())
                                        for r in ok)]
    columns = TERMINAL[:-1] + ep + TERMINAL[-1:]
    body = [[cell(r, key) for _, key in columns] for r in ok]
    head = [h for h, _ in columns]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    room = width - sum(widths[1:]) - 2 * (len(widths) - 1)
    widths[0] = max(8, min(widths[0], room))

    def line(cells):
        first = cells[0] if len(cells[0]) <= widths[0] else cells[0][:widths[0] - 1] + "…"
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first.ljust(widths[0]), *rest]).rstrip()

    lines = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    lines.append(f"GB/s: PP per message, TP{'/EP all-to-all' if ep else ''} bus bandwidth; intra = links "
                 "inside a node, inter = across nodes.")
    if any(c == "small" for b in body for c in b[1:]):
        from commpipe.report.links import MIN_BANDWIDTH_BYTES

        lines.append(f"small: every message under {MIN_BANDWIDTH_BYTES // 1024} KiB, which times "
                     "the call's latency, not the link's bandwidth.")
    for r in rows:      # wrapped, not cut: the reason ends with what to change
        if r["status"] != "ok":
            lines += textwrap.wrap(f"{r.get('label') or r['name']}: {r['status']}: {r.get('reason') or ''}",
                                   width, subsequent_indent="  ", max_lines=4, placeholder=" …")
    lines.append(f"Every column, per-link matrices and figures: {report}")
    return "\n".join(lines)
