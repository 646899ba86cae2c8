"""Models whose attention calls F.scaled_dot_product_attention, exported to ONNX: one
FusedAttention node per SDPA site, dynamic batch/sequence, parity in ONNX Runtime against the
untouched model (attn_export.validate), and the command line on a --model factory. timm's
VisionTransformer is a real model class (skipped when timm is not installed)."""
import copy
import json
from pathlib import Path

import onnx
import pytest
import torch

import attn_export
from attn_export import spec
from attn_export.surgery import sdpa
from attn_export.onnx import export_onnx
from attn_export.surgery.replace import ROUTED, inspect_attention, replace_attention

import sdpa_models as M
from helpers import assert_parity, run

pytestmark = pytest.mark.slow  # make test-fast leaves it out

S = spec.load()
TESTS = Path(__file__).resolve().parents[1]  # where sdpa_models.py is


def fused_nodes(path):
    model = onnx.load(str(path))
    return [n for n in model.graph.node if n.op_type == S.op_type and n.domain.startswith(S.domain)]


def sdpa_nodes_left(path):
    model = onnx.load(str(path))
    return [n.op_type for n in model.graph.node if n.op_type in ("Softmax", "Attention")]


def export_and_validate(model, tmp_path, sites: int):
    inputs = model.example_inputs
    result = export_onnx(model, inputs, tmp_path / "m.onnx")
    assert result.num_attention_nodes == sites and len(fused_nodes(result.path)) == sites
    assert sdpa_nodes_left(result.path) == []  # no stock attention left in the graph
    assert all(layer.status == ROUTED for layer in result.replacement.layers)
    assert not any(sdpa.is_routed(m) for m in model.modules())  # the original is untouched
    check = attn_export.validate(model, result.path, inputs)
    assert check.passed, check.failures
    return result


def test_gqa_decoder_exports_one_node_per_layer(tmp_path):
    result = export_and_validate(M.gqa_decoder(), tmp_path, sites=2)
    assert set(result.dynamic_axes["input_ids"].values()) == {"batch", result.dynamic_axes["input_ids"][1]}


def test_whisper_like_encoder_decoder_exports_self_causal_and_cross_attention(tmp_path):
    result = export_and_validate(M.whisper_like(), tmp_path, sites=6)
    causal = [n for n in fused_nodes(result.path)
              if any(a.name == "is_causal" and a.i == 1 for a in n.attribute)]
    assert len(causal) == 2  # the decoder's self-attention


def test_timm_vision_transformer(tmp_path):
    model = M.timm_vit()
    plan = inspect_attention(model)
    assert [(layer.path, layer.found) for layer in plan.layers] == [
        ("blocks.0.attn", "sdpa"), ("blocks.1.attn", "sdpa")]
    assert plan.coverage_error(require_all=True) is None
    x = model.example_inputs["x"]
    fused = copy.deepcopy(model)
    replace_attention(fused)
    out = fused(x)
    with torch.no_grad():
        assert float((out - model(x)).abs().max() / model(x).abs().max()) <= 2e-6
    assert [sdpa.call_counter(m) for m in fused.modules() if sdpa.is_routed(m)] == [{"fused": 1}] * 2
    result = export_onnx(model, {"x": x}, tmp_path / "vit.onnx", dynamic_axes={"x": {0: "batch"}})
    assert result.num_attention_nodes == 2 and sdpa_nodes_left(result.path) == []
    check = attn_export.validate(model, result.path, {"x": x}, dynamic_axes={"x": {0: "batch"}})
    assert check.passed, check.failures


def test_timm_training_gradients():
    model = M.timm_vit().train()
    fused = copy.deepcopy(model)
    replace_attention(fused)
    x = model.example_inputs["x"]
    model(x).square().sum().backward()
    fused(x).square().sum().backward()
    got = dict(fused.named_parameters())
    want = [p.grad for p in model.parameters()]  # the configuration's scale: every parameter gradient
    for name, p in model.named_parameters():
        assert_parity(got[name].grad, p.grad, 1e-5, name, scale=want)


def test_cli_inspect_and_convert_a_factory_model(tmp_path):
    proc = run("inspect", "--model", "sdpa_models:whisper_like", "--require-all", "--min-replaced", "6",
               cwd=TESTS, expect=0)
    assert "sdpa" in proc.stdout and "decoder.1.cross_attn" in proc.stdout
    run("inspect", "--model", "sdpa_models:whisper_like", "--min-replaced", "7", cwd=TESTS, expect=1)
    out = tmp_path / "gqa.onnx"
    proc = run("--model", "sdpa_models:gqa_decoder", "--to", "onnx", "-o", out, "--require-all", cwd=TESTS, expect=0)
    text = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert "2 fused attention node(s)" in text and "PASSED" in proc.stdout
    assert len(fused_nodes(out)) == 2


