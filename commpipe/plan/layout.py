"""A layout to price (`Layout`, commpipe.layout: the one the sweep runs too), the job it runs
(`Job`), and which layouts are valid.

Validity follows `ParallelDims.check_model` / `check_batch` (heads, KV heads and vocabulary
divisible by tp; seq_len divisible by 2*cp; pp*vpp <= layers; global batch divisible by
micro_batch_size*dp) plus each schedule's own constraints, so a layout the planner proposes is
one `commpipe train` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from commpipe.layout import Layout
from commpipe.models.spec import ModelSpec, divisors
from commpipe.runtime.features import RuntimeFeatures
from commpipe.schedules.registry import NAMES, info

# a GPU rank's fixed memory beyond its tensors (memory.py's docstring: "Reserve")
GPU_RANK_RESERVE_GIB = 1.5

SCHEDULES = NAMES          # every named schedule (commpipe.schedules.registry) is priced
RECOMPUTE = ("none", "selective", "full", "op")
# "op" is torchtitan's per-op selective activation checkpointing (memory.py, kernels.py); the
# search tries it only when --recompute fixes it (commpipe's runtime does not run it)
SEARCHED_RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp32", "fp8")
ZERO_STAGES = (0, 1, 2, 3)
CP_COMM = ("ring", "allgather")
CE_KERNELS = ("fused", "megatron-unfused")   # the loss kernels priced (kernels.CE_BYTES)
ATTN_KERNELS = ("fused", "fa2")     # the flash-attention kernels priced (compute.attention_rate)


def runtime_job(features: RuntimeFeatures | None = None) -> dict:
    """The `Job` fields that price commpipe's own runtime running with `features`, the one
    definition `commpipe train` reads (commpipe.runtime.features; default: what train runs
    without flags). Precision and ZeRO stay with the caller (`Job.precision`, `Layout.zero`).

    - sequence parallelism with tp > 1 (LLaMA): reduce-scatter / all-gather around the TP
      regions, norms on sequence shards, pipeline messages carry the shards;
    - CP: K and V all-gathered (Llama 3's CP), overlapped with the attention over the rank's own
      chunk, their gradients reduce-scattered after the backward's attention;
    - DP: buckets reduced during the last micro-batch's backward (ZeRO-1: reduce-scatter, then
      an all-gather of the updated parameters: the same traffic);
    - TP: the asynchronous input-gradient collective of each entry beside its projections'
      weight-gradient GEMMs (`tp_grad_overlap`, with TP overlap on; not inside the I passes of
      zero-bubble schedules, whose W GEMMs move to the W pass); the forward all-gather beside
      the own-row GEMMs (--tp-forward-overlap, off by default, a few ms on CPU) is not priced;
      no chunked (TE userbuffers) overlap, so `tp_overlap` stays off;
    - per step a grad-norm all-reduce over TP and PP and a loss all-reduce over DP*CP and PP;
      activations as this runtime saves them (`runtime="commpipe"`, plan/runtime_memory.py),
      SwiGLU keeping its SiLU output (plain PyTorch)."""
    f = features or RuntimeFeatures()
    return {"sequence_parallel": f.sequence_parallel, "pp_sharded": f.sequence_parallel,
            "cp_comm": "allgather", "cp_overlap": f.overlap.cp, "dp_overlap": f.overlap.dp,
            "tp_grad_overlap": f.overlap.tp,
            "tp_overlap": False, "step_syncs": True, "fused_swiglu": False, "runtime": "commpipe"}


RUNTIME_JOB = runtime_job()   # what `commpipe train` runs without flags
# The search skips context parallelism below 256 tokens per rank: ring attention then moves
# more K/V than it computes on (Llama 3 used CP16 only at 128K tokens); `estimate` still
# prices any cp that ParallelDims accepts.
MIN_CP_TOKENS = 256


@dataclass(frozen=True)
class Job:
    """What is trained, independent of the layout."""

    global_batch: int           # sequences per optimizer step
    seq_len: int
    precision: str = "bf16"     # bf16: mixed precision with fp32 master weights; fp32: all fp32;
    #                             fp8: bf16 mixed precision with the layers' linear GEMMs in FP8
    #                             (Transformer Engine; see compute.py and memory.py)
    zero1: bool = False         # ZeRO-1 at least (alias of Layout.zero=1; kept for old callers)
    dp_overlap: bool = True     # overlap the DP gradient all-reduce with the last backward pass
    sequence_parallel: bool = True  # Megatron SP: RS+AG instead of all-reduce, norms sharded
    flash_attention: bool | None = None  # None: on (TE/FlashAttention, every current stack);
    #                                      False for Megatron-DeepSpeed-era GPT runs (vTrain)
    grad_fp32: bool = False     # Megatron-LM's default: accumulate and reduce gradients in fp32
    # How the runtime communicates (defaults: Megatron-LM; `runtime_job()` gives commpipe's own):
    cp_comm: str = "ring"       # ring: K/V ring overlapped with attention; allgather: K/V gathered first
    cp_overlap: bool = False    # allgather: the gather travels while attention runs over the rank's
    #                             own chunk (commpipe's CPOverlappedCore); False: it waits before
    pp_sharded: bool = True     # pipeline sends [b, s/cp, h]/tp (SP or scatter-gather) vs the full tensor
    step_syncs: bool = False    # price the step's scalar all-reduces (grad norm, loss)
    fp8_params: bool = True     # fp8: weights kept as FP8 (+ transpose) instead of bf16 (Megatron
    #                             --fp8-param-gather, NeMo's FP8 recipes); False: bf16 weights plus
    #                             TE's cached FP8 copy and transpose
    tp_grad_overlap: bool = False  # each entry's input-gradient collective (all-reduce, SP:
    #                             reduce-scatter) beside its column projections' weight-gradient
    #                             GEMMs (commpipe's TPRegion; backward passes not split into I/W)
    tp_overlap: bool = False    # TP collectives pipelined with their GEMMs (TE userbuffers,
    #                             Megatron --tp-comm-overlap, NeMo's performance recipes)
    fused_swiglu: bool = True   # SwiGLU keeps only its input (Megatron/TE recompute SiLU); False:
    #                             plain PyTorch also keeps SiLU's output (commpipe's runtime)
    runtime: str = "megatron"   # whose activations memory.py counts; "commpipe": this runtime's
    #                             saved tensors, as activation_mb measures them (runtime_memory.py)
    eager_ops: bool = False     # non-GEMM ops as unfused PyTorch eager kernels, each a round trip
    #                             through HBM, counted op by op (torchtitan without torch.compile;
    #                             kernels.py); False: fused kernels (Megatron/TE, torch.compile)
    fsdp_copies: bool = False   # ZeRO-3 as PyTorch FSDP2: gathered weights copied out of, and
    #                             gradients into, flat NCCL buffers on the compute stream (kernels.py)
    expert_imbalance: float = 1.25  # MoE: token copies routed to the busiest EP rank over the
    #                             mean (Switch Transformer's capacity factor; plan/moe.py)
    moe_host_ops: bool = True   # MoE: the host operations of Megatron-Core's router, all-to-all
    #                             dispatcher and grouped experts added to each MoE layer's pass
    #                             (moe_host.py); False: not priced (torchtitan, not counted)
    param_gather_chained: bool = False  # Megatron-LM before Megatron-Core 0.9: the distributed
    #                             optimizer's bucket all-gathers chained, each launched when the
    #                             previous one is waited on (zero_costs.py); False: a chunk's
    #                             gather launched a chunk ahead (Megatron-Core 0.9 and later)
    ce_kernel: str = "fused"    # the head's cross-entropy kernels: "fused" (one pass, ~10 bytes
    #                             per logit each way) or "megatron-unfused" (Megatron-LM without
    #                             --cross-entropy-loss-fusion, counted op by op; kernels.py)
    attn_kernel: str = "fused"  # flash attention as the GPU generation's own fused kernel ("fused":
    #                             cuDNN's on Hopper and newer, as Transformer Engine picks it) or
    #                             as FlashAttention-2 ("fa2": PyTorch SDPA's default flash backend),
    #                             which does not reach Hopper's new instructions (compute.py)
    rank_reserve_gb: float = GPU_RANK_RESERVE_GIB  # a rank's memory beyond its tensors: on a GPU
    #                             the CUDA context, workspaces and communicator buffers (memory.py);
    #                             on CPU the process itself, torch imported (fits.CPU_RANK_RESERVE_GIB)

    def __post_init__(self):
        if self.global_batch < 1 or self.seq_len < 1:
            raise ValueError("--global-batch and --seq-len must be positive")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is unknown; use one of {PRECISIONS}")
        if self.cp_comm not in CP_COMM:
            raise ValueError(f"cp_comm {self.cp_comm!r} is unknown; use one of {CP_COMM}")
        if self.ce_kernel not in CE_KERNELS:
            raise ValueError(f"ce_kernel {self.ce_kernel!r} is unknown; use one of {CE_KERNELS}")
        if self.attn_kernel not in ATTN_KERNELS:
            raise ValueError(f"--attention-kernel {self.attn_kernel!r} is unknown; use one of "
                             f"{ATTN_KERNELS}")

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element on the wire: bf16 under mixed precision, else fp32."""
        return 4 if self.precision == "fp32" else 2

    @property
    def mixed(self) -> bool:
        """bf16 or fp8 training: bf16 weights with fp32 master copies in the optimizer."""
        return self.precision != "fp32"

    def uses_flash(self, spec: ModelSpec) -> bool:
        return True if self.flash_attention is None else self.flash_attention


