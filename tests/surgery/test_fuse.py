"""Hand-written attention fused in PyTorch (attn_export.surgery.fuse): fuse_patterns' module and
torch.compile(backend="attn_export") give the eager model's outputs and gradients, with one
attn_export::attention call per matched site."""
import torch

import attn_export
from attn_export.surgery import fuse

import sdpa_models as M
from helpers import assert_parity


def _fused_calls(module) -> int:
    return sum(n.target == torch.ops.attn_export.attention.default for n in module.graph.nodes)


def test_fuse_patterns_returns_the_rewritten_module():
    model = M.nanogpt_manual()
    (idx,) = model.example_inputs.values()
    fused = attn_export.fuse_patterns(model, (idx,))
    assert [s.rewritten for s in fused.pattern_sites] == [True, True]
    assert _fused_calls(fused) == 2
    with torch.no_grad():
        assert_parity(fused(idx), model(idx), 2e-6, "nanoGPT", n=12)


def test_compile_backend_by_name_fuses_and_follows_dynamic_shapes():
    """Shifted-window attention with a learned relative-position bias: fused without gradients,
    also for the second batch size (dynamo recompiles it with a dynamic batch)."""
    model = M.swin_stage()
    compiled = torch.compile(model, backend="attn_export", fullgraph=True)
    before = len(fuse.backend.sites)
    with torch.no_grad():
        for batch in (2, 3, 4):
            x = torch.randn(batch, 8, 8, 32)
            assert_parity(compiled(x), model(x), 2e-6, f"batch {batch}", n=16)
    graphs = fuse.backend.sites[before:]
    assert 1 <= len(graphs) <= 2 and all([s.rewritten for s in g] == [True, True] for g in graphs), graphs


def test_compiled_training_keeps_every_gradient():
    """With gradients on, the bias computed from the learned table stays as written (the
    operator treats masks as constants); nanoGPT's causal mask is a constant, so its sites are
    fused and trained through the operator. Parameter gradients match the eager model's."""
    for factory, fused_sites in (("swin_stage", 0), ("nanogpt_manual", 2)):
        model = getattr(M, factory)()
        args = tuple(model.example_inputs.values())
        backend = fuse.Backend()
        compiled = torch.compile(model, backend=backend)
        # a random cotangent: the square of a LayerNorm's output would cancel to rounding noise
        weight = torch.randn(model(*args).shape, generator=torch.Generator().manual_seed(1))
        model.zero_grad()
        (compiled(*args) * weight).sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        (model(*args) * weight).sum().backward()
        (sites,) = backend.sites
        assert sum(s.rewritten for s in sites) == fused_sites, [s.reason for s in sites]
        if fused_sites == 0:
            assert all("a bias computed from l_self_modules_blocks_modules_" in s.reason and "needs gradients"
                       in s.reason for s in sites), [s.reason for s in sites]
        for name, p in model.named_parameters():
            assert_parity(got[name], p.grad, 2e-5, f"{factory} {name}", n=16)


def test_fuse_patterns_for_training_leaves_learned_biases():
    model = M.swin_stage()
    (x,) = model.example_inputs.values()
    fused = attn_export.fuse_patterns(model, (x,), for_training=True)
    assert [s.rewritten for s in fused.pattern_sites] == [False, False]
    assert all("needs gradients" in s.reason for s in fused.pattern_sites)


def test_fuse_patterns_with_dynamic_batch_and_length():
    """nanoGPT's causal buffer sliced to the symbolic length: the mask's expand takes symbolic sizes."""
    model = M.nanogpt_manual()
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("length", max=63)}
    fused = attn_export.fuse_patterns(model, (torch.randint(0, 50, (2, 12)),), dynamic_shapes=(dims,))
    assert [s.rewritten for s in fused.pattern_sites] == [True, True]
    for batch, length in ((3, 20), (1, 7)):
        idx = torch.randint(0, 50, (batch, length))
        with torch.no_grad():
            assert_parity(fused(idx), model(idx), 2e-6, f"[{batch}, {length}]", n=length)
