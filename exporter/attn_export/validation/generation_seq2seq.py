"""The generation gate of an encoder-decoder's cached export (the contract's encoder-decoder
layout, attn_export/cache_contract.py): the encoder file once per batch, then the decoder file
step by step with its cache, against the model's own greedy ``generate()``
(validation/generation.py holds the decoder-only gate, whose reference handling, step loop and
verdicts this one shares).

A left-padded batch of random sources of different lengths (Whisper: random log-mel features of
the config's size) goes through the encoder; every row's decoding starts at the model's
``decoder_start_token_id`` with an empty past; each later step feeds the reference's previous
token, the presents of the self-attention from the step before, and the encoder's hidden states
and mask. Passes when every step picks the reference's token and its logits are within the
dtype's tolerance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from attn_export import cache_contract as _contract
from attn_export.cache_contract import CacheContract
from attn_export.errors import InputError, first_line
from attn_export.options import GateOptions, OrtOptions
from attn_export.surgery.transformers.seq2seq_cache import example_features, start_token
from attn_export.validation import generation as _generation
from attn_export.validation.generation_result import BackendGeneration, GenerationResult
from attn_export.validation.generation_steps import DTYPES, is_prefill
from attn_export.validation.runners import OnnxRuntimeRunner, RunnerError
from attn_export.validation.tolerances import reduction_length, tolerance


class Seq2SeqSteps:
    """The decoder file (an OnnxRuntimeRunner, loaded) stepped with its self-attention's cache
    held here, each step fed the encoder's outputs (``encoder``: name -> tensor)."""

    def __init__(self, runner, layout: CacheContract, output_names: List[str], encoder: Mapping[str, torch.Tensor]):
        self.runner, self.name = runner, runner.name
        self.layout, self.output_names, self.encoder = layout, list(output_names), dict(encoder)
        self.presents = layout.present_to_past()
        self.past: Dict[str, torch.Tensor] = {}

    def step(self, feed: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if is_prefill(feed):
            self.past = self.layout.empty_past(feed[_contract.INPUT_IDS].shape[0])
        outs = dict(zip(self.output_names, self.runner.run({_contract.INPUT_IDS: feed[_contract.INPUT_IDS],
                                                            **self.encoder, **self.past})))
        self.past = {self.presents[n]: t for n, t in outs.items() if n in self.presents}
        return {_contract.LOGITS: outs[_contract.LOGITS]}


def sources(model: nn.Module, layout: CacheContract, prompt_lengths: Sequence[int],
            seed: int) -> Dict[str, torch.Tensor]:
    """The encoder's inputs: left-padded random token sources of ``prompt_lengths`` tokens, or
    random log-mel features of the config's size (one per length)."""
    if not layout.encoder_masked:
        return {layout.encoder_input: example_features(model.config, len(prompt_lengths), seed)}
    vocab = _generation.vocabulary_size(model)
    prompts = _generation.random_prompts(vocab, prompt_lengths, seed, avoid=_generation._special_tokens(model.config))
    ids, mask = _generation.left_padded(prompts, _generation.choose_pad_id(model.config, vocab))
    return {_contract.INPUT_IDS: ids, _contract.ATTENTION_MASK: mask}


def reference_generation(model: nn.Module, source: Mapping[str, torch.Tensor], new_tokens: int):
    """The model's own greedy generate() from ``source``: tokens [B, N] after the start token,
    each step's logits [N, B, V], and the first step's [B, 1, V] (the decoder's "prefill")."""
    import transformers

    vocab = _generation.vocabulary_size(model)
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None, use_cache=True,
        pad_token_id=_generation.choose_pad_id(model.config, vocab), decoder_start_token_id=start_token(model.config),
        output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        try:
            with _generation._plain_generation_defaults(model):
                out = model.generate(**source, generation_config=config)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise InputError(f"the model's generate() failed on {len(_rows(source))} sources: "
                             f"{type(exc).__name__}: {first_line(exc)}") from exc
    if len(out.logits) != new_tokens:
        raise InputError(f"the model's generate() stopped after {len(out.logits)} of {new_tokens} tokens")
    tokens, logits = out.sequences[:, -new_tokens:], torch.stack([step.float() for step in out.logits])
    _generation._require_greedy(tokens, logits)
    return tokens, logits, logits[0][:, None]


def _rows(source: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The source's main tensor (token ids or features): its rows are the batch."""
    return next(iter(source.values()))


def check_seq2seq_generation(model: nn.Module, onnx_path: str | Path, onnx_model, layout: CacheContract, *,
                             prompt_lengths: Sequence[int], ort: OrtOptions, gate: GateOptions) -> GenerationResult:
    """Greedy generation of ``gate.new_tokens`` tokens through the encoder file beside
    ``onnx_path`` and the decoder file ``onnx_path`` in ONNX Runtime (each of ``ort.providers``),
    against ``model.generate()`` (the original, in float32; not modified)."""
    import copy

    from attn_export.onnx.seq2seq import encoder_path
    from attn_export.validation.providers import provider_setups

    encoder_file = encoder_path(onnx_path)
    if not encoder_file.is_file():
        raise InputError(f"{onnx_path} is the decoder of an encoder-decoder; its encoder {encoder_file} is missing "
                         "(the export writes both)")
    reference_model = copy.deepcopy(model).float().eval()
    source = sources(reference_model, layout, prompt_lengths, gate.seed)
    reference = reference_generation(reference_model, source, gate.new_tokens)
    batch = _rows(source).shape[0]
    source_length = _rows(source).shape[-1]
    k = max(reduction_length(reference_model, {}, {}), source_length + gate.new_tokens)
    rtol = tolerance(DTYPES[layout.dtype], k)
    result = GenerationResult(new_tokens=gate.new_tokens, prompt_lengths=list(prompt_lengths), dtype=layout.dtype,
                              rtol=rtol, reduction_length=k, reference_tokens=reference[0].tolist())
    output_names = [o.name for o in onnx_model.graph.output]
    start = torch.full((batch, 1), start_token(reference_model.config), dtype=torch.long)
    for setup in provider_setups(ort.providers, onnx_model, timeout_s=gate.runtime_timeout_s):
        run, version = _backend(onnx_path, setup, gate, layout, output_names, source, start, reference, rtol)
        result.runs.append(run)
        result.runtime_version = result.runtime_version or version
    return result


def _backend(onnx_path, setup, gate: GateOptions, layout, output_names, source, start, reference,
             rtol: float) -> Tuple[BackendGeneration, Optional[str]]:
    """One provider: the encoder's run, then the decoder's steps against the reference; and
    ONNX Runtime's version."""
    from attn_export.onnx.seq2seq import encoder_path

    timeout_s = gate.runtime_timeout_s
    with OnnxRuntimeRunner(encoder_path(onnx_path), setup, timeout_s=timeout_s) as encoder, \
            OnnxRuntimeRunner(onnx_path, setup, timeout_s=timeout_s) as decoder:
        try:
            encoder.load()
            decoder.load()
            hidden = encoder.run({name: source[name] for name in layout.encoder_input_names()})[0]
        except (RunnerError, RuntimeError) as exc:
            error = f"ONNX Runtime failed on the encoder or loading the decoder: {first_line(exc)}"
            return BackendGeneration(decoder.name, error=error), None
        feed = {_contract.ENCODER_HIDDEN_STATES: torch.as_tensor(hidden)}
        if layout.encoder_masked:
            feed[_contract.ENCODER_ATTENTION_MASK] = source[_contract.ATTENTION_MASK]
        steps = Seq2SeqSteps(decoder, layout, output_names, feed)
        return _generation.run_backend(steps, layout, start, torch.ones_like(start), reference, rtol), decoder.version

