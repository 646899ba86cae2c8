"""A transformers encoder-decoder as the two modules its cached export traces (``--with-past``,
the encoder-decoder layout of attn_export/cache_contract.py):

    >>> check_seq2seq(model)                            # InputError for a model it cannot serve
    >>> encoder = Seq2SeqEncoder(model)                 # {input_ids, attention_mask} -> last_hidden_state
    >>> decoder = Seq2SeqDecoderWithPast.wrap(model)    # one decoder step with its cache as flat tensors
    >>> decoder(**decoder.example_inputs(source))       # {"logits": ..., <each present>: ...}

The decoder takes its tokens, the encoder's hidden states (and their mask) and the past of its
self-attention; it computes the cross-attention's keys and values from the hidden states in
every step and gives them as presents beside the self-attention's. One graph serves the first
step (past length 0) and every later one, with no If: the cost is the cross-attention's key and
value projections over the source in every step (Optimum's merged decoder instead feeds them
back through an If).
"""
from __future__ import annotations

import inspect
from typing import Dict, Mapping

import torch
from torch import nn

from attn_export import cache_contract as _contract
from attn_export.cache_contract import ENCODER_DECODER, CacheContract
from attn_export.errors import InputError
from attn_export.surgery.transformers.cache import TRACE_PAST_LENGTH, FlatCacheModule, cache_tensors
from attn_export.surgery.transformers.compat import is_hf_model

# The example's decoder inputs (transformers' names), which the cached export makes itself.
DECODER_EXAMPLE = ("decoder_input_ids", "decoder_attention_mask")


def check_seq2seq(model: nn.Module) -> None:
    """InputError unless ``model`` is a transformers encoder-decoder that generates with a
    cache (``AutoModelForSeq2SeqLM``, ``WhisperForConditionalGeneration``), naming what to do."""
    name = type(model).__name__
    if not is_hf_model(model) or not getattr(model.config, "is_encoder_decoder", False):
        raise InputError(f"--with-past: {name} is not a transformers encoder-decoder")
    params = inspect.signature(model.forward).parameters
    if not model.can_generate() or not callable(getattr(model, "get_encoder", None)) \
            or not {"encoder_outputs", "decoder_input_ids"} <= set(params):
        raise InputError(f"--with-past: {name} does not generate text from an encoder's outputs (load a "
                         "generating class, e.g. --model transformers:AutoModelForSeq2SeqLM), or export it "
                         "without --with-past")


def encoder_input(model: nn.Module) -> str:
    """What the encoder reads: token ids, or log-mel features (Whisper)."""
    params = inspect.signature(model.get_encoder().forward).parameters
    return _contract.INPUT_FEATURES if _contract.INPUT_FEATURES in params else _contract.INPUT_IDS


class Seq2SeqEncoder(nn.Module):
    """The encoder of ``model``: its source in, ``last_hidden_state`` out (the encoder file)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids=None, attention_mask=None, input_features=None):
        given = {_contract.INPUT_IDS: input_ids, _contract.ATTENTION_MASK: attention_mask,
                 _contract.INPUT_FEATURES: input_features}
        given = {name: value for name, value in given.items() if value is not None}
        return {_contract.LAST_HIDDEN_STATE: self.encoder(**given, return_dict=True).last_hidden_state}


class Seq2SeqDecoderWithPast(FlatCacheModule):
    """One decoder step of ``model`` with its cache as flat tensors (module doc)."""

    check = staticmethod(check_seq2seq)
    contract_of = staticmethod(lambda model, dtype: contract_of(model, dtype))  # defined below

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask=None, **past):
        from transformers.modeling_outputs import BaseModelOutput

        self._check_past(past)
        cache = _cache(self.contract, past)
        mask = {"attention_mask": encoder_attention_mask} if encoder_attention_mask is not None else {}
        out = self.model(decoder_input_ids=input_ids, encoder_outputs=BaseModelOutput(encoder_hidden_states),
                         use_cache=True, return_dict=True, **{self._cache_kwarg: cache}, **mask)
        result = {_contract.LOGITS: out.logits}
        layers = zip(cache_tensors(cache.self_attention_cache), cache_tensors(cache.cross_attention_cache))
        for i, (own, cross) in enumerate(layers):
            result.update({self.contract.present_name(i, slot): t
                           for slot, t in zip(self.contract.slots, own + cross)})
        return result

    def example_inputs(self, inputs: Mapping[str, torch.Tensor], past_length: int = TRACE_PAST_LENGTH,
                       seed: int = 0) -> Dict[str, torch.Tensor]:
        """The decoder's flat inputs for the encoder's example ``inputs``: the encoder's hidden
        states of them, two new tokens (the start token) after a random past of ``past_length``."""
        source = encoder_example(self.contract, inputs)
        with torch.no_grad():
            hidden = Seq2SeqEncoder(self.model)(**source)[_contract.LAST_HIDDEN_STATE]
        batch = hidden.shape[0]
        start = start_token(self.model.config)
        out = {_contract.INPUT_IDS: torch.full((batch, 2), start, dtype=torch.int64),
               _contract.ENCODER_HIDDEN_STATES: hidden}
        if self.contract.encoder_masked:
            out[_contract.ENCODER_ATTENTION_MASK] = source[_contract.ATTENTION_MASK]
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, self.contract.num_kv_heads, past_length, self.contract.head_dim)
        out.update({name: torch.randn(shape, generator=gen).to(hidden.dtype) for name in self.contract.past_names()})
        return out


def encoder_example(contract: CacheContract, inputs: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The encoder's example inputs from the export's (the mask made when a token encoder's is
    missing), InputError for anything else."""
    names = contract.encoder_input_names()
    main = inputs.get(contract.encoder_input)
    if not isinstance(main, torch.Tensor):
        raise InputError(f"--with-past: the encoder-decoder's example inputs need {contract.encoder_input}")
    unknown = sorted(set(inputs) - set(names) - set(DECODER_EXAMPLE))
    if unknown:
        raise InputError(f"--with-past: the encoder takes {', '.join(names)}; drop {', '.join(unknown)}")
    out = {contract.encoder_input: main}  # the decoder's example tokens are the wrapper's own
    if contract.encoder_masked:
        mask = inputs.get(_contract.ATTENTION_MASK)
        out[_contract.ATTENTION_MASK] = torch.ones(main.shape[:2], dtype=torch.int64) if mask is None \
            else mask.to(torch.int64)
    return out


