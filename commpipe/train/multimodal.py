"""Training the BLIP-style captioner (commpipe.models.blip) with the same trainer as LLaMA: the
family's training glue (commpipe.train.families), registered at the end of this file.

What differs from a decoder-only model, and lives here:
- configuration: a `blip-*` model trains on `spec.text_len` caption tokens per image (the
  --seq-len of the run is set to it); context parallelism is rejected (the caption is 16-40
  tokens and every decoder layer cross-attends to all image tokens, so there is no long
  sequence to cut); tensor parallelism needs tp to divide both towers' heads and MLP widths
  and the vocabulary; sequence parallelism is not used;
- stages: `build_blip_stages` and their boundary descriptions (`blip_spec.stage_io`): image
  hidden states inside the encoder, image features plus text hidden states past it;
- data: synthetic image-caption pairs without --data (`SyntheticCaptions`), the COCO captions
  layout with it (`commpipe.data.coco`); batches are dicts (pixels, tokens, labels) cut into
  micro-batch dicts by `split_batch`;
- the loss: summed caption cross-entropy over labelled tokens (padding is IGNORE), divided by
  the global count of labelled tokens of the step (`labelled_tokens`), so gradients add up
  across micro-batches and DP ranks exactly as on one device.
"""

from __future__ import annotations

import dataclasses

import torch

from commpipe.models.blip import IGNORE, caption_loss_sum
from commpipe.models.blip_spec import BlipSpec, resolve_blip, stage_io
from commpipe.parallel.dims import split_layers
from commpipe.train.families import Training, register_training, stage_counts

SYNTHETIC_CLASSES = 8   # synthetic images come in this many kinds, each with its caption


def resolve_config(cfg, world_size: int | None) -> None:
    """TrainConfig.resolve for a blip-* model: validates and fills cfg in place."""
    spec = resolve_blip(cfg.model)
    if cfg.vocab:
        spec = dataclasses.replace(spec, vocab=cfg.vocab)
    spec.validate()
    d = cfg.dims
    if d.cp > 1:
        raise ValueError(f"--cp {d.cp}: context parallelism is not supported for {spec.name}: its "
                         f"captions are {spec.text_len} tokens and every decoder layer "
                         f"cross-attends to all {spec.image_tokens} image tokens, so there is no "
                         "long sequence to split; use --cp 1 and scale with --tp, --pp or --dp")
    for what, n in (("encoder heads", spec.enc_heads), ("decoder heads", spec.dec_heads),
                    ("encoder MLP width", spec.enc_mlp), ("decoder MLP width", spec.dec_mlp),
                    ("vocabulary", spec.vocab)):
        if n % d.tp:
            ok = [t for t in (1, 2, 4, 8, 16) if spec.enc_heads % t == 0 and spec.dec_heads % t == 0]
            raise ValueError(f"tp={d.tp} does not divide the {what} ({n}) of {spec.name}; use tp "
                             f"in {ok}")
    if cfg.adapt is not None:
        raise ValueError("--adapt re-plans decoder-only (LLaMA) runs; drop it for "
                         f"{spec.name}")
    cfg.seq_len = spec.text_len
    cfg.sequence_parallel = False   # boundaries and norms keep whole captions on every TP rank
    cfg.resolve_batch()
    cfg._check_run_options()
    cfg.spec = spec
    prog = cfg.program()
    if isinstance(cfg.stage_layers, str):   # auto: by FLOPs (auto:measured: see build_blip)
        from commpipe.parallel.balance import blip_layer_costs

        cfg.set_balanced_split(blip_layer_costs(spec, "flops"), prog.num_stages, "flops")
    stages = prog.num_stages
    if cfg.stage_layers is not None:
        if len(cfg.stage_layers) != stages:
            raise ValueError(f"--stage-layers lists {len(cfg.stage_layers)} stages but the "
                             f"schedule has {stages}; give one layer count per stage")
        if sum(cfg.stage_layers) != spec.layers or min(cfg.stage_layers) < 1:
            raise ValueError(f"--stage-layers {cfg.stage_layers} must be positive and sum to "
                             f"{spec.name}'s {spec.layers} layers ({spec.enc_layers} encoder + "
                             f"{spec.dec_layers} decoder)")
    elif spec.layers < stages:
        raise ValueError(f"{stages} pipeline stages exceed {spec.name}'s {spec.layers} layers")
    if world_size is not None:
        d.check_world(world_size)


