"""The BLIP-style captioner: a ViT encoder feeding a text decoder with cross-attention.

Shapes, FLOPs and stage boundaries: commpipe.models.blip_spec; the module:
commpipe.models.blip; Hugging Face: commpipe.models.hf_blip.
"""

from __future__ import annotations

from commpipe.models import blip_spec as B
from commpipe.models.family import register


class BlipFamily:
    arch = "blip"
    archs = ("blip",)
    unit = "sample"
    sequence_parallel = False   # boundaries and norms keep whole captions on every TP rank
    planner = "towers"          # its own planner: commpipe.plan.blip

    def presets(self) -> dict:
        return dict(B.BLIP_PRESETS)

    def owns(self, model: str) -> bool:
        return B.is_blip(model)

    def resolve(self, model: str):
        return B.resolve_blip(model)

    def spec_from_dict(self, d: dict):
        d = {k: v for k, v in d.items() if k != "arch"}
        return B.BlipSpec(**d).validate()

    def trainable(self, spec) -> str | None:
        return None

    def param_count(self, spec, seq_len: int) -> int:
        return B.param_count(spec)

    def flops_per_unit(self, spec, seq_len: int) -> float:
        return float(B.flops_per_sample(spec, seq_len))

    def step_flops(self, spec, seq_len: int, global_batch: int) -> float:
        return float(B.flops_per_sample(spec, seq_len) * global_batch)

    def layer_costs(self, spec, seq_len: int) -> list[float]:
        return [float(f) for f in B.layer_flops(spec)]

    def stage_io(self, spec, stage_layers, micro_batch: int, seq_len: int,
                 dtype: str = "float32") -> list:
        return B.stage_io(spec, stage_layers, micro_batch, seq_len, dtype)

    def build_stages(self, spec, ranges, seed: int, device) -> list:
        from commpipe.models.blip import build_model

        return [build_model(spec, seed, r, device) for r in ranges]

    def loss_sum(self, logits, labels):
        from commpipe.models.blip import caption_loss_sum

        return caption_loss_sum(logits, labels)

    @property
    def hf(self):
        from commpipe.models.hf import family_for_arch

        return family_for_arch(self.arch)


FAMILY = register(BlipFamily())
