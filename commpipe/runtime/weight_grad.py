"""The I/W split of zero-bubble schedules lives beside the parallel modules it routes
(commpipe.parallel.weight_grad); the runtime reaches it under this name too."""

from commpipe.parallel.weight_grad import WeightGradStore, enable_weight_grad_split, route_linear

__all__ = ["WeightGradStore", "enable_weight_grad_split", "route_linear"]
