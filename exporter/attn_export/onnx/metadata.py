"""The exporter's ``attn_export.*`` entries of a model's ``metadata_props``."""
from __future__ import annotations

from typing import Dict

import onnx

META_PREFIX = "attn_export."


def read_metadata(model: onnx.ModelProto) -> Dict[str, str]:
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
