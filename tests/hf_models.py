"""Tiny transformers models (random weights, nothing downloaded) and padded batches, shared by the
tests that route, export and validate them. Import only where transformers is installed (the
importing test file skips first)."""
from __future__ import annotations

import torch
import transformers

from attn_export.surgery import transformers as hf

HF5 = hf._version_tuple(transformers.__version__) >= (5,)

def tiny_bert(cls_name="BertModel", **overrides):
    config = transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, **overrides,
    )
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).eval()


def tiny_gpt2(cls_name="GPT2LMHeadModel", **overrides):
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=0, eos_token_id=0, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).eval()


def tiny_llama(cls_name="LlamaForCausalLM", **overrides):
    """A 2-layer Llama-style decoder with grouped-query attention: 8 query heads over 2
    key/value heads (head dim 8)."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).eval()


def tiny_vit():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4)
    torch.manual_seed(0)
    return transformers.ViTModel(config).eval()


def padded_batch(lengths, seq, vocab=97, left=False, seed=0):
    """input_ids and a 0/1 attention_mask whose rows have the given valid lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=gen)
    pos = torch.arange(seq)
    lengths = torch.tensor(lengths)[:, None]
    keep = pos >= seq - lengths if left else pos < lengths
    return {"input_ids": ids, "attention_mask": keep.long()}


def main_output(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


# Ops that carry one tensor's data along (input 0), reshaped, repeated or cast: the chain from a
# projection to the attention node's key/value input.
_DATA_PATH_OPS = {"Reshape", "Transpose", "Expand", "Tile", "Unsqueeze", "Squeeze", "Identity", "Cast", "Concat"}


def repeats_feeding(proto, value: str) -> list:
    """The Expand/Tile nodes on the data path (input 0 of data-carrying ops) that ends in ``value``."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    found, node = [], producers.get(value)
    while node is not None and node.op_type in _DATA_PATH_OPS:
        if node.op_type in ("Expand", "Tile"):
            found.append(node.op_type)
        node = producers.get(node.input[0])
    return found


def genai_greedy_tokens(directory, prompts, pad_id: int, new_tokens: int):
    """ONNX Runtime GenAI's greedy tokens ``[rows, new_tokens]`` (a list of lists) for ``prompts``,
    from the model and genai_config.json in ``directory``. GenAI 0.18 reads a padded batch as
    RIGHT-padded (it masks the pad tokens after a row's last other token), so the prompts go in
    right-padded; transformers' generate() takes them left-padded."""
    import numpy as np
    import pytest

    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    width = max(map(len, prompts))
    params.set_search_options(max_length=width + new_tokens, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    generator.append_tokens(ids)
    steps = []
    while not generator.is_done():
        generator.generate_next_token()
        steps.append(generator.get_next_tokens().tolist())
    return np.array(steps).T.tolist()

