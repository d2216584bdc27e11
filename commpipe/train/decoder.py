"""Training a decoder-only (LLaMA) model: the family's training glue (commpipe.train.families).

- configuration: `resolve_config` is TrainConfig.resolve for a LLaMA shape (vocabulary from
  --data, the stage split, the batch, every check that needs no process group);
- stages: `build` makes this rank's stages with TP (sequence-parallel), CP and recomputation
  applied, the vocabulary-parallel loss and the stage boundaries (hidden states, sharded along
  the sequence when sequence-parallel);
- data: a tokenized corpus (`--data DIR`, commpipe.data) or synthetic tokens.
"""

from __future__ import annotations

from commpipe.models.family import family_for_model
from commpipe.models.spec import with_vocab
from commpipe.train.families import Training, register_training, stage_counts


def resolve_config(cfg, world_size: int | None) -> None:
    """TrainConfig.resolve for a decoder-only model: validates and fills cfg in place."""
    family = family_for_model(cfg.model)
    spec = family.resolve(cfg.model)
    if cfg.vocab:
        spec = with_vocab(spec, cfg.vocab)
    spec.validate()
    why = family.trainable(spec)
    if why:
        raise ValueError(why)
    d = cfg.dims
    if cfg.vpp < 1:
        raise ValueError(f"vpp={cfg.vpp} must be >= 1")
    if isinstance(cfg.stage_layers, str):
        if cfg.stage_layers == "auto:measured":
            raise ValueError("--stage-layers auto:measured profiles the layers of blip models; "
                             "LLaMA's layers are identical, use --stage-layers auto")
        if cfg.schedule.endswith(".csv"):
            raise ValueError("--stage-layers auto needs a named schedule (the stage count of "
                             "a CSV is known once loaded); give explicit counts")
        cfg.set_balanced_split(family.layer_costs(spec, cfg.seq_len),
                               d.pp * cfg._stage_multiplier(), "flops")
    if not cfg.schedule.endswith(".csv"):  # a CSV's stage count is known once loaded
        d.check_model(spec, cfg.seq_len, cfg.stage_layers, cfg._stage_multiplier())
    cfg.resolve_batch()
    cfg._check_run_options()
    cfg.spec = spec
    prog = cfg.program()  # the schedule validates m against p and v
    d.check_model(spec, cfg.seq_len, cfg.stage_layers, prog.num_stages // d.pp)
    if world_size is not None:  # last: a wrong layout is worth more to hear about
        d.check_world(world_size)
    cfg._check_adapt(d.world_size)


def build(cfg, comm, program, device, act_dtype, features) -> tuple[dict, object, list]:
    """This rank's stages (TP, CP, recomputation applied), the loss and the boundaries."""
    from commpipe.parallel.context import apply_cp
    from commpipe.parallel.pipeline import build_stages
    from commpipe.parallel.tensor import apply_tp, make_loss_fn
    from commpipe.runtime.recompute import apply_recompute
    spec = cfg.spec
    stages = build_stages(spec, program, comm.local_rank("pp"), cfg.seed, cfg.stage_layers, device)
    for module in stages.values():
        apply_tp(module, comm, features.sequence_parallel, features.overlap.tp,
                 features.overlap.tp_forward)
        apply_cp(module, comm, features.overlap.cp)
        apply_recompute(module, features.recompute)
    last = stages.get(program.num_stages - 1)
    loss_fn = make_loss_fn(comm, last.output if last is not None else None)
    seq_local = cfg.seq_len // cfg.dims.cp
    if features.sequence_parallel:     # stage boundaries carry sequence shards
        seq_local //= cfg.dims.tp
    stage_io = family_for_model(cfg.model).stage_io(spec, stage_counts(cfg), cfg.micro_batch_size,
                                                    seq_local, str(act_dtype).removeprefix("torch."))
    return stages, loss_fn, stage_io


def open_data(cfg, world_size: int):
    """Open the tokenized corpus of --data and set the vocabulary from its tokenizer."""
    from commpipe import data
    from commpipe.train.source import padded_vocab

    source = data.open_source(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed,
                              tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                              build=world_size == 1, progress=False if world_size > 1 else None)
    if cfg.eval_every and "valid" not in source.prepared.caches:
        raise ValueError(f"--eval-every needs a valid split in {cfg.data} (e.g. wiki.valid.raw, "
                         f"valid.txt or valid.jsonl); add one or drop --eval-every")
    cfg.vocab = padded_vocab(source.vocab_size, cfg.dims.tp)
    return source


def make_source(cfg):
    """The batch source of a resolved cfg: the corpus of --data, else synthetic tokens."""
    from commpipe import data
    from commpipe.train.source import check_vocab

    spec = cfg.spec
    if cfg.data:
        world = cfg.dims.world_size
        source = data.open_source(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed,
                                  tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                                  build=world == 1, progress=False if world > 1 else None)
        check_vocab(source, spec, cfg.data)
        return source
    return synthetic_source(cfg)


def synthetic_source(cfg):
    from commpipe.data import SyntheticTokens

    return SyntheticTokens(vocab=cfg.spec.vocab, seq_len=cfg.seq_len, seed=cfg.seed)


register_training("llama", Training(resolve_config, build, open_data, make_source,
                                    synthetic_source))
