"""More decoder families exported with their cache (``export_onnx(..., with_past=True)``), each a
tiny random model whose generating gate (validation/generation.py) passes on a left-padded batch
of prompts of lengths 5, 9 and 12: partial rotary (GPT-NeoX), multi-query (Falcon, GPT-BigCode),
learned positions with an offset (OPT), query/key norms (Qwen3), sliding windows of 8 shorter
and longer than the prompts (Gemma 3, StarCoder2), every attention fused with its cache. And
the issue's reproductions through the CLI, from config folders alone: Mistral (its EOS reached),
GPT-2 with GPT2Config's BOS/EOS 50256 beside a vocabulary of 128, Phi-3. ALiBi (Bloom, MPT): one
node per layer in its cache form with the model's slopes, in the custom and standard flavors.
docs/huggingface.md's family table says the same."""
import json

import pytest

transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402
import torch  # noqa: E402

from attn_export.onnx import export_onnx, read_metadata  # noqa: E402
from attn_export.validation import check_generation  # noqa: E402
from hf_models import HF5, padded_batch  # noqa: E402
from helpers import ci_sample  # noqa: E402

pytestmark = pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")

VOCAB = 128
# In-vocabulary special ids: rows reach their EOS (id 2) as real checkpoints' do.
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(vocab_size=VOCAB, max_position_embeddings=128, num_hidden_layers=2, num_attention_heads=4, **SPECIAL)


def _llama_like(config_cls, **extra):
    return config_cls(hidden_size=64, intermediate_size=128, num_key_value_heads=2, **DECODER, **extra)


FAMILIES = {
    "qwen3": lambda t: t.Qwen3ForCausalLM(_llama_like(t.Qwen3Config, head_dim=16)),
    "gemma3": lambda t: t.Gemma3ForCausalLM(_llama_like(t.Gemma3TextConfig, head_dim=16, sliding_window=8)),
    "gpt_neox": lambda t: t.GPTNeoXForCausalLM(
        t.GPTNeoXConfig(hidden_size=64, intermediate_size=128, rotary_pct=0.25, **DECODER)),
    "falcon": lambda t: t.FalconForCausalLM(
        t.FalconConfig(hidden_size=64, multi_query=True, new_decoder_architecture=False, **DECODER)),
    "opt": lambda t: t.OPTForCausalLM(t.OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, **DECODER)),
    "starcoder2": lambda t: t.Starcoder2ForCausalLM(_llama_like(t.Starcoder2Config, sliding_window=8)),
    "gpt_bigcode": lambda t: t.GPTBigCodeForCausalLM(
        t.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, n_positions=128, multi_query=True, vocab_size=VOCAB,
                           **SPECIAL)),
}
KV_HEADS = {"qwen3": 2, "gemma3": 2, "gpt_neox": 4, "falcon": 1, "opt": 4, "starcoder2": 2, "gpt_bigcode": 1}


def fused_nodes(proto):
    return [n for n in proto.graph.node if n.op_type == "FusedAttention"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ci_sample(sorted(FAMILIES)))  # CI: falcon, gpt_bigcode, opt, starcoder2
def test_the_family_exports_with_its_cache_and_generates_the_models_tokens(name, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[name](transformers).eval()
    path = tmp_path / f"{name}.onnx"
    export_onnx(model, padded_batch((5, 3), 5, vocab=VOCAB, left=True), path, with_past=True)
    proto = onnx.load(str(path), load_external_data=False)
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in fused_nodes(proto)]
    assert len(attrs) == 2, [n.op_type for n in proto.graph.node]  # every layer fused
    assert all(a["has_past"] == 1 and a["has_attn_mask"] == 0 and a["kv_num_heads"] == KV_HEADS[name]
               for a in attrs), attrs
    assert json.loads(read_metadata(proto)["with_past"])["num_kv_heads"] == KV_HEADS[name]
    result = check_generation(model, path, new_tokens=16)
    assert result.passed, result.failures
    assert result.prompt_lengths == [5, 9, 12] and result.runs[0].tokens == result.reference_tokens


