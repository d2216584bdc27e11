"""The Mixture-of-Experts decoder family: LLaMA blocks whose MLP is a routed layer of experts
(Mixtral, DeepSeek-V3 shapes). Trained like LLaMA, with expert parallelism (--ep) on top.

Shapes, counts and FLOPs (active experts only): commpipe.models.moe_spec; the module:
commpipe.models.moe; training glue: commpipe.train.moe; expert parallelism:
commpipe.parallel.expert.
"""

from __future__ import annotations

from commpipe.models import moe_spec as M
from commpipe.models.family import LayerForm, register


class MoEFamily:
    arch = "moe"
    archs = ("moe",)
    unit = "token"
    # every TP rank routes the whole sequence through replicated experts: no sequence shards
    sequence_parallel = False
    # the layout search over decoder layers, its MLPs priced as routed experts (commpipe.plan.moe)
    planner = "layers"

    def presets(self) -> dict:
        return dict(M.PRESETS)

    def owns(self, model: str) -> bool:
        return M.is_moe(model)

    def resolve(self, model: str):
        return M.resolve_moe(model)

    def spec_from_dict(self, d: dict):
        return M.spec_from_dict(d)

    def trainable(self, spec) -> str | None:
        return None

    def param_count(self, spec, seq_len: int) -> int:
        return M.param_count(spec, seq_len)

    def flops_per_unit(self, spec, seq_len: int) -> float:
        return M.flops_per_token(spec, seq_len)

    def step_flops(self, spec, seq_len: int, global_batch: int) -> float:
        return M.flops_per_token(spec, seq_len) * global_batch * seq_len

    def layer_costs(self, spec, seq_len: int) -> list[float]:
        costs = [M.layer_flops_per_token(spec, seq_len, i) for i in range(spec.layers)]
        costs[-1] += M.head_flops_per_token(spec)
        return costs

    def stage_io(self, spec, stage_layers, micro_batch: int, seq_len: int,
                 dtype: str = "float32") -> list:
        return M.stage_io(spec, stage_layers, micro_batch, seq_len, dtype)

    def build_stages(self, spec, ranges, seed: int, device) -> list:
        from commpipe.models.moe import build_moe

        last = spec.layers
        return [build_moe(spec, seed, r, has_embedding=r.start == 0, has_head=r.stop == last,
                          device=device, stage=True) for r in ranges]

    def loss_sum(self, logits, labels):
        """`logits`: the last stage's MoEOutput (logits and the carried balancing term)."""
        from commpipe.models.moe import stage_loss_sum

        return stage_loss_sum(logits, labels)

    def layer_form(self, spec) -> LayerForm:
        """LLaMA's attention and norms; the MLPs are the routed layer `spec` describes (no
        op-by-op eager kernel count for it)."""
        return LayerForm(eager_ops=False, routed=spec)

    @property
    def hf(self):
        from commpipe.models.hf import family_for_arch

        return family_for_arch(self.arch)


FAMILY = register(MoEFamily())