def build(cfg, comm, program, device, act_dtype, features=None) -> tuple[dict, object, list]:
    """This rank's BLIP stages (tensor-parallel when tp > 1), the loss and the boundary
    descriptions. With --stage-layers auto:measured, rank 0 first profiles forward + backward of
    every layer on this device and all ranks balance on its costs (one split everywhere)."""
    from commpipe.parallel.tensor_blip import apply_tp_blip

    spec = cfg.spec
    balance = cfg.stage_balance or {}
    if balance.get("wanted") == "measured" and balance.get("from") != "measured":
        from commpipe.parallel.balance import blip_layer_costs

        costs = blip_layer_costs(spec, "measured", cfg.micro_batch_size, device=device) \
            if comm.rank == 0 else None
        cfg.set_balanced_split(comm.broadcast_object(costs), program.num_stages, "measured")
    stages = build_blip_stages(spec, program, comm.local_rank("pp"), cfg.seed, cfg.stage_layers,
                               device)
    for module in stages.values():
        apply_tp_blip(module, comm)
    last = stages.get(program.num_stages - 1)
    loss_fn = make_caption_loss_fn(comm, last.head.output if last is not None else None)
    return stages, loss_fn, blip_stage_io(cfg, act_dtype)


def build_blip_stages(spec: BlipSpec, program, pp_rank: int, seed: int,
                      stage_layers: list[int] | None, device) -> dict:
    """The stage modules `pp_rank` holds, keyed by virtual stage (names as in the whole model)."""
    from commpipe.models.blip import build_model

    ranges = split_layers(spec.layers, program.num_stages, stage_layers)
    return {s: build_model(spec, seed, ranges[s], device) for s in program.stages_of(pp_rank)}


def blip_stage_io(cfg, act_dtype: torch.dtype) -> list:
    dtype = str(act_dtype).removeprefix("torch.")
    return stage_io(cfg.spec, stage_counts(cfg), cfg.micro_batch_size, cfg.seq_len, dtype)


def make_caption_loss_fn(comm, head_output):
    """Summed caption cross-entropy over labelled tokens, on full logits or, under TP, on this
    rank's vocabulary shard (commpipe.parallel.tensor_blip)."""
    if comm.size("tp") == 1 or head_output is None:
        return caption_loss_sum
    from commpipe.parallel.tensor_blip import vocab_parallel_caption_loss

    return vocab_parallel_caption_loss(comm, head_output)


def split_batch(batch: dict, micro_batch_size: int, device) -> list[dict]:
    """A DP-local batch of fields [B/dp, ...] as micro-batch dicts."""
    parts = {k: v.to(device).split(micro_batch_size) for k, v in batch.items()}
    n = len(next(iter(parts.values())))
    return [{k: v[i] for k, v in parts.items()} for i in range(n)]


def labelled_tokens(batch: dict, comm) -> int:
    """Labelled caption tokens of the whole global batch (all DP ranks)."""
    count = torch.tensor([float((batch["labels"] != IGNORE).sum())], dtype=torch.float64,
                         device=comm.device)
    comm.all_reduce(count, "dp")
    return int(count.item())


