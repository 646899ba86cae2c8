"""A site's heads and embed dim, where the module says them under a common name."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn


def _own_attribute(module: nn.Module, *names: str):
    """The first of ``names`` the module has as an instance or class attribute. Not getattr
    alone: diffusers' models answer unknown names from their config with a FutureWarning."""
    for name in names:
        if name in vars(module) or hasattr(type(module), name):
            value = getattr(module, name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def geometry(module: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """(heads, embed dim) where the module says them under a common name, else None."""
    return (_own_attribute(module, "num_heads", "num_attention_heads", "heads", "n_head"),
            _own_attribute(module, "embed_dim", "hidden_size", "inner_dim"))
