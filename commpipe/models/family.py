"""The one contract between a model family and everything that runs it.

A `ModelFamily` says what a family of shapes is, without torch where it can: which `--model`
names and fields are its own (`owns`, `resolve`, named shapes in `presets`), how a saved spec
reads back (`spec_from_dict`), its parameter count and FLOPs (`param_count`, `step_flops`,
`flops_per_unit`), the per-layer costs the stage balancer splits by (`layer_costs`), what
crosses each stage boundary (`stage_io`), its plain stage modules and loss (`build_stages`,
`loss_sum`), whether its stages run sequence-parallel TP, its Hugging Face mapping (`hf`), and
what `commpipe plan` asks of it: which planner prices it (`planner`) and, for the layout search
over a stack of decoder layers, the form of those layers (`layer_form`, a `LayerForm`).
The trainer, checkpoint, balancer, planner, simulator costs and `commpipe convert` ask the
family; the training glue of a family (data source, tensor parallelism) is registered beside
it in commpipe.train.families. Adding a family: docs/models.md.

    >>> family_for_model("blip-base").arch, family_for_model("llama3-8b").arch
    ('blip', 'llama')
    >>> family_of(resolve("arch=gpt,layers=2,hidden=64,heads=4,vocab=128")).arch
    'llama'
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol


@dataclass(frozen=True)
class LayerForm:
    """What the layout planner's cost and memory models (commpipe.plan) read of a decoder layer
    beyond its sizes. The defaults are LLaMA's form."""
    # SwiGLU MLP (gate and up GEMMs, 2 x ffn_hidden wide), RMSNorm, and torchtitan's
    # separate wq/wk/wv and w1/w3 GEMMs when unfused; else GPT-3's GELU fc1/fc2 and LayerNorm
    gated_mlp: bool = True
    # LayerNorm biases and the row-parallel GEMMs' output biases (replicated across TP ranks)
    biases: bool = False
    learned_positions: bool = False   # a [seq, hidden] position table beside the embedding
    tied_head: bool = False           # the head reuses the embedding (synced across the pipeline)
    # --eager-ops' op-by-op count of torchtitan's Llama kernels describes this layer
    eager_ops: bool = True
    # a Mixture-of-Experts decoder: its spec (commpipe.models.moe_spec.MoESpec), whose MLPs
    # commpipe.plan.moe prices (router, shared and routed experts, the EP all-to-alls, expert
    # states over ep); the layer machinery then prices attention, norms, embedding and head
    # (the spec's `ffn_hidden` is 0). None: the layers' MLP is the dense one of `ffn_hidden`
    routed: object = None


class ModelFamily(Protocol):
    arch: str                       # the registry key (a spec's `arch`, e.g. "llama", "blip")
    archs: tuple[str, ...]          # every spec.arch the family serves ("llama", "gpt")
    unit: str                       # what training FLOPs are counted per: "token" or "sample"
    sequence_parallel: bool         # its stages run sequence-parallel TP (boundaries sharded)
    # which planner `commpipe plan` runs (commpipe.plan.cli.PLANNERS): "layers", the layout
    # search over a stack of decoder layers (commpipe.plan.search), or "towers", an encoder and
    # a decoder tower (commpipe.plan.blip); a family without one is not planned (`planner_of`)
    planner: str

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

    def layer_form(self, spec) -> LayerForm:
        """The form of `spec`'s layers, for planner "layers" (default: `LayerForm()`)."""

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
    from commpipe.models import blip_family, llama_family, moe_family  # noqa: F401


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
    """The family a `--model` value belongs to; field lists no family claims go to the default
    family (LLaMA), whose error names the fields. A name no family has is refused with every
    family's named shapes and the closest of them."""
    import difflib

    _load()
    found = [f for f in families() if f.owns(model)]
    if found:
        return found[0]
    if "=" not in model:
        names = [name for f in families() for name in f.presets()]
        close = difflib.get_close_matches(model, names, n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(f"unknown model {model!r}; {hint}the named shapes are {', '.join(names)}; "
                         "or give fields like arch=llama,layers=32,hidden=4096,heads=32,vocab=32000")
    return FAMILIES["llama"]


def resolve(model: str):
    """Any family's spec from `--model`."""
    return family_for_model(model).resolve(model)


def spec_from_dict(d: dict):
    """The spec a checkpoint's commpipe.json records, rebuilt by its family."""
    return family_for_arch(d.get("arch", "llama")).spec_from_dict(d)


def planner_of(family: ModelFamily) -> str | None:
    """The planner `commpipe plan` runs for `family` (None: the family is not planned)."""
    return getattr(family, "planner", None)


def layout_planned(spec) -> bool:
    """Does the layout search (its memory and time models) price `spec` as commpipe's own
    runtime runs it (the train-time memory checks ask)? Routed-expert layers are priced for GPU
    frameworks only (commpipe.plan.moe), so not for them."""
    return planner_of(family_of(spec)) == "layers" and layer_form(spec).routed is None


@lru_cache(maxsize=256)
def layer_form(spec) -> LayerForm:
    """The form of `spec`'s decoder layers, asked of its family (cached: the planner's search
    asks for every layout it prices)."""
    family = family_of(spec)
    return family.layer_form(spec) if hasattr(family, "layer_form") else LayerForm()
