"""attention heatmaps: the captured weights are the ones the models compute (checked against the
stock nn.MultiheadAttention's need_weights output), fused agrees with original per site and
head, masks show as zeros, and `attn-export heatmap` writes the picture it says it writes."""
import struct
import sys

import pytest
import torch

from attn_export import heatmaps
from helpers import invoke, one_line_error

pytest.importorskip("matplotlib", reason="the pictures need matplotlib (pip install 'attn-export[plot]')")

SEQ2SEQ_SITES = ["transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                 "transformer.decoder.layers.0.multihead_attn"]


def stock_weights(model, inputs, batch_index):
    """Per MHA layer: the stock module's own need_weights output (per head), called afresh with
    the arguments the model passed it."""
    calls = {}

    def keep(path):
        def hook(_module, args, kwargs):
            calls[path] = (args, kwargs)

        return hook

    handles = [m.register_forward_pre_hook(keep(p), with_kwargs=True)
               for p, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention)]
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # else the encoder layer bypasses self_attn
    try:
        with torch.no_grad():
            model(**inputs)
            modules = dict(model.named_modules())
            out = {}
            for path, (args, kwargs) in calls.items():
                kwargs = {**kwargs, "need_weights": True, "average_attn_weights": False}
                out[path] = modules[path](*args, **kwargs)[1][batch_index]
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
        for h in handles:
            h.remove()
    return out


@pytest.mark.parametrize("batch_index", [1])
def test_multihead_weights_are_the_stock_modules(small_seq2seq, batch_index):
    inputs = small_seq2seq.example_inputs
    maps = heatmaps(small_seq2seq, inputs, batch_index=batch_index)
    reference = stock_weights(small_seq2seq, inputs, batch_index)
    assert [s.path for s in maps.sites] == SEQ2SEQ_SITES
    for site in maps.sites:
        expected = reference[site.path].numpy()
        assert site.original.shape == expected.shape == (2,) + expected.shape[1:]
        assert abs(site.original - expected).max() < 1e-6, site.path
        assert abs(site.fused - expected).max() < 1e-5, site.path
    assert 0 < maps.max_abs_diff < 1e-5
    # batch element 1 pads its source after 11 tokens: the encoder and the cross-attention give
    # those keys nothing; the decoder's self-attention is causal.
    padded = inputs["src_key_padding_mask"][batch_index].numpy()
    assert padded.any()
    for site in (maps.sites[0], maps.sites[2]):
        assert (site.fused[..., padded] == 0).all() and (site.fused[..., ~padded] > 0).all()
    causal = maps.sites[1].fused
    upper = torch.ones(causal.shape[-2:], dtype=torch.bool).triu(1).numpy()
    assert (causal[:, upper] == 0).all() and (causal[:, ~upper] > 0).all()


def test_sdpa_sites_fused_against_original():
    """The SDPA route: weights from the SDPA calls of the original (SDPA's mask convention) and
    from the operator calls of the routed copy (the operator's) agree, masks included."""
    from sdpa_models import whisper_like

    model = whisper_like()
    maps = heatmaps(model, model.example_inputs, batch_index=1, max_layers=10)
    paths = [s.path for s in maps.sites]
    assert paths == ["encoder.0.attn", "encoder.1.attn", "decoder.0.attn", "decoder.0.cross_attn",
                     "decoder.1.attn", "decoder.1.cross_attn"], paths
    assert not maps.omitted
    assert maps.max_abs_diff < 1e-5
    for site in maps.sites:  # every query sees a key: rows are distributions on both sides
        assert abs(site.original.sum(-1) - 1).max() < 1e-5 and abs(site.fused.sum(-1) - 1).max() < 1e-5, site.path
    invalid = ~model.example_inputs["mel_mask"][1].numpy()  # keys 7.. of element 1 are padding
    assert (maps.sites[3].fused[..., invalid] == 0).all() and (maps.sites[3].fused[..., ~invalid] > 0).all()
    upper = torch.ones(6, 6, dtype=torch.bool).triu(1).numpy()
    assert (maps.sites[2].fused[:, upper] == 0).all()


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_cli_writes_the_picture_of_the_expected_size(tmp_path):
    out = tmp_path / "maps.png"
    proc = invoke("heatmap", "--model", "attn_export.examples:tiny_seq2seq", "--max-layers", "2", "--max-heads", "2",
                  "-o", out)
    assert proc.returncode == 0, proc.stderr
    # 2 sites (rows) x 2 heads x 3 panels, 1.6 in each at 100 dpi, plus 1.8 in x 1.2 in of margins.
    assert png_size(out) == (1140, 440)
    assert "2 attention site(s)" in proc.stdout
    assert "4 of 6 sites (max 2 layers)" in proc.stderr  # what was left out is said
    assert "heads 2-3 of each layer" in proc.stderr


def test_cli_one_layer_as_svg(tmp_path):
    out = tmp_path / "enc.svg"
    proc = invoke("heatmap", "--model", "attn_export.examples:tiny_seq2seq", "--layer",
                  "transformer.encoder.layers.1.self_attn", "--max-heads", "1", "--batch-index", "1", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()[:2000]
    assert "1 attention site(s)" in proc.stdout


def test_cli_errors(tmp_path, monkeypatch):
    model = ("--model", "attn_export.examples:tiny_seq2seq")
    one_line_error(invoke("heatmap", *model, "--layer", "nope", "-o", tmp_path / "x.png"),
                   "--layer nope", "transformer.encoder.layers.0.self_attn")
    one_line_error(invoke("heatmap", *model, "--batch-index", "5", "-o", tmp_path / "x.png"), "batch index 5")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    one_line_error(invoke("heatmap", *model, "-o", tmp_path / "x.png"), "pip install 'attn-export[plot]'")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_routed_transformers_layers_against_eager_attentions():
    """A BERT from a config: the weights captured from transformers' sdpa calls (original) and
    from the routed operator calls (fused) are the ones its eager attention returns
    (output_attentions)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'attn-export[hf]')")
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    inputs = {"input_ids": torch.randint(0, 50, (2, 9)), "attention_mask": mask}
    maps = heatmaps(model, inputs, batch_index=1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True).attentions
    assert [s.path for s in maps.sites] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    for site, expected in zip(maps.sites, eager):
        assert abs(site.original - expected[1].numpy()).max() < 1e-6
        assert abs(site.fused - expected[1].numpy()).max() < 1e-5
        assert (site.fused[..., 6:] == 0).all()
