#!/usr/bin/env python
"""Fine-tune a small model with fused attention under DDP, then export it to ONNX and validate it.

    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py                  # CPU, gloo
    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py --backend nccl   # one GPU per process

The path a user takes (docs/training.md):

1. every rank builds the bundled example model (attn_export.examples.TinySeq2Seq: nn.Transformer,
   encoder self-, causal decoder self- and cross-attention) and swaps its attention layers for
   the fused operator with attn_export.replace_attention;
2. DistributedDataParallel trains it for --steps AdamW steps to imitate a fixed "teacher" copy
   with other weights, each rank on its own batches (the loss printed is the mean over ranks);
3. rank 0 writes the trained weights (a state_dict: the same keys as the stock model), exports
   ONNX with one FusedAttention node per attention layer and validates it in ONNX Runtime
   against the stock model loaded with the same weights.

Writes under --out (default out/train_ddp/): model.pt, model.onnx, report.json. Exit 0 when the
validation passes, 1 when it fails, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import attn_export
from attn_export.atomic_io import atomic_output, write_text
from attn_export.examples import TinySeq2Seq

BATCH, SRC_LEN, TGT_LEN = 8, 16, 12


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU processes; nccl: one CUDA device per process (LOCAL_RANK)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/train_ddp"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if "RANK" not in os.environ:
        parser.error("run it under torchrun, e.g. torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py")
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs CUDA devices; on the CPU use --backend gloo")
    return args


def build_model(seed: int) -> TinySeq2Seq:
    """The example model without dropout: attention dropout is not fused (a layer with dropout
    runs PyTorch's unfused attention in training), and it keeps the run deterministic."""
    torch.manual_seed(seed)
    model = TinySeq2Seq()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def make_batch(step: int, rank: int, features: int, device: torch.device) -> dict:
    """This rank's batch of the step: random sequences, the second half padded at the end."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    padding = torch.zeros(BATCH, SRC_LEN, dtype=torch.bool)
    padding[BATCH // 2:, SRC_LEN - 4:] = True
    batch = {"src": torch.randn(BATCH, SRC_LEN, features, generator=gen),
             "tgt": torch.randn(BATCH, TGT_LEN, features, generator=gen),
             "src_key_padding_mask": padding}
    return {name: t.to(device) for name, t in batch.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=5))

    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    try:
        start = time.perf_counter()
        model = build_model(seed=0).train()
        report = attn_export.replace_attention(model)
        say(f"[1/3] {world_size} ranks ({args.backend}); attention layers: {report.summary()}")
        # The teacher stays in training mode (no dropout: the same function) so that its stock
        # encoder takes no nested-tensor fast path; it only runs under no_grad.
        teacher = build_model(seed=1).to(device)
        model.to(device)
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        features = model.embed_src.in_features
        for step in range(args.steps):
            batch = make_batch(step, rank, features, device)
            with torch.no_grad():
                target = teacher(**batch)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(**batch), target)
            loss.backward()
            optimizer.step()
            mean_loss = loss.detach()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == args.steps:
                say(f"[2/3] step {step + 1:>4}/{args.steps}  loss {mean_loss.item():.5f}")
        code = 0
        if rank == 0:
            code = export_and_validate(model, args.out, features)
            say(f"done in {time.perf_counter() - start:.1f} s")
        # Every rank leaves with rank 0's verdict.
        verdict = torch.tensor([code], device=device)
        dist.broadcast(verdict, src=0)
        return int(verdict.item())
    finally:
        dist.destroy_process_group()


def export_and_validate(model: TinySeq2Seq, out: Path, features: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model = model.cpu().eval()
    state = model.state_dict()
    with atomic_output(out / "model.pt") as tmp:
        torch.save(state, tmp)
    inputs = make_batch(0, 0, features, torch.device("cpu"))
    result = attn_export.export_onnx(model, inputs, out / "model.onnx")
    print(f"[3/3] wrote {out / 'model.pt'} and {result.path} "
          f"({result.num_attention_nodes} FusedAttention nodes); validating in ONNX Runtime...", flush=True)
    stock = build_model(seed=0).eval()  # the stock layers, with the trained weights
    stock.load_state_dict(state)
    check = attn_export.validate(stock, result.path, inputs)
    write_text(out / "report.json", check.to_json())
    print(f"validation {'PASSED' if check.passed else 'FAILED'} ({out / 'report.json'})", flush=True)
    for failure in check.failures:
        print(f"  {failure}", flush=True)
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
