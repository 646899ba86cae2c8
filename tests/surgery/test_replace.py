"""replace_attention: every nn.MultiheadAttention in the tree, the fused operator really runs
(train and eval, PyTorch's native fast paths included), outputs equal the original model's."""
import copy
import json

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import attn_export
from attn_export import FusedMultiheadAttention, replace_attention, inspect_attention, CoverageError
from helpers import assert_rel_close

try:  # the hf extra; imported here, once, rather than in each test (mutation runs fork per mutant)
    import transformers
except ImportError:
    transformers = None

FUSED_OP = torch.ops.attn_export.multi_head_attention.default
NATIVE_LAYER_OP = torch.ops.aten._transformer_encoder_layer_fwd.default


class CountOps(TorchDispatchMode):
    """Counts operator calls as they reach the dispatcher (below any Python module logic)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def run_counting(model, *args, **kwargs):
    with torch.no_grad(), CountOps() as counter:
        out = model(*args, **kwargs)
    return out, counter.counts


def encoder(layers=2, **kw):
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, **kw)
    return nn.TransformerEncoder(layer, layers)


class Custom(nn.MultiheadAttention):
    """A subclass that overrides forward: not swapped (its forward may do anything)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[-1, length // 2:] = True
    return mask


def test_stock_encoder_layer_in_eval_takes_the_native_fast_path():
    """The trap this module defeats: in eval, the stock layer never calls its self_attn."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    _, counts = run_counting(layer, torch.randn(2, 5, 16))
    assert counts.get(NATIVE_LAYER_OP, 0) == 1


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_encoder_runs_the_fused_op_in_train_and_eval(mode):
    torch.manual_seed(0)
    original = getattr(encoder(), mode)()
    model = copy.deepcopy(original)
    report = replace_attention(model)
    assert report.num_replaced == 2
    x = torch.randn(3, 7, 16)
    out, counts = run_counting(model, x)
    assert counts.get(FUSED_OP, 0) == 2
    assert counts.get(NATIVE_LAYER_OP, 0) == 0
    # The original in eval takes the native fast path: an independent implementation.
    expected, _ = run_counting(original, x)
    assert_rel_close(out, expected, 2e-6, f"{mode} output")


def test_encoder_with_padding_in_eval_matches_the_original():
    """In eval with a padding mask the stock encoder runs nested tensors (zeros at padded
    positions); the replaced model must agree at every real position, and everywhere with
    PyTorch's fast paths off."""
    torch.manual_seed(0)
    original = encoder().eval()
    model = copy.deepcopy(original)
    report = replace_attention(model)
    assert model.use_nested_tensor is False and original.use_nested_tensor is True
    assert any("use_nested_tensor" in note for note in report.notes)
    x, pad = torch.randn(3, 8, 16), padding(3, 8)
    out, counts = run_counting(model, x, src_key_padding_mask=pad)
    assert counts.get(FUSED_OP, 0) == 2
    expected, _ = run_counting(original, x, src_key_padding_mask=pad)
    keep = ~pad
    assert_rel_close(out[keep], expected[keep], 2e-6, "real positions")
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        expected_slow, _ = run_counting(original, x, src_key_padding_mask=pad)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert_rel_close(out, expected_slow, 2e-6, "all positions, fast path off")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_transformer_self_and_cross_attention_are_replaced(mode):
    torch.manual_seed(0)
    original = getattr(nn.Transformer(16, 2, 2, 2, 32, dropout=0.0, batch_first=True), mode)()
    model = copy.deepcopy(original)
    report = replace_attention(model)
    paths = [layer.path for layer in report.replaced]
    assert paths == [
        "encoder.layers.0.self_attn", "encoder.layers.1.self_attn",
        "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn",
        "decoder.layers.1.self_attn", "decoder.layers.1.multihead_attn",
    ]
    assert all(layer.num_heads == 2 and layer.embed_dim == 16 for layer in report.replaced)
    assert all(isinstance(m, FusedMultiheadAttention) for n, m in model.named_modules() if n in paths)
    src, tgt = torch.randn(2, 9, 16), torch.randn(2, 5, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    kwargs = dict(tgt_mask=causal, tgt_is_causal=True)
    out, counts = run_counting(model, src, tgt, **kwargs)
    assert counts.get(FUSED_OP, 0) == 6
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        expected, _ = run_counting(original, src, tgt, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert_rel_close(out, expected, 2e-6, "transformer")


def test_sequence_first_and_nested_custom_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4)  # sequence-first
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.ModuleDict({"cross": nn.MultiheadAttention(16, 2)}))

        def forward(self, x, memory):
            y, _ = self.attn(x, x, x)
            z, _ = self.inner[1]["cross"](y, memory, memory)
            return self.inner[0](z)

    torch.manual_seed(0)
    original = Block().eval()
    model = copy.deepcopy(original)
    report = replace_attention(model)
    assert [(layer.path, layer.num_heads) for layer in report.replaced] == [("attn", 4), ("inner.1.cross", 2)]
    x, memory = torch.randn(6, 2, 16), torch.randn(4, 2, 16)
    out, counts = run_counting(model, x, memory)
    assert counts.get(FUSED_OP, 0) == 2
    assert_rel_close(out, original(x, memory), 2e-6, "block")


def test_parameters_are_shared_not_copied():
    model = encoder(1)
    before = {id(p) for p in model.parameters()}
    replace_attention(model)
    assert {id(p) for p in model.parameters()} == before
    attn = model.layers[0].self_attn
    assert isinstance(attn, FusedMultiheadAttention)
    assert set(model.state_dict()) == set(encoder(1).state_dict())


def test_a_module_reached_by_two_paths_is_replaced_once_everywhere():
    shared = nn.MultiheadAttention(16, 2, batch_first=True)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    report = replace_attention(model)
    assert report.num_replaced == 1 and report.replaced[0].also_at == ["b.0"]
    assert model["a"] is model["b"][0] and isinstance(model["a"], FusedMultiheadAttention)


def test_every_configuration_is_replaced_and_unswappable_layers_keep_the_reason():
    class MyAttention(nn.Module):  # not an nn.MultiheadAttention at all
        def __init__(self):
            super().__init__()
            self.num_heads = 2
            self.proj = nn.Linear(16, 16)

    model = nn.ModuleDict({
        "ok": nn.MultiheadAttention(16, 2),
        "bias_kv": nn.MultiheadAttention(16, 2, add_bias_kv=True),
        "zero_attn": nn.MultiheadAttention(16, 2, add_zero_attn=True),
        "kdim": nn.MultiheadAttention(16, 2, kdim=8, vdim=8),
        "custom": Custom(16, 2),
        "mine": MyAttention(),
    })
    plan = inspect_attention(model)
    report = replace_attention(model)
    reasons = {layer.path: layer.reason for layer in report.skipped}
    assert [layer.path for layer in report.replaced] == ["ok", "bias_kv", "zero_attn", "kdim"]
    assert [layer.path for layer in plan.replaced] == ["ok", "bias_kv", "zero_attn", "kdim"]
    # The plan and the result say the same thing about how each layer runs.
    assert [layer.notes for layer in plan.layers] == [layer.notes for layer in report.layers]
    notes = {layer.path: " ".join(layer.notes) for layer in report.replaced}
    assert notes["ok"] == ""
    assert "add_bias_kv" in notes["bias_kv"] and "core operator" in notes["bias_kv"]
    assert "add_zero_attn" in notes["zero_attn"]
    assert "kdim=8" in notes["kdim"]
    assert "overrides" in reasons["custom"]
    assert "not a torch.nn.MultiheadAttention" in reasons["mine"]
    for path in ("ok", "bias_kv", "zero_attn", "kdim"):
        assert type(model[path]) is FusedMultiheadAttention
    assert type(model["custom"]) is Custom
    data = json.loads(json.dumps(report.to_dict()))
    assert data["num_replaced"] == 4 and data["num_skipped"] == 2


def test_replaced_core_operator_layers_match_the_originals():
    torch.manual_seed(0)
    original = nn.ModuleDict({
        "bias_kv": nn.MultiheadAttention(16, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True),
        "kdim": nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True),
    }).eval()
    model = copy.deepcopy(original)
    replace_attention(model)
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 8), torch.randn(2, 7, 12)
    (out, w), counts = run_counting(model["kdim"], q, k, v)
    assert counts.get(torch.ops.attn_export.attention.default, 0) == 1
    out_ref, w_ref = original["kdim"](q, k, v)
    assert_rel_close(out, out_ref, 2e-6, "kdim output")
    assert_rel_close(w, w_ref, 2e-6, "kdim weights")
    assert_rel_close(model["bias_kv"](q, q, q)[0], original["bias_kv"](q, q, q)[0], 2e-6, "bias_kv output")


