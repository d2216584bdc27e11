"""The decoder-only family: LLaMA (trained and planned) and GPT shapes (planned only).

Shapes and FLOPs: commpipe.models.spec; the module: commpipe.models.llama; Hugging Face:
commpipe.models.hf_llama.
"""

from __future__ import annotations

from commpipe.models import spec as S
from commpipe.models.boundary import llama_stage_io
from commpipe.models.family import LayerForm, register

# GPT-3's layer (Brown et al. 2020, as Megatron-LM builds it): GELU MLP, LayerNorm with biases,
# biased linear maps, learned positions, the head tied to the embedding
GPT_FORM = LayerForm(gated_mlp=False, biases=True, learned_positions=True, tied_head=True,
                     eager_ops=False)


class LlamaFamily:
    arch = "llama"
    archs = ("llama", "gpt")
    unit = "token"
    sequence_parallel = True
    planner = "layers"

    def presets(self) -> dict:
        return dict(S.PRESETS)

    def owns(self, model: str) -> bool:
        if "=" in model:
            arch = dict(p.split("=", 1) for p in model.replace(" ", "").split(",") if "=" in p)
            return arch.get("arch", "llama") in self.archs
        return model in S.PRESETS

    def resolve(self, model: str):
        return S.resolve_model(model)

    def spec_from_dict(self, d: dict):
        return S.ModelSpec(**d).validate()

    def trainable(self, spec) -> str | None:
        if spec.arch != "llama":
            return (f"training builds arch=llama models, got arch={spec.arch}; "
                    "gpt shapes work with plan and estimate")
        return None

    def param_count(self, spec, seq_len: int) -> int:
        return S.param_count(spec, seq_len)

    def flops_per_unit(self, spec, seq_len: int) -> float:
        return S.flops_per_token(spec, seq_len)

    def step_flops(self, spec, seq_len: int, global_batch: int) -> float:
        return S.flops_per_token(spec, seq_len) * global_batch * seq_len

    def layer_costs(self, spec, seq_len: int) -> list[float]:
        # the layers are identical: balancing only moves the head's share
        costs = [S.layer_flops_per_token(spec, seq_len)] * spec.layers
        costs[-1] += S.head_flops_per_token(spec)
        return costs

    def stage_io(self, spec, stage_layers, micro_batch: int, seq_len: int,
                 dtype: str = "float32") -> list:
        return llama_stage_io(spec, stage_layers, micro_batch, seq_len, dtype)

    def build_stages(self, spec, ranges, seed: int, device) -> list:
        from commpipe.models.llama import build_model

        last = spec.layers
        return [build_model(spec, seed, r, has_embedding=r.start == 0, has_head=r.stop == last,
                            device=device) for r in ranges]

    def loss_sum(self, logits, labels):
        from commpipe.models.llama import cross_entropy_sum

        return cross_entropy_sum(logits, labels)

    def layer_form(self, spec) -> LayerForm:
        return GPT_FORM if spec.arch == "gpt" else LayerForm()

    @property
    def hf(self):
        from commpipe.models.hf import family_for_arch

        return family_for_arch(self.arch)


FAMILY = register(LlamaFamily())
