"""Hand-written attention, eager against fused in PyTorch: the model as written, the module of
``attn_export.fuse_patterns``, and ``torch.compile(model, backend="attn_export")``, inference
(``torch.no_grad``), float32, on the CPU. Interleaved rounds (the order rotates); the minimum of
the per-round medians is kept, since a shared machine's bursts only ever add time.

    python -m benchmarks.fuse_patterns --threads 2 --rounds 5
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import click
import torch
from torch import nn

import attn_export
from attn_export.surgery import fuse
from benchmarks.onnx_runtime import interleaved_rounds, machine

IMPLS = ("eager", "fuse_patterns", "compile")


class HandWritten(nn.Module):
    """A pre-norm encoder whose attention is written out: q k^T / sqrt(d) + a key-padding bias,
    softmax, @ v (the form of nanoGPT's and BERT's eager paths)."""

    def __init__(self, dim: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, x, padding_bias):
        b, l, e = x.shape
        for qkv, out, norm in zip(self.qkv, self.out, self.norm):
            q, k, v = qkv(norm(x)).view(b, l, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-2, -1) / math.sqrt(e // self.heads) + padding_bias[:, None, None, :]
            x = x + out((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, l, e))
        return x


def cases(seqs: List[int]):
    for seq in seqs:
        torch.manual_seed(0)
        model = HandWritten(256, 4, 2).eval()
        bias = torch.zeros(4, seq)
        bias[-1, seq // 2:] = -1e4
        yield f"hand-written encoder, [4, {seq}, 256], 4 heads, 2 layers", model, (torch.randn(4, seq, 256), bias)
    try:
        from x_transformers import Encoder, ViTransformerWrapper
    except ImportError:
        return
    torch.manual_seed(0)
    vit = ViTransformerWrapper(image_size=128, patch_size=8, num_classes=10,
                               attn_layers=Encoder(dim=256, depth=2, heads=4)).eval()
    yield "x-transformers ViTransformerWrapper, 128x128 image, 257 tokens, dim 256", vit, (torch.randn(4, 3, 128, 128),)


def runners(model, args) -> Dict[str, Callable[[], object]]:
    fused = attn_export.fuse_patterns(model, args)
    assert all(s.rewritten for s in fused.pattern_sites), fused.pattern_sites
    compiled = torch.compile(model, backend=fuse.Backend(), fullgraph=True)
    with torch.no_grad():
        expected = model(*args)
        for name, fn in (("fuse_patterns", fused), ("compile", compiled)):
            err = float((fn(*args) - expected).abs().max() / expected.abs().max())
            assert err < 1e-5, f"{name}: relative error {err:.2e}"
    return {"eager": lambda: model(*args), "fuse_patterns": lambda: fused(*args), "compile": lambda: compiled(*args)}


def timed(run: Dict[str, Callable[[], object]], rounds: int, min_run_time: float) -> Dict[str, float]:
    with torch.no_grad():
        per_round = interleaved_rounds(run, rounds, min_run_time)
    return {impl: min(t) * 1e3 for impl, t in per_round.items()}


@click.command()
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--min-run-time", type=float, default=0.2, show_default=True)
@click.option("--seqs", default="128,512", show_default=True, help="Sequence lengths of the hand-written encoder.")
def main(threads: int, rounds: int, min_run_time: float, seqs: str) -> None:
    torch.set_num_threads(threads)
    facts = machine()
    print(f"CPU {facts['cpu']} ({facts['isa']}), torch {facts['torch']} ({facts['torch_gemm']}), "
          f"{torch.get_num_threads()} threads for every implementation, gemm backend {attn_export.gemm_backend()}")
    print("| model | eager ms | fuse_patterns ms | compile ms | fuse_patterns / eager | compile / eager |")
    print("|---|---|---|---|---|---|")
    for label, model, args in cases([int(s) for s in seqs.split(",")]):
        ms = timed(runners(model, args), rounds, min_run_time)
        print(f"| {label} | {ms['eager']:.2f} | {ms['fuse_patterns']:.2f} | {ms['compile']:.2f} | "
              f"{ms['fuse_patterns'] / ms['eager']:.2f}x | {ms['compile'] / ms['eager']:.2f}x |")


if __name__ == "__main__":
    main()
