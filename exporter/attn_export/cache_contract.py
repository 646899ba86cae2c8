"""The cached export's contract: the names, axes and layout that every program generating with a
cached decoder export looks up (the exporter, the generation gate, TensorRT's profile and
engine steps, ONNX Runtime GenAI's config), and the metadata property that carries the layout
in the file (docs/architecture.md, "The cache contract").

    >>> contract = CacheContract(num_layers=2, num_kv_heads=4, head_dim=64, position_ids=True)
    >>> contract.input_names()        # input_ids, attention_mask, position_ids, then the past per layer
    >>> contract.output_names()       # logits, then the present per layer
    >>> CacheContract.from_metadata(onnx_model)   # the file's contract; None: not a cached export

Names are Optimum's. Inputs: ``input_ids`` [batch, sequence], ``attention_mask`` [batch,
total_sequence] (past + new tokens, 1 = token), ``position_ids`` [batch, sequence] where the
model takes them, the past of every layer [batch, num_kv_heads, past_sequence, head_dim], one
tensor per slot (key, value). Outputs: ``logits`` [batch, sequence, vocab] (or [batch, 1, vocab]: ``last_logits``), the present of
every layer [batch, num_kv_heads, past_sequence + sequence, head_dim], which the next step
takes as its past under the past's name. One graph serves the prefill (past length 0) and
every decode step. An encoder-decoder (``layout="encoder-decoder"``) is a pair of files: its
encoder's names are ``encoder_input_names()`` / ``encoder_output_names()``, its decoder's the
same methods as a decoder-only file's, with four slots per layer (below).

This module is the bottom of the cached export: it imports nothing of the package but
``errors``. The names are spelled here and nowhere else in the package.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Tuple

import torch

from attn_export.errors import InputError, first_line

# The inputs beside the cache, and the output.
INPUT_IDS, ATTENTION_MASK, POSITION_IDS = "input_ids", "attention_mask", "position_ids"
TOKEN_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
LOGITS = "logits"
# The axes' labels (the graph's symbols; attn_export.onnx.dims reads them as declared axes).
BATCH, SEQUENCE, PAST_SEQUENCE, TOTAL_SEQUENCE = "batch", "sequence", "past_sequence", "total_sequence"
AXES = (BATCH, SEQUENCE, PAST_SEQUENCE, TOTAL_SEQUENCE)
# A cache tensor's name: role, layer, slot. The present of a layer's slot becomes the past of
# the same layer's slot by swapping the role's prefix alone, whatever the slot is.
PAST_ROLE, PRESENT_ROLE = "past_key_values", "present"
SLOTS = ("key", "value")
# An encoder-decoder's layout (Optimum's seq2seq-lm-with-past): two files. The encoder takes the
# source (token ids and their mask, or Whisper's log-mel features) and gives its hidden states;
# the decoder takes its tokens, the encoder's hidden states and their mask, and the past of its
# self-attention, and gives the logits and the presents of both attentions. Every layer has four
# cache slots: the self-attention's (decoder.*, growing by the new tokens) and the
# cross-attention's (encoder.*, as long as the source).
DECODER_ONLY, ENCODER_DECODER = "decoder", "encoder-decoder"
LAYOUTS = (DECODER_ONLY, ENCODER_DECODER)
SELF_SLOTS = ("decoder.key", "decoder.value")
CROSS_SLOTS = ("encoder.key", "encoder.value")
ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK = "encoder_hidden_states", "encoder_attention_mask"
LAST_HIDDEN_STATE, INPUT_FEATURES = "last_hidden_state", "input_features"
ENCODER_INPUTS = (INPUT_IDS, INPUT_FEATURES)  # what an encoder reads: tokens, or log-mel features
ENCODER_SEQUENCE = "encoder_sequence"
# The ONNX metadata property holding the layout as JSON, and its key as
# attn_export.onnx.read_metadata returns it (the package's prefix stripped).
METADATA_KEY = "with_past"
METADATA_PROPERTY = "attn_export." + METADATA_KEY
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def cache_name(role: str, layer, slot: str) -> str:
    """``role.layer.slot``; ``layer`` may be a placeholder (``"%d"``: ONNX Runtime GenAI's
    patterns)."""
    return f"{role}.{layer}.{slot}"


@dataclass(frozen=True)
class CacheContract:
    """A cached export's layout and every name and axis derived from it (module doc). Written
    to the file by :meth:`to_metadata`, read back by :meth:`from_metadata`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    position_ids: bool  # the graph takes position_ids
    dtype: str = "fp32"  # the cache's (and the export's) precision, a key of DTYPES
    # The layout, a key of LAYOUTS: a decoder-only file, or the decoder of an encoder-decoder
    # pair (its slots are SELF_SLOTS + CROSS_SLOTS, the cross slots on an encoder_sequence axis).
    # Written to the metadata only when not the default: a decoder-only file reads as before.
    layout: str = DECODER_ONLY
    encoder_input: str = INPUT_IDS  # an encoder-decoder's encoder input, a key of ENCODER_INPUTS
    # ``logits`` of the last position only, [batch, 1, vocab] (--last-logits): a decoder-only
    # file's prefill gives no logits for the prompt's other positions. Written only when true.
    last_logits: bool = False
    # Where later layouts go, without a change to the consumers (they iterate the names, slots
    # and axes below): a past/present buffer shared in place (GenAI's past_present_share_buffer)
    # is a field whose past axis is the buffer's fixed length.

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.position_ids, bool):
            raise ValueError(f"position_ids must be true or false, got {self.position_ids!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.encoder_input not in ENCODER_INPUTS:
            raise ValueError(f"encoder_input must be one of {', '.join(ENCODER_INPUTS)}, got {self.encoder_input!r}")
        if self.layout == DECODER_ONLY and self.encoder_input != INPUT_IDS:
            raise ValueError("encoder_input belongs to the encoder-decoder layout")
        if not isinstance(self.last_logits, bool):
            raise ValueError(f"last_logits must be true or false, got {self.last_logits!r}")
        if self.layout == ENCODER_DECODER and self.last_logits:
            raise ValueError("last_logits belongs to the decoder-only layout")
        if self.layout == ENCODER_DECODER and self.position_ids:
            raise ValueError("an encoder-decoder's decoder takes no position_ids (it counts them from its past)")

    # ---- names ---------------------------------------------------------------------------

    @property
    def encoder_decoder(self) -> bool:
        """The decoder of an encoder-decoder pair (the encoder is a file of its own)."""
        return self.layout == ENCODER_DECODER

    @property
    def slots(self) -> Tuple[str, ...]:
        """The cache tensors of one layer, in the graph's order (the presents')."""
        return SELF_SLOTS + CROSS_SLOTS if self.encoder_decoder else SLOTS

    @property
    def past_slots(self) -> Tuple[str, ...]:
        """The slots a step takes as its past: an encoder-decoder's decoder takes its
        self-attention's alone and computes the cross-attention's keys and values from
        ``encoder_hidden_states`` in every step (one graph for every step, no If); it gives
        them as presents all the same."""
        return SELF_SLOTS if self.encoder_decoder else SLOTS

    @staticmethod
    def past_name(layer, slot: str) -> str:
        return cache_name(PAST_ROLE, layer, slot)

    @staticmethod
    def present_name(layer, slot: str) -> str:
        return cache_name(PRESENT_ROLE, layer, slot)

    def layer_past_names(self, layer: int) -> Tuple[str, ...]:
        """The past inputs of ``layer``, one per slot (key, value)."""
        return tuple(self.past_name(layer, slot) for slot in self.past_slots)

    def past_names(self) -> List[str]:
        return [self.past_name(i, slot) for i in range(self.num_layers) for slot in self.past_slots]

    def present_names(self) -> List[str]:
        return [self.present_name(i, slot) for i in range(self.num_layers) for slot in self.slots]

    def token_inputs(self) -> List[str]:
        """The inputs beside the cache, in the graph's order (an encoder-decoder's decoder:
        its tokens, the encoder's hidden states and, for a token encoder, their mask)."""
        if self.encoder_decoder:
            return [INPUT_IDS, ENCODER_HIDDEN_STATES] + ([ENCODER_ATTENTION_MASK] if self.encoder_masked else [])
        return [INPUT_IDS, ATTENTION_MASK] + ([POSITION_IDS] if self.position_ids else [])

    def input_names(self) -> List[str]:
        return self.token_inputs() + self.past_names()

    def output_names(self) -> List[str]:
        return [LOGITS] + self.present_names()

    def present_to_past(self) -> Dict[str, str]:
        """present output -> the past input the next step feeds it to."""
        past = set(self.past_names())
        return {n: self.past_of(n) for n in self.present_names() if self.past_of(n) in past}

    # ---- an encoder-decoder's encoder ------------------------------------------------------

    @property
    def encoder_masked(self) -> bool:
        """The encoder (and the decoder's cross-attention) takes a mask over the source: token
        encoders do, Whisper's features encoder does not."""
        return self.encoder_input == INPUT_IDS

    def encoder_input_names(self) -> List[str]:
        return [self.encoder_input] + ([ATTENTION_MASK] if self.encoder_masked else [])

    @staticmethod
    def encoder_output_names() -> List[str]:
        return [LAST_HIDDEN_STATE]

    def encoder_dynamic_axes(self) -> Dict[str, Dict[int, str]]:
        """The encoder file's symbolic axes (log-mel features have a fixed number of frames)."""
        source = {0: BATCH, 1: ENCODER_SEQUENCE} if self.encoder_masked else {0: BATCH}
        return {name: dict(source) for name in self.encoder_input_names()}

    @staticmethod
    def is_past(name: str) -> bool:
        return name.startswith(PAST_ROLE + ".")

    @staticmethod
    def is_present(name: str) -> bool:
        return name.startswith(PRESENT_ROLE + ".")

    @staticmethod
    def past_of(present: str) -> str:
        """The past input a present output feeds (by name alone: an engine carries no metadata)."""
        return PAST_ROLE + present[len(PRESENT_ROLE):]

    @staticmethod
    def describe_inputs() -> str:
        """The inputs in words, for messages."""
        return ", ".join(TOKEN_INPUTS) + f", {PAST_ROLE}.*"

    # ---- axes ----------------------------------------------------------------------------

    @staticmethod
    def axes_of(name: str) -> Optional[Dict[int, str]]:
        """axis -> label of an input of the contract by its name (what TensorRT's profile sizes
        each axis as); None for a name that is no input of the contract."""
        if CacheContract.is_past(name):
            cross = any(name.endswith("." + slot) for slot in CROSS_SLOTS)
            return {0: BATCH, 2: ENCODER_SEQUENCE if cross else PAST_SEQUENCE}
        if name in (ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK):
            return {0: BATCH, 1: ENCODER_SEQUENCE}
        if name in (INPUT_IDS, POSITION_IDS):
            return {0: BATCH, 1: SEQUENCE}
        if name == ATTENTION_MASK:
            return {0: BATCH, 1: TOTAL_SEQUENCE}
        return None

    def dynamic_axes(self) -> Dict[str, Dict[int, str]]:
        """input -> axis -> label: every axis that must be symbolic, in the inputs' order."""
        return {name: self.axes_of(name) for name in self.input_names()}  # type: ignore[misc]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def empty_past(self, batch: int, dtype: Optional[torch.dtype] = None,
                   device: Optional[torch.device] = None) -> Dict[str, torch.Tensor]:
        """The past of a prefill: every past input of length 0 (in the contract's dtype unless
        ``dtype`` says otherwise)."""
        shape = (batch, self.num_kv_heads, 0, self.head_dim)
        dtype = dtype or self.torch_dtype
        return {name: torch.zeros(shape, dtype=dtype, device=device) for name in self.past_names()}

    # ---- metadata ------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The fields; the layout's only for an encoder-decoder (older readers refuse an
        unknown field, and a decoder-only file keeps the fields it always had)."""
        values = asdict(self)
        if not self.encoder_decoder:
            del values["layout"], values["encoder_input"]
        if not self.last_logits:
            del values["last_logits"]
        return values

    def to_metadata(self) -> Dict[str, str]:
        """The ONNX metadata property (full key -> JSON) the file carries the contract in."""
        return {METADATA_PROPERTY: json.dumps(self.to_dict(), sort_keys=True)}

    @classmethod
    def from_metadata(cls, model_or_props) -> Optional["CacheContract"]:
        """The contract an ONNX file records: ``model_or_props`` is an onnx.ModelProto or its
        metadata as a mapping (full keys, or as attn_export.onnx.read_metadata strips them).
        None for a file without a cache; InputError for a value the exporter does not write."""
        if hasattr(model_or_props, "metadata_props"):
            props = {p.key: p.value for p in model_or_props.metadata_props}
        else:
            props = dict(model_or_props)
        raw = props.get(METADATA_PROPERTY, props.get(METADATA_KEY))
        if raw is None:
            return None
        try:
            values = json.loads(raw)
            if not isinstance(values, dict):
                raise ValueError("not a JSON object")
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"unknown field(s) {', '.join(unknown)} (written by a newer attn-export?)")
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise InputError(f"the metadata {METADATA_PROPERTY} is not the JSON the exporter writes ({raw!r}: "
                             f"{first_line(exc)}); re-export the model with its cache") from exc

    @classmethod
    def require(cls, model_or_props, where) -> "CacheContract":
        """:meth:`from_metadata`, or InputError for a file without a cache (``where`` names it)."""
        contract = cls.from_metadata(model_or_props)
        if contract is None:
            raise InputError(f"{where} has no key/value cache (no {METADATA_PROPERTY} metadata): export it with "
                             "--with-past (ConvertOptions(with_past=True))")
        return contract


def positions(attention_mask: torch.Tensor, new_tokens: Optional[int] = None) -> torch.Tensor:
    """``position_ids`` as transformers' ``generate()`` counts them from a left-padded mask:
    ``cumsum(mask) - 1`` clipped at 0; of the last ``new_tokens`` tokens (all when None), as a
    contiguous tensor (a view of a longer one would carry the longer length into torch.export's
    guards)."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos if new_tokens is None else pos[:, pos.shape[1] - new_tokens:].contiguous()