def test_coverage_gate_fails_before_changing_anything():
    model = nn.ModuleDict({"ok": nn.MultiheadAttention(16, 2), "bad": Custom(16, 2)})
    with pytest.raises(CoverageError, match="cannot be fused"):
        replace_attention(model, require_all=True)
    with pytest.raises(CoverageError, match="fewer than the required 2"):
        replace_attention(model, min_replaced=2)
    assert type(model["ok"]) is nn.MultiheadAttention  # untouched
    assert replace_attention(model, min_replaced=1).num_replaced == 1


def test_inspect_changes_nothing_and_already_fused_layers_count():
    model = encoder(2)
    plan = inspect_attention(model)
    assert not plan.applied and plan.num_replaced == 2
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.layers)
    replace_attention(model)
    again = inspect_attention(model)
    assert again.num_replaced == 0 and len(again.already_fused) == 2 and again.num_fused == 2
    assert [(layer.cls.rsplit(".", 1)[-1], layer.num_heads, layer.embed_dim) for layer in again.already_fused] == [
        ("FusedMultiheadAttention", 2, 16)] * 2
    assert again.coverage_error(min_replaced=2) is None


def test_no_global_side_effects():
    """Per instance only: an untouched stock layer keeps PyTorch's fast path."""
    stock = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    replace_attention(encoder(2).eval())
    assert torch.backends.mha.get_fastpath_enabled()
    _, counts = run_counting(stock, torch.randn(2, 5, 16))
    assert counts.get(NATIVE_LAYER_OP, 0) == 1


