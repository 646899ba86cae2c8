"""One ``batch`` symbol for every input's batch axis (attn_export/onnx/dims.py): the inputs' batch
axes are traced as one torch.export Dim where the example's sizes agree, kept apart where they
differ or where the model contradicts one batch; every output's batch follows. Checked on the
files: ONNX shape inference, ONNX Runtime at a batch other than the example's, the TensorRT
profile."""
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from attn_export.errors import InputError
from attn_export.onnx import export_onnx
from attn_export.onnx.dims import shared_labels
from attn_export.tensorrt.profiles import derive_profile
from helpers import MaskedSelfAttention, assert_parity, dims


def batch_symbols(model):
    """dim 0 of every graph input and output."""
    return {v.name: dims(model, v.name)[0] for v in list(model.graph.input) + list(model.graph.output)}


def ort_run(path, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in feeds.items()})


def inferred(path):
    """The file through ONNX shape inference, strict: the symbols must agree node by node."""
    return onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True, data_prop=True)


# --------------------------------------------------------------------------------------------
# Which labels become one Dim
# --------------------------------------------------------------------------------------------

def test_the_batch_is_one_dim_where_the_example_sizes_agree():
    inputs = {"src": torch.zeros(2, 5, 4), "mask": torch.zeros(2, 5, dtype=torch.bool)}
    axes = {"src": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "mask_seq"}}
    assert shared_labels(inputs, axes) == ({"batch"}, [])


def test_batches_of_different_example_sizes_stay_apart_with_a_note():
    inputs = {"queries": torch.zeros(2, 5, 4), "keys": torch.zeros(3, 7, 4)}
    axes = {"queries": {0: "batch", 1: "seq"}, "keys": {0: "batch", 1: "keys_seq"}}
    shared, notes = shared_labels(inputs, axes)
    assert shared == set()
    assert notes == ["the example inputs' batch sizes differ (queries[0]=2, keys[0]=3): their batch axes are "
                     "separate symbols (batch, batch_<input>)"]


def test_default_sequence_labels_are_left_to_torch_export_and_declared_labels_are_shared():
    inputs = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    hf_axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert shared_labels(inputs, hf_axes)[0] == {"batch"}
    declared = {"input_ids": {0: "rows", 1: "tokens"}, "attention_mask": {0: "rows", 1: "tokens"}}
    assert shared_labels(inputs, declared)[0] == {"rows", "tokens"}
    one_input = {"input_ids": {0: "batch", 1: "seq"}}
    assert shared_labels(inputs, one_input)[0] == set()


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------

class TwoBatches(nn.Module):
    """Queries and a memory whose batches are independent: the output is [queries, memories]."""

    def forward(self, queries, memory):
        return queries.mean(1) @ memory.mean(1).transpose(0, 1)


def test_inputs_of_different_example_batch_keep_their_own_symbols(tmp_path):
    model = TwoBatches()
    inputs = {"queries": torch.randn(2, 5, 4), "memory": torch.randn(3, 7, 4)}
    result = export_onnx(model, inputs, tmp_path / "two.onnx")
    proto = inferred(result.path)
    assert batch_symbols(proto) == {"queries": "batch", "memory": "batch_memory", "output": "batch"}
    assert dims(proto, "output") == ["batch", "batch_memory"]
    assert any("batch sizes differ (queries[0]=2, memory[0]=3)" in note for note in result.notes)
    other = {"queries": torch.randn(4, 6, 4), "memory": torch.randn(1, 2, 4)}
    (out,) = ort_run(result.path, other)
    assert_parity(out, model(**other).numpy(), 1e-6)


def test_independent_batches_declared_apart_are_respected(tmp_path):
    model = TwoBatches()
    inputs = {"queries": torch.randn(2, 5, 4), "memory": torch.randn(2, 7, 4)}
    axes = {"queries": {0: "queries", 1: "seq"}, "memory": {0: "memories", 1: "memory_seq"}}
    result = export_onnx(model, inputs, tmp_path / "declared.onnx", dynamic_axes=axes)
    assert dims(onnx.load(str(result.path)), "output") == ["queries", "memories"]
    other = {"queries": torch.randn(3, 6, 4), "memory": torch.randn(5, 2, 4)}
    (out,) = ort_run(result.path, other)
    assert_parity(out, model(**other).numpy(), 1e-6)


