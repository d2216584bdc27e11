"""Training a Mixture-of-Experts decoder (commpipe.models.moe): the family's training glue
(commpipe.train.families), registered at the end of this file.

- configuration: as a LLaMA model (commpipe.train.decoder), plus expert parallelism: --ep must
  divide dp*cp and the expert count (commpipe.parallel.expert.check_ep); context parallelism,
  recomputation and multi-head latent attention under TP are not applied to MoE stages. Under
  expert parallelism ZeRO-1 shards each parameter's AdamW state over the ranks replicating it
  (dense over dp, experts over edp: commpipe.parallel.data), --dp-microbatches may differ
  between EP groups but not inside one (their all-to-alls pair up micro-batch by micro-batch:
  commpipe.train.dp_split.check_ep_blocks), and --elastic restarts keep the largest ep up to
  --ep that divides the new dp (commpipe.elastic.restart.elastic_ep), each rank reading its
  experts' rows from the checkpoint (commpipe.train.checkpoint_shards); `layout_problem` is the
  layout rule, which --adapt's candidates follow too (they may change ep:
  commpipe.adapt.switch gathers and re-slices the experts);
- stages: the family's plain MoEStage modules, then tensor parallelism on attention, embedding,
  head and MLPs, each expert split over TP too (commpipe.parallel.tensor_moe), and the experts
  sharded over ep (commpipe.parallel.expert); the loss adds the load-balancing term the stages
  carried;
- data: the decoder's (a tokenized corpus or synthetic tokens).
"""

from __future__ import annotations

import dataclasses

from commpipe.models.family import family_for_model
from commpipe.train import decoder
from commpipe.train.families import Training, register_training, stage_counts


def layout_problem(spec, dims, ep: int) -> str | None:
    """Why tp x cp x pp x dp (`dims`) with expert parallelism `ep` cannot train `spec`, or None:
    what `resolve_config` refuses and the adaptive controller's candidates leave out
    (commpipe.adapt.candidates)."""
    from commpipe.models.moe_spec import tp_problem
    from commpipe.parallel.expert import check_ep

    if dims.cp > 1:
        return (f"--cp {dims.cp}: context parallelism is not applied to MoE models (the "
                "load-balancing loss of a sequence chunk differs from the whole sequence's); use "
                "--cp 1 and --ep/--dp for the replicas")
    if dims.tp > 1 and spec.attention != "gqa":
        return (f"--tp {dims.tp}: tensor parallelism shards grouped-query attention; "
                f"{spec.name} uses attention={spec.attention}; use --tp 1")
    if dims.tp > 1 and tp_problem(spec, dims.tp):
        return tp_problem(spec, dims.tp)
    try:
        check_ep(ep, dims, spec.experts)
    except ValueError as e:
        return str(e)
    return None


def resolve_config(cfg, world_size: int | None) -> None:
    """TrainConfig.resolve for a MoE model: validates and fills cfg in place."""
    from commpipe.train.dp_split import check_ep_blocks

    family = family_for_model(cfg.model)
    spec = family.resolve(cfg.model)
    if cfg.vocab:
        spec = dataclasses.replace(spec, vocab=cfg.vocab)
    spec.validate()
    d = cfg.dims
    problem = layout_problem(spec, d, cfg.ep)
    if problem:
        raise ValueError(problem)
    if cfg.recompute != "none":
        raise ValueError(f"--recompute {cfg.recompute} is not applied to MoE stages; use "
                         "--recompute none")
    if isinstance(cfg.stage_layers, str):
        if cfg.stage_layers == "auto:measured":
            raise ValueError("--stage-layers auto:measured profiles the layers of blip models; "
                             "use --stage-layers auto (by FLOPs) for MoE models")
        if cfg.schedule.endswith(".csv"):
            raise ValueError("--stage-layers auto needs a named schedule (the stage count of "
                             "a CSV is known once loaded); give explicit counts")
        cfg.set_balanced_split(family.layer_costs(spec, cfg.seq_len),
                               d.pp * cfg._stage_multiplier(), "flops")
    if not cfg.schedule.endswith(".csv"):
        d.check_model(spec, cfg.seq_len, cfg.stage_layers, cfg._stage_multiplier())
    cfg.resolve_batch()
    check_ep_blocks(cfg.dp_microbatches, cfg.ep)   # an EP group's replicas: one count
    cfg._check_run_options()
    cfg.spec = spec
    prog = cfg.program()
    d.check_model(spec, cfg.seq_len, cfg.stage_layers, prog.num_stages // d.pp)
    if world_size is not None:
        d.check_world(world_size)


def build(cfg, comm, program, device, act_dtype, features) -> tuple[dict, object, list]:
    """This rank's stages (TP on attention and inside every MLP, experts over ep), the loss and
    the boundaries."""
    from commpipe.models.family import family_of
    from commpipe.models.moe import stage_loss_sum
    from commpipe.parallel.dims import split_layers
    from commpipe.parallel.expert import apply_ep, build_ep_groups
    from commpipe.parallel.tensor import make_loss_fn
    from commpipe.parallel.tensor_moe import apply_tp_moe

    spec, family = cfg.spec, family_of(cfg.spec)
    build_ep_groups(comm, cfg.ep)
    ranges = split_layers(spec.layers, program.num_stages, cfg.stage_layers)
    stages = {s: family.build_stages(spec, [ranges[s]], cfg.seed, device)[0]
              for s in program.stages_of(comm.local_rank("pp"))}
    for module in stages.values():
        apply_tp_moe(module, comm)
        apply_ep(module, comm)
    last = stages.get(program.num_stages - 1)
    token_loss = make_loss_fn(comm, last.output if last is not None else None)

    def loss_fn(out, labels):
        return stage_loss_sum(out, labels, token_loss)

    stage_io = family.stage_io(spec, stage_counts(cfg), cfg.micro_batch_size, cfg.seq_len,
                               str(act_dtype).removeprefix("torch."))
    return stages, loss_fn, stage_io


register_training("moe", Training(resolve_config, build, decoder.open_data, decoder.make_source,
                                  decoder.synthetic_source, expert_parallel=True))
