#!/usr/bin/env python
"""`make demo`: the fused layer on a small example transformer.

Builds a small nn.TransformerEncoder (fixed seed), swaps each self-attention for
FusedMultiheadAttention with the same weights, prints the parity of outputs and gradients
against the stock model, then a short side-by-side timing of one layer.
"""
import copy

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import attn_export
from attn_export import bench

console = Console()


def example_model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def main() -> None:
    stock = example_model().train()  # train mode: the eval fast path would bypass the submodules
    fused = copy.deepcopy(stock)
    for layer in fused.layers:
        layer.self_attn = attn_export.FusedMultiheadAttention.from_module(layer.self_attn)

    x = torch.randn(8, 16, 64, requires_grad=True)
    padding = torch.zeros(8, 16, dtype=torch.bool)
    padding[4:, 12:] = True
    out_stock = stock(x, src_key_padding_mask=padding)
    out_fused = fused(x, src_key_padding_mask=padding)
    grad_out = torch.randn_like(out_stock)  # not .sum(): LayerNorm makes that gradient ~0
    grads_stock = torch.autograd.grad(out_stock, [x, *stock.parameters()], grad_out)
    grads_fused = torch.autograd.grad(out_fused, [x, *fused.parameters()], grad_out)

    table = Table(title="Parity: fused vs stock nn.TransformerEncoder (float32, 2 layers, batch 8, seq 16)")
    table.add_column("tensor")
    table.add_column("max |error| / max |reference|", justify="right")

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    table.add_row("output", f"{rel(out_fused, out_stock):.2e}")
    names = ["input", *[n for n, _ in stock.named_parameters()]]
    worst = max(zip(grads_fused, grads_stock, names), key=lambda t: rel(t[0], t[1]))
    table.add_row(f"gradients ({len(names)} tensors), worst: {worst[2]}", f"{rel(worst[0], worst[1]):.2e}")
    console.print(table)

    torch.set_num_threads(2)
    with console.status("timing one attention layer (batch 8, seq 16, embed 64, 4 heads)"):
        results = bench.run_benchmark([bench.Shape(8, 16, 64, 4)], rounds=3, min_run_time=0.1)
    speed = Table(title="Speed of one layer, 2 CPU threads (median us; ratio to nn.MultiheadAttention)")
    for col in ("mode", "fused", "nn.MultiheadAttention", "F.scaled_dot_product_attention"):
        speed.add_column(col, justify="right")
    for mode in bench.MODES:
        row = {r.implementation: r for r in results if r.mode == mode}
        speed.add_row(
            mode,
            f"{row['fused'].median_us:.1f} ({row['fused'].ratio:.2f}x)",
            f"{row[bench.REFERENCE].median_us:.1f}",
            f"{row['sdpa'].median_us:.1f} ({row['sdpa'].ratio:.2f}x)",
        )
    console.print(speed)
    console.print("Full benchmark: `attn-export bench` (see docs/benchmarks.md).")


if __name__ == "__main__":
    main()
