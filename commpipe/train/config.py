"""Training configuration: small dataclasses, validated before any process group starts."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from commpipe.models.spec import ModelSpec
from commpipe.parallel.dims import ParallelDims
from commpipe.train.hooks import Drill, Steering

MAX_STEP_PASSES = 65536   # micro-batches x pipeline stages per step (TrainConfig.resolve_batch)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0
    zero1: bool = False


@dataclass
class TrainConfig:
    model: str = "tiny"
    dims: ParallelDims = field(default_factory=ParallelDims)
    ep: int = 1                       # expert parallelism, carved from dp*cp (parallel.expert)
    schedule: str = "1f1b"
    vpp: int = 1
    microbatches: int | None = None
    micro_batch_size: int = 1
    dp_microbatches: tuple[int, ...] | None = None  # per DP replica (train.dp_split); None: even
    global_batch: int | None = None
    seq_len: int = 64
    steps: int = 10
    seed: int = 0
    stage_layers: list[int] | str | None = None   # counts, or "auto" / "auto:measured"
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: str | None = None
    tokenizer: str | None = None      # a tokenizer.json for --data (default: the one in DIR)
    vocab_size: int | None = None     # choose/train tokenizer-<N>.json in the data directory
    vocab: int | None = None          # model vocabulary (with --data: the tokenizer's, padded)
    eval_every: int = 0               # validation loss every N steps (0: never)
    eval_batches: int = 4             # global batches of the valid split per evaluation
    save_every: int = 0               # checkpoint every N steps into OUT/checkpoints (0: never)
    resume: str | None = None         # "latest" (OUT/checkpoints) or a checkpoint path
    init_from: str | None = None      # start from this checkpoint's weights (train.weights)
    overwrite: bool = False           # replace the run OUT holds (commpipe.train.run_folder)
    timeout_s: float = 300.0          # process-group timeout: a rank that stops answering
    hang_timeout_s: float = 60.0      # hang watchdog: no step for this long names the stuck rank
    elastic: bool = False             # re-plan for torchrun's world size, resume (commpipe.elastic)
    peer_copy_every: int | None = None  # --elastic: state copies on another node (train.peer_copies)
    fail_at: tuple[int, int] | None = None  # fault drill: (rank, step) raises at that step
    out: str | None = None
    monitor: float | None = None
    trace: bool = False
    tensorboard: bool = False         # scalars and adapt events into OUT/tensorboard
    log_every: int = 1
    device: str = "auto"
    emulate_device: float = 1.0       # CPU: compute ops take this many times their host time,
                                      # the host idle for the rest (commpipe.runtime.device_time)
    precision: str | None = None      # fp32 | bf16 (autocast); default bf16 on CUDA, fp32 on CPU
    strict_order: bool = False        # match point-to-point messages in issue order, as NCCL does
    adapt: Steering | None = None     # --adapt: commpipe.adapt.config.AdaptConfig
    slow_rank: Drill | None = None    # fault drill (adapt.config.SlowRank): a slower rank
    sequence_parallel: bool = True    # with tp > 1 (commpipe.runtime.features)
    overlap: bool = True              # --no-overlap: every overlap off, for A/B measurement
    recompute: str = "none"           # none | selective | full
    dp_bucket_mb: float = 25.0        # gradient bucket size of the DP reduction
    tp_forward_overlap: bool | None = None  # SP all-gather beside own-row GEMMs; None: default

    # filled by resolve()
    spec: ModelSpec | None = None
    stage_balance: dict | None = None  # --stage-layers auto: costs, split, predicted stage costs

    def resolve(self, world_size: int | None = None) -> TrainConfig:
        """Derive micro-batches / global batch and validate everything that can be checked
        without starting processes. Raises ValueError naming the fix."""
        from commpipe.models.family import family_for_model
        from commpipe.train.families import training_for

        # the model family's part (commpipe.train.decoder, commpipe.train.multimodal)
        training = training_for(family_for_model(self.model))
        if self.ep != 1 and not training.expert_parallel:
            raise ValueError(f"--ep {self.ep} shards the experts of MoE models; {self.model} has "
                             "none: drop --ep (or train a MoE model, e.g. --model moe-tiny)")
        training.resolve_config(self, world_size)
        return self

    def resolve_batch(self) -> None:
        """Micro-batches per pipeline m = B / (b * dp) and the global batch B, from whichever
        was given (m defaults to 2*pp); the step count."""
        d, b = self.dims, self.micro_batch_size
        for flag, value in (("--microbatches", self.microbatches), ("--micro-batch-size", b),
                            ("--global-batch", self.global_batch), ("--seq-len", self.seq_len)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.microbatches is None and self.global_batch is None:
            self.microbatches = max(2 * d.pp, 2)
        if self.global_batch is None:
            self.global_batch = self.microbatches * b * d.dp
        m = d.check_batch(self.global_batch, b)
        if self.microbatches is not None and self.microbatches != m:
            raise ValueError(f"--microbatches {self.microbatches} disagrees with --global-batch "
                             f"{self.global_batch} / (micro-batch-size {b} * dp {d.dp}) = {m}; "
                             "give one of them")
        self.microbatches = m
        from commpipe.train.dp_split import check_dp_microbatches

        self.dp_microbatches = check_dp_microbatches(self.dp_microbatches, d.dp, m, d.pp,
                                                     self.schedule)
        # the runtime builds the step's program action by action (about 0.1 kB and 40 us each)
        passes = max(self.dp_microbatches or (m,)) * d.pp * self.vpp
        most = max(1, MAX_STEP_PASSES // (d.pp * self.vpp))
        if passes > MAX_STEP_PASSES:
            raise ValueError(f"{m} micro-batches per step through {d.pp * self.vpp} pipeline "
                             f"stages make {passes} forward passes, more than {MAX_STEP_PASSES} a "
                             f"step's program holds; use --microbatches <= "
                             f"{most} or --global-batch <= {most * b * d.dp} (a larger "
                             "--micro-batch-size keeps the global batch)")
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps} must be >= 1")

    def _check_run_options(self) -> None:
        for flag, value in (("--eval-every", self.eval_every), ("--save-every", self.save_every)):
            if value < 0:
                raise ValueError(f"{flag} {value} must be >= 0 (0 turns it off)")
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches {self.eval_batches} must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s {self.timeout_s} must be positive")
        if self.hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout-s {self.hang_timeout_s} must be >= 0 (0 turns the "
                             "hang watchdog off)")
        if self.peer_copy_every is not None and self.peer_copy_every < 0:
            raise ValueError(f"--peer-copy-every {self.peer_copy_every} must be >= 0 (0 turns the "
                             "copies off)")
        if self.peer_copy_every and not self.elastic:
            raise ValueError("--peer-copy-every keeps copies for the restarts of --elastic; add "
                             "--elastic (and run under torchrun's elastic agent) or drop it")
        o = self.optim
        for flag, value, ok, rule in (
                ("--lr", o.lr, o.lr > 0, "must be > 0"),
                ("--min-lr", o.min_lr, 0 <= o.min_lr <= o.lr, f"must be in [0, --lr {o.lr}]"),
                ("--warmup", o.warmup_steps, o.warmup_steps >= 0, "must be >= 0 (0: no warm-up)"),
                ("--clip", o.clip, o.clip >= 0, "must be >= 0 (0 turns clipping off)"),
                ("--log-every", self.log_every, self.log_every >= 1, "must be >= 1")):
            if not ok:
                raise ValueError(f"{flag} {value} {rule}")
        if self.fail_at is not None:
            (rank, step), world = self.fail_at, self.dims.world_size
            if not 0 <= rank < world:
                raise ValueError(f"--fail-at {rank}:{step}: the layout has {world} ranks "
                                 f"(0..{world - 1}); use a RANK in that range")
            if not 0 <= step < self.steps:
                raise ValueError(f"--fail-at {rank}:{step}: the run has steps 0..{self.steps - 1}; "
                                 "use a STEP in that range")
        self._check_device()
        if self.save_every and not self.out:
            raise ValueError("--save-every writes into OUT/checkpoints; give --out DIR")
        if self.tensorboard:
            from commpipe.train.tensorboard import check_available

            check_available(self.out)
        if self.resume == "latest" and not self.out:
            raise ValueError("--resume without a path reads OUT/checkpoints; give --out DIR or "
                             "--resume PATH")
        self._check_precision()
        self.features()
        if self.dp_bucket_mb <= 0:
            raise ValueError(f"--dp-bucket-mb {self.dp_bucket_mb} must be positive")
        if (self.tokenizer or self.vocab_size) and not self.data:
            raise ValueError("--tokenizer and --vocab-size choose the tokenizer of --data DIR; "
                             "give --data")

    def _check_adapt(self, world: int) -> None:
        if self.adapt is not None:
            self.adapt.validate()
            if not self.out:
                raise ValueError("--adapt logs its decisions to OUT/adapt.jsonl; give --out DIR")
            if self.monitor is None:   # link signals come from the monitor, one call in ten
                self.monitor = 0.1
            from commpipe.schedules.registry import ONE_CHUNK

            if self.schedule not in ONE_CHUNK:
                raise ValueError(f"--adapt re-splits stages of one-chunk schedules "
                                 f"({', '.join(ONE_CHUNK)}); --schedule {self.schedule} is not "
                                 "one of them")
        if self.slow_rank is not None and self.slow_rank.rank >= world:
            raise ValueError(f"--slow-rank {self.slow_rank.rank}: there are only {world} ranks "
                             f"(0..{world - 1})")

    def _check_device(self) -> None:
        import torch

        from commpipe.runtime.device_time import check_factor

        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: PyTorch sees no CUDA GPU here "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use "
                             "--device cpu or auto")
        on_cuda = self.device.startswith("cuda") or (self.device == "auto"
                                                     and torch.cuda.is_available())
        check_factor(self.emulate_device)
        if self.emulate_device > 1.0 and on_cuda:
            raise ValueError(f"--emulate-device {self.emulate_device}: CPU only, and this run is on "
                             "CUDA (a GPU's kernels already leave the host free); drop the flag or "
                             "add --device cpu")

    def _check_precision(self) -> None:
        """bf16: autocast on the device (CPU too), with fp32 master parameters, gradients,
        optimizer state and loss; stage boundaries carry bf16 activations and gradients."""
        import torch

        on_cuda = self.device.startswith("cuda") or (self.device == "auto"
                                                     and torch.cuda.is_available())
        if self.precision is None:
            self.precision = "bf16" if on_cuda else "fp32"
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"--precision {self.precision!r} is not supported; use fp32 or bf16")
        if self.precision == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
            raise ValueError("--precision bf16: this GPU has no bfloat16 support (it predates "
                             "Ampere); use --precision fp32")

    def sequence_parallel_capable(self) -> bool:
        """Whether this run's TP layers, at any tp > 1, gather and scatter the sequence: asked
        for, and the model's family runs it (LLaMA's stages do; blip's towers keep whole
        sequences)."""
        from commpipe.models.family import family_for_model

        return self.sequence_parallel and family_for_model(self.model).sequence_parallel

    def features(self):
        """The runtime features this run uses (validated): the one definition the trainer
        reads and the planner prices."""
        from commpipe.runtime.features import Overlap, RuntimeFeatures

        sp = self.dims.tp > 1 and self.sequence_parallel_capable()
        if sp and self.seq_len % (self.dims.cp * self.dims.tp):
            fits = [t for t in (1, 2, 4, 8) if self.seq_len % (self.dims.cp * t) == 0]
            raise ValueError(f"sequence parallelism splits the {self.seq_len // self.dims.cp} "
                             f"tokens per CP rank across tp={self.dims.tp}; use a --seq-len "
                             f"divisible by cp*tp={self.dims.cp * self.dims.tp}, tp in {fits}, "
                             "or --no-sequence-parallel")
        overlap = Overlap.none()
        if self.overlap:
            overlap = Overlap() if self.tp_forward_overlap is None else \
                Overlap(tp_forward=self.tp_forward_overlap)
        return RuntimeFeatures(sequence_parallel=sp, overlap=overlap,
                               recompute=self.recompute, precision=self.precision or "fp32",
                               zero=1 if self.optim.zero1 else 0).validate()

    def _stage_multiplier(self) -> int:
        """Model chunks per pipeline rank of a named schedule (commpipe.schedules.registry)."""
        from commpipe.schedules.registry import info

        return info(self.schedule).chunks(self.vpp)

    def replica_microbatches(self, dp_rank: int) -> int:
        """Micro-batches DP replica `dp_rank` runs per step (commpipe.train.dp_split)."""
        from commpipe.train.dp_split import replica_microbatches

        return replica_microbatches(self.dp_microbatches, self.microbatches, dp_rank)

    def program(self, microbatches: int | None = None):
        """The schedule's program for `microbatches` (default: the even count per replica)."""
        from commpipe.schedules import dry_run, generate

        want = self.microbatches if microbatches is None else microbatches
        prog = generate(self.schedule, self.dims.pp, want, self.vpp)
        if self.schedule.endswith(".csv"):  # the generators are proven; a hand-written file is
            dry_run(prog)                   # checked as `commpipe simulate` checks it
        acts = [p for rank in prog.actions for a in rank for p in a.parts]
        if any(a.unit is not None for a in acts):
            raise ValueError(f"schedule {self.schedule!r} addresses single units of a stage "
                             "(e.g. 1F3.attn): the runtime runs whole-stage actions, and a braid's "
                             "passes unit by unit; use `commpipe simulate` to time unit-level "
                             "programs, or write the braids as whole-stage actions (1F3&0I1)")
        if self.recompute == "full" and any(a.is_braid for rank in prog.actions for a in rank):
            raise ValueError(f"--recompute full with the braided schedule {self.schedule!r}: a "
                             "braid runs each layer unit by unit, keeping every unit's input, so "
                             "whole-layer recomputation saves nothing there; use --recompute "
                             "selective (or none)")
        if prog.pp != self.dims.pp:
            raise ValueError(f"schedule {self.schedule} is for pp={prog.pp}, layout has "
                             f"pp={self.dims.pp}; use --pp {prog.pp}")
        if prog.microbatches != want:
            raise ValueError(f"schedule {self.schedule} runs {prog.microbatches} micro-batches, "
                             f"training has {want}; give --microbatches "
                             f"{prog.microbatches} (the default is 2*pp)")
        return prog

    def set_balanced_split(self, costs: list[float], stages: int, source: str) -> None:
        """--stage-layers auto: contiguous stages minimizing the slowest one (parallel.balance)
        from per-layer costs (`source`: flops = forward FLOPs per sample, predicted; measured =
        seconds of forward + backward per micro-batch); the split and its predicted stage costs
        are kept in stage_balance (config.json) beside the even split's."""
        from commpipe.parallel.balance import balance, stage_costs
        from commpipe.parallel.dims import split_layers

        wanted = self.stage_layers if isinstance(self.stage_layers, str) else \
            "auto:" + (self.stage_balance or {}).get("wanted", "flops")
        if wanted not in ("auto", "auto:flops", "auto:measured"):
            raise ValueError(f"--stage-layers {wanted!r}: use counts like 3,3,2, auto (balanced "
                             "by predicted FLOPs) or auto:measured (by a per-layer profile)")
        if stages > len(costs):
            raise ValueError(f"{stages} pipeline stages exceed the model's {len(costs)} layers")
        split = balance(costs, stages)
        even = [len(r) for r in split_layers(len(costs), stages)]
        self.stage_layers = split
        self.stage_balance = {
            "from": source, "wanted": "measured" if wanted == "auto:measured" else "flops",
            "unit": "forward FLOPs (per sample; LLaMA: per token)" if source == "flops"
            else "s fwd+bwd per micro-batch",
            "layer_costs": [float(c) for c in costs], "split": split,
            "predicted_stage_costs": stage_costs(costs, split),
            "even_split": even, "even_stage_costs": stage_costs(costs, even)}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.to_dict() if self.spec else None
        return d

    def save(self, path) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)


def layout_label(cfg) -> str:
    """The `layout` of a metrics record: tp/cp/pp/dp, schedule, micro-batching, stage split."""
    label = f"{cfg.dims} {cfg.schedule} m{cfg.microbatches}x{cfg.micro_batch_size}"
    if getattr(cfg, "ep", 1) > 1:
        label = f"ep{cfg.ep}-{label}"
    if cfg.stage_layers:
        label += " layers " + ",".join(str(x) for x in cfg.stage_layers)
    if cfg.dp_microbatches:
        label += " dp-m " + ",".join(str(x) for x in cfg.dp_microbatches)
    return label