def test_report_renders_as_a_table_and_text():
    from rich.console import Console

    model = nn.ModuleDict({"ok": nn.MultiheadAttention(16, 2), "bad": Custom(16, 2)})
    report = replace_attention(model)
    console = Console(record=True, width=200)
    console.print(report.table())
    text = console.export_text()
    assert "ok" in text and "replaced" in text and "overrides" in text
    assert "1 replaced" in str(report) and "1 skipped" in str(report)


def test_fused_layer_alone_inside_a_stock_encoder_layer_is_not_bypassed():
    """Even swapped by hand (no replace_attention), the fused layer's hook keeps the stock
    layer off its native path."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    layer.self_attn = FusedMultiheadAttention.from_module(layer.self_attn)
    _, counts = run_counting(layer, torch.randn(2, 5, 16))
    assert counts.get(FUSED_OP, 0) == 1 and counts.get(NATIVE_LAYER_OP, 0) == 0


def test_public_api():
    assert attn_export.replace_attention is replace_attention


def test_a_model_that_is_an_attention_layer_is_left_in_place_with_the_reason():
    model = nn.MultiheadAttention(16, 2, batch_first=True)
    plan = inspect_attention(model)
    report = replace_attention(model)  # nothing to swap it in: the model has no parent
    for r in (plan, report):
        assert r.num_replaced == 0 and [layer.path for layer in r.skipped] == [""]
        assert "the model itself is the attention layer: use FusedMultiheadAttention.from_module" in r.skipped[0].reason
        assert r.skipped[0].notes == []
    assert type(model) is nn.MultiheadAttention
    with pytest.raises(CoverageError, match="the model itself"):
        replace_attention(model, require_all=True)


def test_a_layer_both_overriding_forward_and_being_the_model_gives_both_reasons():
    report = replace_attention(Custom(16, 2))
    assert report.skipped[0].reason == ("Custom overrides nn.MultiheadAttention.forward; the model itself is the "
                                        "attention layer: use FusedMultiheadAttention.from_module")


def test_attention_like_modules_are_listed_unless_they_hold_a_multihead_attention():
    class SelfAttention(nn.Module):  # named like attention, computes it by hand
        def __init__(self):
            super().__init__()
            self.num_heads, self.embed_dim = 2, 16
            self.qkv = nn.Linear(16, 48)

    class AttentionBlock(nn.Module):  # named like attention, wraps a stock layer
        def __init__(self):
            super().__init__()
            self.inner = nn.MultiheadAttention(16, 2)

    model = nn.ModuleDict({"hand": SelfAttention(), "block": AttentionBlock(), "lin": nn.Linear(2, 2)})
    report = replace_attention(model)
    assert [layer.path for layer in report.replaced] == ["block.inner"]
    (hand,) = report.skipped
    assert hand.path == "hand" and hand.num_heads == 2 and hand.embed_dim == 16 and hand.found == ""
    assert hand.cls == f"{SelfAttention.__module__}.{SelfAttention.__qualname__}"
    assert hand.reason == ("its forward calls no F.scaled_dot_product_attention and it is not a "
                           "torch.nn.MultiheadAttention (hand-written softmax(q k^T) v is rewritten in the export, "
                           "where it matches)")
    assert type(model["block"].inner) is FusedMultiheadAttention
    # The model itself named like attention is not listed (nothing to swap it into).
    assert inspect_attention(SelfAttention()).layers == []


def test_dropout_is_noted_on_the_replaced_layer():
    report = replace_attention(nn.ModuleDict({"d": nn.MultiheadAttention(16, 2, dropout=0.25),
                                              "n": nn.MultiheadAttention(16, 2, dropout=0.0)}))
    notes = {layer.path: layer.notes for layer in report.replaced}
    assert notes["d"] == ["dropout=0.25: unfused in training mode (dropout is not fused); fused in eval"]
    assert notes["n"] == []


def test_nested_tensor_fast_path_is_switched_off_only_where_layers_were_fused():
    fused_enc = encoder(2)
    other = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    other.layers[0].self_attn = Custom(16, 2, batch_first=True)
    other.layers[1].self_attn = Custom(16, 2, batch_first=True)
    model = nn.ModuleDict({"enc": fused_enc, "other": other})
    assert fused_enc.use_nested_tensor and other.use_nested_tensor
    report = replace_attention(model)
    assert fused_enc.use_nested_tensor is False and other.use_nested_tensor is True
    assert [n for n in report.notes if "use_nested_tensor" in n] == [
        "enc: use_nested_tensor set to False (its nested-tensor fast path would bypass the fused layers)"]
    top = encoder(1)
    assert top.use_nested_tensor
    assert "(model): use_nested_tensor set to False" in " ".join(replace_attention(top).notes)
    assert top.use_nested_tensor is False


def test_sdpa_modules_with_dropout_carry_the_note():
    class Attn(nn.Module):
        def __init__(self, **attrs):
            super().__init__()
            self.__dict__.update(attrs)

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    model = nn.ModuleDict({"drop": Attn(attn_drop=nn.Dropout(0.1)), "p": Attn(dropout_p=0.2, dropout=True),
                           "off": Attn(attn_drop=nn.Dropout(0.0), attention_dropout=0)})
    notes = {layer.path: layer.notes for layer in inspect_attention(model).layers}
    assert notes["drop"] == ["attn_drop=0.1: calls with dropout_p > 0 (training) run on PyTorch's SDPA (dropout "
                             "is not fused); fused otherwise"]
    assert notes["p"] == ["dropout_p=0.2: calls with dropout_p > 0 (training) run on PyTorch's SDPA (dropout "
                          "is not fused); fused otherwise"]  # dropout=True is a flag, not a rate
    assert notes["off"] == []
    # every attribute name the models in the wild use for the rate
    names = ("attn_drop", "attn_dropout", "attention_dropout", "dropout", "dropout_p", "attn_pdrop")
    model = nn.ModuleDict({name: Attn(**{name: 0.3}) for name in names})
    notes = {layer.path: layer.notes for layer in inspect_attention(model).layers}
    assert {name: notes[name][0].split(":")[0] for name in names} == {name: f"{name}=0.3" for name in names}


ROUTING_NOTE = ("transformers attention layers {} through transformers' AttentionInterface "
                "(attn_implementation='attn_export'); the modules themselves stay in place")
SDPA_NOTE = ("F.scaled_dot_product_attention calls of the 'sdpa' sites {} on the fused operator; calls it cannot "
             "express (dropout_p > 0, a mask that requires grad, ...) stay on PyTorch's SDPA "
             "(attn_export.surgery.fused_calls(module) counts both)")


@pytest.mark.parametrize("status,applied,verb", [("routed", True, "are routed"), ("will be routed", False, "will be routed")])
def test_the_routing_note_names_the_implementation_only_when_layers_route(status, applied, verb):
    from attn_export.surgery.replace import ALREADY_FUSED, ROUTED, SKIPPED, WILL_ROUTE, AttentionLayer
    from attn_export.surgery.routes.base import Site
    from attn_export.surgery.routes.transformers import TransformersLayers

    def sites(*statuses):
        return [Site(AttentionLayer(f"l{i}", "Attn", 2, 16, s, found="transformers"), None, [], None)
                for i, s in enumerate(statuses)]

    notes = TransformersLayers().notes
    routing = {"routed": ROUTED, "will be routed": WILL_ROUTE}[status]
    assert notes(sites(SKIPPED, routing), applied) == [ROUTING_NOTE.format(verb)]
    assert notes(sites(routing), applied) == [ROUTING_NOTE.format(verb)]
    assert notes(sites(SKIPPED, ALREADY_FUSED), applied) == []
    assert notes([], applied) == []


def test_inspect_notes_the_routes_it_would_take_without_taking_them():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    model = nn.ModuleDict({"a": Attn()})
    plan = inspect_attention(model)
    assert plan.notes[0] == SDPA_NOTE.format("will run") and plan.applied is False
    assert plan.notes[1].startswith("no sample forward ran, so F.scaled_dot_product_attention calls were looked for")
    assert [(layer.path, layer.status, layer.found) for layer in plan.layers] == [("a", "will be routed", "sdpa")]
    report = replace_attention(model)
    assert report.notes[-1] == SDPA_NOTE.format("run")
    assert [layer.status for layer in report.layers] == ["routed"]


def test_a_skipped_layer_first_does_not_stop_the_others_and_unfused_encoders_are_left_alone():
    model = nn.ModuleDict({"bad": Custom(16, 2), "ok": nn.MultiheadAttention(16, 2)})
    report = replace_attention(model)
    assert [(layer.path, layer.status) for layer in report.layers] == [("bad", "skipped"), ("ok", "replaced")]
    assert type(model["ok"]) is FusedMultiheadAttention
    off = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False)
    assert off.use_nested_tensor is False
    assert not any("use_nested_tensor" in note for note in replace_attention(off).notes)



# ---- transformers models (the hf extra): routed through transformers' AttentionInterface, not
# swapped. The expectations are the model's own structure and outputs as built here.

def tiny_gpt2():
    if transformers is None:
        pytest.skip("needs the hf extra: pip install 'attn-export[hf]'")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=13, n_embd=8, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # attn_pdrop 0.1: a dropout note
    torch.manual_seed(0)
    return transformers.GPT2Model(config).eval()


GPT2_LAYERS = ["h.0.attn", "h.1.attn"]


def test_transformers_layers_are_routed_in_place_and_the_plan_says_so_first():
    model = tiny_gpt2()
    original = copy.deepcopy(model)
    before = model.config._attn_implementation
    plan = inspect_attention(model)
    assert [(layer.path, layer.status, layer.found, layer.num_heads, layer.embed_dim) for layer in plan.layers] == [
        (path, "will be routed", "transformers", 2, 8) for path in GPT2_LAYERS]
    assert plan.notes == [ROUTING_NOTE.format("will be routed")]
    assert {layer.cls for layer in plan.layers} == {f"{type(model.h[0].attn).__module__}.GPT2Attention"}
    assert model.config._attn_implementation == before != "attn_export"  # inspect changes nothing
    report = replace_attention(model)
    assert [(layer.path, layer.status) for layer in report.layers] == [(path, "routed") for path in GPT2_LAYERS]
    assert report.notes == [ROUTING_NOTE.format("are routed")]
    assert model.config._attn_implementation == "attn_export"
    assert all(type(model.h[i].attn) is type(original.h[i].attn) for i in range(2))  # not swapped
    ids = torch.randint(1, 13, (2, 6))
    with torch.no_grad():
        assert_rel_close(model(ids).last_hidden_state, original(ids).last_hidden_state, 2e-6, "routed gpt2")


def test_a_routed_model_beside_a_new_one_does_not_stop_the_new_ones_routing():
    done = tiny_gpt2()
    replace_attention(done)
    model = nn.ModuleDict({"done": done, "new": tiny_gpt2()})
    report = replace_attention(model)
    assert [(layer.path, layer.status) for layer in report.layers] == (
        [(f"done.{p}", "already fused") for p in GPT2_LAYERS] + [(f"new.{p}", "routed") for p in GPT2_LAYERS])


@pytest.mark.parametrize("refusals", [[], ["no such implementation"], ["not now", "not ever"]])
def test_a_route_transformers_refuses_leaves_the_layers_skipped_with_its_words(refusals):
    """transformers logs its refusals instead of raising; whatever it said, the layers whose
    config did not change are skipped, with what it said appended."""
    models = [tiny_gpt2() for _ in range(max(len(refusals), 1))]
    before = models[0].config._attn_implementation
    for model, words in zip(models, refusals or [None]):
        def refuse(implementation, words=words):
            if words is not None:
                raise ValueError(words)
        model.set_attn_implementation = refuse  # leaves the config as it is
    model = models[0] if len(models) == 1 else nn.ModuleDict({f"m{i}": m for i, m in enumerate(models)})
    assert all(layer.notes for layer in inspect_attention(model).layers)  # the dropout note, dropped below
    report = replace_attention(model)
    reason = (f"transformers did not set attn_implementation='attn_export' on it (it stays {before!r}; the model "
              "class may not support changing it after loading: load it with attn_implementation='attn_export')"
              + "".join(f"; GPT2Model: {words}" for words in refusals))
    assert [(layer.status, layer.reason, layer.notes) for layer in report.layers] == [
        ("skipped", reason, [])] * 2 * len(models)
    assert report.notes == []


def test_a_transformers_attention_layer_outside_a_transformers_model_is_not_routable():
    """Routing sets attn_implementation on a PreTrainedModel; a layer used on its own has none."""
    layer = tiny_gpt2().h[0].attn
    plan = inspect_attention(nn.ModuleDict({"attn": layer}))
    assert [(layer.path, layer.status, layer.found) for layer in plan.layers] == [("attn", "skipped", "")]
    assert plan.layers[0].reason.startswith("its forward calls no F.scaled_dot_product_attention and it is not a "
                                            "torch.nn.MultiheadAttention")


def test_hand_written_attention_beside_a_transformers_model_says_routing_cannot_reach_it():
    class HandWrittenAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

    model = nn.ModuleDict({"gpt": tiny_gpt2(), "head_attention": HandWrittenAttention()})
    *routed, hand = inspect_attention(model).layers
    assert [layer.status for layer in routed] == ["will be routed"] * 2
    assert (hand.path, hand.status, hand.reason) == (
        "head_attention", "skipped", "does not dispatch through transformers' AttentionInterface (it computes "
        "attention itself), so attn_implementation cannot route it")


def test_an_sdpa_module_reached_by_two_paths_is_listed_once():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    shared = Attn()
    shared.inner = nn.MultiheadAttention(16, 2)  # its children are visited too
    shared.num_heads, shared.embed_dim = 4, 32
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    for report in (inspect_attention(model), replace_attention(model)):
        assert [(layer.path, layer.found, layer.also_at) for layer in report.layers] == [
            ("a", "sdpa", ["b.0"]), ("a.inner", "module", [])]  # one module under both: visited once
        assert report.layers[0].cls.endswith(".Attn") and (report.layers[0].num_heads, report.layers[0].embed_dim) == (4, 32)
    assert [(layer.path, layer.status) for layer in inspect_attention(model).layers] == [
        ("a", "already fused"), ("a.inner", "already fused")]


def test_hand_written_attention_geometry_is_read_from_the_transformers_style_names_too():
    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_attention_heads, self.hidden_size = 3, 12
            self.qkv = nn.Linear(12, 36)

    class OddAttention(SelfAttention):  # geometry attributes that are not integers are not reported as such
        def __init__(self):
            super().__init__()
            self.num_attention_heads, self.hidden_size = 3.0, "12"

    hand, odd = inspect_attention(nn.ModuleDict({"hand": SelfAttention(), "odd": OddAttention()})).layers
    assert (hand.path, hand.status, hand.num_heads, hand.embed_dim) == ("hand", "skipped", 3, 12)
    assert (odd.path, odd.status, odd.num_heads, odd.embed_dim) == ("odd", "skipped", None, None)


def test_a_multihead_attention_subclass_whose_forward_calls_sdpa_is_skipped_not_routed():
    """Overriding nn.MultiheadAttention.forward is what skips a layer, whatever the forward calls."""
    class SdpaMHA(nn.MultiheadAttention):
        def forward(self, q, k, v, **kwargs):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v), None

    (layer,) = inspect_attention(nn.ModuleDict({"m": SdpaMHA(16, 2)})).layers
    assert (layer.status, layer.found) == ("skipped", "module")
    assert layer.reason == f"{SdpaMHA.__qualname__} overrides nn.MultiheadAttention.forward"


def test_already_fused_layers_keep_their_notes_and_a_model_that_is_an_sdpa_site_names_its_children():
    model = nn.ModuleDict({"ok": nn.MultiheadAttention(16, 2), "bias_kv": nn.MultiheadAttention(16, 2, add_bias_kv=True)})
    replace_attention(model)
    notes = {layer.path: layer.notes for layer in inspect_attention(model).already_fused}
    assert notes["ok"] == [] and "add_bias_kv" in " ".join(notes["bias_kv"])

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.MultiheadAttention(16, 2)

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    assert [(layer.path, layer.found) for layer in inspect_attention(Attn()).layers] == [("", "sdpa"), ("inner", "module")]


def test_a_transformers_layer_without_a_config_is_skipped_with_the_reason():
    model = tiny_gpt2()
    model.h[1].attn.config = None  # dispatches through the interface, nothing to set attn_implementation on
    assert [(layer.path, layer.status, layer.reason) for layer in inspect_attention(model).layers] == [
        ("h.0.attn", "will be routed", None),
        ("h.1.attn", "skipped", "dispatches through transformers' AttentionInterface but has no config with an "
                                "attn_implementation to set")]


def test_skipped_layers_carry_the_reason_and_class_not_the_notes():
    (layer,) = replace_attention(nn.ModuleDict({"c": Custom(16, 2, dropout=0.1)})).layers
    assert (layer.status, layer.notes, layer.cls) == ("skipped", [], f"{Custom.__module__}.{Custom.__qualname__}")


def test_a_transformers_layer_reached_by_two_paths_is_listed_once():
    model = tiny_gpt2()
    model.h[1].attn = model.h[0].attn
    assert [(layer.path, layer.also_at) for layer in inspect_attention(model).layers] == [("h.0.attn", ["h.1.attn"])]
