"""diffusers' native route (attn_export.surgery.routes.diffusers): fused processors set through diffusers'
own set_attn_processor, on UNet, SD3 and Flux models from small configs: the same outputs as the
stock processors, every SDPA call fused, one operator node per call under torch.export."""
import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra installs it)")

from attn_export.surgery.routes import diffusers as fused_diffusers  # noqa: E402
from helpers import assert_parity  # noqa: E402

import library_zoo as zoo  # noqa: E402

MODELS = {"unet": (zoo.unet, 8), "sd3": (zoo.sd3, 1), "flux": (zoo.flux, 2)}


def _main(out):
    return out[0] if isinstance(out, tuple) else out.sample


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_processors_match_the_stock_ones_and_fuse_every_call(name):
    build, calls = MODELS[name]
    model, inputs = build()
    kinds = {type(p).__name__ for p in model.attn_processors.values()}
    with torch.no_grad():
        expected = _main(model(**inputs))
    assert fused_diffusers.use_fused_processors(model) == calls
    assert {type(p).__name__ for p in model.attn_processors.values()} == {f"Fused{k}" for k in kinds}
    with torch.no_grad():
        out = _main(model(**inputs))
    assert fused_diffusers.processor_calls(model) == {"fused": calls}
    assert_parity(out, expected, 2e-5, "output", n=64)
    exported = torch.export.export(model, (), kwargs=inputs, strict=False)
    nodes = [n for n in exported.graph.nodes if n.target is torch.ops.attn_export.attention.default]
    assert len(nodes) == calls


def test_the_fused_processor_keeps_the_signature_diffusers_reads():
    import inspect

    from diffusers.models.attention_processor import AttnProcessor2_0

    fused = fused_diffusers.fused_processor(AttnProcessor2_0())
    assert inspect.signature(fused.__call__).parameters.keys() == \
        inspect.signature(AttnProcessor2_0().__call__).parameters.keys()
    assert fused_diffusers.fused_processor(fused) is fused  # idempotent


def test_a_model_without_the_processor_api_is_a_clear_error():
    with pytest.raises(TypeError, match="has no diffusers attention-processor API"):
        fused_diffusers.use_fused_processors(torch.nn.Linear(2, 2))
