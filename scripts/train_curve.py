#!/usr/bin/env python
"""Train a small causal language model from one seed with nn.MultiheadAttention and with the fused
operator, and compare the two loss curves against the noise of training itself.

    python scripts/train_curve.py                  # CPU, float32: head dim 32, sequence 64
    python scripts/train_curve.py --device cuda    # bfloat16 autocast: head dim 128, sequence 256
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 python scripts/train_curve.py --device cuda
                                                   # the same on the Hopper kernels (sm_90a build)

The task is copying: each sequence is a random prefix, a separator and the prefix again, and the
loss is the next-token cross entropy over the copy. Only attention can bring it below ln(vocab)
(the model has to look back to the prefix), so a wrong attention gradient shows in the curve.

Three runs train for --steps AdamW steps from the same initial weights:
  stock       the model with nn.MultiheadAttention;
  fused       a copy whose attention attn_export.replace_attention swapped, on the same batches;
  reshuffled  stock again on batches drawn in another order (the data seed + 1).
The losses are averaged over windows of --window steps. The noise is the largest window gap
between reshuffled and stock: how far one curve of this model moves when nothing but the order
of its data changes. The fused curve passes when its largest window gap from stock is no larger,
and the stock model learned (its last window at most half its first: before that the curves differ
by rounding only).

Writes under --out (default out/train_curve/): curve.json (every step's loss of each run, the
window means, the verdict, the device and dispatch switches, and on CUDA the attention kernels
one training step of each run launched) and curve.md. Exit 0 when the curve passes, 1 when it
does not, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import attn_export
from attn_export.atomic_io import write_text

SEPARATOR = 0
# Kernel names that say which attention ran: ours (sm80 flash, Hopper, generic) and PyTorch's.
ATTENTION_KERNEL_MARKS = ("attn_export", "flash", "sm90", "fmha", "attention", "cudnn", "efficient")
DISPATCH_SWITCHES = ("ATTN_EXPORT_CUDA_PREVIEW", "ATTN_EXPORT_CUDA_SM90")
# Until a model has learned, its curves differ by rounding, not by training, and their gaps say
# nothing: the stock curve's last window must be at most this fraction of its first.
LEARNED_RATIO = 0.5


@dataclass(frozen=True)
class Config:
    device: str
    dtype: str  # what the forward runs in: float32, or bfloat16/float16 under torch.autocast
    steps: int
    window: int
    batch: int
    seq_len: int
    vocab: int
    d_model: int
    heads: int
    layers: int
    lr: float
    seed: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


# Per device: sizes at which one run takes seconds on that device and the model learns the copy
# well inside 200 steps (the CUDA sizes learned it by step ~80 in float32 on a CPU). On a GPU, head
# dim 128 and enough 64-row query tiles (32 x 2 heads x 256 / 64 = 256) to fill an H100/H200, so
# the sm80 forward would not split the keys and the Hopper forward keeps the problem.
DEFAULTS = {
    "cpu": dict(dtype="float32", batch=16, seq_len=64, vocab=32, d_model=64, heads=2, layers=2),
    "cuda": dict(dtype="bfloat16", batch=32, seq_len=256, vocab=64, d_model=256, heads=2, layers=4),
}


class CopyLM(nn.Module):
    """Token and position embeddings, pre-norm nn.TransformerEncoder layers under a causal mask
    (no dropout: the runs must differ only where the attention does), a linear head."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, 4 * cfg.d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.size(1)
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = self.blocks(x, mask=causal, is_causal=True)
        return self.head(self.norm(x))


