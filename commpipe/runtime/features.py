"""What the runtime can do, in one place: the trainer reads it, the planner prices it.

    RuntimeFeatures(sequence_parallel=True, overlap=Overlap(), recompute="selective")

- sequence_parallel (Korthikanti et al. 2022): with tp > 1, norms and residuals run on
  sequence shards; all-gather before column-parallel, reduce-scatter after row-parallel.
- overlap per dimension: tp (input-gradient collective beside the weight-gradient GEMM),
  tp_forward (with sequence parallelism, the all-gather before the column-parallel Linears
  beside their GEMMs over the rank's own rows; docs/overlap.md says why its default is what
  it is), dp
  (gradient buckets reduced during the backward), pp (receives posted one compute early).
  cp (the K/V all-gather beside the attention over the rank's own chunk, merged by
  log-sum-exp).
- recompute: none | selective (the attention core) | full (the whole layer, its input kept).
- precision: compute dtype (fp32 or bf16 autocast); parameters, gradients, optimizer states
  and the loss stay fp32; pipeline messages carry the compute dtype.
- zero: 0 or 1; ZeRO-1 shards optimizer states over `zero_group` (the DP ranks; CP replicas
  keep the same shard), gradients reduce-scattered and parameters all-gathered (Megatron's
  distributed optimizer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16")
ZERO_STAGES = (0, 1)
ZERO_GROUPS = ("dp",)
# chunked forward all-gather/GEMM overlap: off, it does not pay on CPU/gloo (docs/overlap.md,
# "Forward all-gather beside the own-row GEMMs"); --tp-forward-overlap turns it on
TP_FORWARD_DEFAULT = False


@dataclass(frozen=True)
class Overlap:
    tp: bool = True
    tp_forward: bool = TP_FORWARD_DEFAULT
    dp: bool = True
    pp: bool = True
    cp: bool = True

    @classmethod
    def none(cls) -> Overlap:
        return cls(tp=False, tp_forward=False, dp=False, pp=False, cp=False)


@dataclass(frozen=True)
class RuntimeFeatures:
    sequence_parallel: bool = True
    overlap: Overlap = field(default_factory=Overlap)
    recompute: str = "none"
    precision: str = "fp32"          # compute dtype; master weights, grads, optimizer: fp32
    zero: int = 0
    zero_group: str = "dp"

    def validate(self) -> RuntimeFeatures:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"--recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not supported by the runtime; "
                             f"use {' or '.join(PRECISIONS)}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage {self.zero} is not run by commpipe train; use 0 or 1 "
                             "(--zero1)")
        if self.zero_group not in ZERO_GROUPS:
            raise ValueError(f"ZeRO group {self.zero_group!r}: commpipe shards over dp")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def options() -> dict[str, tuple]:
        """Every value the runtime accepts, per field: what the planner may enumerate."""
        return {"sequence_parallel": (True, False), "recompute": RECOMPUTE_MODES,
                "precision": PRECISIONS, "zero": ZERO_STAGES, "overlap": (True, False)}
