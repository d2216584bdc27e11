"""The training loop: build this rank's part of the model, run the schedule, step the optimizer.

One process:           python -m commpipe train --preset tiny --steps 5
Several (CPU, gloo):   torchrun --nproc-per-node 4 -m commpipe train --tp 2 --pp 2 --steps 5

Order of application (fixed, documented): pipeline stage split -> tensor parallel -> context
parallel -> data parallel (gradient reduction) -> optimizer (optionally ZeRO-1).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from commpipe.models.spec import flops_per_token
from commpipe.parallel.comm import Comm, init_distributed
from commpipe.parallel.context import apply_cp, cp_positions, cp_split
from commpipe.parallel.data import GradReducer, Zero1, clip_grad_norm_
from commpipe.parallel.pipeline import build_stages
from commpipe.parallel.tensor import apply_tp, make_loss_fn
from commpipe.runtime.executor import PipelineRuntime
from commpipe.timeline import write_chrome_trace
from commpipe.train.config import TrainConfig


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(name)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up for warmup_steps, then cosine decay to min_lr at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(cfg.steps - o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / span, 1.0)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(params, cfg: TrainConfig, comm: Comm):
    o = cfg.optim

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=o.lr, betas=o.betas, eps=o.eps,
                                 weight_decay=o.weight_decay, foreach=False)

    if o.zero1 and comm.size("dp") > 1:
        return Zero1(params, comm, adamw)
    return adamw(params)


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
    capture_grads: bool = False      # keep the last step's reduced, clipped gradients (tests)
    last_grads: dict = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: TrainConfig, comm: Comm | None = None) -> Trainer:
        device = pick_device(cfg.device)
        if comm is None:
            rank, world = init_distributed()
            cfg.resolve(world)
            comm = Comm(cfg.dims, rank, device=device)
        elif cfg.spec is None:
            cfg.resolve(comm.dims.world_size)
        spec = cfg.spec
        program = cfg.program()
        pp_rank = comm.local_rank("pp")
        stages = build_stages(spec, program, pp_rank, cfg.seed, cfg.stage_layers, device)
        for module in stages.values():
            apply_tp(module, comm)
            apply_cp(module, comm)
        last = stages.get(program.num_stages - 1)
        loss_fn = make_loss_fn(comm, last.output if last is not None else None)
        params = [p for s in sorted(stages) for p in stages[s].parameters()]
        seq_local = cfg.seq_len // cfg.dims.cp
        autocast = torch.bfloat16 if device.type == "cuda" else None
        runtime = PipelineRuntime(program, stages, comm, loss_fn,
                                  (cfg.micro_batch_size, seq_local, spec.hidden), device,
                                  autocast_dtype=autocast)
        optimizer = make_optimizer(params, cfg, comm)
        from commpipe.train.source import make_source

        source = make_source(cfg, spec)
        trainer = cls(cfg, comm, stages, runtime, optimizer, GradReducer(params, comm), params,
                      source, device)
        trainer.named_params = [(n, p) for s in sorted(stages) for n, p in stages[s].named_parameters()]
        if cfg.monitor is not None and cfg.out:
            from commpipe.monitor import Monitor

            trainer.monitor = Monitor(comm, cfg.out, sample=cfg.monitor, seed=cfg.seed + 1,
                                      trace=cfg.trace)
            trainer.monitor.attach()
            runtime.on_compute = trainer.monitor.record_compute
        if cfg.trace:
            runtime.events = []
        return trainer

    # -- one optimizer step -----------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, comm = self.cfg, self.comm
        t0 = time.perf_counter()
        dp_rank, cp_rank, cp = comm.local_rank("dp"), comm.local_rank("cp"), comm.size("cp")
        inputs, labels = self.source.batch(self.step, cfg.global_batch, dp_rank, comm.size("dp"))
        inputs = cp_split(inputs, cp, cp_rank).to(self.device)     # [B/dp, s/cp]
        labels = cp_split(labels, cp, cp_rank).to(self.device)
        positions = cp_positions(cfg.seq_len, cp, cp_rank).to(self.device)
        mb_inputs = list(inputs.split(cfg.micro_batch_size))
        mb_labels = list(labels.split(cfg.micro_batch_size))
        # every micro-batch loss is divided by the tokens of the whole global batch, so that
        # gradients simply add up across micro-batches, CP chunks and DP ranks
        scale = 1.0 / (cfg.global_batch * cfg.seq_len)
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.runtime.run_step(mb_inputs, mb_labels, positions, scale, self.step)
        self.reducer.reduce()
        grad_norm = clip_grad_norm_(self.params, cfg.optim.clip, comm)
        if self.capture_grads:
            self.last_grads = {n: p.grad.detach().clone() for n, p in self.named_params}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the loss lives on the last stage; sum it over the DP and CP ranks that computed it
        loss_t = loss.detach().double().reshape(1)
        comm.all_reduce(loss_t, "dp_cp")
        comm.all_reduce(loss_t, "pp")  # non-last stages contribute 0: every rank learns it
        step_time = time.perf_counter() - t0
        tokens = cfg.global_batch * cfg.seq_len
        flops = flops_per_token(cfg.spec, cfg.seq_len) * tokens
        record = {
            "step": self.step, "loss": loss_t.item(), "grad_norm": grad_norm, "lr": lr,
            "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "tflops_per_gpu": flops / step_time / cfg.dims.world_size / 1e12,
            "tp": cfg.dims.tp, "cp": cfg.dims.cp, "pp": cfg.dims.pp, "dp": cfg.dims.dp,
            "schedule": cfg.schedule, "microbatches": cfg.microbatches,
            "micro_batch_size": cfg.micro_batch_size, "global_batch": cfg.global_batch,
            "seq_len": cfg.seq_len, "model": cfg.spec.name,
        }
        if self.monitor is not None:
            self.monitor.end_step(self.step)
        self.step += 1
        return record

    @property
    def is_logger(self) -> bool:
        """The last pipeline stage of DP rank 0 (cp and tp rank 0) writes metrics."""
        c = self.comm.coords
        return c["pp"] == self.cfg.dims.pp - 1 and c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0

    def write_trace(self) -> None:
        if not (self.cfg.trace and self.cfg.out and self.runtime.events is not None):
            return
        out = Path(self.cfg.out) / "trace"
        out.mkdir(parents=True, exist_ok=True)
        rank = self.comm.rank
        write_chrome_trace(self.runtime.events, out / f"actions_rank{rank}.json", rank,
                           self.comm.dims.world_size)
        with open(out / f"actions_rank{rank}.jsonl", "w") as f:
            for e in self.runtime.events:
                f.write(json.dumps(e.to_dict()) + "\n")


def train(cfg: TrainConfig, comm: Comm | None = None, log=print) -> list[dict]:
    """Train for cfg.steps; returns the per-step metric records (on every rank)."""
    trainer = Trainer.build(cfg, comm)
    out = Path(cfg.out) if cfg.out else None
    metrics_file = None
    if out is not None and trainer.is_logger:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.json")
        metrics_file = open(out / "metrics.jsonl", "a")
    try:
        while trainer.step < cfg.steps:
            if trainer.runtime.events is not None:  # keep only the last step's timeline
                trainer.runtime.events.clear()
            rec = trainer.train_step()
            trainer.history.append(rec)
            if trainer.is_logger:
                if metrics_file:
                    metrics_file.write(json.dumps(rec) + "\n")
                    metrics_file.flush()
                if log and (rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.steps - 1):
                    log(f"step {rec['step']:>5} | loss {rec['loss']:.4f} | "
                        f"{rec['step_time_s'] * 1e3:8.1f} ms | {rec['tokens_per_s']:9.0f} tok/s"
                        f" | {rec['tflops_per_gpu']:.4f} TFLOP/s/GPU | lr {rec['lr']:.2e}")
        trainer.write_trace()
    finally:
        if metrics_file:
            metrics_file.close()
        if trainer.monitor is not None:
            trainer.monitor.close()
    return trainer.history
