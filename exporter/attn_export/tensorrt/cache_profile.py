"""The optimization profile of a cached decoder export (``--with-past --to tensorrt``).

The cached export's inputs (the cache's contract, attn_export/cache_contract.py) have four
kinds of dynamic axis: ``batch`` (axis 0 of every input), ``sequence`` (the new tokens:
input_ids, position_ids), ``past_sequence`` (axis 2 of every past tensor) and
``total_sequence`` (the attention_mask: past + new). One profile covers the prefill (past 0, many new tokens) and every
decode step (past > 0, one new token):

    ============== ===== ========================== ==================
    axis           min   opt                        max
    ============== ===== ========================== ==================
    batch          1     the example's batch        4 x the example's (at least 4)
    sequence       1     1 (a decode step)          max_context
    past_sequence  0     max_context // 2           max_context - 1
    total_sequence 1     max_context // 2 + 1       max_context
    ============== ===== ========================== ==================

``max_context`` is the longest context (past + new tokens) the engine takes: ``--max-context``,
else the model config's ``max_position_embeddings``. TensorRT accepts a minimum of 0 (its
IOptimizationProfile::setDimensions asks 0 <= min <= opt <= max), which the prefill's empty
past needs. Every axis of one kind gets the same bounds whatever symbol the graph gives it, so
the past tensors of all layers agree; ``--min/--opt/--max-shapes`` override a kind through any
input that has it.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from attn_export import cache_contract as _contract
from attn_export.cache_contract import CacheContract
from attn_export.errors import InputError
from attn_export.tensorrt.profiles import Dims, ShapeProfile, dynamic_overrides, graph_input_dims

# The axes' kinds are the contract's labels.
BATCH, SEQUENCE, PAST, TOTAL = _contract.BATCH, _contract.SEQUENCE, _contract.PAST_SEQUENCE, _contract.TOTAL_SEQUENCE
KINDS = _contract.AXES
MAX_CONTEXT_FLAG = "--max-context"


def max_context_of(config, given: Optional[int]) -> int:
    """The longest context (past + new tokens) the engine takes: ``given`` (--max-context) or
    the config's ``max_position_embeddings``; InputError naming the flag when neither says."""
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    if given is not None:
        if given < 2:
            raise InputError(f"{MAX_CONTEXT_FLAG} {given}: a prefill and one decode step need at least 2 tokens")
        if isinstance(limit, int) and given > limit:
            raise InputError(f"{MAX_CONTEXT_FLAG} {given} is beyond the model's max_position_embeddings ({limit}): "
                             f"give {MAX_CONTEXT_FLAG} {limit} or less")
        return int(given)
    if not isinstance(limit, int) or limit < 2:
        raise InputError("--with-past --to tensorrt: the engine's profile needs the longest context (past + new "
                         "tokens) and the model config has no max_position_embeddings: give "
                         f"{MAX_CONTEXT_FLAG} N")
    return limit


def axis_kinds(contract: CacheContract) -> Dict[str, Dict[int, str]]:
    """input -> axis -> kind, as the cache's contract declares them."""
    return contract.dynamic_axes()


def default_bounds(max_context: int, batch: int) -> Dict[str, List[int]]:
    """[min, opt, max] per kind (the module's table)."""
    half = max_context // 2
    return {BATCH: [1, batch, max(4 * batch, 4)], SEQUENCE: [1, 1, max_context],
            PAST: [0, half, max_context - 1], TOTAL: [1, half + 1, max_context]}


