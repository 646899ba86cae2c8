"""Small models whose attention calls F.scaled_dot_product_attention, written the way popular
code writes them (tests of the SDPA route, attn_export.sdpa). Also importable as
``--model sdpa_models:<factory>`` by the command-line tests."""
from __future__ import annotations

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

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def gqa_decoder():
    torch.manual_seed(0)
    model = GQADecoder().eval()
    model.example_inputs = {"input_ids": torch.randint(0, 50, (2, 12))}
    return model


def whisper_like():
    torch.manual_seed(0)
    model = WhisperLike().eval()
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    model.example_inputs = {"mel": torch.randn(2, 10, 8), "tokens": torch.randint(0, 40, (2, 6)), "mel_mask": mask}
    return model


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


def swin_sdpa():
    torch.manual_seed(0)
    model = SwinSdpaWindowAttention().eval()
    model.example_inputs = {"x": torch.randn(8, 16, 32)}
    return model
