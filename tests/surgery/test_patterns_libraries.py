"""Hand-written attention of real model libraries, built small with random weights, fused by the
rewrite of the exported graph (attn_export.surgery.patterns) with the eager model's answer."""

import pytest
import torch

import attn_export
from attn_export.onnx import export_onnx
from attn_export.surgery.patterns import rewrite

import _timm
from helpers import assert_parity


def _fused(model, args, length, **kwargs):
    """Exports ``model``, rewrites it, checks it against the eager model; returns the sites."""
    model.eval()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    exported = torch.export.export(model, args, kwargs, strict=False)
    sites = rewrite(exported)
    with torch.no_grad():
        got = exported.module()(*args, **kwargs)
    got, expected = (got[0], expected[0]) if isinstance(expected, (tuple, list)) else (got, expected)
    assert_parity(got, expected, 2e-6, type(model).__name__, n=length)
    nodes = [n for n in exported.graph.nodes if n.target == torch.ops.attn_export.attention.default]
    assert len(nodes) == sum(s.rewritten for s in sites)
    return sites


def test_x_transformers_vit_wrapper():
    """Attend's default: einsum scores, sim.clone() kept for intermediates, softmax(dtype=float32),
    .type(dtype), einsum with the values."""
    xt = pytest.importorskip("x_transformers", reason="pip install x-transformers")
    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                    attn_layers=xt.Encoder(dim=32, depth=2, heads=4))
    sites = _fused(model, (torch.randn(2, 3, 32, 32),), 17)
    assert [s.rewritten for s in sites] == [True, True], [s.reason for s in sites]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_x_transformers_grouped_and_multi_query_heads(kv_heads):
    """attn_kv_heads=2: keys and values repeated by einops' repeat; 1: einsum('b h i d, b j d -> b h i j')
    broadcasting one key head."""
    xt = pytest.importorskip("x_transformers", reason="pip install x-transformers")
    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                    attn_layers=xt.Encoder(dim=32, depth=1, heads=4, attn_kv_heads=kv_heads))
    (site,) = _fused(model, (torch.randn(2, 3, 32, 32),), 17)
    assert site.rewritten, site.reason


@pytest.mark.slow  # the ONNX export too; the rewrite: test_x_transformers_vit_wrapper
def test_x_transformers_vit_exports_with_a_dynamic_batch(tmp_path):
    """The einsum operands' permutes and the output's, with the batch symbolic, in ONNX Runtime."""
    xt = pytest.importorskip("x_transformers", reason="pip install x-transformers")
    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                    attn_layers=xt.Encoder(dim=32, depth=2, heads=4)).eval()
    inputs, axes = {"img": torch.randn(2, 3, 32, 32)}, {"img": {0: "batch"}}
    result = export_onnx(model, inputs, tmp_path / "vit.onnx", dynamic_axes=axes)
    assert result.num_attention_nodes == 2
    check = attn_export.validate(model, result.path, inputs, dynamic_axes=axes)
    assert check.passed, check.failures


def test_x_transformers_masked_decoder():
    """A causal decoder with a key-padding mask: two masked_fill with -finfo.max."""
    xt = pytest.importorskip("x_transformers", reason="pip install x-transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=xt.Decoder(dim=32, depth=2, heads=4))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    sites = _fused(model, (torch.randint(0, 50, (2, 12)),), 12, mask=mask)
    assert [s.rewritten for s in sites] == [True, True], [s.reason for s in sites]


def test_x_transformers_talking_heads_stay_unfused():
    xt = pytest.importorskip("x_transformers", reason="pip install x-transformers")
    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10, attn_layers=xt.Encoder(
        dim=32, depth=1, heads=4, attn_pre_talking_heads=True, attn_post_talking_heads=True))
    (site,) = _fused(model, (torch.randn(2, 3, 32, 32),), 17)
    assert not site.rewritten and "talking-heads attention" in site.reason, site.reason


def _whisper(monkeypatch):
    pytest.importorskip("tiktoken", reason="openai-whisper imports tiktoken: pip install tiktoken")
    model_module = pytest.importorskip("whisper.model", reason="pip install --no-deps openai-whisper")
    monkeypatch.setattr(model_module.MultiHeadAttention, "use_sdpa", False)
    dims = model_module.ModelDimensions(n_mels=16, n_audio_ctx=12, n_audio_state=32, n_audio_head=4,
                                        n_audio_layer=2, n_vocab=60, n_text_ctx=10, n_text_state=32,
                                        n_text_head=4, n_text_layer=2)
    torch.manual_seed(0)
    model = model_module.Whisper(dims).eval()
    # whisper leaves the decoder's positional embedding uninitialized (torch.empty: NaN at times)
    torch.nn.init.normal_(model.decoder.positional_embedding, std=0.02)
    return model, {"mel": torch.randn(2, 16, 24), "tokens": torch.randint(0, 60, (2, 7))}


