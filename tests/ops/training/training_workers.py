"""What tests/ops/training/test_distributed.py runs in other processes: the ranks of a 2-process gloo group
(DDP, FSDP2, distributed checkpoints) and the peak-memory probe of activation checkpointing.

    python tests/ops/training/training_workers.py ranks OUT_DIR   # one rank; RANK and WORLD_SIZE from the env
    MALLOC_MMAP_THRESHOLD_=65536 python tests/ops/training/training_workers.py memory   # JSON {"plain_mb", "checkpointed_mb"}

Also imported by the test for the model, the data and the training loop, so that the ranks and
the single-process references run the same code.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import attn_export
from attn_export.atomic_io import atomic_output

EMBED, HEADS, FFN, LAYERS = 32, 4, 64, 2
BATCH, SEQ, STEPS, LR = 4, 12, 3, 0.2


class TinyEncoder(nn.Module):
    """A stack of nn.TransformerEncoderLayer (no dropout) with a linear head; each layer
    optionally under activation checkpointing (torch.utils.checkpoint, use_reentrant=False)."""

    def __init__(self, layers: int = LAYERS, embed: int = EMBED, heads: int = HEADS, ffn: int = FFN):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(embed, heads, ffn, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(embed, embed)
        self.checkpointed = False

    def forward(self, src: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpointed:
                src = checkpoint(layer, src, src_key_padding_mask=src_key_padding_mask, use_reentrant=False)
            else:
                src = layer(src, src_key_padding_mask=src_key_padding_mask)
        return self.head(src)


def build_model(seed: int = 0, fused: bool = True, **sizes) -> TinyEncoder:
    torch.manual_seed(seed)
    model = TinyEncoder(**sizes)
    if fused:
        report = attn_export.replace_attention(model)
        assert report.num_replaced == len(model.layers), report.summary()
    return model


def batches(steps: int = STEPS, batch: int = BATCH) -> list:
    """(src, padding, target) per step, the full batch; the last sequences are padded."""
    generator = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(steps):
        src = torch.randn(batch, SEQ, EMBED, generator=generator)
        padding = torch.zeros(batch, SEQ, dtype=torch.bool)
        padding[batch // 2:, SEQ - 3:] = True
        data.append((src, padding, torch.randn(batch, SEQ, EMBED, generator=generator)))
    return data


def shard(data: list, rank: int, world_size: int) -> list:
    """This rank's equal slice of every batch (full-batch mean = mean of the ranks' means)."""
    per_rank = BATCH // world_size
    return [tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in step) for step in data]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameters and gradients) gathered whole; others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model: nn.Module, data: list, average_loss=None) -> dict:
    """SGD on mean squared error. Returns the losses (``average_loss`` turns a rank's local loss
    into the global one), every parameter's gradient at every step and the updated parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for src, padding, target in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(src, padding), target)
        loss.backward()
        loss = loss.detach()
        losses.append(float(average_loss(loss) if average_loss else loss))
        grads.append({name: _full(p.grad).detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
    params = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _strip_ddp(results: dict) -> dict:
    """DDP prefixes every name with ``module.``."""
    def strip(d):
        return {name.removeprefix("module."): t for name, t in d.items()}
    return {"losses": results["losses"], "grads": [strip(g) for g in results["grads"]],
            "params": strip(results["params"])}


def run_rank(out_dir: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # A file store: no port to pick or to collide on; gloo itself talks over loopback.
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        data = shard(batches(), rank, world_size)

        def global_loss(loss):
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            return loss

        results = {}
        for name, fused in (("ddp_stock", False), ("ddp_fused", True)):
            model = DistributedDataParallel(build_model(fused=fused))
            results[name] = _strip_ddp(train(model, data, global_loss))

        model = build_model()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        results["fsdp_fused"] = train(model, data, global_loss)

        # Distributed checkpoint: each rank writes its shards; a differently initialized model
        # loads them back.
        dcp.save(model.state_dict(), checkpoint_id=out_dir / "checkpoint")
        fresh = build_model(seed=1)
        for layer in fresh.layers:
            fully_shard(layer)
        fully_shard(fresh)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=out_dir / "checkpoint")
        fresh.load_state_dict(state)
        results["dcp_loaded"] = {name: _full(p).detach().clone() for name, p in fresh.named_parameters()}
        if rank == 0:
            with atomic_output(out_dir / "results.pt") as tmp:
                torch.save(results, tmp)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _status_mb(field: str) -> float:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def peak_rss_growth_mb(fn) -> float:
    """How far this process's resident memory rose while ``fn`` ran: Linux's peak-RSS counter
    (VmHWM), reset through /proc/self/clear_refs, against the RSS at the start. Run with a fixed
    MALLOC_MMAP_THRESHOLD_ so that glibc returns every large tensor to the system when it is
    freed and the RSS follows the live tensors (its default threshold grows, and freed blocks
    then stay resident for reuse)."""
    Path("/proc/self/clear_refs").write_text("5")
    start = _status_mb("VmRSS")
    fn()
    return _status_mb("VmHWM") - start


def probe_memory() -> None:
    """Peak memory of one training step of 6 fused layers at sequence 2048, without and with
    activation checkpointing. A narrow embedding (less compute) and a wide feed-forward (its
    activations, 2048 x 1024 per layer, dominate)."""
    torch.set_num_threads(1)
    model = build_model(layers=6, embed=32, heads=4, ffn=1024)

    def step_growth(seqlen: int, checkpointed: bool) -> float:
        model.checkpointed = checkpointed
        src, padding = torch.randn(1, seqlen, 32), torch.zeros(1, seqlen, dtype=torch.bool)
        return peak_rss_growth_mb(lambda: model(src, padding).square().mean().backward())

    for checkpointed in (False, True):  # one-time allocations of each path, at a short sequence
        step_growth(128, checkpointed)
    print(json.dumps({"plain_mb": step_growth(2048, False), "checkpointed_mb": step_growth(2048, True)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        probe_memory()
    elif len(sys.argv) == 3 and sys.argv[1] == "ranks":
        run_rank(Path(sys.argv[2]))
    else:
        raise SystemExit("usage: python tests/ops/training/training_workers.py ranks OUT_DIR | memory")
