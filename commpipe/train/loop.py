"""The training loop: build this rank's part of the model, run the schedule, step the optimizer.

One process:           python -m commpipe train --preset tiny --steps 5
Several (CPU, gloo):   torchrun --nproc-per-node 4 -m commpipe train --tp 2 --pp 2 --steps 5

Order of application (fixed, documented): pipeline stage split -> tensor parallel (with sequence
parallelism) -> context parallel -> recomputation -> data parallel (gradient reduction hooks) ->
optimizer (optionally ZeRO-1). What each applies is read off `cfg.features()`
(commpipe.runtime.features), the definition the planner prices too.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from commpipe.models.family import family_of
from commpipe.monitor import unmonitored
from commpipe.parallel.comm import Comm
from commpipe.parallel.context import cp_positions, cp_split
from commpipe.parallel.data import GradReducer, Zero1, clip_grad_norm_
from commpipe.parallel.world import init_distributed
from commpipe.runtime.device_time import emulated
from commpipe.runtime.executor import PipelineRuntime
from commpipe.runtime.recompute import ActivationMeter
from commpipe.train import checkpoint
from commpipe.train.config import TrainConfig, layout_label
from commpipe.train.console import banner, format_balance, format_step, summary
from commpipe.train.dp_split import replica_batch
from commpipe.train.evaluate import evaluate, forward_program
from commpipe.train.failures import (
    StopSignals,
    TrainingDiverged,
    check_finite_params,
    diverged_message,
    is_finite,
    last_good,
)
from commpipe.train.families import training_for
from commpipe.train.optim import lr_at, make_optimizer
from commpipe.train.run_files import TRACE_STEPS, kineto_trace, open_metrics
from commpipe.train.source import check_vocab, make_source
from commpipe.train.tensorboard import TensorBoardLog


def step_flops(cfg: TrainConfig) -> float:
    """Model FLOPs of one optimizer step (forward + backward)."""
    return family_of(cfg.spec).step_flops(cfg.spec, cfg.seq_len, cfg.global_batch)


def pick_device(name: str) -> torch.device:
    """auto: this rank's GPU (LOCAL_RANK) when CUDA is there, else the CPU; a bare `cuda` is
    this rank's GPU too (torch.cuda.set_device needs an index)."""
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if name in ("auto", "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


@dataclass
class Trainer:
    """Everything one rank holds for training; built by `Trainer.build(cfg)`."""

    cfg: TrainConfig
    comm: Comm
    stages: dict
    runtime: PipelineRuntime
    optimizer: object
    reducer: GradReducer
    params: list
    source: object
    device: torch.device
    step: int = 0
    history: list = field(default_factory=list)
    monitor: object = None
    named_params: list = field(default_factory=list)
    capture_grads: bool = False      # keep the last step's reduced gradients before clipping (tests)
    last_grads: dict = field(default_factory=dict)
    forward_runner: PipelineRuntime | None = None   # validation: the schedule's forwards only
    meter: ActivationMeter | None = None            # activation_mb of each step
    build_s: float = 0.0   # seconds building the stages, runtime, reducer and optimizer
    device_time: object = field(default_factory=nullcontext)  # each step runs under it

    @classmethod
    def build(cls, cfg: TrainConfig, comm: Comm | None = None, source=None) -> Trainer:
        """This rank's stages, runtime, optimizer and data. `source`: an already opened batch
        source (the CLI opens --data before the process group starts); made here otherwise."""
        device = pick_device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)   # the current device is where unplaced tensors go
        if comm is None:
            rank, world = init_distributed(timeout_s=cfg.timeout_s)
            cfg.resolve(world)
            comm = Comm(cfg.dims, rank, device=device, timeout_s=cfg.timeout_s)
        elif cfg.spec is None:
            cfg.resolve(comm.dims.world_size)
        comm.strict_order = comm.strict_order or cfg.strict_order
        spec = cfg.spec
        # torch imports torch._dynamo (~2 s) at the first parameter initialised under a device
        # context; imported first, build_s times what rebuilding the stages repeats (the
        # adaptive controller's switch-cost allowance)
        importlib.import_module("torch._dynamo")
        t_build = time.perf_counter()
        # uneven DP (commpipe.train.dp_split): this replica's pipeline runs its own count
        program = cfg.program(cfg.replica_microbatches(comm.coords["dp"]))
        # bf16: autocast, with stage boundaries (pipeline buffers) in bf16 too
        autocast = torch.bfloat16 if cfg.precision == "bf16" else None
        act_dtype = autocast or torch.float32
        features = cfg.features()
        # the family's stages with the parallel dimensions applied (commpipe.train.families)
        stages, loss_fn, stage_io = training_for(family_of(spec)).build(
            cfg, comm, program, device, act_dtype, features)
        params = [p for s in sorted(stages) for p in stages[s].parameters()]
        runtime = PipelineRuntime(program, stages, comm, loss_fn, stage_io, device,
                                  act_dtype=act_dtype, autocast_dtype=autocast,
                                  prefetch=features.overlap.pp)
        reducer = GradReducer(params, comm, cfg.dp_bucket_mb, microbatches=program.microbatches,
                              overlap=features.overlap.dp, zero=features.zero == 1)
        optimizer = make_optimizer(params, cfg, reducer)
        build_s = time.perf_counter() - t_build
        if source is None:
            source = make_source(cfg, spec)
        else:
            check_vocab(source, spec, cfg.data)
        trainer = cls(cfg, comm, stages, runtime, optimizer, reducer, params, source, device)
        trainer.build_s = build_s
        trainer.meter = ActivationMeter(params, device)
        # validation reads even DP shares (source.validation): the even count's program
        even = program if cfg.dp_microbatches is None else cfg.program()
        trainer.forward_runner = PipelineRuntime(forward_program(even), stages, comm, loss_fn,
                                                 runtime.stage_io, device, act_dtype=act_dtype,
                                                 autocast_dtype=autocast, forward_only=True,
                                                 units=runtime.units)
        trainer.named_params = [(n, p) for s in sorted(stages) for n, p in stages[s].named_parameters()]
        # --trace on CPU: the monitor times every call and writes OUT/trace/rank{r}.json with
        # the compute actions; on CUDA the timeline comes from torch.profiler (see kineto_trace)
        host_trace = cfg.trace and device.type != "cuda"
        if (cfg.monitor is not None or host_trace) and cfg.out:
            from commpipe.monitor import Monitor

            sample = 1.0 if host_trace else cfg.monitor
            trainer.monitor = Monitor(comm, cfg.out, sample=sample, seed=cfg.seed + 1,
                                      trace=host_trace, trace_steps=TRACE_STEPS)
            trainer.monitor.attach()
            runtime.on_compute = trainer.monitor.record_compute
        if cfg.trace:
            runtime.events = []
            runtime.annotate = device.type == "cuda"   # action names as profiler annotations
        if cfg.slow_rank is not None:   # a commpipe.train.hooks.Drill
            cfg.slow_rank.install(trainer)
        trainer.device_time = emulated(cfg.emulate_device)   # --emulate-device, else no-op
        return trainer

    # -- one optimizer step -----------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step; its metrics record. Under --emulate-device its compute operators
        run as device time (commpipe.runtime.device_time), wherever the step is taken from (the
        loop, the controller's trials, the adaptive demo's oracle)."""
        with self.device_time:
            return self._step()

    def _step(self) -> dict:
        cfg, comm = self.cfg, self.comm
        t0 = time.perf_counter()
        batch = replica_batch(self.source, self.step, cfg.global_batch, cfg.dp_microbatches,
                              cfg.micro_batch_size, comm.local_rank("dp"), comm.size("dp"))
        mb_inputs, mb_labels, positions, scale = self.prepare_batch(batch)
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.meter:   # bytes held for backward; DP buckets go out during the backward
            loss = self.runtime.run_step(mb_inputs, mb_labels, positions, scale, self.step)
        self.reducer.reduce()
        if self.capture_grads:  # before clipping, which would hide a uniformly scaled gradient
            self.last_grads = self._full_grads()
        grad_norm = clip_grad_norm_(self.params, cfg.optim.clip, comm,  # the pre-clip norm
                                    sharded=self.reducer.zero)
        # a NaN/inf gradient (every rank sees the same global norm) must not reach the
        # parameters: the step is skipped and the loop stops on the non-finite record
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the loss lives on the last stage; sum it over the DP and CP ranks that computed it
        loss_t = loss.detach().double().reshape(1)
        activation_mb = comm.all_reduce_scalars([self.meter.peak / 2**20], op="max")[0]  # MiB
        comm.all_reduce(loss_t, "dp_cp")
        comm.all_reduce(loss_t, "pp")  # non-last stages contribute 0: every rank learns it
        step_time = time.perf_counter() - t0
        tokens = cfg.global_batch * cfg.seq_len
        flops = step_flops(cfg)
        record = {
            "step": self.step, "loss": loss_t.item(), "grad_norm": grad_norm, "lr": lr,
            "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "tflops_per_gpu": flops / step_time / cfg.dims.world_size / 1e12,
            "tp": cfg.dims.tp, "cp": cfg.dims.cp, "pp": cfg.dims.pp, "dp": cfg.dims.dp, "ep": cfg.ep,
            "schedule": cfg.schedule, "microbatches": cfg.microbatches,
            "micro_batch_size": cfg.micro_batch_size, "global_batch": cfg.global_batch,
            "dp_microbatches": list(cfg.dp_microbatches) if cfg.dp_microbatches else None,
            "seq_len": cfg.seq_len, "model": cfg.spec.name, "layout": layout_label(cfg),
            "activation_mb": activation_mb, "recompute": cfg.recompute, "overlap": cfg.overlap,
        }
        if self.monitor is not None:
            self.monitor.end_step(self.step)
        self.step += 1
        return record

    def _full_grads(self) -> dict:
        """Every parameter's reduced gradient, also where ZeRO-1 left this rank only a shard."""
        if isinstance(self.optimizer, Zero1):
            full = self.optimizer.full_grads()
            return {n: full[id(p)] for n, p in self.named_params}
        return {n: p.grad.detach().clone() for n, p in self.named_params}

    def prepare_batch(self, batch):
        """Micro-batches of a DP-local batch and the loss scale. Every micro-batch loss is
        divided by the tokens of the whole global batch (for captions: its labelled tokens,
        counted over DP), so gradients simply add up across micro-batches, CP chunks and DP."""
        cfg = self.cfg
        if isinstance(batch, dict):   # image-caption batches (commpipe.train.multimodal)
            from commpipe.train.multimodal import labelled_tokens, split_batch

            return (split_batch(batch, cfg.micro_batch_size, self.device), None, None,
                    1.0 / labelled_tokens(batch, self.comm))
        return (*self.shard_batch(*batch), 1.0 / (cfg.global_batch * cfg.seq_len))

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's CP slice of a DP-local batch [B/dp, s], cut into micro-batches."""
        cfg, comm = self.cfg, self.comm
        cp_rank, cp = comm.local_rank("cp"), comm.size("cp")
        inputs = cp_split(inputs, cp, cp_rank).to(self.device)     # [B/dp, s/cp]
        labels = cp_split(labels, cp, cp_rank).to(self.device)
        positions = cp_positions(cfg.seq_len, cp, cp_rank).to(self.device)
        return (list(inputs.split(cfg.micro_batch_size)), list(labels.split(cfg.micro_batch_size)),
                positions)

    def evaluate(self) -> float:
        """Validation loss of the current parameters (see commpipe.train.evaluate)."""
        return evaluate(self)

    @property
    def is_logger(self) -> bool:
        """The last pipeline stage of DP rank 0 (cp and tp rank 0) writes metrics."""
        c = self.comm.coords
        return c["pp"] == self.cfg.dims.pp - 1 and c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0

    def write_trace(self) -> None:
        """The last step's per-action timeline (commpipe.timeline.Event rows) for `simulate
        --compare`. JSONL only: OUT/trace/ holds one Chrome trace per rank (rank{r}.json) so
        that HTA maps each rank to one file."""
        if not (self.cfg.trace and self.cfg.out and self.runtime.events is not None):
            return
        out = Path(self.cfg.out) / "trace"
        out.mkdir(parents=True, exist_ok=True)
        rank = self.comm.rank
        with open(out / f"actions_rank{rank}.jsonl", "w") as f:
            for e in self.runtime.events:
                f.write(json.dumps(e.to_dict()) + "\n")


