"""``genai_config.json`` beside a cached export, so that ONNX Runtime GenAI
(``onnxruntime-genai``) generates with it: the decoder's file, the input and output names of
the cache's contract (attn_export/cache_contract.py; the cache's as ``%d`` patterns), the
cache's heads and head size as the export's metadata records them, the special tokens and
greedy search.

    >>> write_genai_config("out/model.onnx", model.config)   # writes out/genai_config.json
    >>> import onnxruntime_genai as og; og.Model("out")

The search section asks for greedy decoding and ``past_present_share_buffer: false``: the
export's past grows by concatenation (present = past + new), not in a preallocated buffer;
``true`` for an ``--onnx-attention ort`` export whose every attention is ONNX Runtime's
GroupQueryAttention, which writes the new tokens into one buffer at max length (onnx/ort/buffer.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from attn_export import cache_contract as _contract
from attn_export.cache_contract import CacheContract
from attn_export.errors import InputError

CONFIG_NAME = "genai_config.json"
# GenAI's generic decoder-only model: every input and output by the names given here. Its own
# per-family types are not all that: "gpt2" selects its GPT-2 model class, which wants one
# combined past tensor per layer (past_%d), not this contract's separate keys and values.
MODEL_TYPE = "decoder"


def _token(config, name: str):
    value = getattr(config, name, None)
    return list(value) if isinstance(value, (list, tuple)) else value


def _first_given(*values):
    return next((v for v in values if v is not None), None)


def _io_names(contract: CacheContract):
    """GenAI's decoder "inputs" and "outputs": each role by the contract's name, the cache's
    per-layer names as ``%d`` patterns. (An encoder-decoder contract would add GenAI's
    cross-attention keys here: cross_past_key_names, ...)"""
    inputs = {name: name for name in contract.token_inputs()}
    inputs.update(past_key_names=contract.past_name("%d", "key"), past_value_names=contract.past_name("%d", "value"))
    outputs = {_contract.LOGITS: _contract.LOGITS, "present_key_names": contract.present_name("%d", "key"),
               "present_value_names": contract.present_name("%d", "value")}
    return inputs, outputs


def genai_config(onnx_model, filename: str, config, *, context_length: Optional[int] = None) -> Dict[str, object]:
    """The config for the cached export ``onnx_model`` (saved as ``filename``) of a transformers
    decoder with ``config`` (its PretrainedConfig)."""
    from attn_export.onnx.ort.buffer import shares_buffer

    layout = CacheContract.require(onnx_model, filename)
    context = context_length or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        raise InputError("the model's config gives no context length (max_position_embeddings): pass context_length")
    inputs, outputs = _io_names(layout)
    eos = _token(config, "eos_token_id")
    if eos is None:
        raise InputError("the model's config has no eos_token_id, which ONNX Runtime GenAI requires: set "
                         "config.eos_token_id (the token that ends a generated sequence)")
    pad = _token(config, "pad_token_id")
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)  # as generate() pads
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename, "head_size": layout.head_dim, "hidden_size": config.hidden_size,
        "inputs": inputs, "outputs": outputs,
        "num_attention_heads": config.num_attention_heads, "num_hidden_layers": layout.num_layers,
        "num_key_value_heads": layout.num_kv_heads,
    }
    return {
        # GenAI requires a number; some configs (Qwen2) have no begin-of-sequence token.
        "model": {"bos_token_id": _first_given(_token(config, "bos_token_id"), pad), "context_length": int(context), "decoder": decoder,
                  "eos_token_id": eos, "pad_token_id": pad,
                  "type": MODEL_TYPE, "vocab_size": config.vocab_size},
        "search": {"do_sample": False, "num_beams": 1, "max_length": int(context), "min_length": 0,
                   "past_present_share_buffer": shares_buffer(onnx_model), "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1,
                   "top_p": 1.0, "early_stopping": True, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "num_return_sequences": 1, "diversity_penalty": 0.0},
    }


def write_genai_config(onnx_path: str | Path, config, *, context_length: Optional[int] = None) -> Path:
    """Writes ``genai_config.json`` in the export's directory; returns its path."""
    import onnx

    from attn_export.atomic_io import write_text

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    out = onnx_path.with_name(CONFIG_NAME)
    body = genai_config(model, onnx_path.name, config, context_length=context_length)
    write_text(out, json.dumps(body, indent=4) + "\n")
    return out