def test_whisper_without_sdpa(monkeypatch):
    """q * scale and k * scale, qk.float(), softmax(...).to(q.dtype), qk also returned (unread)."""
    model, inputs = _whisper(monkeypatch)
    sites = _fused(model, tuple(inputs.values()), 12)
    assert len(sites) == 6 and all(s.rewritten for s in sites), [s.reason for s in sites]


@pytest.mark.slow  # the ONNX export too; the rewrite: test_whisper_without_sdpa
def test_whisper_without_sdpa_exports_six_nodes(monkeypatch, tmp_path):
    model, inputs = _whisper(monkeypatch)
    result = export_onnx(model, inputs, tmp_path / "whisper.onnx", dynamic_axes={})
    assert result.num_attention_nodes == 6
    assert {(layer.found, layer.status) for layer in result.replacement.layers} == {("pattern", "rewritten in the export")}
    check = attn_export.validate(model, result.path, inputs, dynamic_axes={})
    assert check.passed, check.failures


def _sam_encoder():
    with _timm.torchvision_placeholders():  # imported at import time; its models use none
        pytest.importorskip("segment_anything", reason="pip install segment-anything")
        from segment_anything.modeling import ImageEncoderViT

    torch.manual_seed(0)
    return ImageEncoderViT(img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=4, out_chans=16,
                           use_rel_pos=True, window_size=4, global_attn_indexes=(1,))


def test_segment_anything_image_encoder():
    """3-D [B*H, L, D] q/k/v and the decomposed relative position added through
    attn.view(B, q_h, q_w, k_h, k_w) + rel_h + rel_w, then .view(B, q_h*q_w, k_h*k_w); one windowed
    block, one global."""
    encoder = _sam_encoder()
    with torch.no_grad():  # rel_pos_h/w are zeros at init: give the bias a value
        for block in encoder.blocks:
            block.attn.rel_pos_h.normal_()
            block.attn.rel_pos_w.normal_()
    sites = _fused(encoder, (torch.randn(1, 3, 64, 64),), 64)
    assert [s.rewritten for s in sites] == [True, True], [s.reason for s in sites]


@pytest.mark.slow  # the ONNX export too; the rewrite: test_segment_anything_image_encoder
def test_segment_anything_exports_one_node_per_block(tmp_path):
    encoder = _sam_encoder().eval()
    x = {"x": torch.randn(1, 3, 64, 64)}
    result = export_onnx(encoder, x, tmp_path / "sam.onnx", dynamic_axes={})
    assert result.num_attention_nodes == 2
    assert [(layer.found, layer.status) for layer in result.replacement.layers if layer.found == "pattern"] == \
        [("pattern", "rewritten in the export")] * 2
    check = attn_export.validate(encoder, result.path, x, dynamic_axes={})
    assert check.passed, check.failures


def test_vit_pytorch():
    with _timm.torchvision_placeholders():  # vit_pytorch imports it at import time; ViT uses none of it
        vit = pytest.importorskip("vit_pytorch", reason="pip install --no-deps vit-pytorch einops")
    torch.manual_seed(0)
    model = vit.ViT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=4, mlp_dim=64)
    sites = _fused(model, (torch.randn(2, 3, 32, 32),), 17)
    assert [s.rewritten for s in sites] == [True, True], [s.reason for s in sites]


def test_timm_swin_by_hand():
    """timm's WindowAttention with fused_attn=False: q * scale, q @ k^T, + relative position
    bias, the shift mask added through a [B/W, W, H, N, N] view."""
    timm = _timm.import_timm()
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=32,
                              depths=(2, 2), num_heads=(2, 4), window_size=7, num_classes=10)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
    sites = _fused(model, (torch.randn(1, 3, 56, 56),), 49)
    assert len(sites) == 4 and all(s.rewritten for s in sites), [s.reason for s in sites]


@pytest.mark.parametrize("masked", [False, True])
def test_diffusers_attention_with_the_classic_processor(masked):
    """AttnProcessor (not the SDPA one): get_attention_scores' baddbmm, beta=0 over an empty
    tensor without a mask, beta=1 over the additive mask with one; 3-D [B*H, L, D] operands."""
    processors = pytest.importorskip("diffusers.models.attention_processor", reason="pip install diffusers")

    class CrossAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = processors.Attention(query_dim=32, heads=4, dim_head=8, processor=processors.AttnProcessor())

        def forward(self, x, context, mask):
            return self.attn(x, encoder_hidden_states=context, attention_mask=mask)

    torch.manual_seed(0)
    x, context = torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    mask = None
    if masked:
        keep = torch.ones(2, 5)
        keep[1, 3:] = 0
        mask = ((1 - keep) * -10000.0)[:, None, :]
    (site,) = _fused(CrossAttention(), (x, context if masked else x, mask), 6)
    assert site.rewritten and site.path == "attn", site.reason