def test_swin_style_window_attention_with_learned_bias_exports_fused(tmp_path):
    """The relative-position bias requires grad while torch.export traces; an exported graph has
    no backward, so the mask is detached and the call fused."""
    model = M.swin_sdpa()
    inputs = model.example_inputs
    axes = {"x": {0: "windows"}}
    result = export_onnx(model, inputs, tmp_path / "swin.onnx", dynamic_axes=axes)
    assert result.num_attention_nodes == 1 and sdpa_nodes_left(result.path) == []
    check = attn_export.validate(model, result.path, inputs, dynamic_axes=axes)
    assert check.passed, check.failures


def test_gqa_decoder_fp16_export(tmp_path):
    model = M.gqa_decoder()
    result = export_onnx(model, model.example_inputs, tmp_path / "m16.onnx", dtype="fp16")
    assert result.num_attention_nodes == 2 and sdpa_nodes_left(result.path) == []


def test_site_that_makes_no_sdpa_call_is_confirmed_and_its_by_hand_branch_rewritten(tmp_path):
    """timm's fused_attn=False runs its by-hand attention: the source names SDPA, the run does
    not call it (the site is not fused by the SDPA route), and the export rewrites the by-hand
    branch instead (found = pattern)."""
    model = M.timm_vit(fused_attn=False)
    assert all(layer.found == "sdpa" for layer in inspect_attention(model).layers)
    routed = copy.deepcopy(model)
    report = replace_attention(routed)
    with torch.no_grad():
        routed(model.example_inputs["x"])
    changed = report.confirm_calls(routed)
    assert len(changed) == 2 and all("no F.scaled_dot_product_attention call" in line for line in changed)
    assert report.coverage_error(require_all=True) is not None

    axes = {"x": {0: "batch"}}
    result = export_onnx(model, model.example_inputs, tmp_path / "vit.onnx", dynamic_axes=axes)
    assert result.num_attention_nodes == 2 and sdpa_nodes_left(result.path) == []
    assert [(layer.found, layer.status) for layer in result.replacement.layers] == \
        [("pattern", "rewritten in the export")] * 2
    check = attn_export.validate(model, result.path, model.example_inputs, dynamic_axes=axes)
    assert check.passed, check.failures


def test_cli_convert_gates_on_the_exports_report(tmp_path):
    """torchvision-style Swin: no attention form is known before export (the gate waits), both
    windows' attention are rewritten in the graph, --require-all passes; a hand-written attention
    that cannot be rewritten fails it with the reason."""
    out = tmp_path / "swin.onnx"
    proc = run("--model", "sdpa_models:swin_stage", "--to", "onnx", "-o", out, "--dynamic", "x:0=batch",
               "--require-all", cwd=TESTS, expect=0)
    text = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert "2 fused attention node(s)" in text and "2 rewritten in the export" in text and "PASSED" in text


def test_inspect_plans_what_the_export_does_and_require_all_counts_the_export(tmp_path):
    """A hand-written attention whose softmax is an nn.Softmax child (vit-pytorch) and one whose
    SDPA call goes through a processor object (diffusers): inspect's plan, from a sample forward
    and the captured graph, names the attention modules as the sites; the export fuses both and
    --require-all passes on it."""
    proc = run("inspect", "--model", "sdpa_models:two_kinds", "--json", tmp_path / "plan.json", "--require-all",
               cwd=TESTS, expect=0)
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = [(layer["path"], layer["found"], layer["status"], layer["num_heads"], layer["embed_dim"])
            for layer in plan["layers"]]
    assert rows == [("hand", "pattern", "rewritten in the export", 4, 32),  # heads from the graph
                    ("proc", "sdpa", "will be routed", 4, 32)], proc.stdout
    out = tmp_path / "two.onnx"
    run("--model", "sdpa_models:two_kinds", "--to", "onnx", "-o", out, "--require-all", "--json",
        tmp_path / "run.json", cwd=TESTS, expect=0)
    assert len(fused_nodes(out)) == 2
    ran = json.loads((tmp_path / "run.json").read_text())["export"]["replacement"]["layers"]
    assert [(layer["path"], layer["status"]) for layer in ran] == [("hand", "rewritten in the export"),
                                                                 ("proc", "routed")]