def generates(model) -> bool:
    """How a cached export of ``model`` is checked, decided here once: True, by generating
    greedy tokens against the model's own ``generate()`` (the generation gate,
    validation/generation.py); False, for a model without ``generate()`` or a config, by the
    parity gate's cases through the decoder wrapped with its cache as flat tensors
    (surgery/transformers/cache.py's DecoderWithPast, at the file's inputs)."""
    return callable(getattr(model, "generate", None)) and getattr(model, "config", None) is not None


__all__ = ["CacheContract", "cache_name", "positions", "generates", "TOKEN_INPUTS", "INPUT_IDS", "ATTENTION_MASK",
           "POSITION_IDS", "LOGITS", "BATCH", "SEQUENCE", "PAST_SEQUENCE", "TOTAL_SEQUENCE", "AXES", "SLOTS",
           "METADATA_KEY", "METADATA_PROPERTY", "DTYPES", "LAYOUTS", "DECODER_ONLY", "ENCODER_DECODER", "SELF_SLOTS",
           "CROSS_SLOTS", "ENCODER_HIDDEN_STATES", "ENCODER_ATTENTION_MASK", "LAST_HIDDEN_STATE", "INPUT_FEATURES",
           "ENCODER_INPUTS", "ENCODER_SEQUENCE"]
