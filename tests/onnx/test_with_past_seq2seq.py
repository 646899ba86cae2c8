"""Encoder-decoders exported with their cache (``export_onnx(..., with_past=True)``): an encoder
file beside the decoder file (``m.onnx`` the decoder, ``m_encoder.onnx`` the encoder), every
self- and cross-attention fused, and the generating gate (validation/generation_seq2seq.py)
running the encoder once and the decoder step by step against the model's ``generate()`` on a
left-padded batch of sources. BART first (and the broken-on-purpose file the gate must fail),
then T5 (relative position bias: a mask on the node), Whisper (log-mel features made from the
config) and Marian; the CLI from config folders alone. docs/huggingface.md's family table says
the same."""
import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402
import torch  # noqa: E402

from attn_export.errors import InputError  # noqa: E402
from attn_export.onnx import export_onnx, read_metadata  # noqa: E402
from attn_export.onnx.seq2seq import encoder_path  # noqa: E402
from attn_export.surgery.transformers.seq2seq_cache import Seq2SeqDecoderWithPast, example_features  # noqa: E402
from attn_export.validation import check_generation  # noqa: E402
from hf_models import HF5  # noqa: E402
from helpers import ci_sample  # noqa: E402

pytestmark = pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")

VOCAB = 128
SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128)
# init_std 0.2 (not 0.02): a random BART of 0.02 repeats its start token; these weights make the
# rows' tokens differ from step to step, so that a wrong cross-attention changes them.
CONFIGS = {
    "bart": lambda t: t.BartConfig(vocab_size=VOCAB, max_position_embeddings=64, init_std=0.2, **SIZES),
    "marian": lambda t: t.MarianConfig(vocab_size=VOCAB, max_position_embeddings=64, init_std=0.2, pad_token_id=0,
                                       decoder_start_token_id=0, eos_token_id=1, **SIZES),
    # One layer each: T5's position bias makes its export the slowest of the four.
    "t5": lambda t: t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                               decoder_start_token_id=0),
    "whisper": lambda t: t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16,
                                         max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                         eos_token_id=2, bos_token_id=1, **SIZES),
}


def tiny(name):
    torch.manual_seed(0)
    config = CONFIGS[name](transformers)
    if name == "whisper":
        return transformers.WhisperForConditionalGeneration(config).eval()
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


