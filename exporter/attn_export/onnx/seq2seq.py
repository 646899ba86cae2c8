"""An encoder-decoder's cached export is a pair of files side by side: ``-o m.onnx`` is the
decoder, the file with the cache (its contract in the metadata, what generates step by step and
what the gate, ONNX Runtime GenAI and TensorRT's profile read), and ``m_encoder.onnx`` is its
encoder, run once per source (docs/huggingface.md, "Encoder-decoders").

    >>> encoder_path("out/m.onnx")    # PosixPath('out/m_encoder.onnx')
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from attn_export.cache_contract import CacheContract
from attn_export.options import ExportOptions
from attn_export.surgery.transformers import seq2seq_cache as _seq2seq

ENCODER_SUFFIX = "_encoder"


def encoder_path(decoder_path: str | Path) -> Path:
    """The encoder file beside a decoder file: its stem with ``_encoder``."""
    path = Path(decoder_path)
    return path.with_name(path.stem + ENCODER_SUFFIX + path.suffix)


def export_encoder(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], decoder_path: str | Path,
                   options: ExportOptions, contract: CacheContract):
    """Exports the encoder of ``model`` beside the decoder at ``decoder_path`` (its attention
    fused, its axes the contract's) with ``options`` (an export without the cache); returns its
    ExportResult."""
    from attn_export.onnx.pipeline import export_onnx

    inputs = _seq2seq.encoder_example(contract, example_inputs)
    options = dataclasses.replace(options, dynamic_axes=contract.encoder_dynamic_axes())
    return export_onnx(_seq2seq.Seq2SeqEncoder(model), inputs, encoder_path(decoder_path), options)