def copy_batch(cfg: Config, data_seed: int, step: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Inputs [B, L] and targets [B, L] of one step: prefix, separator, prefix (cut to L + 1
    tokens); targets outside the copy are -100 (ignored by the loss)."""
    half = cfg.seq_len - cfg.seq_len // 2  # 2 * half + 1 >= seq_len + 1 tokens
    gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    prefix = torch.randint(1, cfg.vocab, (cfg.batch, half), generator=gen)
    separator = torch.full((cfg.batch, 1), SEPARATOR)
    sequence = torch.cat([prefix, separator, prefix], dim=1)[:, : cfg.seq_len + 1]
    targets = sequence[:, 1:].clone()
    targets[:, :half] = -100
    return sequence[:, :-1].to(device), targets.to(device)


def train(model: nn.Module, cfg: Config, data_seed: int) -> tuple[list[float], list[float]]:
    """Every step's loss and wall time (seconds) of --steps AdamW steps."""
    device = torch.device(cfg.device)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses, times = [], []
    for step in range(cfg.steps):
        tokens, targets = copy_batch(cfg, data_seed, step, device)
        start = time.perf_counter()
        loss = training_step(model, optimizer, tokens, targets, cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at step {step + 1}")
    return losses, times


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor,
                  cfg: Config) -> Tensor:
    optimizer.zero_grad(set_to_none=True)
    autocast = cfg.dtype != "float32"
    with torch.autocast(cfg.device, dtype=getattr(torch, cfg.dtype), enabled=autocast):
        logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    return loss.detach()


def attention_kernels(model: nn.Module, cfg: Config) -> list[str]:
    """The attention-like CUDA kernels one training step of a copy of `model` launches."""
    if cfg.device != "cuda":
        return []
    trial = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trial.parameters(), lr=cfg.lr)
    tokens, targets = copy_batch(cfg, 0, 0, torch.device("cuda"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        training_step(trial, optimizer, tokens, targets, cfg)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n for n in names if any(mark in n.lower() for mark in ATTENTION_KERNEL_MARKS))


def window_means(losses: list[float], window: int) -> list[float]:
    return [statistics.fmean(losses[i: i + window]) for i in range(0, len(losses), window)]


def largest_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def compare(curves: dict[str, list[float]], window: int) -> dict:
    """The verdict: the fused curve's largest window gap from stock against the reshuffled one's,
    provided the stock model learned (its last window at most LEARNED_RATIO of its first)."""
    means = {name: window_means(losses, window) for name, losses in curves.items()}
    gap = largest_gap(means["fused"], means["stock"])
    noise = largest_gap(means["reshuffled"], means["stock"])
    learned = means["stock"][-1] <= LEARNED_RATIO * means["stock"][0]
    return {"window_means": means, "fused_gap": gap, "noise": noise, "learned": learned,
            "gap_over_noise": gap / noise if noise > 0 else float("inf"), "passed": learned and gap <= noise}


def verdict_line(report: dict) -> str:
    if not report["learned"]:
        means = report["window_means"]["stock"]
        return (f"FAILED: the stock model did not learn the copy in {report['config']['steps']} steps (window loss "
                f"{means[0]:.3f} -> {means[-1]:.3f}), so the curves compare rounding, not training: more --steps, "
                f"a shorter --seq-len or another --lr")
    return (f"{'PASSED' if report['passed'] else 'FAILED'}: fused gap {report['fused_gap']:.2e}, "
            f"noise {report['noise']:.2e} (ratio {report['gap_over_noise']:.3f})")


def run(cfg: Config) -> dict:
    """Trains the three runs and returns the report (curve.json's content)."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    stock = CopyLM(cfg)
    fused, reshuffled = copy.deepcopy(stock), copy.deepcopy(stock)
    replacement = attn_export.replace_attention(fused, require_all=True)
    fused.to(device)
    kernels = {"stock": attention_kernels(stock.to(device), cfg), "fused": attention_kernels(fused, cfg)}
    curves, step_times = {}, {}
    for name, model, data_seed in (("stock", stock, cfg.seed), ("fused", fused, cfg.seed),
                                   ("reshuffled", reshuffled, cfg.seed + 1)):
        curves[name], step_times[name] = train(model, cfg, data_seed)
        print(f"  {name:<10} loss {curves[name][0]:.4f} -> {statistics.fmean(curves[name][-cfg.window:]):.4f} "
              f"(last {cfg.window} steps), median step {1e3 * statistics.median(step_times[name]):.2f} ms",
              flush=True)
    return {
        "config": asdict(cfg) | {"head_dim": cfg.head_dim},
        "environment": environment(cfg),
        "replaced": replacement.summary(),
        "attention_kernels": kernels,
        # Medians of every step after the first (warm-up); a comparison, not the benchmark.
        "median_step_ms": {name: 1e3 * statistics.median(t[1:] or t) for name, t in step_times.items()},
        "losses": curves,
        **compare(curves, cfg.window),
    }


def environment(cfg: Config) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "attn_export": attn_export.__version__,
           "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "switches": {name: os.environ.get(name) for name in DISPATCH_SWITCHES}}
    if cfg.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def markdown(report: dict) -> str:
    cfg = report["config"]
    means = report["window_means"]
    lines = [
        f"# Loss curves: nn.MultiheadAttention vs the fused operator ({cfg['steps']} steps)",
        "",
        f"Copy task, {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads (head dim "
        f"{cfg['head_dim']}), batch {cfg['batch']} x {cfg['seq_len']} tokens, {cfg['dtype']} on {cfg['device']} "
        f"({report['environment'].get('gpu', report['environment']['cpu'])}), AdamW lr {cfg['lr']}, seed {cfg['seed']}.",
        f"Replaced: {report['replaced']}",
        "",
        f"| steps | stock | fused | reshuffled data |",
        f"|---|---|---|---|",
    ]
    for i, (s, f, r) in enumerate(zip(means["stock"], means["fused"], means["reshuffled"])):
        first = i * cfg["window"] + 1
        lines.append(f"| {first}-{min(first + cfg['window'] - 1, cfg['steps'])} | {s:.4f} | {f:.4f} | {r:.4f} |")
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines += [
        "",
        f"**{verdict}**: the fused curve's largest window gap from stock is {report['fused_gap']:.2e}, the noise "
        f"(reshuffled vs stock) {report['noise']:.2e} (ratio {report['gap_over_noise']:.3f})"
        + ("." if report["learned"] else "; but the stock model did not learn, so the gaps are rounding."),
        f"Median step: stock {report['median_step_ms']['stock']:.2f} ms, fused {report['median_step_ms']['fused']:.2f} ms.",
    ]
    for name, kernels in report["attention_kernels"].items():
        if kernels:
            lines.append(f"Attention kernels of one {name} step: {', '.join(kernels)}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="float32, or autocast to bfloat16/float16 (default: float32 on the CPU, bfloat16 on CUDA)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default: %(default)s)")
    parser.add_argument("--window", type=int, default=20, help="steps per averaged window (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data (default: %(default)s)")
    for name in ("batch", "seq-len", "vocab", "d-model", "heads", "layers"):
        parser.add_argument(f"--{name}", type=int, help="default: per device (see DEFAULTS)")
    parser.add_argument("--out", type=Path, default=Path("out/train_curve"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device and a CUDA build of PyTorch")
    sizes = dict(DEFAULTS[args.device])
    for key in ("dtype", "batch", "seq_len", "vocab", "d_model", "heads", "layers"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if args.steps < 1 or args.window < 1:
        parser.error("--steps and --window must be at least 1")
    if sizes["d_model"] % sizes["heads"]:
        parser.error(f"--d-model {sizes['d_model']} is not a multiple of --heads {sizes['heads']}")
    if sizes["seq_len"] < 4 or sizes["vocab"] < 3:
        parser.error("the copy task needs --seq-len >= 4 and --vocab >= 3")
    return Config(device=args.device, steps=args.steps, window=args.window, lr=args.lr, seed=args.seed, **sizes), args.out


def main(argv=None) -> int:
    cfg, out = parse_args(argv)
    print(f"training 3 x {cfg.steps} steps on {cfg.device} ({cfg.dtype}), head dim {cfg.head_dim}...", flush=True)
    report = run(cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "curve.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "curve.md", markdown(report))
    print(f"(written: {out / 'curve.md'}, {out / 'curve.json'})", flush=True)
    print(verdict_line(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
