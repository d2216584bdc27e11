"""`ParallelDims`: the layout (dp, pp, cp, tp) and its rank grid.

Rank order follows Megatron-LM's default "tp-cp-dp-pp" (innermost first): TP is innermost
(consecutive ranks, so TP groups share a node), then CP, then DP, and PP outermost (pipeline
stages span nodes):

    grid = arange(world).view(pp, dp, cp, tp)
    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

`order` names another placement of the same degrees, as Megatron's RankGenerator order does:
"tp-cp-pp-dp" puts consecutive pipeline stages on consecutive ranks (inside a node) and the DP
replicas outermost, so the gradient all-reduce crosses nodes and the stage-to-stage messages do
not. Every group, peer and coordinate follows from `coords` / `rank_of`; the values computed are
the same under any order (the adaptive controller re-places ranks this way when a link slows).

Validation is pure Python so that bad input fails before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from commpipe.models.spec import ModelSpec, divisors

DIM_NAMES = ("pp", "dp", "cp", "tp")  # outermost first (the default order)
DEFAULT_ORDER = "tp-cp-dp-pp"         # innermost first, as Megatron-LM writes it


def _fmt(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    order: str = DEFAULT_ORDER   # rank placement, innermost dimension first (module docstring)

    def __post_init__(self):
        for name in DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if sorted(self.order.split("-")) != sorted(DIM_NAMES):
            raise ValueError(f"rank order {self.order!r} must name tp, cp, dp and pp once each, "
                             f"innermost first (default {DEFAULT_ORDER}; e.g. tp-cp-pp-dp)")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def __str__(self) -> str:
        base = f"tp{self.tp}-cp{self.cp}-pp{self.pp}-dp{self.dp}"
        return base if self.order == DEFAULT_ORDER else f"{base} ranks {self.order}"

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours of one dimension: the product of the degrees of the
        dimensions inside it in `order`."""
        out = 1
        for d in self.order.split("-"):
            if d == dim:
                return out
            out *= getattr(self, d)
        raise ValueError(f"unknown dimension {dim!r}; use one of {DIM_NAMES}")

    # -- validation -------------------------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp}"
                f" = {self.world_size}; launch {self.world_size} processes "
                f"(torchrun --nproc-per-node {self.world_size}) or change the layout"
            )

    def check_model(self, spec: ModelSpec, seq_len: int, layers_per_stage: list[int] | None = None,
                    vpp: int = 1) -> None:
        if spec.heads % self.tp:
            ok = [d for d in divisors(spec.heads) if spec.kv_heads % d == 0]
            raise ValueError(f"tp={self.tp} does not divide {spec.heads} attention heads; "
                             f"use tp in {_fmt(ok)}")
        if spec.kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide {spec.kv_heads} KV heads; "
                             f"use tp in {_fmt(divisors(spec.kv_heads))}")
        if spec.vocab % self.tp:
            raise ValueError(f"tp={self.tp} does not divide vocab={spec.vocab} (vocabulary-parallel "
                             f"embedding); use tp in {_fmt(divisors(spec.vocab)[:12])}")
        stages = self.pp * vpp
        if layers_per_stage is not None:
            if len(layers_per_stage) != stages:
                raise ValueError(f"--stage-layers lists {len(layers_per_stage)} stages but pp*vpp="
                                 f"{stages}; give one layer count per stage")
            if sum(layers_per_stage) != spec.layers or min(layers_per_stage) < 1:
                raise ValueError(f"--stage-layers {layers_per_stage} must be positive and sum to "
                                 f"the model's {spec.layers} layers")
        elif spec.layers < stages:
            raise ValueError(f"pp*vpp={stages} stages exceeds the model's {spec.layers} layers; "
                             f"use pp*vpp <= {spec.layers}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        if self.cp > 1 and seq_len % (2 * self.cp):
            # context parallelism cuts the sequence into 2*cp chunks (causal load balance)
            fits = [c for c in (2, 4, 8, 16) if c < self.cp and seq_len % (2 * c) == 0]
            chunk = 2 * self.cp
            nearest = " or ".join(str(n) for n in (seq_len // chunk * chunk, -(-seq_len // chunk) * chunk)
                                  if n > 0)
            also = f", or cp in {_fmt(fits)}" if fits else ""
            raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * self.cp} (context "
                             f"parallelism cuts the sequence into 2*cp chunks); use --seq-len "
                             f"{nearest}{also}")

    def check_batch(self, global_batch: int, micro_batch_size: int) -> int:
        """Return micro-batches per pipeline m = B / (b * dp), or explain why it is not whole."""
        if micro_batch_size < 1 or global_batch < 1:
            raise ValueError("--global-batch and --micro-batch-size must be positive")
        per_dp = global_batch // self.dp
        if global_batch % self.dp or per_dp % micro_batch_size:
            raise ValueError(
                f"global batch {global_batch} is not divisible by micro_batch_size*dp = "
                f"{micro_batch_size}*{self.dp}; use a global batch that is a multiple of "
                f"{micro_batch_size * self.dp}"
            )
        return per_dp // micro_batch_size

    # -- the rank grid ------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {"pp": .., "dp": .., "cp": .., "tp": ..}."""
        return {d: (rank // self.stride(d)) % getattr(self, d) for d in DIM_NAMES}

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        at = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        return sum(at[d] * self.stride(d) for d in DIM_NAMES)

    def groups(self, dim: str) -> list[list[int]]:
        """All rank groups of one dimension ("tp", "cp", "dp", "pp" or "dp_cp")."""
        dims = ("dp", "cp") if dim == "dp_cp" else (dim,)
        for d in dims:
            if d not in DIM_NAMES:
                raise ValueError(f"unknown dimension {dim!r}; use one of {DIM_NAMES} or dp_cp")
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(v for k, v in c.items() if k not in dims)
            out.setdefault(key, []).append(rank)
        return list(out.values())

    def group_of(self, dim: str, rank: int) -> list[int]:
        for g in self.groups(dim):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is outside world size {self.world_size}")


def split_layers(layers: int, stages: int, explicit: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges per stage: an explicit list, or as even as possible (earlier
    stages take the remainder, since the last stage also holds the head and loss)."""
    counts = explicit or [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
