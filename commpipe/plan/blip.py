"""Planning a BLIP-style captioner (commpipe.models.blip_spec): rank (tp, pp, dp, micro-batch,
schedule) layouts of `blip-*` on a cluster, each with stages balanced by FLOPs.

    commpipe plan --model blip-base --gpu a100-80gb --gpus 16 --global-batch 256

Per layout:
- the split: `balance(layer_flops, stages)` (exact, contiguous; commpipe.parallel.balance);
- compute per stage and micro-batch: the stage's forward FLOPs / tp at the GPU's bf16 peak times
  Efficiency.e_max, plus Efficiency.overhead_s per layer; backward twice the forward;
- TP (no sequence parallelism, as the runtime trains blip): per encoder layer two all-reduces of
  [b, P, he] forward and two backward; per decoder layer three of [b, s, h] forward (self-
  attention, cross-attention, MLP) and three backward plus one of the image features [b, P, he]
  (cross-attention's K/V input gradient); all exposed;
- pipeline messages sized from the stages' boundary descriptions (`stage_io` send bytes, bf16:
  image hidden states inside the encoder, text hidden states plus image features past it), on
  the link between neighbouring stages; the step's pipeline time from the simulator;
- DP: an all-reduce of the largest stage's gradients (bf16), counted exposed;
- memory per rank: weights, gradients and Adam states at 18 bytes per parameter (bf16 weights,
  fp32 master, fp32 gradients, two fp32 moments) of the stage's share / tp, plus activations of
  the micro-batches 1F1B keeps in flight on that stage: per encoder layer Korthikanti et al.'s
  s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes, per decoder layer the same for the caption plus
  cross-attention's K and V of all image tokens and its scores, and the image features every
  decoder stage holds.
A first-order model: no fitted efficiency curve, no recomputation or ZeRO. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from commpipe.models.blip_spec import BlipSpec, layer_flops, layer_params, stage_io
from commpipe.parallel.balance import balance, stage_costs
from commpipe.schedules import generate
from commpipe.sim import CostTable, simulate

BYTES_PER_PARAM = 18          # bf16 weights + fp32 master + fp32 grads + Adam m, v
ACT_BYTES = 2                 # bf16 activations and messages


@dataclass
class BlipPlan:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    microbatches: int
    schedule: str
    split: list[int]
    stage_ms: list[float]            # forward + backward of one micro-batch, compute + TP
    step_ms: float
    memory_gib: float                # the fullest rank
    fits: bool

    def to_dict(self) -> dict:
        return asdict(self)


def encoder_layer_act(spec: BlipSpec, b: int, t: int) -> float:
    s, h, a = spec.image_tokens, spec.enc_hidden, spec.enc_heads
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def decoder_layer_act(spec: BlipSpec, b: int, t: int) -> float:
    s, h, a, p, he = spec.text_len, spec.dec_hidden, spec.dec_heads, spec.image_tokens, spec.enc_hidden
    own = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    cross = b * (2 * p * h * ACT_BYTES / t + 5 * a * s * p / t + 4 * s * h)   # K, V, scores, q/out
    return own + cross + b * p * he * ACT_BYTES / t    # its K/V projections' input, per shard


def plan_layout(spec: BlipSpec, cluster, eff, global_batch: int, tp: int, pp: int, mbs: int,
                schedule: str = "1f1b") -> BlipPlan | None:
    """One layout priced; None when it cannot run (batch or stage count)."""
    gpus = cluster.num_gpus
    if gpus % (tp * pp) or pp > spec.layers:
        return None
    dp = gpus // (tp * pp)
    if global_batch % (mbs * dp):
        return None
    m = global_batch // (mbs * dp)
    if m < pp and schedule != "gpipe":
        return None
    fwd = [float(x) for x in layer_flops(spec)]
    split = balance(fwd, pp)
    peak = cluster.gpu.achievable_tflops("bf16") * 1e12 * eff.e_max
    tp_size, tp_stride = tp, 1
    pp_stride = tp * dp
    f_s, b_s, tp_s, mem = [], [], [], []
    io = stage_io(spec, split, mbs, dtype="bfloat16")
    start = 0
    img = mbs * spec.image_tokens * spec.enc_hidden * ACT_BYTES
    txt = mbs * spec.text_len * spec.dec_hidden * ACT_BYTES
    for k, (count, flops) in enumerate(zip(split, stage_costs(fwd, split))):
        layers = range(start, start + count)
        start += count
        f = flops * mbs / tp / peak + count * eff.overhead_s
        enc = sum(1 for i in layers if spec.is_encoder_layer(i))
        dec = count - enc
        ar = lambda n: cluster.all_reduce(n, tp_size, tp_stride)   # noqa: E731
        tp_f = enc * 2 * ar(img) + dec * 3 * ar(txt)
        tp_b = enc * 2 * ar(img) + dec * (3 * ar(txt) + ar(img))
        f_s.append(f + tp_f)
        b_s.append(2 * f + tp_b)
        tp_s.append(tp_f + tp_b)
        params = sum(layer_params(spec, i) for i in layers) / tp
        act = enc * encoder_layer_act(spec, mbs, tp) + dec * decoder_layer_act(spec, mbs, tp)
        if dec:
            act += img / tp
        in_flight = m if schedule == "gpipe" else min(pp - k, m)
        mem.append(params * BYTES_PER_PARAM + act * in_flight)
    link = cluster.p2p_link(0, pp_stride) if pp > 1 else cluster.intra
    costs = CostTable(f=[x * 1e3 for x in f_s], b=[x * 1e3 for x in b_s],
                      latency_ms=link.latency_s * 1e3, bandwidth_gbps=link.bandwidth_gbps,
                      activation_bytes=[float(x.send_bytes) for x in io[:-1]])
    pipe_ms = simulate(generate(schedule, pp, m), costs).makespan
    biggest = max(sum(layer_params(spec, i) for i in range(s0, s0 + c)) / tp
                  for s0, c in zip([sum(split[:j]) for j in range(pp)], split))
    dp_ms = cluster.all_reduce(biggest * ACT_BYTES, dp, tp) * 1e3
    limit = cluster.gpu.mem_gb * 2 ** 30
    return BlipPlan(tp, pp, dp, mbs, m, schedule, split,
                    [round((f + b) * 1e3, 3) for f, b in zip(f_s, b_s)],
                    pipe_ms + dp_ms, max(mem) / 2 ** 30, max(mem) <= limit)


def plan_blip(spec: BlipSpec, cluster, eff, global_batch: int, fixed: dict | None = None,
              top: int = 5) -> list[BlipPlan]:
    """The fastest layouts that fit, best first (or, when none fits, the least memory-hungry)."""
    fixed = fixed or {}
    unsupported = sorted(set(fixed) - {"tp", "pp", "dp", "micro_batch_size", "schedule"})
    if unsupported or fixed.get("cp", 1) != 1:
        raise ValueError(f"planning {spec.name} fixes only --tp --pp --dp --micro-batch-size "
                         f"--schedule (no CP for blip models); drop {unsupported}")
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node
           and spec.enc_heads % t == 0 and spec.dec_heads % t == 0 and spec.vocab % t == 0]
    plans = []
    for tp in [fixed["tp"]] if "tp" in fixed else tps:
        for pp in [fixed["pp"]] if "pp" in fixed else range(1, spec.layers + 1):
            for mbs in [fixed["micro_batch_size"]] if "micro_batch_size" in fixed else (1, 2, 4, 8, 16):
                for sched in [fixed["schedule"]] if "schedule" in fixed else ("1f1b", "zbh1"):
                    if pp == 1 and sched != "1f1b":
                        continue
                    p = plan_layout(spec, cluster, eff, global_batch, tp, pp, mbs, sched)
                    if p is not None and ("dp" not in fixed or p.dp == fixed["dp"]):
                        plans.append(p)
    if not plans:
        raise ValueError(f"no layout of {spec.name} runs {global_batch} images per step on "
                         f"{cluster.num_gpus} GPUs with {fixed}; change --global-batch or the fixed "
                         "dimensions")
    fit = sorted((p for p in plans if p.fits), key=lambda p: p.step_ms)
    return fit[:top] if fit else sorted(plans, key=lambda p: p.memory_gib)[:top]


def print_blip_plan(spec: BlipSpec, cluster, global_batch: int, plans: list[BlipPlan]) -> None:
    print(f"{spec.name} ({spec.enc_layers} encoder + {spec.dec_layers} decoder layers, "
          f"{spec.image_tokens} image tokens, {spec.text_len} caption tokens) on "
          f"{cluster.num_gpus} x {cluster.gpu.name}; global batch {global_batch} images; stages "
          "balanced by FLOPs")
    if not plans[0].fits:
        print("no layout fits in memory; the least memory-hungry:")
    for p in plans:
        print(f"  tp{p.tp} pp{p.pp} dp{p.dp} mbs{p.micro_batch_size} x{p.microbatches} "
              f"{p.schedule if p.pp > 1 else '-':<5} split {p.split}: step {p.step_ms:8.1f} ms, "
              f"stage fwd+bwd {p.stage_ms} ms, memory {p.memory_gib:.1f} GB"
              f"{'' if p.fits else ' (does not fit)'}")


def run_blip_cli(args) -> int:
    """`commpipe plan --model blip-*`."""
    import json
    import sys

    from commpipe.models.blip_spec import resolve_blip
    from commpipe.plan.cli_inputs import cluster_from_args, fixed_from_args

    spec = resolve_blip(args.model)
    if not args.global_batch or args.global_batch < 1:
        raise ValueError("--global-batch (images per step) is required")
    if args.seq_len and args.seq_len != spec.text_len:
        raise ValueError(f"{spec.name} trains on {spec.text_len}-token captions; drop --seq-len")
    cluster, eff = cluster_from_args(args, profile_path=args.profile)
    plans = plan_blip(spec, cluster, eff, args.global_batch, fixed_from_args(args), args.top)
    if args.json:
        json.dump([p.to_dict() for p in plans], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_blip_plan(spec, cluster, args.global_batch, plans)
    return 0
