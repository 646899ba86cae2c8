"""The torch operators' signatures, read from the one spec: the schema strings of
``csrc/attention_spec.h`` (``kSchema*``), parsed with torch's own schema parser. Every argument's
name, order, type and default is known here, so the fake kernels (``ops/fake.py``) and the ONNX
translation (``onnx/translation.py``) take the operators' arguments from their schemas instead of
spelling them, and tests/test_spec.py holds every signature still spelled in Python to them.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

import torch

from attn_export import spec as _spec

# Schema types of non-tensor arguments -> the Python type onnxscript reads as an attribute. An
# optional scalar (`float? scale=None`) is annotated as the scalar, with the default None; a list
# of floats (`float[]? alibi_slopes=None`) as Sequence[float], which onnxscript reads as FLOATS.
_SCALAR_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "List[float]": Sequence[float]}


@dataclass(frozen=True)
class Argument:
    """One argument of an operator's schema."""

    name: str
    type: str  # as torch spells it: "Tensor", "Optional[Tensor]", "bool", "Optional[float]", "List[bool]"
    default: Any  # inspect.Parameter.empty when the argument is required

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Optional[Tensor]")

    @property
    def annotation(self) -> Any:
        """The Python type of a scalar argument or a list of floats (the attribute onnxscript
        sees); empty for tensors and other lists."""
        scalar = self.type[len("Optional["):-1] if self.type.startswith("Optional[") else self.type
        return _SCALAR_TYPES.get(scalar, inspect.Parameter.empty)


@functools.lru_cache(maxsize=None)
def schema(op: str) -> torch.FunctionSchema:
    """The parsed schema of the operator `op` (a qualified name, ``spec.load().torch_op_*``)."""
    schemas = _spec.load().torch_schemas
    if op not in schemas:
        raise KeyError(f"{op!r} is not an operator of the spec; known: {', '.join(schemas)}")
    return torch._C.parse_schema(schemas[op])


@functools.lru_cache(maxsize=None)
def arguments(op: str) -> Tuple[Argument, ...]:
    """The operator's arguments, in schema order."""
    return tuple(
        Argument(a.name, str(a.type), a.default_value if a.has_default_value() else inspect.Parameter.empty)
        for a in schema(op).arguments
    )


@functools.lru_cache(maxsize=None)
def signature(op: str) -> inspect.Signature:
    """The operator's Python signature: its arguments' names, order, defaults and scalar types."""
    return inspect.Signature([
        inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=a.default,
                          annotation=a.annotation)
        for a in arguments(op)
    ])


def bind(op: str, args: tuple, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """A call's arguments by name, the schema's defaults filled in (TypeError as Python raises
    for a call that does not fit the schema)."""
    bound = signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def with_signature(op: str, body: Callable[..., Any]) -> Callable[..., Any]:
    """`body` under the operator's own signature: the result takes the operator's arguments as
    the schema orders them (positionally or by name, defaults filled in) and calls
    ``body(**arguments)``. Its ``__signature__`` and ``__annotations__`` are the schema's, which
    is what torch's ONNX exporter and onnxscript read to pass a call's inputs and attributes."""
    sig = signature(op)

    @functools.wraps(body, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def call(*args, **kwargs):
        return body(**bind(op, args, kwargs))

    call.__signature__ = sig
    call.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()
                            if p.annotation is not inspect.Parameter.empty}
    return call


def follows_schema(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: ``with_signature(op, body)``."""
    return functools.partial(with_signature, op)


def check_parameters(function: Callable[..., Any], op: str, where: str) -> None:
    """Raises TypeError unless `function`'s parameters are the operator's arguments: the same
    names in the same order, with the schema's defaults (a Python ``None`` may stand for the
    schema's default where the function documents it as "the operator's default"). `where` names
    the place to fix ("exporter/attn_export/ops/functional.py: attention")."""
    params = list(inspect.signature(function).parameters.values())
    expected = arguments(op)
    names, want = [p.name for p in params], [a.name for a in expected]
    if names != want:
        raise TypeError(f"{where}: its parameters {names} are not {op}'s arguments {want} "
                        f"(csrc/attention_spec.h); add or reorder them to match the schema")
    for p, a in zip(params, expected):
        stands_for_default = p.default is None and a.default is not inspect.Parameter.empty
        if p.default != a.default and not stands_for_default:
            raise TypeError(f"{where}: parameter {p.name!r} defaults to {p.default!r}, the schema of {op} "
                            f"to {a.default!r} (csrc/attention_spec.h)")
