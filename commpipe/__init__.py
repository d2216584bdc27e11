"""commpipe: communication-aware 4D-parallel transformer training on torch.distributed."""

__version__ = "0.1.0"