class SyntheticCaptions:
    """Deterministic image-caption pairs: sample i of step t shows one of SYNTHETIC_CLASSES
    image patterns (plus noise) and carries that class's caption, of class-dependent length
    (padding labelled IGNORE), so the task is learnable and captions differ in length. Every
    sample is drawn from (seed, step, its index in the global batch): DP shards are slices."""

    kind = "synthetic"

    def __init__(self, spec: BlipSpec, seed: int = 0, val_batches: int = 4):
        self.spec, self.seed, self.val_batches = spec, seed, val_batches
        self.vocab_size = spec.vocab
        g = torch.Generator().manual_seed(10_007 * seed + 1)
        size, c, s = spec.image_size, spec.channels, spec.text_len
        self.patterns = torch.randn(SYNTHETIC_CLASSES, c, size, size, generator=g)
        self.captions = torch.randint(3, spec.vocab, (SYNTHETIC_CLASSES, s + 1), generator=g)
        self.lengths = [s // 2 + (k * (s - s // 2)) // SYNTHETIC_CLASSES + 1
                        for k in range(SYNTHETIC_CLASSES)]

    def _samples(self, stream: int, step: int, rows: range) -> dict:
        pixels, tokens, labels = [], [], []
        for i in rows:
            g = torch.Generator().manual_seed(((self.seed * 2 + stream) * 1_000_003 + step)
                                              * 1_000_033 + i)
            k = int(torch.randint(SYNTHETIC_CLASSES, (1,), generator=g))
            noise = torch.randn(self.patterns[k].shape, generator=g)
            pixels.append(self.patterns[k] + 0.5 * noise)
            seq = self.captions[k].clone()
            n = self.lengths[k]
            seq[n + 1:] = 0                       # pad id 0 after the caption
            tokens.append(seq[:-1])
            lab = seq[1:].clone()
            lab[n:] = IGNORE
            labels.append(lab)
        return {"pixels": torch.stack(pixels), "tokens": torch.stack(tokens),
                "labels": torch.stack(labels)}

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1) -> dict:
        from commpipe.data.sampler import check_dp

        local = check_dp(global_batch, dp_rank, dp_size)
        return self._samples(0, step, range(dp_rank * local, (dp_rank + 1) * local))

    def validation(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                   max_batches: int | None = None):
        from commpipe.data.sampler import check_dp

        local = check_dp(global_batch, dp_rank, dp_size)
        n = self.val_batches if max_batches is None else min(self.val_batches, max_batches)
        for i in range(n):
            yield self._samples(1, i, range(dp_rank * local, (dp_rank + 1) * local))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "captions": True, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("captions"):
            raise ValueError("data state is not from synthetic image-caption pairs; resume with "
                             "the same model and data")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint data seed {state.get('seed')} differs from --seed "
                             f"{self.seed}")


def open_coco(cfg, world_size: int):
    """The COCO captions folder of --data for a blip model, opened (and checked: every caption's
    image must exist and decode) before any process group starts. One process may build the
    caches and train the caption tokenizer; several only read them. Sets cfg.vocab."""
    from commpipe.data.coco import CocoSource, prepare_coco, read_split
    from commpipe.train.source import padded_vocab

    spec = resolve_blip(cfg.model)
    splits = ("train", "val") if cfg.eval_every else ("train",)
    for name in splits:      # every captioned image must exist, named if not (caches or not)
        split = read_split(cfg.data, name)
        for i in sorted({c.image_id for c in split.captions}):
            path = split.image_dir / split.files[i]
            if not path.is_file():
                raise FileNotFoundError(f"image {path} (image id {i}, in {split.annotation}) is "
                                        "missing; restore it or remove its captions")
    if world_size > 1:
        hint = ("; prepare it with one process first (the same command without torchrun, e.g. "
                "--steps 1), which trains the caption tokenizer and builds the caches")
    else:
        hint = ""
    vocab_size = cfg.vocab_size if cfg.vocab_size or cfg.tokenizer else min(spec.vocab, 8192)
    try:
        tok, data = prepare_coco(cfg.data, spec.image_size, spec.text_len,
                                 vocab_size=None if cfg.tokenizer else vocab_size,
                                 tokenizer=cfg.tokenizer, splits=splits, build=world_size == 1)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}{hint}") from None
    source = CocoSource(tok, data, seed=cfg.seed)
    cfg.vocab = padded_vocab(source.vocab_size, cfg.dims.tp)
    return source


def make_blip_source(cfg):
    if cfg.data:
        return open_coco(cfg, cfg.dims.world_size)
    return SyntheticCaptions(cfg.spec, cfg.seed)


def synthetic_source(cfg):
    return SyntheticCaptions(cfg.spec, cfg.seed)


register_training("blip", Training(resolve_config, build, open_coco, make_blip_source,
                                   synthetic_source))
