"""Communication monitor: sampled, per-step, wait-vs-transfer timing of every comm call.

See docs/monitor.md. `Monitor` observes a `commpipe.parallel.comm.Comm`; `probe` measures
links before training; `megatron` installs the same monitor into Megatron-Core.
`Monitor` is imported on first use, so `parse_monitor_flag` and the probe's parser do not pull
in torch.
"""

from commpipe.monitor.flag import parse_monitor_flag

__all__ = ["Monitor", "parse_monitor_flag"]


def __getattr__(name):
    if name == "Monitor":
        from commpipe.monitor.monitor import Monitor

        return Monitor
    raise AttributeError(f"module 'commpipe.monitor' has no attribute {name!r}")
