"""Autocast rules for the public operators, so that mixed-precision training (``torch.autocast``)
works as it does with the modules they replace.

Without a rule, an autocast region hands the operator whatever it gets: bfloat16 activations from
an autocast ``nn.Linear`` next to float32 parameters, which the kernels reject. torch's own
matmul-class operators (``linear``, ``scaled_dot_product_attention``, ``bmm``) follow the
"lower_precision_fp" policy: every floating input except float64 is cast to the region's dtype,
and the operator runs with autocast off. These rules do the same, reading the dtype from the
region (``torch.get_autocast_dtype``) rather than fixing it at registration as
``torch.library.register_autocast`` does, since a CUDA region may be float16 or bfloat16.

Inputs that are the same tensor stay the same tensor after the cast: the layer operator takes
its packed-projection path for self-attention (query is key is value) by identity.
Gradients reach the float32 parameters through the casts, in float32, as with ``nn.Linear``.
"""
from __future__ import annotations

import torch

from attn_export import spec as _spec

_OPS = _spec.load()

# The operators users call; the kernels they dispatch to run below the autocast keys.
_PUBLIC_OPS = (_OPS.torch_op_multi_head_attention, _OPS.torch_op_attention)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

_library = None  # the registrations live as long as this Library object


def _cast_like_autocast(args, dtype: torch.dtype) -> list:
    """Casts the floating tensors of ``args`` (not float64) to ``dtype``, once per tensor."""
    cast = {}
    out = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dtype not in (torch.float64, dtype):
            if id(arg) not in cast:
                cast[id(arg)] = arg.to(dtype)
            arg = cast[id(arg)]
        out.append(arg)
    return out


def _autocast_kernel(op, device_type: str):
    def kernel(*args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type=device_type, enabled=False):
            return op(*_cast_like_autocast(args, dtype))

    return kernel


def register() -> None:
    global _library
    if _library is not None:
        return
    namespace = _OPS.torch_op_attention.split("::")[0]
    library = torch.library.Library(namespace, "IMPL")
    for qualified_name in _PUBLIC_OPS:
        name = qualified_name.split("::")[1]
        op = getattr(getattr(torch.ops, namespace), name).default
        for device_type, key in _AUTOCAST_KEYS.items():
            library.impl(name, _autocast_kernel(op, device_type), key)
    _library = library
