"""torch2trt converters: ``attn_export.attention`` -> the FusedAttention TensorRT plugin.

UNVERIFIED: torch2trt is not on the package index and TensorRT is not installed where this
was written, so these converters have never run. The tested path to TensorRT is ONNX
(``attn-export MODEL --to tensorrt``, docs/tensorrt.md).

It lives outside the ``attn_export`` package (an unverified binding is not imported by
``import attn_export``): put this folder on ``sys.path`` and import it. Importing it registers
the converters when torch2trt is importable and does nothing otherwise (``AVAILABLE`` says
which)::

    import sys; sys.path.insert(0, "plugins/torch2trt")
    import torch2trt
    import attn_export_torch2trt
    from attn_export import tensorrt as attn_trt
    import tensorrt as trt

    attn_trt.register_plugin_library(attn_trt.find_plugin_library(), trt.get_plugin_registry())
    model_trt = torch2trt.torch2trt(model, [q, k, v])

Covered: the attention core ``attn_export.attention(q, k, v, attn_mask, key_padding_mask,
is_causal, scale)`` on ``[B, H, L, D]`` tensors, masks floating or absent (boolean masks raise:
use the ONNX path, whose exporter turns them into additive masks). The layer operator behind
``FusedMultiheadAttention`` (projections + attention) has no converter here.
"""
from __future__ import annotations

import importlib.util
import math

AVAILABLE = importlib.util.find_spec("torch2trt") is not None


def _pack(network, tensor):
    """[B, H, L, D] -> [B, L, H*D] (the node's token-major layout)."""
    layer = network.add_shuffle(tensor)
    layer.first_transpose = (0, 2, 1, 3)
    layer.reshape_dims = (0, 0, -1)
    return layer.get_output(0)


def _unpack(network, tensor, heads: int):
    """[B, Lq, H*Dv] -> [B, H, Lq, Dv]."""
    layer = network.add_shuffle(tensor)
    layer.reshape_dims = (0, 0, heads, -1)
    layer.second_transpose = (0, 2, 1, 3)
    return layer.get_output(0)


def _mask(network, trt, mask, rank: int, add_missing_trt_tensors):
    """A floating mask as a float32 tensor of the node's rank, or the zero placeholder."""
    import numpy as np
    import torch

    if mask is None:
        shape = (1,) * rank
        return network.add_constant(shape, np.zeros(shape, np.float32)).get_output(0), False
    if mask.dtype == torch.bool:
        raise NotImplementedError(
            "attn_export torch2trt converter: boolean masks are not converted; export through ONNX "
            "(attn-export MODEL --to tensorrt), which turns them into additive masks"
        )
    (tensor,) = add_missing_trt_tensors(network, [mask])
    if mask.dtype != torch.float32:
        tensor = network.add_cast(tensor, trt.float32).get_output(0)
    if mask.dim() < rank:
        layer = network.add_shuffle(tensor)
        layer.reshape_dims = (1,) * (rank - mask.dim()) + tuple(mask.shape)
        tensor = layer.get_output(0)
    return tensor, True


def convert_attention(ctx):
    import tensorrt as trt
    from torch2trt.torch2trt import add_missing_trt_tensors, get_arg

    from attn_export import spec as _spec
    from attn_export.tensorrt import plugin_field_collection

    s = _spec.load()
    query = get_arg(ctx, "query", pos=0, default=None)
    key = get_arg(ctx, "key", pos=1, default=None)
    value = get_arg(ctx, "value", pos=2, default=None)
    attn_mask = get_arg(ctx, "attn_mask", pos=3, default=None)
    key_padding_mask = get_arg(ctx, "key_padding_mask", pos=4, default=None)
    is_causal = bool(get_arg(ctx, "is_causal", pos=5, default=False))
    scale = get_arg(ctx, "scale", pos=6, default=None)
    softcap = get_arg(ctx, "softcap", pos=7, default=None)
    heads, head_dim = int(query.shape[1]), int(query.shape[3])
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    network = ctx.network
    q, k, v = (_pack(network, t) for t in add_missing_trt_tensors(network, [query, key, value]))
    kpm, has_kpm = _mask(network, trt, key_padding_mask, 2, add_missing_trt_tensors)
    mask, has_mask = _mask(network, trt, attn_mask, 4, add_missing_trt_tensors)

    creator = trt.get_plugin_registry().get_creator(s.plugin_name, s.plugin_version, s.plugin_namespace)
    if creator is None:
        raise RuntimeError(
            f"the {s.plugin_name} TensorRT plugin is not registered: load its library first with "
            "attn_export.tensorrt.register_plugin_library(path, tensorrt.get_plugin_registry())"
        )
    fields = plugin_field_collection(trt, num_heads=heads, scale=scale, is_causal=is_causal,
                                     has_key_padding_mask=has_kpm, has_attn_mask=has_mask,
                                     softcap=float(softcap or 0.0))
    plugin = creator.create_plugin(s.op_type, fields, trt.TensorRTPhase.BUILD)
    layer = network.add_plugin_v3([q, k, v, kpm, mask], [], plugin)
    ctx.method_return._trt = _unpack(network, layer.get_output(0), heads)


def register() -> bool:
    """Registers the converters with torch2trt; False when torch2trt is not importable."""
    if not AVAILABLE:
        return False
    from torch2trt.torch2trt import tensorrt_converter

    # torch2trt swaps the named function during conversion; attn_export.attention is a second
    # name of attn_export.ops.functional.attention, so both are registered.
    for name in ("attn_export.ops.functional.attention", "attn_export.attention"):
        tensorrt_converter(name)(convert_attention)
    return True


REGISTERED = register()
