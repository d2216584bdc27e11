"""The one contract between a model family and everything that runs it.

A `ModelFamily` says what a family of shapes is, without torch where it can: which `--model`
names and fields are its own (`owns`, `resolve`, named shapes in `presets`), how a saved spec
reads back (`spec_from_dict`), its parameter count and FLOPs (`param_count`, `step_flops`,
`flops_per_unit`), the per-layer costs the stage balancer splits by (`layer_costs`), what
crosses each stage boundary (`stage_io`), its plain stage modules and loss (`build_stages`,
`loss_sum`), whether its stages run sequence-parallel TP, and its Hugging Face mapping (`hf`).
The trainer, checkpoint, balancer, planner, simulator costs and `commpipe convert` ask the
family; the training glue of a family (data source, tensor parallelism) is registered beside
it in commpipe.train.families. Adding a family: docs/models.md.

    >>> family_for_model("blip-base").arch, family_for_model("llama3-8b").arch
    ('blip', 'llama')
    >>> family_of(resolve("arch=gpt,layers=2,hidden=64,heads=4,vocab=128")).arch
    'llama'
"""

from __future__ import annotations

from typing import Protocol


class ModelFamily(Protocol):
    arch: str                       # the registry key (a spec's `arch`, e.g. "llama", "blip")
    archs: tuple[str, ...]          # every spec.arch the family serves ("llama", "gpt")
    unit: str                       # what training FLOPs are counted per: "token" or "sample"
    sequence_parallel: bool         # its stages run sequence-parallel TP (boundaries sharded)

    def presets(self) -> dict:
        """Named shapes: {name: spec}."""

    def owns(self, model: str) -> bool:
        """Is `--model` (a preset name or `key=value` fields) one of this family's shapes?"""

    def resolve(self, model: str):
        """The spec of `--model` (raises ValueError naming the valid choices)."""

    def spec_from_dict(self, d: dict):
        """The spec a checkpoint records (`spec.to_dict()`), rebuilt and validated."""

    def trainable(self, spec) -> str | None:
        """None when `commpipe train` builds this shape, else why not (said to the user)."""

    def param_count(self, spec, seq_len: int) -> int: ...

    def flops_per_unit(self, spec, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per `unit`."""

    def step_flops(self, spec, seq_len: int, global_batch: int) -> float:
        """Model FLOPs of one optimizer step of `global_batch` sequences (samples)."""

    def layer_costs(self, spec, seq_len: int) -> list[float]:
        """Per-layer forward FLOPs, what stage balancing splits by (head and embeddings
        charged to the layer whose stage runs them)."""

    def stage_io(self, spec, stage_layers: list[int], micro_batch: int, seq_len: int,
                 dtype: str = "float32") -> list:
        """commpipe.models.boundary.StageIO of every stage of a split (layer counts)."""

    def build_stages(self, spec, ranges: list[range], seed: int, device) -> list:
        """Plain (parallel-free) modules, one per layer range."""

    def loss_sum(self, logits, labels):
        """Summed loss of one micro-batch; callers divide by the global label count."""

    @property
    def hf(self):
        """The Hugging Face mapping (commpipe.models.hf.Family): `commpipe convert`."""


FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    for arch in family.archs:
        FAMILIES[arch] = family
    return family


def _load() -> None:
    # each module registers its family on import; models/ holds one per family
    from commpipe.models import blip_family, llama_family  # noqa: F401


def families() -> list[ModelFamily]:
    """Every registered family, once each."""
    _load()
    return list({id(f): f for f in FAMILIES.values()}.values())


def family_for_arch(arch: str) -> ModelFamily:
    _load()
    if arch not in FAMILIES:
        raise ValueError(f"model arch={arch!r} is unknown; use one of {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def family_of(spec) -> ModelFamily:
    return family_for_arch(spec.arch)


def family_for_model(model: str) -> ModelFamily:
    """The family a `--model` value belongs to; the default family (LLaMA) when none claims
    it, so its error names the presets."""
    _load()
    found = [f for f in families() if f.owns(model)]
    return found[0] if found else FAMILIES["llama"]


def resolve(model: str):
    """Any family's spec from `--model`."""
    return family_for_model(model).resolve(model)


def spec_from_dict(d: dict):
    """The spec a checkpoint's commpipe.json records, rebuilt by its family."""
    return family_for_arch(d.get("arch", "llama")).spec_from_dict(d)
