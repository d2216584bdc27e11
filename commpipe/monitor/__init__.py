"""Communication monitor: sampled, per-step, wait-vs-transfer timing of every comm call.

See docs/monitor.md. `Monitor` observes a `commpipe.parallel.comm.Comm`; `probe` measures
links before training; `megatron` installs the same monitor into Megatron-Core.
`Monitor` is imported on first use, so `parse_monitor_flag` and the probe's parser do not pull
in torch.
"""

from contextlib import contextmanager

from commpipe.monitor.flag import parse_monitor_flag

__all__ = ["Monitor", "parse_monitor_flag", "unmonitored"]


@contextmanager
def unmonitored(trainer):
    """Keep the traffic of the block out of the monitor's per-step link records (evaluation,
    checkpoints, the stop flags, the adaptive controller's control traffic: between steps, not
    of them). A monitor that is not observing stays so."""
    mon = trainer.monitor
    if mon is None or mon not in trainer.comm.observers:
        yield
        return
    mon.detach()
    try:
        yield
    finally:
        mon.attach()


def __getattr__(name):
    if name == "Monitor":
        from commpipe.monitor.monitor import Monitor

        return Monitor
    raise AttributeError(f"module 'commpipe.monitor' has no attribute {name!r}")
