"""The generation gate's reference for a quantized export (``--quantize``): the original model
carrying exactly the weights the file holds. Each ``nn.Linear`` is quantized and dequantized in
PyTorch with the file's scheme (attn_export.onnx.ort.quantize: per output row, blocks along the
input features, symmetric); every row of the result must equal, bit for bit, a column of a
MatMulNBits weight read back from the file and dequantized, and every such column must be
some Linear's row. Then the reference computes with the file's weights, and what is left between
the two is how ONNX Runtime computes (docs/validation.md, "Quantized exports")."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from attn_export.errors import InputError


@dataclass(frozen=True)
class QuantizedReference:
    """What the reference was given: the Linear layers whose weights it now holds dequantized,
    the file's bits, block size and accuracy level, and how many quantized columns it matched."""

    linears: int
    bits: int
    block_size: int
    accuracy_level: int
    columns: int

    @property
    def compute_precision(self) -> Optional[str]:
        """How ONNX Runtime computes these MatMuls (MatMulNBits' accuracy_level 2-4: the
        activations in float16, bfloat16 or int8; 0-1: float32), tolerances.COMPUTE_EPS' key."""
        return {2: "fp16", 3: "bf16", 4: "int8"}.get(self.accuracy_level)

    @property
    def note(self) -> str:
        return (f"the reference carries the file's quantized weights: {self.linears} Linear layer(s) quantized and "
                f"dequantized in PyTorch ({self.bits} bits, block {self.block_size}, symmetric), equal bit for bit "
                f"to the file's {self.columns} MatMulNBits columns read back and dequantized")


def fake_quantize(weight: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``weight`` [N, K] through the file's scheme and back, in float32, as ONNX Runtime's
    quantizer computes it (bit for bit, ties included): per row, blocks of ``block`` along K
    (zero-padded); scale = the block's signed value of largest magnitude over ``-2**(bits-1)``;
    a value is ``w * (1 / scale) + 2**(bits-1)`` rounded half away from zero (C's roundf) and
    clamped to ``[0, 2**bits - 1]``, the offset taken off again."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach().float(), (0, (-k) % block)).reshape(n, -1, block)
    peak = torch.gather(w, -1, w.abs().argmax(-1, keepdim=True))
    offset = float(2 ** (bits - 1))
    scale = peak / -offset
    reciprocal = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    q = torch.clamp(_round_half_away(w * reciprocal + offset), 0, 2 ** bits - 1) - offset
    return (q * scale).reshape(n, -1)[:, :k]


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: ties away from zero (torch.round rounds them to even: a 4.5 that ONNX
    Runtime stores as 5 would be 4)."""
    whole = torch.trunc(x)
    return torch.where((x - whole).abs() == 0.5, whole + torch.sign(x), torch.round(x))


def _rows(matrix) -> Counter:
    """The rows' bytes, counted; + 0.0 makes every -0.0 (a zero times a negative scale) +0.0."""
    return Counter(bytes(row) for row in (matrix.astype("float32") + 0.0).astype("float32"))


def dequantize_reference(model: nn.Module, onnx_model, base_dir: str = "") -> Optional[QuantizedReference]:
    """Gives ``model`` (the gate's own copy) the file's quantized weights in place; None when the
    file has no MatMulNBits. InputError when the file's weights and the model's Linears do not
    match under the scheme (another quantizer, zero points, a model the file was not made from)."""
    from attn_export.onnx.ort.quantize import dequantized_weights

    try:
        read = list(dequantized_weights(onnx_model, base_dir))
    except (ValueError, KeyError) as exc:
        raise InputError(f"the generation gate could not read the file's quantized weights: {exc}") from exc
    if not read:
        return None
    attrs = [{a.name: a.i for a in node.attribute} for node, _ in read]
    schemes = {(a["bits"], a["block_size"], a.get("accuracy_level", 0)) for a in attrs}
    if len(schemes) != 1:
        raise InputError(f"the file's MatMulNBits mix quantization schemes (bits, block, accuracy) {sorted(schemes)}")
    bits, block, level = schemes.pop()
    columns = Counter()
    for _, weight in read:
        columns.update(_rows(weight.T))
    found = Counter()
    replaced = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            dequantized = fake_quantize(module.weight, bits, block)
            rows = _rows(dequantized.numpy())
            if rows and all(columns[r] >= c for r, c in rows.items()):
                module.weight = nn.Parameter(dequantized.to(module.weight.dtype), requires_grad=False)
                found.update(rows)
                replaced += 1
    missing = sum((columns - found).values())
    if missing:
        raise InputError(f"{missing} of the file's {sum(columns.values())} quantized weight columns equal no row of "
                         f"the model's Linear layers quantized with the file's scheme ({bits} bits, block {block}, "
                         "symmetric): the file was not quantized from this model by --quantize")
    return QuantizedReference(replaced, bits, block, level, sum(columns.values()))


__all__ = ["QuantizedReference", "dequantize_reference", "fake_quantize"]
