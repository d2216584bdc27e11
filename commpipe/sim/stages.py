"""Cost tables for heterogeneous pipeline stages, from their boundary descriptions.

The simulator prices each point-to-point message by its stage boundary (`CostTable.
activation_bytes` is per boundary), so a stage split of a vision-language model, where a cut
inside the encoder carries image hidden states and a cut inside the decoder carries text hidden
states plus the image features, needs only the stages' `StageIO` and per-stage compute times.

    >>> from commpipe.models.blip_spec import resolve_blip, stage_io
    >>> spec = resolve_blip("blip-tiny")
    >>> boundary_bytes(stage_io(spec, [3, 2, 3], micro_batch=1))
    [100864, 121344]

Pure Python: no torch import.
"""

from __future__ import annotations

from commpipe.parallel.balance import stage_costs
from commpipe.sim.costs import CostTable


def boundary_bytes(stage_io) -> list[int]:
    """Bytes of the forward message across each boundary s -> s+1 (its gradient message is as
    large: every boundary tensor is floating)."""
    return [io.send_bytes for io in stage_io[:-1]]


def stage_cost_table(stage_io, layer_costs: list[float], ms_per_cost: float,
                     backward_ratio: float = 2.0, **kw) -> CostTable:
    """A CostTable whose stage s computes the sum of its layers' costs: forward
    `cost * ms_per_cost`, backward `backward_ratio` times that; messages sized from the
    descriptions. kw: latency_ms, bandwidth_gbps, ... as CostTable takes them."""
    counts = [len(io.layers) for io in stage_io]
    f = [c * ms_per_cost for c in stage_costs(layer_costs, counts)]
    return CostTable(f=f, b=[x * backward_ratio for x in f],
                     activation_bytes=[float(x) for x in boundary_bytes(stage_io)], **kw)