def train(cfg: TrainConfig, comm: Comm | None = None, log=print, source=None) -> list[dict]:
    """Train until cfg.steps (resuming from cfg.resume if given), evaluating and saving as
    configured; returns this run's per-step metric records (on every rank).

    Stops early, on every rank after the same step, when any rank gets SIGTERM or SIGINT: a
    checkpoint is saved (with --out) and the function returns normally. Raises
    TrainingDiverged when the loss, gradient norm or parameters stop being finite; nothing
    is saved then, so the last checkpoint is the last good state.
    """
    trainer = Trainer.build(cfg, comm, source)
    comm = trainer.comm
    say = log if (log and comm.rank == 0) else (lambda *_: None)
    for line in banner(cfg, comm, trainer.device):
        say(line)
    if cfg.stage_balance:
        say(format_balance(cfg.stage_balance))
    out = Path(cfg.out) if cfg.out else None
    ckpt_root = checkpoint.checkpoints_dir(out) if out else None
    start = checkpoint.resolve_resume(cfg)
    from commpipe.train.peer_copies import peer_copies

    copies, restored = peer_copies(trainer, start, say)   # --elastic: newer state in memory?
    start = restored or start
    saved_at = None
    if start is not None:
        meta = checkpoint.load(trainer, start)
        saved_at = trainer.step
        say(f"resumed from {start} at step {trainer.step}")
        if meta.get("global_batch") not in (None, cfg.global_batch):
            # a resume under another pp changes the default micro-batch count (2*pp) with it
            say(f"note: global batch {cfg.global_batch}, the checkpoint's was {meta['global_batch']}; "
                f"pass --global-batch {meta['global_batch']} to keep training on the same batch")
    elif cfg.resume:
        say(f"no checkpoint in {ckpt_root} yet" + (" and no copy in memory" if copies else "")
            + f": starting at step 0 (seed {cfg.seed})")
    if start is None and cfg.init_from:   # weights only: fresh optimizer, step 0
        from commpipe.train.weights import load_weights

        load_weights(trainer, cfg.init_from)
        say(f"initialised the weights from {cfg.init_from}")
    metrics_file = None
    if out is not None and trainer.is_logger:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.json")
        metrics_file = open_metrics(out / "metrics.jsonl", trainer.step, restart=True,
                                    source="peer copies" if restored else
                                    "checkpoint" if start else None)
    board = TensorBoardLog(out) if cfg.tensorboard else None   # the logging rank writes
    # --adapt: a commpipe.train.hooks.Steering field; its hook may switch the layout in memory
    controller = cfg.adapt.step_hook(trainer, out, log) if cfg.adapt is not None else None
    signals = StopSignals().install()
    from commpipe.elastic.watchdog import start_watchdog

    watchdog = start_watchdog(comm, cfg.hang_timeout_s)   # names a rank a stuck step waits on
    together = False  # did every rank leave the loop together (collective clean-up is safe)?
    profiler = kineto_trace(trainer)  # None unless --trace on CUDA
    try:
        if profiler is not None:
            profiler.start()
        while trainer.step < cfg.steps:
            if cfg.fail_at == (comm.rank, trainer.step):
                raise RuntimeError(f"fault drill: --fail-at {comm.rank}:{trainer.step}")
            if trainer.runtime.events is not None:  # keep only the last step's timeline
                trainer.runtime.events.clear()
            rec = trainer.train_step()
            if watchdog is not None:
                watchdog.progress(trainer.step)
            if profiler is not None:
                profiler.step()
            finite = is_finite(rec["loss"], rec["grad_norm"])
            done = trainer.step == cfg.steps
            if finite and cfg.eval_every and (trainer.step % cfg.eval_every == 0 or done):
                with unmonitored(trainer), _between(watchdog, "evaluation"):
                    rec["val_loss"] = trainer.evaluate()
            trainer.history.append(rec)
            if trainer.is_logger:
                if metrics_file:
                    metrics_file.write(json.dumps(rec) + "\n")
                    metrics_file.flush()
                if log and (rec["step"] % cfg.log_every == 0 or done or not finite or "val_loss" in rec):
                    log(format_step(rec, start_layout=trainer.history[0]["layout"]))
            if board is not None:
                board.log_step(trainer, rec, controller.decisions if controller else ())
            if not finite:
                raise TrainingDiverged(diverged_message(rec, ckpt_root))
            if controller is not None:   # may switch to another plan, in memory
                with _between(watchdog, "adaptive controller's turn"):
                    trainer, metrics_file = controller.after_step(
                        trainer, rec, metrics_file, stop=signals.requested is not None)
                comm = trainer.comm
                if watchdog is not None:
                    watchdog.comm = comm
                stop = controller.stop_agreed    # the flags rode in the controller's gather
            else:
                with unmonitored(trainer):
                    stop = signals.agreed(comm)   # a step-sized all-reduce: timed as a step
            due = cfg.save_every and (trainer.step % cfg.save_every == 0 or done)
            if ckpt_root is not None and (due or stop) and saved_at != trainer.step:
                with unmonitored(trainer), _between(watchdog, "checkpoint save"):
                    if not check_finite_params(trainer.params, comm):
                        raise TrainingDiverged(
                            f"parameters became NaN or inf in the update of step {rec['step']} "
                            f"(loss {rec['loss']:.4f}); not saved. " + last_good(ckpt_root))
                    path = checkpoint.save(trainer, ckpt_root)
                    saved_at = trainer.step
                    say(f"saved {path}")
            if copies is not None and copies.due(trainer.step) and saved_at != trainer.step \
                    and not (stop or done):
                with unmonitored(trainer), _between(watchdog, "copy of the state"):
                    copies.take(trainer)
            if stop:
                where = f"; resume with --resume (checkpoint step {saved_at})" if out else \
                    " (no --out: nothing saved)"
                say(f"commpipe: {signals.requested or 'a signal on another rank'}: stopped after "
                    f"step {rec['step']}{where}")
                break
        trainer.write_trace()
        together = True
        if copies is not None and trainer.step >= cfg.steps:
            copies.close()   # the run is over: no restart will read them
    except TrainingDiverged:
        together = True  # every rank decided it from the same all-reduced values
        raise
    finally:
        if profiler is not None:
            profiler.stop()   # writes the recorded steps (also after a failure)
        signals.restore()
        if watchdog is not None:
            watchdog.stop()
        if controller is not None:
            controller.close(together)
        if metrics_file:
            metrics_file.close()
        if trainer.monitor is not None:
            # closing is collective: after a failure of this rank alone it would wait for
            # peers that never come, so only stop observing
            if together:
                trainer.monitor.close()
            else:
                trainer.monitor.detach()
        if board is not None:   # after the monitor's last records (read with a barrier)
            board.close(trainer.comm if together and trainer.monitor is not None else None,
                        controller.decisions if controller else ())
    for line in summary(trainer.cfg, trainer.history, out):
        say(line)
    return trainer.history


@contextmanager
def _between(watchdog, what: str):
    """Evaluation, checkpoint saves and layout switches get the watchdog's longer allowance."""
    if watchdog is None:
        yield
        return
    with watchdog.between_steps(what):
        yield


