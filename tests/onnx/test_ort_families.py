"""The ONNX Runtime flavor (--onnx-attention ort) on the families ONNX Runtime GenAI's model
builder supports, each a tiny random model with head size 16 (GroupQueryAttention rotates
multiples of 16 only): every layer a GroupQueryAttention in the builder's form (packed QKV read
by the operator, do_rotary) over the compacted cache, no If, and the generating gate passing on
a left-padded batch and, with ONNX Runtime GenAI installed, through its generator with the
shared buffer on a batch GenAI pads on the right. And GPT-2, which the builder does not build
(no rotary: do_rotary 0, its learned positions read at the rotated position ids)."""
import pytest

transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402
import torch  # noqa: E402

from attn_export.onnx import export_onnx  # noqa: E402
from attn_export.validation import check_generation  # noqa: E402
from attn_export.validation.generation import random_prompts, reference_generation  # noqa: E402
from hf_models import HF5, genai_greedy_tokens, padded_batch  # noqa: E402
from helpers import ci_sample  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")]

VOCAB = 128
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, **SPECIAL)

FAMILIES = {
    "qwen2": lambda t: t.Qwen2ForCausalLM(t.Qwen2Config(**SIZES)),
    "phi3": lambda t: t.Phi3ForCausalLM(t.Phi3Config(**SIZES)),
    "mistral": lambda t: t.MistralForCausalLM(t.MistralConfig(**SIZES, sliding_window=None)),
    "gemma2": lambda t: t.Gemma2ForCausalLM(t.Gemma2Config(**SIZES, head_dim=16, sliding_window=8)),
}


def gqa_nodes(graph):
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            yield "top", node
        for a in node.attribute:
            if a.HasField("g"):
                yield from ((a.name, n) for n in a.g.node if n.op_type == "GroupQueryAttention")


def genai_matches_generate(model, path):
    """GenAI's generator (a batch it pads on the right, the shared buffer) picks generate()'s tokens."""
    pytest.importorskip("onnxruntime_genai")
    from attn_export.genai_config import write_genai_config
    from attn_export.validation.generation import left_padded
    write_genai_config(path, model.config)
    prompts = random_prompts(VOCAB, (9, 5), seed=1, avoid=[0, 1, 2])
    ids, mask = left_padded(prompts, 0)
    expected = reference_generation(model, ids, mask, 12, 0, takes_positions=True)[0].tolist()
    assert genai_greedy_tokens(path.parent, prompts, 0, 12) == expected


@pytest.mark.parametrize("name", ci_sample(sorted(FAMILIES)))  # CI: gemma2 (window, soft-cap), phi3
def test_the_family_lowers_and_generates_the_models_tokens(name, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[name](transformers).eval()
    path = tmp_path / "model.onnx"
    result = export_onnx(model, padded_batch((5, 3), 5, vocab=VOCAB, left=True), path, with_past=True, attention="ort")
    assert result.kept_custom == []
    graph = onnx.load(str(path)).graph
    rotating = [n for where, n in gqa_nodes(graph)
                if where == "top" and any(a.name == "do_rotary" and a.i == 1 for a in n.attribute)]
    assert len(rotating) == model.config.num_hidden_layers, [(w, n.input[:3]) for w, n in gqa_nodes(graph)]
    gate = check_generation(model, path, new_tokens=12)
    assert gate.passed, gate.failures
    assert len({tuple(t) for t in gate.reference_tokens}) > 1  # rows that differ: a comparison that can fail
    genai_matches_generate(model, path)


def test_gpt2_lowers_and_generates_the_models_tokens(tmp_path):
    """GPT-2 (the family a user takes to Optimum; the builder has none): its packed Conv1D
    projection (a Gemm with the bias) split into query, key and value, learned positions, no
    rotary: every layer a GroupQueryAttention (do_rotary 0) over the compacted cache, the gate passing
    on a left-padded batch and GenAI's generator on the shared buffer giving the model's tokens."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.1, **SPECIAL)).eval()
    path = tmp_path / "model.onnx"
    result = export_onnx(model, padded_batch((5, 3), 5, vocab=VOCAB, left=True), path, with_past=True, attention="ort")
    assert result.kept_custom == []
    found = list(gqa_nodes(onnx.load(str(path)).graph))
    assert [where for where, _ in found] == ["top"] * model.config.n_layer
    assert not any(a.name == "do_rotary" and a.i for _, n in found for a in n.attribute)
    gate = check_generation(model, path, new_tokens=12)
    assert gate.passed, gate.failures
    assert len({tuple(t) for t in gate.reference_tokens}) > 1
    genai_matches_generate(model, path)
