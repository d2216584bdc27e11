"""The rendezvous port picker lives in commpipe.ports (used by `commpipe probe` as well)."""

from commpipe.ports import ephemeral_low, free_port

__all__ = ["ephemeral_low", "free_port"]