def source(model):
    if model.config.model_type == "whisper":
        return {"input_features": example_features(model.config, 2)}
    ids = torch.randint(3, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left-padded
    return {"input_ids": ids, "attention_mask": mask}


def fused(path):
    proto = onnx.load(str(path), load_external_data=False)
    return proto, [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                   for n in proto.graph.node if n.op_type == "FusedAttention"]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    model = tiny("bart")
    path = tmp_path_factory.mktemp("bart") / "bart.onnx"
    result = export_onnx(model, source(model), path, with_past=True)
    return model, path, result


def test_the_wrapper_matches_the_model_step_by_step():
    """Seq2SeqDecoderWithPast: the first step from an empty past and a later one from the
    presents equal the model's own forward with its EncoderDecoderCache."""
    model = tiny("bart")
    wrapped = Seq2SeqDecoderWithPast.wrap(model)
    inputs = wrapped.example_inputs(source(model), past_length=0)
    with torch.no_grad():
        first = wrapped(**inputs)
        later = wrapped(**{**inputs, "input_ids": inputs["input_ids"][:, :1],
                           **{wrapped.contract.present_to_past()[n]: t for n, t in first.items()
                              if n in wrapped.contract.present_to_past()}})
        encoder_outputs = (inputs["encoder_hidden_states"],)
        ids = torch.cat([inputs["input_ids"], inputs["input_ids"][:, :1]], dim=1)
        expected = model(decoder_input_ids=ids, encoder_outputs=encoder_outputs,
                         attention_mask=inputs["encoder_attention_mask"]).logits
    torch.testing.assert_close(later["logits"][:, -1], expected[:, -1], rtol=1e-5, atol=1e-5)
    assert first["present.1.encoder.key"].shape[2] == inputs["encoder_hidden_states"].shape[1]


@pytest.mark.slow
def test_bart_exports_a_pair_with_every_attention_fused_and_generates_the_models_tokens(bart):
    model, path, result = bart
    assert result.paths == [encoder_path(path), path] and encoder_path(path).name == "bart_encoder.onnx"
    assert result.to_dict()["encoder"]["input_names"] == ["input_ids", "attention_mask"]
    proto, attrs = fused(path)
    assert len(attrs) == 4  # two layers' self- and cross-attention
    assert sorted(a["is_causal"] for a in attrs) == [0, 0, 1, 1] and not any(a["has_attn_mask"] for a in attrs)
    # The self-attention's Concat(past, new) stays outside its node: the cache form is all of a
    # model's nodes or none, and the cross-attention reads no past (docs/huggingface.md).
    assert not any(a["has_past"] for a in attrs)
    assert len(fused(encoder_path(path))[1]) == 2
    contract = json.loads(read_metadata(proto)["with_past"])
    assert contract["layout"] == "encoder-decoder" and contract["num_kv_heads"] == 4
    gate = check_generation(model, path, new_tokens=8)
    assert gate.passed, gate.failures
    assert gate.runs[0].tokens == gate.reference_tokens
    assert any(len(set(row)) > 1 for row in gate.reference_tokens)  # the tokens change from step to step


@pytest.mark.slow
def test_the_gate_fails_a_decoder_whose_cross_attention_reads_another_layers_keys(bart, tmp_path):
    model, path, _ = bart
    proto = onnx.load(str(path))
    cross = [n for n in proto.graph.node if n.op_type == "FusedAttention"
             and not {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["is_causal"]]
    cross[1].input[1] = cross[0].input[1]  # layer 1 attends with layer 0's cross-attention keys
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, str(broken))
    shutil.copy(encoder_path(path), encoder_path(broken))
    gate = check_generation(model, broken, new_tokens=8)
    assert not gate.passed
    assert any("logits" in failure for failure in gate.failures), gate.failures


@pytest.mark.slow
def test_the_gate_names_a_missing_encoder_file(bart, tmp_path):
    model, path, _ = bart
    shutil.copy(path, tmp_path / "alone.onnx")
    with pytest.raises(InputError, match="alone_encoder.onnx is missing"):
        check_generation(model, tmp_path / "alone.onnx", new_tokens=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ci_sample(["t5", "marian"]))  # Whisper, BART: through the CLI below
def test_the_family_exports_a_pair_and_generates_the_models_tokens(name, tmp_path):
    model = tiny(name)
    path = tmp_path / f"{name}.onnx"
    export_onnx(model, source(model), path, with_past=True)
    _, attrs = fused(path)
    layers = getattr(model.config, "decoder_layers", None) or model.config.num_decoder_layers
    assert len(attrs) == 2 * layers  # self- and cross-attention
    if name == "t5":  # the relative position bias reaches every node as a materialized mask
        assert all(a["has_attn_mask"] == 1 for a in attrs)
    gate = check_generation(model, path, new_tokens=6)
    assert gate.passed, gate.failures
    assert gate.runs[0].tokens == gate.reference_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name, cls", [("bart", "AutoModelForSeq2SeqLM"), ("whisper", "WhisperForConditionalGeneration")])
def test_the_cli_exports_an_encoder_decoder_from_a_config_folder_and_the_gate_passes(name, cls, tmp_path):
    from helpers import invoke

    CONFIGS[name](transformers).save_pretrained(tmp_path / name)
    out = tmp_path / "m.onnx"
    proc = invoke("--model", f"transformers:{cls}", "--config", tmp_path / name, "--with-past", "-o", out,
                  "--json", tmp_path / "report.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "m_encoder.onnx" in proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["generation"]["passed"] and encoder_path(out).is_file()
    assert len(fused(out)[1]) == 4 and len(fused(encoder_path(out))[1]) == 2  # every attention fused


def test_a_genai_config_or_an_engine_of_the_pair_is_refused_before_the_export(tmp_path):
    from attn_export.conversion import convert
    from attn_export.options import ConvertOptions

    model = tiny("bart")
    with pytest.raises(InputError, match="a TensorRT engine or a GenAI config of the pair is not built"):
        convert(model, source(model), ConvertOptions(str(tmp_path / "m.onnx"), with_past=True, genai_config=True))
    assert not list(tmp_path.iterdir())


def test_what_is_not_an_encoder_decoder_is_refused_by_its_wrapper():
    with pytest.raises(InputError, match="is not a transformers encoder-decoder"):
        Seq2SeqDecoderWithPast.wrap(torch.nn.Linear(2, 2))
