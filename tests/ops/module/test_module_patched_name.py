"""The drop-in adopted the way code bases adopt one: ``torch.nn.MultiheadAttention`` replaced by
``FusedMultiheadAttention`` (here also in ``torch.nn.modules.activation`` and in
``torch.nn.modules.transformer``, whose layers build their attention under that name). With the
name patched, the package must still reach the real stock class where it needs it (the failure
path asks stock for its error; ``to_module`` builds one; surgery tells stock from fused): the
invalid inputs of test_module_errors.py give stock's exception, type and message; PyTorch's
transformer layers built after the patch hold fused layers and match unpatched ones (the
encoder's nested-tensor path included); the conversions, state_dicts, replace_attention, the
attention-map capture and load_model work as without the patch."""
import contextlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention, replace_attention
from helpers import assert_rel_close
from test_module_errors import CASES, CONFIGS, E, H, _outcome

# The real class, taken before any test patches the name.
STOCK = nn.MultiheadAttention
# Where a code base adopting the drop-in rebinds the name.
_OWNERS = (torch.nn, torch.nn.modules.activation, torch.nn.modules.transformer)


@contextlib.contextmanager
def stock_name_patched():
    """``MultiheadAttention`` is the fused class under every name torch.nn has for it; restored after."""
    assert all(owner.MultiheadAttention is STOCK for owner in _OWNERS), "the stock name was left patched"
    with pytest.MonkeyPatch.context() as patch:
        for owner in _OWNERS:
            patch.setattr(owner, "MultiheadAttention", FusedMultiheadAttention)
        yield
    assert all(owner.MultiheadAttention is STOCK for owner in _OWNERS)


@contextlib.contextmanager
def no_fused_layer_built():
    """Fails the first construction of a fused layer inside the block, as a RecursionError.
    Asking "stock" for its error must not build another fused layer: when it did, each level
    asked twice, and the recursion took hours to reach Python's limit rather than failing."""
    def refuse(*args, **kwargs):
        raise RecursionError("a FusedMultiheadAttention was built while the layer looked for stock's error")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedMultiheadAttention, "__init__", refuse)
        yield


