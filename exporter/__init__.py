"""attn-export: a fused multi-head attention operator for PyTorch, with model surgery,
ONNX export and parity validation built around it.

    >>> import attn_export
    >>> layer = attn_export.FusedMultiheadAttention(embed_dim=64, num_heads=4, batch_first=True)
    >>> out, weights = layer(x, x, x)

Importing the package loads the compiled operators (``torch.ops.attn_export.*``).
"""
from attn_export._library import load_library

load_library()

from attn_export.modules import FusedMultiheadAttention  # noqa: E402
from attn_export.ops import attention, multi_head_attention  # noqa: E402

__version__ = "0.1.0"

__all__ = ["FusedMultiheadAttention", "attention", "multi_head_attention", "__version__"]