def zero_stage(layout: Layout, job: Job) -> int:
    """The ZeRO stage priced: the layout's, at least 1 under the old `Job.zero1` flag."""
    return max(layout.zero, 1 if job.zero1 else 0)


def schedule_problem(schedule: str, pp: int, vpp: int, m: int) -> str | None:
    """Why (schedule, pp, vpp, m) cannot run, or None: the schedule's own constraints
    (commpipe.schedules.registry), with vpp counted as chunks per rank (a V schedule's 2), and
    one planner rule: without a pipeline, only 1f1b is priced (the others add nothing)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}"
    sched = info(schedule)
    if not sched.vpp_free and vpp != sched.fixed_chunks:
        return (f"{schedule} places exactly {sched.fixed_chunks} chunk(s) per rank; use --vpp "
                f"{sched.fixed_chunks}" + (" (or --schedule interleaved/zbv)" if vpp > 1 else ""))
    if pp == 1 and schedule != "1f1b":
        return f"pp=1 has no pipeline; {schedule} adds nothing over 1f1b (use --schedule 1f1b)"
    return sched.problem(pp, vpp, m)


def layout_problem(spec: ModelSpec, job: Job, layout: Layout, num_gpus: int | None = None) -> str | None:
    """Why a layout is invalid (divisibility, schedule), or None."""
    if layout.recompute not in RECOMPUTE:
        return f"recompute {layout.recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}"
    if layout.zero not in ZERO_STAGES:
        return f"--zero {layout.zero} is unknown; use one of {', '.join(map(str, ZERO_STAGES))}"
    group = layout.dp * layout.cp
    if layout.dp_shard < 0 or (layout.dp_shard and group % layout.dp_shard):
        return (f"--dp-shard {layout.dp_shard} does not divide the dp*cp group of {group} ranks; "
                f"use one of {divisors(group)}")
    dims = layout.dims
    try:
        dims.check_model(spec, job.seq_len, vpp=layout.vpp)
        if num_gpus is not None and dims.world_size != num_gpus:
            # the trainer's check_world speaks of processes to launch; a plan speaks of --gpus
            return (f"tp*cp*pp*dp = {dims.tp}*{dims.cp}*{dims.pp}*{dims.dp} = {dims.world_size} GPUs, "
                    f"not the {num_gpus} of --gpus; change the degrees or --gpus")
        m = dims.check_batch(job.global_batch, layout.micro_batch_size)
    except ValueError as e:
        return str(e)
    from commpipe.plan.moe import layout_problem as expert_problem  # plan.moe reads Layout

    return (schedule_problem(layout.schedule, layout.pp, layout.vpp, m)
            or info(layout.schedule).recompute_problem(layout.recompute)
            or expert_problem(spec, layout, zero_stage(layout, job)))


def zero_options(pp: int, group: int, fixed: dict) -> list[int]:
    """ZeRO stages the search tries: 1 (Megatron's distributed optimizer: same traffic as a plain
    all-reduce, less memory, so it dominates 0) and, without a pipeline, 3 (FSDP); with pp > 1
    FSDP keeps the stage's weights gathered across micro-batches (torchtitan), so 3 would price as
    1. With no data parallelism every stage is the same: 0. `fixed["zero"]` overrides."""
    if "zero" in fixed:
        return [fixed["zero"]]
    if group == 1:
        return [0]
    return [1, 3] if pp == 1 else [1]


def enumerate_layouts(spec: ModelSpec, job: Job, num_gpus: int, fixed: dict | None = None,
                      schedules=SCHEDULES, recomputes=SEARCHED_RECOMPUTE, max_vpp: int = 8) -> list[Layout]:
    """Every valid layout for `num_gpus`; `fixed` pins any of tp, cp, pp, dp, vpp,
    micro_batch_size, schedule, recompute, zero, dp_shard, ep (MoE models: searched over the
    divisors of dp*cp that divide the expert count)."""
    from commpipe.plan.moe import ep_options
    from commpipe.plan.moe import layout_problem as expert_problem

    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    out: list[Layout] = []
    tps = [t for t in divisors(num_gpus) if spec.heads % t == 0 and spec.kv_heads % t == 0
           and spec.vocab % t == 0]
    for tp in _pick(tps, fixed.get("tp")):
        rest_tp = num_gpus // tp
        cps = [c for c in divisors(rest_tp) if job.seq_len % (2 * c) == 0
               and (c == 1 or job.seq_len // c >= MIN_CP_TOKENS)]
        for cp in _pick(cps, fixed.get("cp")):
            rest_cp = rest_tp // cp
            pps = [p for p in divisors(rest_cp) if p <= spec.layers]
            for pp in _pick(pps, fixed.get("pp")):
                dp = rest_cp // pp
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                if job.global_batch % dp:
                    continue
                for mbs in _pick(divisors(job.global_batch // dp), fixed.get("micro_batch_size")):
                    m = job.global_batch // (dp * mbs)
                    for sched in _pick(list(schedules), fixed.get("schedule")):
                        top_vpp = max(max_vpp, fixed.get("vpp", 0))     # a fixed vpp may exceed it
                        if info(sched).braided and tp == 1 and "schedule" not in fixed:
                            continue      # braids hide TP collectives: with tp=1, zbv's V is the same
                        vpps = info(sched).vpp_options(pp, spec.layers, top_vpp)
                        for vpp in _pick(vpps, fixed.get("vpp")):
                            if schedule_problem(sched, pp, vpp, m):
                                continue
                            if pp * vpp > spec.layers:
                                continue
                            for rc in _pick(_recomputes(recomputes, fixed), fixed.get("recompute")):
                                if info(sched).recompute_problem(rc):
                                    continue
                                for z in zero_options(pp, dp * cp, fixed):
                                    if job.runtime == "commpipe" and (z > 1 or (z and dp == 1)):
                                        continue      # commpipe train: ZeRO-1 over DP at most
                                    shard = fixed.get("dp_shard", 0) if z else 0
                                    if shard and (dp * cp) % shard:
                                        continue
                                    for ep in ep_options(spec, dp * cp, fixed):
                                        lay = Layout(tp, cp, pp, dp, vpp, mbs, sched, rc, z, shard, ep=ep)
                                        if not expert_problem(spec, lay, z):
                                            out.append(lay)
    return out


def _recomputes(searched, fixed: dict) -> list:
    """The recompute modes to try: the searched ones, or any known one when fixed."""
    return list(RECOMPUTE) if "recompute" in fixed else list(searched)


def _pick(options: list, value):
    """The options a fixed value leaves: all (None), the value, or those of a tuple of values."""
    if value is None:
        return options
    if isinstance(value, tuple):
        return [o for o in options if o in value]
    return [value] if value in options else []