CLI_REPRODUCTIONS = {
    # A sliding window of 8 between the prompts' lengths; MistralConfig's EOS (2) is reached.
    "mistral": lambda t: t.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    # GPT2Config's BOS/EOS 50256, outside the vocabulary: the padding used to index past the embedding.
    "gpt2": lambda t: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4),
    # EOS 6: a token row 1 generates at step 3 (the CLI's model and prompts are seeded), as in the issue.
    "phi3": lambda t: t.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, bos_token_id=1, eos_token_id=6, pad_token_id=0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ci_sample(["mistral", "phi3", "gpt2"]))  # CI: the issue's two reproductions
def test_the_cli_exports_the_issues_decoders_from_a_config_folder_and_the_gate_passes(name, tmp_path):
    from helpers import invoke

    CLI_REPRODUCTIONS[name](transformers).save_pretrained(tmp_path / name)
    proc = invoke("--model", "transformers:AutoModelForCausalLM", "--config", tmp_path / name, "--with-past",
                  "-o", tmp_path / f"{name}.onnx", "--json", tmp_path / "report.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    generation = json.loads((tmp_path / "report.json").read_text())["generation"]
    assert generation["passed"] and generation["new_tokens"] == 16


# ALiBi (issue 60): Bloom's and MPT's attention reach the node through the alibi route
# (surgery/routes/alibi.py), every layer in its cache form, causal with the compact padding mask
# and the model's ALiBi as the node's per-head slopes.
ALIBI = {
    "bloom": lambda t: t.BloomForCausalLM(t.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                        **SPECIAL)),
    "mpt": lambda t: t.MptForCausalLM(t.MptConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=VOCAB,
                                                  max_seq_len=128, **SPECIAL)),
}


def alibi_slopes(name, model):
    """The stock model's slopes, read from the ALiBi tensor its own code builds."""
    if name == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        bias = build_alibi_tensor(torch.ones(1, 3, dtype=torch.int64), model.config.n_head, torch.float64)
        return (bias[:, 0, 2] - bias[:, 0, 1]).tolist()
    bias = model.transformer.build_mpt_alibi_tensor(model.config.n_heads, model.config.max_seq_len)
    return (bias[:, 0, -1] - bias[:, 0, -2]).double().tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name, attention", ci_sample([("bloom", "custom"), ("mpt", "custom"), ("mpt", "standard"),
                                                      ("bloom", "standard")]))  # CI: each family, each flavor
def test_alibi_families_fuse_with_their_slopes_and_generate_the_models_tokens(name, attention, tmp_path):
    """custom: one node per layer with the model's slopes; standard: one Attention per layer (the
    bias added to its mask). Both generate generate()'s tokens on a left-padded batch."""
    torch.manual_seed(0)
    model = ALIBI[name](transformers).eval()
    path = tmp_path / f"{name}.onnx"
    result = export_onnx(model, padded_batch((5, 3), 5, vocab=VOCAB, left=True), path, with_past=True,
                         attention=attention)
    rows = [(layer.found, layer.status) for layer in result.replacement.layers]
    assert rows == [("alibi", "routed")] * 2, result.replacement  # the sample run too took the operator
    proto = onnx.load(str(path), load_external_data=False)
    if attention == "standard":
        assert not fused_nodes(proto) and [n.op_type for n in proto.graph.node].count("Attention") == 2
    else:
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in fused_nodes(proto)]
        assert len(attrs) == 2, attrs  # every layer, one node each
        for a in attrs:
            assert (a["has_past"], a["has_attn_mask"], a["has_key_padding_mask"], a["is_causal"], a["num_heads"],
                    a["kv_num_heads"]) == (1, 0, 1, 1, 4, 4), a
            assert a["alibi_slopes"] == pytest.approx(alibi_slopes(name, model), rel=1e-7), a
    result = check_generation(model, path, new_tokens=16)
    assert result.passed, result.failures
    assert result.prompt_lengths == [5, 9, 12] and result.runs[0].tokens == result.reference_tokens
