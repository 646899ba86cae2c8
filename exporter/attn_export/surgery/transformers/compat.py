"""transformers itself: the supported versions, importing it with a clear error, recognizing its
models without importing it."""
from __future__ import annotations

import sys
from typing import Tuple

from torch import nn

from attn_export.errors import InputError

IMPLEMENTATION = "attn_export"
MIN_VERSION = (4, 53)
INSTALL_HINT = "pip install 'attn-export[hf]'"

# Keyword arguments of the attention call that change the math in a way the fused operator
# does not compute. A call carrying one runs transformers' own eager attention instead, and the
# layer is reported as skipped with this reason (routing.classify finds the same names in the
# layer's forward, so the plan and the run agree).
UNSERVED_KWARGS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}

class UnsupportedTransformersError(InputError):
    """transformers is missing or too old for the attention-interface routing."""


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedTransformersError(
            f"Hugging Face models need the transformers package: {INSTALL_HINT}"
        ) from exc
    if _version_tuple(transformers.__version__) < MIN_VERSION:
        raise UnsupportedTransformersError(
            f"transformers {transformers.__version__} is too old: attn-export routes attention through "
            f"AttentionInterface and AttentionMaskInterface, which need transformers >= "
            f"{'.'.join(map(str, MIN_VERSION))}"
        )
    return transformers


def is_hf_model(model) -> bool:
    """True for a transformers ``PreTrainedModel`` (never imports transformers itself)."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def contains_hf_model(model: nn.Module) -> bool:
    return any(is_hf_model(m) for m in model.modules())