def cached_profile(model, layout: CacheContract, *, max_context: int, batch: int,
                   min_shapes: Optional[Mapping[str, Dims]] = None, opt_shapes: Optional[Mapping[str, Dims]] = None,
                   max_shapes: Optional[Mapping[str, Dims]] = None) -> ShapeProfile:
    """The one optimization profile of the cached export ``model`` (an onnx.ModelProto with the
    cache's contract ``layout``), for contexts up to ``max_context`` tokens and an example
    batch of ``batch`` rows. InputError when the graph or the overrides disagree with it."""
    inputs = graph_input_dims(model)
    kinds = axis_kinds(layout)
    _check_graph(inputs, kinds)
    bounds = default_bounds(max_context, batch)
    for which, given, option in ((0, min_shapes, "--min-shapes"), (1, opt_shapes, "--opt-shapes"),
                                 (2, max_shapes, "--max-shapes")):
        for kind, size in _overrides(inputs, kinds, given or {}, option).items():
            bounds[kind][which] = size
    _check_bounds(bounds)
    shapes = {name: tuple(tuple(d if isinstance(d, int) else bounds[kinds[name][axis]][which]
                                for axis, d in enumerate(dims)) for which in range(3))
              for name, dims in inputs.items()}
    return ShapeProfile(shapes=shapes, labels={kind: tuple(bounds[kind]) for kind in KINDS})  # type: ignore[arg-type]


def _check_graph(inputs: Mapping[str, List[object]], kinds: Mapping[str, Mapping[int, str]]) -> None:
    """Every dynamic axis is one the contract sizes, every input is the contract's, and no
    graph symbol stands for two kinds (their bounds differ: TensorRT would refuse the profile)."""
    extra = [n for n in inputs if n not in kinds]
    if extra:
        raise InputError(f"the cached export has input(s) {', '.join(extra)} beyond the cache's contract "
                         f"({CacheContract.describe_inputs()}): no profile rule sizes them")
    symbol_kind: Dict[str, Tuple[str, str]] = {}
    for name, dims in inputs.items():
        for axis, d in enumerate(dims):
            if isinstance(d, int):
                if axis in kinds[name] and kinds[name][axis] == PAST:
                    raise InputError(f"{name}[{axis}] is fixed at {d}: the past must grow (re-export with --with-past)")
                continue
            kind = kinds[name].get(axis)
            if kind is None:
                raise InputError(f"{name}[{axis}] is dynamic ({d}) but the cache's contract fixes it: re-export "
                                 "with --with-past")
            seen = symbol_kind.setdefault(d, (kind, f"{name}[{axis}]"))
            if seen[0] != kind:
                raise InputError(f"the graph gives {seen[1]} ({seen[0]}) and {name}[{axis}] ({kind}) one symbol "
                                 f"{d!r}: a profile cannot bound both (re-export with --with-past)")


def _overrides(inputs, kinds, given: Mapping[str, Dims], option: str) -> Dict[str, int]:
    """kind -> size from one of --min/--opt/--max-shapes (full shapes by input name)."""
    out: Dict[str, Tuple[int, str]] = {}
    for name, axis, _, size in dynamic_overrides(inputs, given, option):
        kind = kinds[name][axis]
        if kind in out and out[kind][0] != size:
            raise InputError(f"{option}: the {kind} axis is {out[kind][0]} in {out[kind][1]} but {size} in "
                             f"{name}[{axis}] (every {kind} axis takes one size)")
        out[kind] = (size, f"{name}[{axis}]")
    return {kind: size for kind, (size, _) in out.items()}


def _check_bounds(bounds: Mapping[str, List[int]]) -> None:
    for kind, (lo, opt, hi) in bounds.items():
        floor = 0 if kind == PAST else 1
        if lo < floor:
            raise InputError(f"profile for the {kind} axis: the minimum must be at least {floor}; got {lo}")
        if not lo <= opt <= hi:
            raise InputError(f"profile for the {kind} axis: need min <= opt <= max; got {lo}, {opt}, {hi}")
    if bounds[PAST][0] != 0:
        raise InputError(f"profile for the past_sequence axis: the minimum must be 0 (the prefill's empty past); "
                         f"got {bounds[PAST][0]}")
    if bounds[PAST][2] + 1 > bounds[TOTAL][2]:
        raise InputError(f"profile: the longest past ({bounds[PAST][2]}) plus one new token exceeds the attention "
                         f"mask's longest ({bounds[TOTAL][2]}): raise its max or {MAX_CONTEXT_FLAG}")
    if bounds[SEQUENCE][2] > bounds[TOTAL][2]:
        raise InputError(f"profile: the longest prefill ({bounds[SEQUENCE][2]} new tokens) exceeds the attention "
                         f"mask's longest ({bounds[TOTAL][2]}): lower input_ids' max or raise {MAX_CONTEXT_FLAG}")
