"""The stock cached export: a transformers decoder with its key/value cache, exported by
``torch.onnx`` from the UNMODIFIED model (transformers' own attention, no replacement). It is
the baseline of the decode benchmark (benchmarks/decode.py) and the file the generation gate is
tested on (tests/validation/test_generation.py), written to the same contract as
``attn_export.export_onnx(..., with_past=True)``:

* inputs ``input_ids`` [batch, sequence], ``attention_mask`` [batch, total_sequence],
  ``position_ids`` [batch, sequence] (when the model's forward takes them),
  ``past_key_values.{i}.key|value`` [batch, num_kv_heads, past_sequence, head_dim];
* outputs ``logits`` [batch, sequence, vocab], ``present.{i}.key|value``
  [batch, num_kv_heads, past_sequence + sequence, head_dim];
* metadata ``attn_export.with_past``: JSON num_layers, num_kv_heads, head_dim, position_ids, dtype.

    python -m benchmarks.stock_cached --config llama.json -o stock.onnx
"""
from __future__ import annotations

import copy
import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import torch
from torch import nn

WITH_PAST_KEY = "attn_export.with_past"
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class CacheLayout:
    """What a runtime needs to build an empty past (the metadata's JSON)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    position_ids: bool
    dtype: str


def cache_layout(model: nn.Module, dtype: torch.dtype = torch.float32) -> CacheLayout:
    """The cache's shape facts from a transformers decoder's config."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return CacheLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       position_ids=takes_positions, dtype=DTYPE_NAMES[dtype])


def input_names(layout: CacheLayout) -> List[str]:
    names = ["input_ids", "attention_mask"] + (["position_ids"] if layout.position_ids else [])
    return names + [f"past_key_values.{i}.{kind}" for i in range(layout.num_layers) for kind in ("key", "value")]


def output_names(layout: CacheLayout) -> List[str]:
    return ["logits"] + [f"present.{i}.{kind}" for i in range(layout.num_layers) for kind in ("key", "value")]


class WithPast(nn.Module):
    """The decoder called with its cache as flat tensors (the ONNX graph's inputs and outputs):
    a DynamicCache is built from ``past`` and the presents are read back out of it."""

    def __init__(self, model: nn.Module, layout: CacheLayout):
        super().__init__()
        self.model = model
        self.layout = layout
        # transformers 5.25 renamed past_key_values to cache (the old name warns, then goes in 5.40)
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, input_ids, attention_mask, *rest):
        from transformers import DynamicCache

        position_ids, past = (rest[0], rest[1:]) if self.layout.position_ids else (None, rest)
        cache = DynamicCache(config=self.model.config)
        for i in range(self.layout.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        extra = {"position_ids": position_ids} if self.layout.position_ids else {}
        extra[self.cache_argument] = cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **extra)
        presents = []
        for layer in out.past_key_values.layers:
            presents += [layer.keys, layer.values]
        return (out.logits, *presents)


def _examples(layout: CacheLayout, dtype: torch.dtype, vocab: int):
    """Batch 2, past 3, sequence 4, row 0 left-padded by 2: sizes that differ from each other, so
    no two axes are unified by accident."""
    batch, past_len, seq = 2, 3, 4
    ids = torch.randint(1, vocab, (batch, seq))
    mask = torch.ones(batch, past_len + seq, dtype=torch.long)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
    past = [torch.randn(batch, layout.num_kv_heads, past_len, layout.head_dim, dtype=dtype)
            for _ in range(2 * layout.num_layers)]
    return (ids, mask, *([positions] if layout.position_ids else []), *past)


def export_stock_cached(model: nn.Module, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        opset: Optional[int] = None) -> CacheLayout:
    """Writes ``path``: ``model`` (a transformers decoder; not modified) exported by torch.onnx
    with its cache, dynamic batch, sequence and past-sequence axes. Returns the layout."""
    from torch.export import Dim

    import onnx

    layout = cache_layout(model, dtype)
    model = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    wrapper = WithPast(model.eval(), layout).eval()
    args = _examples(layout, dtype, model.config.vocab_size)
    batch, seq, past, total = Dim("batch"), Dim("sequence"), Dim("past_sequence"), Dim("total_sequence")
    rest = ([{0: batch, 1: seq}] if layout.position_ids else []) + [{0: batch, 2: past}] * (2 * layout.num_layers)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total}, "rest": tuple(rest)}
    with torch.no_grad():
        program = torch.onnx.export(wrapper, args, dynamic_shapes=dynamic, input_names=input_names(layout),
                                    output_names=output_names(layout), dynamo=True, optimize=True,
                                    opset_version=opset, verbose=False)
    proto = program.model_proto
    entry = proto.metadata_props.add()
    entry.key, entry.value = WITH_PAST_KEY, json.dumps(asdict(layout))
    onnx.save(proto, str(path))
    return layout


def main(argv=None) -> int:
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a transformers config.json of a causal LM")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = transformers.AutoConfig.from_pretrained(args.config)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    print(export_stock_cached(model, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
