"""The four small models the portability test exports, each with its example inputs and the
batches it is compared on: a padded nn.TransformerEncoder, an nn.Transformer with causal
self-attention and padded cross-attention, transformers' BERT and GPT-2 (padded batches)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import nn

EMBED, HEADS, FFN = 32, 4, 64
# onnx.reference's GatherElements (BERT's token-type lookup gathers along the positions) goes
# through numpy.choose, which takes at most 64 choices, and its fallback fails on broadcast
# data: 32 positions keep that lookup in what onnx.reference runs.
MAX_POSITIONS = 32
# (batch, sequence) of the compared batches: the traced shape and two others.
SHAPES = ((2, 12), (3, 5), (1, 17))


@dataclass
class Case:
    """A model, how to make a batch of a shape, and which output positions are real tokens."""

    name: str
    model: nn.Module
    batch: Callable[[int, int, int], Dict[str, torch.Tensor]]  # (batch, seq, seed) -> inputs
    valid: Callable[[Dict[str, torch.Tensor]], torch.Tensor]  # inputs -> bool [B, L] of the output


def _lengths(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Row lengths in 1..seq, the first row full (so the batch really has length seq)."""
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    return lengths


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, src, src_key_padding_mask):
        return self.encoder(src, src_key_padding_mask=src_key_padding_mask)


class CausalSeq2Seq(nn.Module):
    """nn.Transformer: causal decoder self-attention, the source's padding on encoder self- and
    decoder cross-attention."""

    def __init__(self):
        super().__init__()
        self.model = nn.Transformer(EMBED, HEADS, 1, 1, FFN, dropout=0.0, batch_first=True)

    def forward(self, src, tgt, src_key_padding_mask):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), dtype=tgt.dtype)
        return self.model(src, tgt, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_key_padding_mask,
                          memory_key_padding_mask=src_key_padding_mask)


def _encoder_batch(batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    pad = torch.arange(seq) >= _lengths(batch, seq, gen)[:, None]
    return {"src": torch.randn(batch, seq, EMBED, generator=gen), "src_key_padding_mask": pad}


def _seq2seq_batch(batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    pad = torch.arange(seq) >= _lengths(batch, seq, gen)[:, None]
    tgt_seq = max(2, seq - 3)
    return {"src": torch.randn(batch, seq, EMBED, generator=gen),
            "tgt": torch.randn(batch, tgt_seq, EMBED, generator=gen), "src_key_padding_mask": pad}


def _token_batch(batch, seq, seed, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.arange(seq) < _lengths(batch, seq, gen)[:, None]
    return {"input_ids": torch.randint(1, vocab, (batch, seq), generator=gen), "attention_mask": keep.long()}


def _tiny_bert():
    import transformers

    config = transformers.BertConfig(vocab_size=97, hidden_size=EMBED, num_hidden_layers=2, num_attention_heads=HEADS,
                                     intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS)
    return transformers.BertModel(config).eval()


def _tiny_gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=97, n_embd=EMBED, n_layer=2, n_head=HEADS, n_positions=MAX_POSITIONS,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _unpadded(inputs):
    return ~inputs["src_key_padding_mask"]


def _all_target_positions(inputs):
    return torch.ones(inputs["tgt"].shape[:2], dtype=torch.bool)


def _tokens(inputs):
    return inputs["attention_mask"].bool()


def cases(names: List[str]) -> Dict[str, Case]:
    """The named cases, their models built with seed 0."""
    builders = {
        "encoder": lambda: Case("encoder", PaddedEncoder().eval(), _encoder_batch, _unpadded),
        "seq2seq": lambda: Case("seq2seq", CausalSeq2Seq().eval(), _seq2seq_batch, _all_target_positions),
        "bert": lambda: Case("bert", _tiny_bert(), _token_batch, _tokens),
        "gpt2": lambda: Case("gpt2", _tiny_gpt2(), _token_batch, _tokens),
    }
    out = {}
    for name in names:
        torch.manual_seed(0)
        out[name] = builders[name]()
    return out


def first_output(outputs) -> torch.Tensor:
    """The model's main output: the tensor, or transformers' logits / last hidden state."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    return outputs.last_hidden_state