def start_token(config) -> int:
    """The token every decoded row starts with."""
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        raise InputError("the encoder-decoder's config names no decoder_start_token_id")
    return int(start)


def _cache(contract: CacheContract, past: Mapping[str, torch.Tensor]):
    """An EncoderDecoderCache holding the self-attention's past and an empty cross-attention's
    (which the model fills from the encoder's hidden states)."""
    from transformers import DynamicCache, EncoderDecoderCache

    own = DynamicCache()
    for i in range(contract.num_layers):
        keys, values = (past[name] for name in contract.layer_past_names(i))
        own.update(keys, values, i)
    return EncoderDecoderCache(own, DynamicCache())


def contract_of(model: nn.Module, dtype: str) -> CacheContract:
    """The cache's layout as the model writes it: one first step over a two-token source."""
    source = encoder_input(model)
    probe = CacheContract(1, 1, 1, False, dtype=dtype, layout=ENCODER_DECODER, encoder_input=source)
    wrapped = Seq2SeqDecoderWithPast(model, probe)
    example = wrapped.example_inputs(_probe_source(model, source), past_length=0)
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        model(decoder_input_ids=example[_contract.INPUT_IDS][:, :1],
              encoder_outputs=BaseModelOutput(example[_contract.ENCODER_HIDDEN_STATES]), use_cache=True,
              return_dict=True, **{wrapped._cache_kwarg: cache})
    layers = [own + cross for own, cross in zip(cache_tensors(cache.self_attention_cache),
                                                cache_tensors(cache.cross_attention_cache))]
    if not layers or any(t.dim() != 4 for layer in layers for t in layer):
        raise InputError(f"--with-past: {type(model).__name__}'s cache is not [batch, heads, sequence, head_dim] "
                         "keys and values per layer; export it without --with-past")
    _, heads, _, head_dim = layers[0][0].shape
    if any(t.shape[1] != heads or t.shape[3] != head_dim for layer in layers for t in layer):
        raise InputError(f"--with-past: {type(model).__name__}'s layers differ in heads or head size; export it "
                         "without --with-past")
    return CacheContract(num_layers=len(layers), num_kv_heads=int(heads), head_dim=int(head_dim), position_ids=False,
                         dtype=dtype, layout=ENCODER_DECODER, encoder_input=source)


def _probe_source(model: nn.Module, source: str) -> Dict[str, torch.Tensor]:
    """A source of one row: two tokens, or the features the config sizes."""
    if source == _contract.INPUT_IDS:
        return {source: torch.zeros(1, 2, dtype=torch.int64)}
    return {source: example_features(model.config, 1)}


def example_features(config, batch: int, seed: int = 0) -> torch.Tensor:
    """Log-mel features [batch, num_mel_bins, 2 * max_source_positions] (Whisper's input)."""
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if not bins or not positions:
        raise InputError("the config names no num_mel_bins / max_source_positions for the encoder's features")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, int(bins), 2 * int(positions), generator=gen)

