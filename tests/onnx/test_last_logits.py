"""--last-logits (attn_export/onnx/last_logits.py): a cached decoder's language-model head runs on
the last position only. The file's logits are [batch, 1, vocab] and equal the last position of
the same export without the option, in ONNX Runtime at a prompt and at a decode step; the
generation gate passes (in every flavor, through a final soft-cap, quantized); the contract in
the file says so; the option without a cache is a usage error."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attn_export.cache_contract import CacheContract
from attn_export.errors import InputError
from attn_export.onnx import export_onnx, read_metadata
from attn_export.options import ExportOptions

transformers = pytest.importorskip("transformers")

from attn_export.validation.generation import check_generation  # noqa: E402
from helpers import ci_sample  # noqa: E402
from hf_models import HF5, padded_batch, tiny_llama  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")]


def _export(model, path, **options):
    return export_onnx(model, padded_batch((5, 3), 5, left=True), path, with_past=True, **options)


def _feeds(contract: CacheContract, ids, mask, past_length=0):
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if contract.position_ids:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        feeds["position_ids"] = positions.numpy()
    shape = (ids.shape[0], contract.num_kv_heads, past_length, contract.head_dim)
    feeds.update({name: np.random.default_rng(1).standard_normal(shape).astype(np.float32)
                  for name in contract.past_names()})
    return feeds


@pytest.mark.parametrize("attention", ci_sample(["ort", "custom"]))  # CI: the ort flavor (GenAI's)
def test_the_logits_are_the_last_position_of_the_full_export(tmp_path, attention):
    model = tiny_llama()
    full = _export(model, tmp_path / "full.onnx", attention=attention)
    last = _export(model, tmp_path / "last.onnx", attention=attention, last_logits=True)
    proto = onnx.load(str(last.path))
    logits = next(o for o in proto.graph.output if o.name == "logits")
    assert [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim][1] == 1
    contract = CacheContract.from_metadata(proto)
    assert contract.last_logits and json.loads(read_metadata(proto)["with_past"])["last_logits"] is True
    assert not CacheContract.from_metadata(onnx.load(str(full.path), load_external_data=False)).last_logits
    assert "last_logits" in [p.name for p in last.passes]
    if attention == "ort":  # both files on the compacted cache, no If: the pick reads each row's count
        assert all("ort_compact_rows" in [p.name for p in r.passes if p.changed] for r in (full, last))
        assert not [n for n in proto.graph.node if n.op_type == "If"]
        pick = next(n for n in proto.graph.node if n.name.endswith("/rows_last"))
        assert pick.input[1] == "ort_compact/back/last_index"
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (full.path, last.path)]
    ids = torch.randint(1, 97, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, :3] = 0  # left padding
    # A prompt, a decode step, a prompt after a past (not in ONNX Runtime's GroupQueryAttention at
    # batch 2: "batch_size must be 1 when sequence_length > 1 and past context is given").
    for past, new in ((0, 7), (4, 1)) + (((4, 3),) if attention == "custom" else ()):
        step_mask = torch.ones(2, past + new, dtype=torch.int64)
        step_mask[1, :2] = 0
        feeds = _feeds(contract, ids[:, :new], step_mask, past)
        want, got = (s.run(["logits"], feeds)[0] for s in sessions)
        assert got.shape == (2, 1, want.shape[-1]) and want.shape[1] == new
        scale = float(np.abs(want[:, -1]).max())
        assert float(np.abs(got[:, 0] - want[:, -1]).max()) <= 1e-5 * scale, (past, new)
    # A right-padded prompt (how ONNX Runtime GenAI pads a batch): each row's last kept position.
    right = torch.ones(2, 7, dtype=torch.int64)
    right[0, 4:] = 0
    want, got = (s.run(["logits"], _feeds(contract, ids, right))[0] for s in sessions)
    for row, kept in enumerate((3, 6)):
        assert float(np.abs(got[row, 0] - want[row, kept]).max()) <= 1e-5 * float(np.abs(want[row, kept]).max())
    if attention == "ort":
        _genai_generates_a_right_padded_batch_like_transformers(model, last.path)


def _genai_generates_a_right_padded_batch_like_transformers(model, path):
    """ONNX Runtime GenAI pads a batch on the right: with the last position's logits only, each
    row's logits must come from its own last prompt token, not from the pad tokens after it."""
    pytest.importorskip("onnxruntime_genai")
    from attn_export.genai_config import write_genai_config
    from attn_export.validation.generation import left_padded, random_prompts, reference_generation
    from hf_models import genai_greedy_tokens

    write_genai_config(path, model.config)
    prompts = random_prompts(model.config.vocab_size, (5, 9, 12), seed=0, avoid=[0])
    ids, mask = left_padded(prompts, 0)
    expected = reference_generation(model, ids, mask, 8, 0, takes_positions=True)[0].tolist()
    assert len({tuple(t) for t in expected}) == len(prompts)  # rows that differ: a comparison that can fail
    assert genai_greedy_tokens(path.parent, prompts, 0, 8) == expected


