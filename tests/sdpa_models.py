"""Small models whose attention calls F.scaled_dot_product_attention or is written out by hand, the way popular
code writes them (tests of the SDPA route, attn_export.surgery.routes.sdpa). Also importable as
``--model sdpa_models:<factory>`` by the command-line tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GQAAttention(nn.Module):
    """Grouped-query causal self-attention (Llama-style, no rotary): 4 query heads, 2 key/value heads."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class GQADecoder(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2, heads=4, kv_heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm1": nn.LayerNorm(dim), "attn": GQAAttention(dim, heads, kv_heads),
                           "norm2": nn.LayerNorm(dim), "mlp": nn.Sequential(nn.Linear(dim, 64), nn.GELU(),
                                                                            nn.Linear(64, dim))})
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x)


class WhisperAttention(nn.Module):
    """Whisper-style attention: self (optionally causal) or cross, SDPA through a helper method,
    a boolean key-padding mask in SDPA's convention (True = may attend)."""

    def __init__(self, dim=32, heads=4, causal=False, dropout=0.0):
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _split(self, x):
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)

    def qkv_attention(self, q, k, v, mask):
        y = F.scaled_dot_product_attention(
            self._split(q), self._split(k), self._split(v), attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal and mask is None)
        return y.permute(0, 2, 1, 3).flatten(start_dim=2)

    def forward(self, x, xa=None, key_mask=None):
        src = x if xa is None else xa
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return self.out(self.qkv_attention(self.query(x), self.key(src), self.value(src), mask))


class WhisperBlock(nn.Module):
    def __init__(self, dim=32, heads=4, cross=False, dropout=0.0):
        super().__init__()
        self.attn_ln = nn.LayerNorm(dim)
        self.attn = WhisperAttention(dim, heads, causal=cross, dropout=dropout)
        self.cross_attn = WhisperAttention(dim, heads, dropout=dropout) if cross else None
        self.cross_attn_ln = nn.LayerNorm(dim) if cross else None
        self.mlp_ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))

    def forward(self, x, xa=None, key_mask=None):
        x = x + self.attn(self.attn_ln(x))
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, key_mask)
        return x + self.mlp(self.mlp_ln(x))