def test_a_batch_the_trace_ties_to_a_sequence_is_traced_again_apart(tmp_path):
    """Example batch == sequence (4): one batch Dim would make x's batch and sequence one symbol
    through the mask; the export notices and keeps the batch apart. The float [L, L] mask's dim
    0, labelled a batch by the defaults, is a sequence."""
    torch.manual_seed(0)
    model = MaskedSelfAttention(8, 2).eval()
    inputs = {"x": torch.randn(4, 4, 8), "mask": torch.randn(4, 4)}
    result = export_onnx(model, inputs, tmp_path / "square.onnx")
    assert any("separate symbols" in note and "x[1] (seq)" in note for note in result.notes), result.notes
    proto = inferred(result.path)
    assert dims(proto, "x")[:2] == ["batch", "seq"] and dims(proto, "mask") == ["seq", "seq"]
    other = {"x": torch.randn(2, 5, 8), "mask": torch.randn(5, 5)}
    (out,) = ort_run(result.path, other)
    with torch.no_grad():
        assert_parity(out, model(**other).numpy(), 2e-6)


class FixedMemoryBatch(nn.Module):
    def forward(self, x, memory):
        return x + memory.reshape(2, -1).sum()


def test_a_batch_the_model_fixes_stays_static_and_the_others_dynamic(tmp_path):
    result = export_onnx(FixedMemoryBatch(), {"x": torch.randn(2, 3), "memory": torch.randn(2, 5)},
                         tmp_path / "fixed.onnx")
    assert any("torch.export refused it" in note for note in result.notes), result.notes
    assert dims(onnx.load(str(result.path)), "x") == ["batch", "seq"]
    assert dims(onnx.load(str(result.path)), "memory")[0] == 2


def test_the_bundled_example_has_one_batch(small_seq2seq, exported_seq2seq):
    proto = inferred(exported_seq2seq.path)
    assert set(batch_symbols(proto).values()) == {"batch"}
    assert not [n for n in exported_seq2seq.notes if "batch" in n]


# --------------------------------------------------------------------------------------------
# A transformers decoder
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 2-layer Llama-style decoder (grouped-query attention) exported with the default axes:
    (model, example inputs, ExportResult)."""
    transformers = pytest.importorskip("transformers")
    from hf_models import padded_batch

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    inputs = padded_batch([9, 4], 9)
    return model, inputs, export_onnx(model, inputs, tmp_path_factory.mktemp("llama") / "llama.onnx")


@pytest.mark.slow  # the module's Llama export: make test-fast leaves it out
def test_a_transformers_decoder_has_one_batch_on_every_input_and_output(llama):
    from hf_models import padded_batch

    model, _, result = llama
    proto = inferred(result.path)
    assert batch_symbols(proto) == {"input_ids": "batch", "attention_mask": "batch", "logits": "batch"}
    assert dims(proto, "attention_mask") == ["batch", "seq"] and dims(proto, "logits") == ["batch", "seq", 97]
    assert result.dynamic_axes == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    batch = padded_batch([3, 11, 7], 11, left=True, seed=2)  # batch 3 and length 11: not the example's
    (logits,) = ort_run(result.path, batch)
    with torch.no_grad():
        want = model(**batch).logits
    valid = batch["attention_mask"].bool()
    assert_parity(torch.from_numpy(logits)[valid], want[valid], 1e-4)


@pytest.mark.slow  # the module's Llama export: make test-fast leaves it out
def test_the_tensorrt_profile_sees_one_batch(llama):
    _, inputs, result = llama
    proto = onnx.load(str(result.path))
    profile = derive_profile(proto, inputs)
    assert set(profile.labels) == {"batch", "seq"}
    assert profile.shapes["input_ids"] == profile.shapes["attention_mask"] == ((1, 1), (2, 9), (8, 48))
    with pytest.raises(InputError, match="dimension 'batch' is 1 in input_ids.0. but 2 in attention_mask.0."):
        derive_profile(proto, inputs, min_shapes={"input_ids": (1, 1), "attention_mask": (2, 1)})