@pytest.mark.parametrize("mode", ["train", "eval+no_grad"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_invalid_inputs_give_stocks_exception_with_the_name_patched(config, mode):
    """Stock's answer comes from the real class; the layer under test is built by the patched name."""
    ref = STOCK(E, H, batch_first=True, **CONFIGS[config]).train(mode == "train")
    with stock_name_patched():
        layer = nn.MultiheadAttention(E, H, batch_first=True, **CONFIGS[config]).train(mode == "train")
        assert type(layer) is FusedMultiheadAttention
        layer.load_state_dict(ref.state_dict())
        compared = 0
        for name, make in CASES.items():
            query, key, value, kwargs = make(True)
            if config == "kvdim" and key.size(-1) == E:  # the kdim/vdim configuration's own widths
                key, value = key[..., :6], value[..., :6]
            with torch.no_grad() if mode != "train" else contextlib.nullcontext(), no_fused_layer_built():
                stock = _outcome(ref, query, key, value, kwargs)
                ours = _outcome(layer, query, key, value, kwargs)
            if stock is not None:
                assert ours == stock, name
                compared += 1
    assert compared >= len(CASES) - 2  # at most the cases this configuration accepts are left out


def _inputs(batch=3, seqlen=6, embed=16):
    torch.manual_seed(1)
    src, tgt = torch.randn(batch, seqlen, embed), torch.randn(batch, seqlen - 1, embed)
    padding = torch.zeros(batch, seqlen, dtype=torch.bool)
    padding[1, -2:] = True
    return src, tgt, padding


@pytest.mark.parametrize("mode", ["train", "eval+no_grad"])
def test_transformer_layers_built_after_the_patch_match_unpatched_ones(mode):
    torch.manual_seed(0)
    encoder_ref = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    decoder_ref = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    with stock_name_patched():
        encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        decoder = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    assert type(encoder.self_attn) is FusedMultiheadAttention
    assert type(decoder.multihead_attn) is FusedMultiheadAttention
    encoder.load_state_dict(encoder_ref.state_dict())
    decoder.load_state_dict(decoder_ref.state_dict())
    src, tgt, padding = _inputs()
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
    for model in (encoder_ref, decoder_ref, encoder, decoder):
        model.train(mode == "train")
    with torch.no_grad() if mode != "train" else contextlib.nullcontext(), stock_name_patched():
        assert_rel_close(encoder(src, src_key_padding_mask=padding), encoder_ref(src, src_key_padding_mask=padding),
                         5e-6, "encoder layer")
        memory = encoder_ref(src)
        assert_rel_close(decoder(tgt, memory, tgt_mask=causal, memory_key_padding_mask=padding),
                         decoder_ref(tgt, memory, tgt_mask=causal, memory_key_padding_mask=padding),
                         5e-6, "decoder layer")


def test_conversions_and_state_dicts_with_the_name_patched():
    torch.manual_seed(0)
    stock = STOCK(16, 2, kdim=8, vdim=8, batch_first=True)
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    expected, _ = stock(q, kv, kv)
    with stock_name_patched():
        fused = FusedMultiheadAttention.from_module(stock)
        back = fused.to_module()
        assert type(back) is STOCK  # the real class, not the patched name's
        assert back.k_proj_weight is stock.k_proj_weight
        built = nn.MultiheadAttention(16, 2, kdim=8, vdim=8, batch_first=True)
        built.load_state_dict(stock.state_dict())
        fresh_stock = STOCK(16, 2, kdim=8, vdim=8, batch_first=True)
        fresh_stock.load_state_dict(built.state_dict())
        for layer in (fused, back, built, fresh_stock):
            assert_rel_close(layer(q, kv, kv)[0], expected, 5e-6, type(layer).__name__)


def test_replace_attention_with_the_name_patched():
    """Layers built by the patched name are already fused; a real stock layer made before the
    patch is still found and replaced; the model's outputs stay the unpatched ones."""
    torch.manual_seed(0)
    reference = nn.ModuleDict({
        "encoder": nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        "attention": STOCK(16, 2, batch_first=True),
    }).eval()
    with stock_name_patched():
        model = nn.ModuleDict({
            "encoder": nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            "attention": STOCK(16, 2, batch_first=True),
        }).eval()
        model.load_state_dict(reference.state_dict())
        report = replace_attention(model)
    assert [(layer.path, layer.status) for layer in report.layers] == [
        ("encoder.self_attn", "already fused"), ("attention", "replaced")]
    assert type(model["attention"]) is FusedMultiheadAttention
    src, _, _ = _inputs()

    def run(m):
        x = m["encoder"](src)
        return m["attention"](x, x, x)[0]

    with torch.no_grad():
        assert_rel_close(run(model), run(reference), 5e-6, "model")


def test_attention_maps_capture_stock_and_fused_layers_with_the_name_patched():
    """The weights of a real stock layer are captured beside those of a fused one."""
    from attn_export.maps.capture import AttentionCapture

    torch.manual_seed(0)
    stock = STOCK(16, 2, batch_first=True).eval()
    with stock_name_patched():
        model = nn.ModuleDict({"stock": stock, "fused": nn.MultiheadAttention(16, 2, batch_first=True)}).eval()
        src, _, _ = _inputs()
        with torch.no_grad(), AttentionCapture(model) as capture:
            for layer in model.values():
                layer(src, src, src)
    expected = stock(src, src, src, average_attn_weights=False)[1][0]
    assert sorted(capture.weights) == ["fused", "stock"]
    assert_rel_close(capture.weights["stock"], expected, 5e-6, "stock layer's weights")


def test_transformer_encoder_built_after_the_patch_takes_its_nested_fast_path():
    """In eval without grad, with a padding mask, nn.TransformerEncoder turns its input into
    nested tensors when its layers look fusable to it, as fused ones do; they still run."""
    torch.manual_seed(0)
    reference = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()
    with stock_name_patched():
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()
    assert encoder.use_nested_tensor and type(encoder.layers[0].self_attn) is FusedMultiheadAttention
    encoder.load_state_dict(reference.state_dict())
    src, _, padding = _inputs()
    with torch.no_grad():
        assert_rel_close(encoder(src, src_key_padding_mask=padding), reference(src, src_key_padding_mask=padding),
                         5e-6, "encoder")


def test_load_model_imported_after_the_patch_loads_a_stock_model(tmp_path):
    """The loader's allowlist is built when attn_export.loading is first imported, which may be
    after the patch: it still admits the real stock class, and the model loads as saved."""
    torch.save(nn.Sequential(STOCK(8, 2)), tmp_path / "model.pt")
    script = f"""
import torch
import attn_export
stock = torch.nn.MultiheadAttention
for owner in (torch.nn, torch.nn.modules.activation, torch.nn.modules.transformer):
    owner.MultiheadAttention = attn_export.FusedMultiheadAttention
from attn_export.loading import load_model
print(type(load_model({str(tmp_path / "model.pt")!r})[0]) is stock)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"], run.stdout