class WhisperLike(nn.Module):
    """Encoder (bidirectional self-attention over audio features) + decoder (causal
    self-attention, cross-attention to the encoder with a padding mask)."""

    def __init__(self, n_mels=8, vocab=40, dim=32, heads=4, layers=2, dropout=0.0):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, dim, kernel_size=3, padding=1)
        self.encoder = nn.ModuleList(WhisperBlock(dim, heads, dropout=dropout) for _ in range(layers))
        self.embed = nn.Embedding(vocab, dim)
        self.decoder = nn.ModuleList(WhisperBlock(dim, heads, cross=True, dropout=dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, mel, tokens, mel_mask):
        xa = F.gelu(self.conv(mel.transpose(1, 2))).transpose(1, 2)  # mel: [B, frames, n_mels]
        for block in self.encoder:
            xa = block(xa)
        x = self.embed(tokens)
        for block in self.decoder:
            x = block(x, xa, mel_mask)
        return self.ln(x) @ self.embed.weight.T


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (flash branch)."""

    def __init__(self, dim=32, heads=4, dropout=0.1):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.n_head, self.dropout = heads, dropout

    def heads(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        return [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)]

    def merge(self, y):
        B, _, T, _ = y.shape
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))

    def forward(self, x):
        q, k, v = self.heads(x)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.merge(y)


def timm_vit(fused_attn: bool = True):
    from _timm import import_timm  # skips the test without timm; stands in for torchvision

    timm = import_timm()

    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10).eval()
    for block in model.blocks:
        block.attn.fused_attn = fused_attn  # timm's own switch between SDPA and its by-hand attention
    model.example_inputs = {"x": torch.randn(2, 3, 32, 32)}
    return model


class SwinSdpaWindowAttention(nn.Module):
    """timm's Swin window attention on its SDPA path: a learned relative-position bias table
    (a parameter) plus the shifted-window mask, given to SDPA as its float attn_mask."""

    def __init__(self, dim=32, heads=4, window=4, shift=True):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("rel_index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)
        n = window * window
        if shift:  # the mask of a shifted 2x2-window grid: tokens of different regions do not attend
            region = torch.zeros(2 * window, 2 * window)
            s = window // 2
            for i, rows in enumerate((slice(0, -window), slice(-window, -s), slice(-s, None))):
                for j, cols in enumerate((slice(0, -window), slice(-window, -s), slice(-s, None))):
                    region[rows, cols] = 3 * i + j
            windows = region.view(2, window, 2, window).permute(0, 2, 1, 3).reshape(4, n)
            mask = (windows[:, None, :] != windows[:, :, None]).float() * -100.0
        else:
            mask = torch.zeros(4, n, n)
        self.register_buffer("shift_mask", mask, persistent=False)  # [windows, N, N]

    def forward(self, x):  # x: [B * 4 windows, N, C]
        bw, n, c = x.shape
        q, k, v = self.qkv(x).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.bias_table[self.rel_index.view(-1)].view(n, n, -1).permute(2, 0, 1)  # [H, N, N]
        mask = bias.unsqueeze(0) + self.shift_mask.repeat(bw // 4, 1, 1).unsqueeze(1)  # [B*4, H, N, N]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(bw, n, c))


# -- hand-written attention (rewritten in the captured graph: attn_export.surgery.patterns) --

class NanoGPTManualAttention(NanoGPTAttention):
    """nanoGPT's CausalSelfAttention, its non-flash branch (a causal buffer and masked_fill)."""

    def __init__(self, dim=32, heads=4, block_size=64, dropout=0.1):
        super().__init__(dim, heads, dropout)
        self.attn_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        T = x.size(1)
        q, k, v = self.heads(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return self.merge(att @ v)


class NanoGPTManual(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(NanoGPTManualAttention(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx):
        x = self.wte(idx)
        for attn in self.h:
            x = x + attn(x)
        return self.ln_f(x)


class BertStyleSelfAttention(nn.Module):
    """BERT's eager self-attention: scores / sqrt(d) + an additive [B, 1, 1, L] padding mask."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.1)

    def split(self, x):
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden, attention_mask):
        q, k, v = self.split(self.query(hidden)), self.split(self.key(hidden)), self.split(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_dim)
        extended = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        scores = scores + extended
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3)
        return context.reshape(hidden.shape)


class BertStyle(nn.Module):
    def __init__(self, vocab=50, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attention = BertStyleSelfAttention(dim)

    def forward(self, input_ids, attention_mask):
        return self.attention(self.embed(input_ids), attention_mask)


def _relative_position_index(window):
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += window - 1
    rel[:, :, 1] += window - 1
    rel[:, :, 0] *= 2 * window - 1
    return rel.sum(-1).flatten()


def shifted_window_attention(x, qkv, proj, relative_position_bias, window, num_heads, shift):
    """torchvision.models.swin_transformer.shifted_window_attention (v1, no padding, no dropout in
    eval), written out as torchvision writes it: q scaled, q.matmul(k^T), + relative bias, the
    shift mask added through a 5-D view, softmax, dropout, matmul(v)."""
    B, H, W, C = x.shape
    if shift > 0:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    num_windows = (H // window) * (W // window)
    x = x.view(B, H // window, window, W // window, window, C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * num_windows, window * window, C)
    t = qkv(x)
    t = t.reshape(x.size(0), x.size(1), 3, num_heads, C // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = t[0], t[1], t[2]
    q = q * (C // num_heads) ** -0.5
    attn = q.matmul(k.transpose(-2, -1))
    attn = attn + relative_position_bias
    if shift > 0:
        attn_mask = x.new_zeros((H, W))
        slices = ((0, -window), (-window, -shift), (-shift, None))
        count = 0
        for h in slices:
            for w in slices:
                attn_mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        attn_mask = attn_mask.view(H // window, window, W // window, window)
        attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(num_windows, window * window)
        attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))
        attn = attn.view(x.size(0) // num_windows, num_windows, num_heads, x.size(1), x.size(1))
        attn = attn + attn_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))
    attn = F.softmax(attn, dim=-1)
    attn = F.dropout(attn, p=0.0, training=False)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = proj(x)
    x = x.view(B, H // window, W // window, window, window, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
    if shift > 0:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x


class ShiftedWindowAttention(nn.Module):
    """torchvision's ShiftedWindowAttention (v1), its parameters and bias table laid out alike."""

    def __init__(self, dim=32, window=4, shift=2, num_heads=4):
        super().__init__()
        self.window, self.shift, self.num_heads = window, shift, num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads) * 0.5)
        self.register_buffer("relative_position_index", _relative_position_index(window))

    def get_relative_position_bias(self):
        n = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x):
        return shifted_window_attention(x, self.qkv, self.proj, self.get_relative_position_bias(), self.window,
                                        self.num_heads, self.shift)


class SwinStage(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.blocks = nn.ModuleList([ShiftedWindowAttention(dim, shift=0), ShiftedWindowAttention(dim, shift=2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class SoftmaxChildAttention(nn.Module):
    """vit-pytorch's Attention: hand-written, the softmax an ``nn.Softmax`` child named ``attend``."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.attend = nn.Softmax(dim=-1)

    def forward(self, x):
        q, k, v = self.to_qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attn = self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale)
        return self.to_out(torch.matmul(attn, v).transpose(1, 2).flatten(2))


class _Processor:
    """diffusers' attention processors, in miniature: an object (not a module) that calls SDPA."""

    def __call__(self, attn, x):
        q, k, v = attn.to_qkv(x).unflatten(-1, (3, attn.heads, -1)).permute(2, 0, 3, 1, 4)
        return attn.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class ProcessorAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.processor = _Processor()

    def forward(self, x):
        return self.processor(self, x)


class TwoKinds(nn.Module):
    """One hand-written attention with an nn.Softmax child, one called through a processor."""

    def __init__(self):
        super().__init__()
        self.hand, self.proc = SoftmaxChildAttention(), ProcessorAttention()

    def forward(self, x):
        return self.proc(self.hand(x))


# -- factories (also for `attn-export --model sdpa_models:<factory>`) ----------------------------

def _build(cls, make_inputs, **kwargs):
    torch.manual_seed(0)
    model = cls(**kwargs).eval()
    model.example_inputs = make_inputs()
    return model


def _padding(batch, length, valid, dtype=torch.bool):
    """[batch, length], 1/True on valid positions; the last row has only ``valid`` of them."""
    mask = torch.ones(batch, length, dtype=dtype)
    mask[-1, valid:] = 0
    return mask


def gqa_decoder():
    return _build(GQADecoder, lambda: {"input_ids": torch.randint(0, 50, (2, 12))})


def whisper_like():
    return _build(WhisperLike, lambda: {"mel": torch.randn(2, 10, 8), "tokens": torch.randint(0, 40, (2, 6)),
                                        "mel_mask": _padding(2, 10, 7)})


def swin_sdpa():
    return _build(SwinSdpaWindowAttention, lambda: {"x": torch.randn(8, 16, 32)})


def nanogpt_manual():
    return _build(NanoGPTManual, lambda: {"idx": torch.randint(0, 50, (2, 12))})


def bert_style():
    return _build(BertStyle, lambda: {"input_ids": torch.randint(0, 50, (2, 10)),
                                      "attention_mask": _padding(2, 10, 6, torch.long)})


def swin_stage():
    return _build(SwinStage, lambda: {"x": torch.randn(2, 8, 8, 32)})


def two_kinds():
    return _build(TwoKinds, lambda: {"x": torch.randn(2, 9, 32)})
