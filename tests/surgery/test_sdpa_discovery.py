"""Where F.scaled_dot_product_attention calls run, found by a sample forward: calls reached through
a processor object, a dispatch function, a closure or a callable stored on the instance are
attributed to the innermost module running, routed there, and the plan equals what ran."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attn_export
from attn_export import inspect_attention, replace_attention
from attn_export.surgery import fused_calls, sdpa
from helpers import assert_parity

_BACKENDS = {"sdpa": lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, **kw)}


def _dispatch(name, q, k, v, **kwargs):  # diffusers' dispatch_attention_fn, in miniature
    return _BACKENDS[name](q, k, v, **kwargs)


class Processor:  # not a module: diffusers' AttnProcessor2_0, in miniature
    def __call__(self, attn, x):
        q, k, v = attn.qkv(x).unflatten(-1, (3, attn.heads, -1)).permute(2, 0, 3, 1, 4)
        out = _dispatch("sdpa", q, k, v, is_causal=attn.causal)
        return attn.out(out.transpose(1, 2).flatten(2))


class ViaProcessor(nn.Module):
    def __init__(self, dim=16, heads=2, causal=False):
        super().__init__()
        self.qkv, self.out, self.causal = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), causal
        self.head_count = heads  # under a name the report does not know: heads come from the calls
        self.processor = Processor()

    @property
    def heads(self):
        return self.head_count

    def forward(self, x):
        return self.processor(self, x)


class ViaStoredCallable(nn.Module):  # torchtune's self._attention_call
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(dim, 3 * dim), heads
        self._attention_call = self._make_call()

    @staticmethod
    def _make_call():
        def call(q, k, v):  # a closure over nothing the class names
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return call

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self._attention_call(q, k, v).transpose(1, 2).flatten(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = ViaProcessor(), nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.inner = ViaStoredCallable()

    def forward(self, x):
        return self.inner(self.mlp(self.attn(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).eval()


def test_a_sample_forward_finds_calls_the_source_does_not_show():
    model, x = _model(), torch.randn(2, 7, 16)
    hint = inspect_attention(model)  # the source: the processor's and the stored callable's calls are missed
    assert not any(layer.found == "sdpa" for layer in hint.layers)
    assert any(note.startswith("no sample forward ran") for note in hint.notes)
    plan = inspect_attention(model, (x,))
    rows = [(layer.path, layer.status, layer.found, layer.num_heads, layer.embed_dim) for layer in plan.layers]
    assert rows == [("0.attn", "will be routed", "sdpa", 2, 16), ("0.inner", "will be routed", "sdpa", 4, 16),
                    ("1.attn", "will be routed", "sdpa", 2, 16), ("1.inner", "will be routed", "sdpa", 4, 16)]
    assert not any(note.startswith("no sample forward ran") for note in plan.notes)


def test_the_calls_found_are_routed_and_the_plan_is_what_ran():
    model, x = _model(), torch.randn(2, 7, 16)
    expected = model(x)
    plan = inspect_attention(model, (x,))
    report = replace_attention(model, (x,))
    assert [layer.path for layer in report.layers] == [layer.path for layer in plan.layers]
    assert all(layer.status == "routed" for layer in report.layers)
    with torch.no_grad():
        out = model(x)
    assert_parity(out, expected, 2e-6, "output", n=16)
    assert report.confirm_calls(model) == []  # every routed site made fused calls, no stock ones
    for path in ("0.attn", "0.inner", "1.attn", "1.inner"):
        assert fused_calls(model.get_submodule(path)).as_counter() == {"fused": 1}, path


def test_the_routed_calls_are_one_operator_node_each_under_torch_export():
    model, x = _model(), torch.randn(2, 7, 16)
    replace_attention(model, (x,))
    exported = torch.export.export(model, (x,), strict=False)
    ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.attn_export.attention.default) == 4
    assert torch.ops.aten.scaled_dot_product_attention.default not in ops


def test_calls_the_operator_cannot_express_are_planned_as_skipped_with_the_reason():
    class Dropping(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)

    model = nn.Sequential(Dropping()).eval()
    plan = inspect_attention(model, (torch.randn(1, 2, 3, 4),))
    (layer,) = plan.layers
    assert layer.status == "skipped" and "dropout_p=0.5 (attention dropout is not fused)" in layer.reason
    replace_attention(model, (torch.randn(1, 2, 3, 4),))
    assert not sdpa.is_routed(model[0])


def test_a_module_whose_source_calls_sdpa_but_took_another_path_says_so():
    class SwitchedAttention(nn.Module):
        fused_attn = False

        def forward(self, x):
            if self.fused_attn:
                return F.scaled_dot_product_attention(x, x, x)
            return (x @ x.transpose(-2, -1)).softmax(-1) @ x

    model = nn.Sequential(SwitchedAttention())
    (layer,) = inspect_attention(model, (torch.randn(1, 2, 3, 4),)).layers
    assert layer.status == "skipped" and "the sample forward made no such call" in layer.reason


def test_a_failing_sample_forward_is_one_clear_error():
    with pytest.raises(attn_export.errors.InputError, match=r"the model rejected the example inputs \[\[2, 7, 5\]\] \(in the sample forward"):
        inspect_attention(_model(), (torch.randn(2, 7, 5),))


class _Calls(nn.Module):
    """One SDPA call on [B, 2, L, 8] heads (embed 16 from the call)."""

    def forward(self, x):
        q = x.unflatten(-1, (2, 8)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("name", ["num_heads", "num_attention_heads", "heads", "n_head"])
def test_the_modules_own_head_count_wins_over_the_calls(name):
    module = _Calls()
    setattr(module, name, 7)
    (layer,) = inspect_attention(nn.Sequential(module), (torch.randn(1, 3, 16),)).layers
    assert (layer.num_heads, layer.embed_dim) == (7, 16), name  # the embed dim the calls computed on


@pytest.mark.parametrize("name", ["embed_dim", "hidden_size", "inner_dim"])
def test_the_modules_own_embed_dim_wins_over_the_calls(name):
    module = _Calls()
    setattr(module, name, 99)
    (layer,) = inspect_attention(nn.Sequential(module), (torch.randn(1, 3, 16),)).layers
    assert (layer.num_heads, layer.embed_dim) == (2, 99), name


def test_a_geometry_the_class_defines_is_read():
    class Declared(_Calls):  # a class attribute and a property, as diffusers' Attention has `heads`
        num_heads = 7

        @property
        def embed_dim(self):
            return 99

    (layer,) = inspect_attention(nn.Sequential(Declared()), (torch.randn(1, 3, 16),)).layers
    assert (layer.num_heads, layer.embed_dim) == (7, 99)


def test_names_answered_by_a_config_getattr_are_not_read():
    class Configured(_Calls):  # diffusers' ConfigMixin answers unknown names from its config
        def __getattr__(self, name):
            if name in ("num_heads", "embed_dim"):
                return 5
            return super().__getattr__(name)

    (layer,) = inspect_attention(nn.Sequential(Configured()), (torch.randn(1, 3, 16),)).layers
    assert (layer.num_heads, layer.embed_dim) == (2, 16)


def test_every_refusal_is_in_the_planned_reason_and_a_skipped_site_has_no_notes():
    class TwoRefused(nn.Module):
        attn_drop = 0.1  # a dropout note would be given to a site that is routed

        def forward(self, x):
            a = F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
            a = a.unsqueeze(0)
            return F.scaled_dot_product_attention(a, a, a)

    (layer,) = inspect_attention(nn.Sequential(TwoRefused()), (torch.randn(1, 2, 3, 4),)).layers
    assert layer.reason == ("its F.scaled_dot_product_attention call(s) would run on PyTorch's SDPA: "
                            "dropout_p=0.5 (attention dropout is not fused); query/key/value of rank 5/5/5 (3-D or "
                            "4-D are routed)")
    assert layer.status == "skipped" and layer.notes == []


SOURCE_NOTE = ("no sample forward ran, so F.scaled_dot_product_attention calls were looked for in the modules' "
               "source, which misses calls through processors, dispatch functions and stored callables: pass "
               "example inputs")


def test_the_source_note_is_given_where_the_source_was_read_and_only_there():
    assert inspect_attention(_model()).notes == [SOURCE_NOTE]
    assert replace_attention(_model()).notes == [SOURCE_NOTE]
    assert SOURCE_NOTE not in replace_attention(_model(), (torch.randn(2, 7, 16),)).notes
    # Layers found by their type need no sample forward.
    assert inspect_attention(nn.Sequential(nn.MultiheadAttention(8, 2))).notes == []


def test_the_reasons_of_attention_modules_no_call_ran_in():
    class HandAttention(nn.Module):
        def forward(self, x):
            return (x @ x.transpose(-2, -1)).softmax(-1) @ x

    (layer,) = inspect_attention(nn.Sequential(HandAttention()), (torch.randn(1, 2, 3, 4),)).layers
    assert layer.reason == ("no F.scaled_dot_product_attention call ran in it in the sample forward and it is not a "
                            "torch.nn.MultiheadAttention (hand-written softmax(q k^T) v is rewritten in the export, "
                            "where it matches)")

    class SwitchedAttention(HandAttention):
        fused_attn = False

        def forward(self, x):
            if self.fused_attn:
                return F.scaled_dot_product_attention(x, x, x)
            return super().forward(x)

    (layer,) = inspect_attention(nn.Sequential(SwitchedAttention()), (torch.randn(1, 2, 3, 4),)).layers
    assert layer.reason == ("its source calls F.scaled_dot_product_attention, but the sample forward made no such "
                            "call in it (it took another path, e.g. a switch such as timm's fused_attn=False)")


@pytest.mark.parametrize("inputs, shown", [((torch.randn(2, 7, 5),), "[[2, 7, 5]]"),
                                           ({"x": torch.randn(2, 7, 5)}, "{'x': [2, 7, 5]}"),
                                           ({"x": torch.randn(2, 7, 5), "scale": 0.5}, "{'x': [2, 7, 5], 'scale': []}")])
def test_the_rejected_inputs_are_named_with_their_shapes(inputs, shown):
    with pytest.raises(attn_export.errors.InputError) as info:
        inspect_attention(_model(), inputs)
    assert str(info.value).startswith(f"the model rejected the example inputs {shown} (in the sample forward that "
                                      "finds the attention calls): ")


def test_an_error_without_a_message_is_named_by_its_type():
    class Silent(nn.Module):
        def forward(self, x):
            raise KeyError()

    with pytest.raises(attn_export.errors.InputError, match=r"attention calls\): KeyError$"):
        inspect_attention(Silent(), (torch.randn(1),))
