"""The fused attention operators and what surrounds them in Python.

``library`` loads the compiled extension (``torch.ops.attn_export.*``) and registers the fake
kernels (``fake``) and autocast rules (``autocast``); ``functional`` holds the entry points,
``module`` the drop-in ``nn.MultiheadAttention``, ``gemm`` the CPU GEMM library choice.
"""
from attn_export.ops.library import load_library

load_library()

from attn_export.ops.functional import CausalAlignment, attention, multi_head_attention  # noqa: E402
from attn_export.ops.gemm import gemm_backend, set_gemm_backend  # noqa: E402
from attn_export.ops.module import FusedMultiheadAttention  # noqa: E402

__all__ = [
    "attention", "CausalAlignment", "multi_head_attention", "FusedMultiheadAttention",
    "gemm_backend", "set_gemm_backend", "load_library",
]
