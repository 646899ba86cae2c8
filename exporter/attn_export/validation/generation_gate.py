"""``validate`` for a cached export (the cache's contract in its metadata,
attn_export/cache_contract.py). A model that generates (``cache_contract.generates``): the
graph checks of the contract, then the generation gate (validation/generation.py) as the
report's cases, one row per backend for the prefill and for every step (output ``logits``), and
one check per backend for the tokens. A model that does not: the parity gate's shape cases
through the decoder wrapped with its cache as flat tensors (:func:`wrapped_decoder`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from attn_export.cache_contract import ATTENTION_MASK, INPUT_IDS, CacheContract
from attn_export.options import DEFAULT_NEW_TOKENS, GateOptions, OrtOptions
from attn_export.validation import checks as _checks
from attn_export.validation.generation import DEFAULT_PROMPT_LENGTHS, DTYPES, check_generation
from attn_export.validation.report import ValidationReport, environment
from attn_export.validation.tolerances import TOLERANCE_FACTOR


def validate_generation(model, onnx_path: Path, onnx_model, *, say: Callable[[str], None], engine=None, plugin=None,
                        ort: Optional[OrtOptions] = None, gate: Optional[GateOptions] = None) -> ValidationReport:
    """The report of a cached export (``onnx_model`` records its cache's contract); with
    ``engine``, a TensorRT engine of it generates too (its own backend rows)."""
    from attn_export import shapes as _shapes
    from attn_export.onnx import attention_flavor, read_metadata

    gate = gate or GateOptions()
    new_tokens, seed = gate.new_tokens, gate.seed
    contract = CacheContract.require(onnx_model, onnx_path)
    init_names = {i.name for i in onnx_model.graph.initializer}
    graph_inputs = [v.name for v in onnx_model.graph.input if v.name not in init_names]
    checks = [_checks.cache_contract_check(onnx_model, contract),
              _checks.dynamic_axes_check(contract.dynamic_axes(), _shapes.graph_axes(onnx_model, graph_inputs))]
    checks += _checks.attention_checks(onnx_model, read_metadata(onnx_model))
    say(f"generating {new_tokens} tokens with the cache, against the model's generate()")
    result = check_generation(model, onnx_path, onnx_model=onnx_model, engine=engine, plugin=plugin, ort=ort,
                              gate=gate)
    backends = [run.backend for run in result.runs]
    return ValidationReport(
        cases=result.case_results(), checks=checks + result.checks(), dtype=result.dtype,
        tolerance={
            "rule": "per step: pass iff max|actual - reference| <= rtol * max|reference logits of that step| "
                    "(prefill: at the prompts' valid tokens), and every step's greedy token equals the reference's; "
                    "rtol = factor * eps(dtype) * sqrt(K); a --quantize file computed with int8 activations: "
                    "rtol = factor / 127 where larger",
            "factor": TOLERANCE_FACTOR, "eps": torch.finfo(DTYPES[result.dtype]).eps,
            "reduction_length": result.reduction_length, "rtol": result.rtol,
            "reference": result.reference,
        },
        environment=_environment(seed, backends, result.runtime_version, engine),
        onnx_path=str(onnx_path), input_names=graph_inputs,
        output_names=[o.name for o in onnx_model.graph.output],
        notes=[f"cached export: greedy generation of {new_tokens} tokens from {len(result.prompt_lengths)} "
               f"left-padded prompts of lengths {result.prompt_lengths} (seed {seed}) replaces the shape cases; "
               "each step feeds the reference's previous token and the presents of the step before"],
        attention_flavor=attention_flavor(onnx_model), generation=result.to_dict(),
    )


def wrapped_decoder(model: nn.Module, inputs: Mapping[str, torch.Tensor], dtype: str,
                    seed: int = 0) -> Tuple[nn.Module, Dict[str, torch.Tensor], str]:
    """What the parity gate compares a cached export of a model without ``generate()`` with:
    the decoder with its cache as flat tensors (the file's inputs), at the example's tokens
    after a non-empty past; and the report's note on it. The shape cases that change one length
    alone (a sequence without the mask over it) the decoder rejects; the gate reports them
    skipped."""
    from attn_export.errors import InputError
    from attn_export.surgery.transformers.cache import DecoderWithPast

    if isinstance(model, DecoderWithPast):  # wrapped already: ``inputs`` are the file's
        wrapped, checked = model, dict(inputs)
    else:
        try:
            wrapped = DecoderWithPast.wrap(model, dtype)
        except InputError as exc:
            raise InputError(f"the file is a cached export, compared with the decoder it was exported from: {exc}") \
                from exc
        checked = wrapped.example_inputs(inputs, seed=seed)
    new = checked[INPUT_IDS].shape[1]
    past = checked[ATTENTION_MASK].shape[1] - new
    note = (f"a cached export of a model without generate(): the parity gate runs {new} new tokens after a past "
            f"of {past} through the decoder with its cache as flat tensors; its cases that resize the sequence or "
            "the past alone are skipped (the attention mask covers past + new tokens)")
    return wrapped, checked, note


def _environment(seed: int, backends, runtime_version, engine) -> dict:
    env = environment(seed, providers=backends, onnxruntime_version=runtime_version)
    if engine is not None:
        from attn_export.tensorrt import environment as trt_environment

        env.update(trt_environment(), engine=str(engine))
    return env


__all__ = ["validate_generation", "wrapped_decoder", "DEFAULT_NEW_TOKENS", "DEFAULT_PROMPT_LENGTHS"]
