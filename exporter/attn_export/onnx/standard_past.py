"""A cached export's Concat(past, new) matcher, importable from here as before; it is shared by
both flavors' folds and lives in :mod:`attn_export.onnx.editing`."""
from attn_export.onnx.editing import (  # noqa: F401
    TO_SEQUENCE_FIRST as _TO_SEQUENCE_FIRST,
    GraphIndex,
    PastFold,
    drop_concats,
    find_past,
    sequence_first,
)
from attn_export.onnx.editing import attr_int as _int  # noqa: F401
from attn_export.onnx.editing import attr_ints as _ints  # noqa: F401
