"""`commpipe train --tensorboard --out DIR`: TensorBoard scalars in DIR/tensorboard.

    commpipe train --preset tiny --steps 20 --out runs/tb --tensorboard --comm-monitor all
    tensorboard --logdir runs/tb/tensorboard

Written through torch.utils.tensorboard.SummaryWriter by the rank that writes metrics.jsonl
(the last pipeline stage of DP rank 0), so the values are metrics.jsonl's, step for step:
train/loss, train/val_loss, train/lr, train/grad_norm, perf/step_time_s, perf/tokens_per_s,
perf/tflops_per_gpu, memory/activation_mb. With --comm-monitor, bandwidth/<dim>/<link class>
(GB/s) is each step's median over the links of that dimension and class, chosen as the report
chooses them (commpipe.report.links: a PP link's per-message bandwidth, a TP/CP/DP group's bus
bandwidth), read from rank 0's OUT/monitor/links.jsonl as the monitor writes it. Every
adaptive-controller record (detection, decision, trial, switch, settle) becomes a text entry
under adapt at its step.

SummaryWriter needs the `tensorboard` package (pip install tensorboard, or the project's
`[tensorboard]` extra); --tensorboard checks for it before training starts.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
           "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s",
           "tokens_per_s": "perf/tokens_per_s", "tflops_per_gpu": "perf/tflops_per_gpu",
           "activation_mb": "memory/activation_mb"}
LINK_DIMS = {"pp": "pp", "tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp"}


def check_available(out: str | None) -> None:
    """Fail before training when --tensorboard cannot write."""
    if not out:
        raise ValueError("--tensorboard writes into OUT/tensorboard; give --out DIR")
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard "
                         "(or pip install -e \".[tensorboard]\")")


def step_bandwidth(links: list[dict]) -> dict[tuple[int, str, str], float]:
    """{(step, dim, link class): median GB/s} over the links of links.jsonl records; the
    report's choice of links and bandwidth (commpipe.report.links.link_rows) per step."""
    acc: dict = {}
    for r in links:
        dim = LINK_DIMS.get(r.get("dim"))
        if dim is None or r.get("link_class") not in ("intra_node", "inter_node"):
            continue
        if r["kind"] == "p2p":
            if dim != "pp":
                continue
            n, bw = r.get("matched") or 0, r.get("bandwidth_gbps")
        else:
            if dim == "pp":         # the loss and grad-norm reductions, not a link
                continue
            n, bw = r.get("sampled") or 0, r.get("busbw_gbps")
        if n and bw and r.get("transfer_ms"):
            acc.setdefault((r["step"], dim, r["link_class"]), []).append(bw)
    return {k: statistics.median(v) for k, v in acc.items()}


def event_text(rec: dict) -> str:
    """One adaptive-controller record (OUT/adapt.jsonl) as a line of text."""
    def name(plan):
        return plan.get("name", "?") if isinstance(plan, dict) else str(plan)

    parts = [str(rec.get("action", "event"))]
    for d in rec.get("detections") or []:
        parts.append(f"{d.get('kind')} {d.get('key')}: {d.get('baseline', 0):.3g} -> "
                     f"{d.get('current', 0):.3g} ms ({d.get('shift', 0):+.0%})")
    if rec.get("from") or rec.get("to"):
        parts.append(f"{name(rec.get('from')) if rec.get('from') else '-'} -> "
                     f"{name(rec['to']) if rec.get('to') else '-'}")
    for key, unit in (("plan", ""), ("kind", ""), ("predicted_current_ms", " ms"),
                      ("predicted_best_ms", " ms"), ("predicted_ms", " ms"), ("measured_ms", " ms"),
                      ("predicted_saving_s", " s"), ("switch_cost_s", " s"),
                      ("switch_time_s", " s"), ("reason", "")):
        value = rec.get(key)
        if value is not None:
            value = f"{value:.4g}" if isinstance(value, float) else value
            parts.append(f"{key} {value}{unit}")
    return "; ".join(parts)


class TensorBoardLog:
    """Created on every rank; only the logging rank opens a writer. After an adaptive switch
    that moves the logging rank, the new one opens its own event file in the same folder."""

    def __init__(self, out):
        self.dir = Path(out) / "tensorboard"
        self.links_path = Path(out) / "monitor" / "links.jsonl"
        self.writer = None
        self._links_at = 0     # bytes of links.jsonl already read
        self._events_seen = 0

    def _open(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(self.dir))
        return self.writer

    def log_step(self, trainer, rec: dict, events: list[dict] = ()) -> None:
        """After every step, on every rank: the step's scalars, the controller records not yet
        written, and the bandwidth of steps the monitor has finished since."""
        if not trainer.is_logger:
            self._close_writer()
            self._events_seen = len(events)   # the logging rank wrote them
            return
        w = self._open()
        for key, tag in SCALARS.items():
            if rec.get(key) is not None:
                w.add_scalar(tag, rec[key], rec["step"])
        self._write_events(events)
        self._read_links()

    def _write_events(self, events: list[dict]) -> None:
        for e in events[self._events_seen:]:
            self.writer.add_text("adapt", event_text(e), int(e.get("step", 0)))
        self._events_seen = len(events)

    def _read_links(self) -> None:
        """The complete lines rank 0 appended to links.jsonl since the last read."""
        try:
            with open(self.links_path, "rb") as f:
                f.seek(self._links_at)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1     # a line rank 0 is still writing waits for next time
        self._links_at += end
        records = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        for (step, dim, cls), gbps in sorted(step_bandwidth(records).items()):
            self.writer.add_scalar(f"bandwidth/{dim}/{cls}", gbps, step)

    def close(self, comm=None, events: list[dict] = ()) -> None:
        """The controller records of the last step, then the event file is closed. comm: given
        on every rank once the monitor has closed (collective): wait for rank 0 to write the
        monitor's last records, and read them first."""
        if comm is not None:
            comm.barrier()
        if self.writer is not None:
            self._write_events(events)
            self._read_links()
        self._close_writer()

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
