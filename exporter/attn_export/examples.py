"""A small bundled example model, built on the fly (no download): a batch-first sequence-to-
sequence transformer with self-attention, causal self-attention and cross-attention, and a
source padding mask. ``make demo`` runs the whole pipeline on it.

    >>> model = attn_export.examples.tiny_seq2seq()
    >>> model(**model.example_inputs).shape
    torch.Size([2, 12, 64])
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class TinySeq2Seq(nn.Module):
    """nn.Transformer (2 encoder + 2 decoder layers, d_model 64, 4 heads) between two linear
    maps. ``forward(src [B, S, F], tgt [B, T, F], src_key_padding_mask [B, S] bool) -> [B, T, F]``;
    the decoder's self-attention is causal."""

    def __init__(self, features: int = 32, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_src = nn.Linear(features, d_model)
        self.embed_tgt = nn.Linear(features, d_model)
        self.transformer = nn.Transformer(
            d_model, heads, num_encoder_layers=layers, num_decoder_layers=layers,
            dim_feedforward=2 * d_model, dropout=0.1, batch_first=True,
        )
        self.head = nn.Linear(d_model, features)

    def forward(self, src: Tensor, tgt: Tensor, src_key_padding_mask: Tensor) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device, dtype=tgt.dtype)
        y = self.transformer(
            self.embed_src(src), self.embed_tgt(tgt), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src_key_padding_mask, memory_key_padding_mask=src_key_padding_mask,
        )
        return self.head(y)

    @property
    def example_inputs(self) -> dict:
        """Batch 2, source length 16 (the second sequence padded after 11), target length 12."""
        gen = torch.Generator().manual_seed(0)
        features = self.embed_src.in_features
        padding = torch.zeros(2, 16, dtype=torch.bool)
        padding[1, 11:] = True
        return {
            "src": torch.randn(2, 16, features, generator=gen),
            "tgt": torch.randn(2, 12, features, generator=gen),
            "src_key_padding_mask": padding,
        }


def tiny_seq2seq(seed: int = 0) -> TinySeq2Seq:
    """The example model with fixed random weights, in eval mode."""
    torch.manual_seed(seed)
    return TinySeq2Seq().eval()
