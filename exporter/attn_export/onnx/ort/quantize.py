"""Weight-only quantization of the ort flavor (``--quantize int4|int8``) by ONNX Runtime's own
quantizer: each MatMul whose weight is a 2-D initializer becomes ``com.microsoft.MatMulNBits``
(``MatMulNBitsQuantizer``, block 32, symmetric, accuracy_level 4: the settings of ONNX Runtime
GenAI's builder's ``-p int4`` on the CPU). The embedding's Gather stays float.

The scheme, which the generation gate repeats to give its reference the same weights
(validation/quantized_reference.py): per output column, blocks of ``block_size`` along K; the
block's scale is its signed value of largest magnitude divided by ``-2**(bits-1)``; a weight is
stored as ``clamp(roundf(w * (1 / scale) + 2**(bits-1)), 0, 2**bits - 1)`` (C's roundf: ties away
from zero; int4: two per byte, the low nibble first). :func:`dequantized_weights` reads a file's back.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, Iterator, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

BITS = {"int4": 4, "int8": 8}
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # activations in int8 per block (ONNX Runtime's CPU kernel); the builder's choice on the CPU
MS_DOMAIN = "com.microsoft"


def quantize_weights(model: onnx.ModelProto, precision: str) -> Counter:
    """Quantizes ``model``'s 2-D MatMul weights in place (``precision``: "int4" | "int8");
    returns how many nodes of each op type the quantizer rewrote."""
    MatMulNBitsQuantizer = _quantizer_class()
    before = Counter(n.op_type for n in model.graph.node)
    quantizer = MatMulNBitsQuantizer(model, bits=BITS[precision], block_size=BLOCK_SIZE,
                                     is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
                                     op_types_to_quantize=("MatMul",))
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, logger.level = logger.level, logging.WARNING  # one INFO line per node otherwise
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    if quantizer.model.model is not model:
        model.CopyFrom(quantizer.model.model)
    after = Counter(n.op_type for n in model.graph.node)
    return Counter({op: before[op] - after[op] for op in before if before[op] > after[op]})


def _quantizer_class():
    """ONNX Runtime's MatMulNBitsQuantizer, imported without the ``logging.basicConfig(level=INFO)``
    its module runs at import (every library's INFO lines would print from then on)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    return MatMulNBitsQuantizer


def _attrs(node: onnx.NodeProto) -> Dict[str, int]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def quantized_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """The MatMulNBits nodes of ``model``, in the main graph and its ``If`` branches, one per
    quantized weight (both branches of one_branch.py's ``If`` read the same weights)."""
    seen = set()
    for node in _within(model.graph):
        if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and node.input[1] not in seen:
            seen.add(node.input[1])
            yield node


def _within(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _within(a.g)


def dequantized_weights(model: onnx.ModelProto, base_dir: str = "") -> Iterator[Tuple[onnx.NodeProto, np.ndarray]]:
    """Each MatMulNBits node and the float32 weight [K, N] it holds, dequantized (symmetric
    nodes, those without zero points, as :func:`quantize_weights` writes them)."""
    inits = {i.name: i for i in model.graph.initializer}
    for node in quantized_nodes(model):
        attrs = _attrs(node)
        k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
        if len(node.input) > 3 and node.input[3]:
            raise ValueError(f"MatMulNBits {node.name!r} has zero points: not the symmetric scheme of --quantize")
        packed = numpy_helper.to_array(inits[node.input[1]], base_dir).reshape(n, -1)
        scales = numpy_helper.to_array(inits[node.input[2]], base_dir).astype(np.float32).reshape(n, -1)
        if bits == 4:
            values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)
        else:
            values = packed
        offset = np.float32(2 ** (bits - 1))
        q = values.astype(np.float32) - offset
        blocks = scales.shape[1]
        w = (q[:, :blocks * block].reshape(n, blocks, block) * scales[:, :, None]).reshape(n, -1)[:, :k]
        yield node, np.ascontiguousarray(w.T)


__all__ = ["ACCURACY_LEVEL", "BITS", "BLOCK_SIZE", "dequantized_weights", "quantize_weights", "quantized_nodes"]
