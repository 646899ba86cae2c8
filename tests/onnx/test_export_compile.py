"""torch.export and torch.compile trace the operators (through the fake kernels) and keep
them as single nodes, with symbolic batch and sequence sizes."""
import pytest
import torch
from torch import nn
from torch.export import Dim

import attn_export
from helpers import assert_rel_close


class Block(nn.Module):
    def __init__(self, embed=16, heads=2):
        super().__init__()
        self.attn = attn_export.FusedMultiheadAttention(embed, heads, batch_first=True)
        self.norm = nn.LayerNorm(embed)

    def forward(self, x, padding):
        y, _ = self.attn(x, x, x, key_padding_mask=padding, need_weights=False)
        return self.norm(x + y)


class Core(nn.Module):
    def forward(self, q, k, v):
        return attn_export.attention(q, k, v, is_causal=True)


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _layer_inputs(batch, seqlen):
    padding = torch.zeros(batch, seqlen, dtype=torch.bool)
    padding[0, -1] = True
    return torch.randn(batch, seqlen, 16), padding


def test_export_keeps_the_layer_op_with_dynamic_batch_and_sequence():
    model = Block().eval()
    batch, seq = Dim("batch"), Dim("seq")
    ep = torch.export.export(
        model, _layer_inputs(2, 7), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq})
    )
    decomposed = ep.run_decompositions()
    for program in (ep, decomposed):
        targets = _targets(program.graph_module)
        assert targets.count("attn_export.multi_head_attention.default") == 1, targets
    for shape in [(1, 1), (3, 11), (2, 64)]:
        inputs = _layer_inputs(*shape)
        assert_rel_close(decomposed.module()(*inputs), model(*inputs), 1e-6, f"shape {shape}")


def test_export_keeps_the_core_op():
    seq = Dim("seq")
    q = k = v = torch.randn(2, 2, 5, 8)
    ep = torch.export.export(Core(), (q, k, v), dynamic_shapes=({2: seq}, {2: seq}, {2: seq})).run_decompositions()
    assert _targets(ep.graph_module).count("attn_export.attention.default") == 1
    q2 = torch.randn(2, 2, 9, 8)
    assert_rel_close(ep.module()(q2, q2, q2), Core()(q2, q2, q2), 1e-6, "core")


def test_export_in_training_mode_with_grad_keeps_the_op():
    """Even when the example inputs require grad, export traces without autograd."""
    model = Block().train()
    x, padding = _layer_inputs(2, 5)
    ep = torch.export.export(model, (x.requires_grad_(), padding)).run_decompositions()
    assert "attn_export.multi_head_attention.default" in _targets(ep.graph_module)


@pytest.mark.slow
def test_compile_dynamic_fullgraph_inference_and_training():
    model = Block()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="aot_eager")
    for shape in [(2, 7), (3, 12)]:
        x, padding = _layer_inputs(*shape)
        x.requires_grad_()
        out_c = compiled(x, padding)
        out_e = model(x, padding)
        assert_rel_close(out_c, out_e, 1e-6, "forward")
        # Not out.sum(): through the final LayerNorm its gradient is ~0 everywhere but in the
        # norm's own parameters, which would compare rounding noise.
        grad = torch.randn_like(out_e)
        grads_c = torch.autograd.grad(out_c, [x] + list(model.parameters()), grad)
        grads_e = torch.autograd.grad(out_e, [x] + list(model.parameters()), grad)
        for gc, ge in zip(grads_c, grads_e):
            assert_rel_close(gc, ge, 1e-5, "gradient")
    with torch.no_grad():
        x, padding = _layer_inputs(4, 9)
        assert_rel_close(compiled(x, padding), model(x, padding), 1e-6, "no_grad")