@pytest.mark.parametrize("attention", ci_sample(["ort", "custom"]))  # CI: the ort flavor's FusedMatMul head
def test_the_gate_passes_with_a_final_soft_cap(tmp_path, attention):
    """Gemma 2: the head's output goes through Div, Tanh, Mul before it is the logits, and the head
    is tied to the embedding (in the ort flavor a FusedMatMul with transB after ONNX Runtime's
    fusions)."""
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, final_logit_softcapping=5.0, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    result = _export(model, tmp_path / "gemma2.onnx", last_logits=True, attention=attention)
    outcome = check_generation(model, result.path, new_tokens=6)
    assert outcome.passed, outcome.failures
    assert outcome.runs[0].prefill.shape == [3, 1, 97]


def test_quantized_and_through_the_cli(tmp_path):
    """--genai-config without --last-logits: the last position's logits, its default."""
    from helpers import invoke

    tiny_llama().save_pretrained(tmp_path / "llama")
    proc = invoke(tmp_path / "llama", "--to", "onnx", "--with-past", "--onnx-attention", "ort", "--quantize", "int4",
                  "--genai-config", "-o", tmp_path / "m.onnx", "--json", tmp_path / "report.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["generation"]["passed"]
    backends = [run["backend"] for run in report["generation"]["runs"]]
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return
    assert any("genai" in b.lower() for b in backends), backends  # GenAI's generator read the [batch, 1, vocab] logits
    assert CacheContract.from_metadata(onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)).last_logits


def test_the_default_follows_the_consumer():
    """None (the default): the last position's with genai_config where the head is found (GenAI's
    generator reads no other; tests/onnx/test_last_logits_head.py), every position's without; an
    explicit choice stands either way."""
    from attn_export.options import LAST_LOGITS_IF_FOUND, ConvertOptions

    assert ConvertOptions("m.onnx", with_past=True, genai_config=True).export.last_logits == LAST_LOGITS_IF_FOUND
    assert ConvertOptions("m.onnx", with_past=True).export.last_logits is False
    assert ConvertOptions("m.onnx", with_past=True, genai_config=True, last_logits=False).export.last_logits is False
    assert ConvertOptions("m.onnx", with_past=True, last_logits=True).export.last_logits is True
    assert ExportOptions().last_logits is None
    with pytest.raises(InputError, match="last_logits must be true, false or None"):
        ExportOptions(with_past=True, last_logits="yes")


def test_without_the_cache_it_is_a_usage_error():
    with pytest.raises(InputError, match="--last-logits .*add --with-past"):
        ExportOptions(last_logits=True)
    with pytest.raises(ValueError, match="last_logits belongs to the decoder-only layout"):
        CacheContract(1, 1, 1, False, layout="encoder-decoder", last_logits=True)
