"""The route registry (attn_export.surgery.routes): every route undone exactly by
restore_attention on a real model (module objects in their places, every module's instance
attributes, configs, state_dict and outputs as before the surgery), one call counter for every
route, a route added with one line (``routes.registered``) reaching the report under its name, the
run, the counter and the undo, and the old homes of two routes still answering, with a warning."""
import copy

import pytest
import torch
from torch import nn

import attn_export
from attn_export.surgery import fused_calls, routes
from attn_export.surgery.routes.base import CallCount, Route
from attn_export.surgery.site_report import AttentionLayer, ROUTED, WILL_ROUTE

import sdpa_models


def _attributes(obj):
    """An object's instance attributes, one level into the dicts it holds (nn.Module keeps its
    parameters, submodules and hooks in dicts it mutates in place)."""
    return {name: dict(value) if isinstance(value, dict) else value for name, value in vars(obj).items()}


def _same(before, after) -> bool:
    """The same keys holding the same objects (identity, not equality)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return before.keys() == after.keys() and all(_same(before[k], after[k]) for k in before)
    return before is after


def _snapshot(model: nn.Module):
    modules = list(model.named_modules(remove_duplicate=False))
    configs = {path: _attributes(m.config) for path, m in modules if hasattr(getattr(m, "config", None), "to_dict")}
    return {
        "modules": [(path, m) for path, m in modules],
        "attributes": {path: _attributes(m) for path, m in modules},
        "configs": configs,
        "state": model.state_dict(keep_vars=True),
    }


def _differences(before, after):
    """What differs between two snapshots, one line each (empty when the model is as it was)."""
    lines = []
    if [p for p, _ in before["modules"]] != [p for p, _ in after["modules"]]:
        lines.append("the module paths differ")
    lines += [f"{p}: another module object" for (p, a), (_, b) in zip(before["modules"], after["modules"]) if a is not b]
    for kind in ("attributes", "configs"):
        for path in before[kind].keys() | after[kind].keys():
            old, new = before[kind].get(path, {}), after[kind].get(path, {})
            if not _same(old, new):
                changed = sorted(k for k in old.keys() | new.keys() if k not in old or k not in new
                                 or not _same(old[k], new[k]))
                lines.append(f"{path or '(model)'} {kind}: {changed}")
    if not _same(before["state"], after["state"]):
        lines.append("state_dict differs")
    return lines


def _run(model, inputs):
    with torch.no_grad():
        out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
    out = out[0] if isinstance(out, tuple) else out
    return getattr(out, "last_hidden_state", getattr(out, "logits", getattr(out, "sample", out)))


def _transformer():
    torch.manual_seed(0)
    model = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                           batch_first=True).eval()
    return model, (torch.randn(2, 5, 16), torch.randn(2, 4, 16))


def _encoder():  # use_nested_tensor on, switched off by the surgery
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    return model, (torch.randn(2, 5, 16),)


def _whisper():
    model = sdpa_models.whisper_like()
    return model, model.example_inputs


def _gpt2():
    pytest.importorskip("transformers", reason="needs transformers (the test extra installs it)")
    import hf_models

    return hf_models.tiny_gpt2("GPT2Model"), hf_models.padded_batch([5, 3], 5)


def _alibi(name):
    pytest.importorskip("transformers", reason="needs transformers (the test extra installs it)")
    import hf_models
    import transformers

    torch.manual_seed(0)
    special = dict(vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = (transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, **special))
             if name == "bloom" else
             transformers.MptForCausalLM(transformers.MptConfig(d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                                                                **special)))
    # right padding: no query row is all padding (there the stock modules and the operator differ)
    return model.eval(), hf_models.padded_batch([5, 3], 5)


def _bloom():
    return _alibi("bloom")


def _mpt():
    return _alibi("mpt")


def _unet():
    pytest.importorskip("diffusers", reason="needs diffusers (the test extra installs it)")
    import library_zoo

    return library_zoo.unet()


# route name -> model factory; every route of the registry has one
MODELS = {"module": [_transformer, _encoder], "sdpa": [_whisper], "transformers": [_gpt2], "alibi": [_bloom, _mpt],
          "diffusers": [_unet]}


def test_every_route_of_the_registry_has_a_model_here():
    assert {route.name for route in routes.ROUTES} == set(MODELS)


@pytest.mark.parametrize("build", [b for builds in MODELS.values() for b in builds], ids=lambda b: b.__name__[1:])
def test_restore_attention_undoes_the_surgery_exactly(build):
    model, inputs = build()
    expected = _run(model, inputs)
    before = _snapshot(model)
    report = attn_export.replace_attention(model, inputs)
    assert report.num_replaced > 0, str(report)
    fused = _run(model, inputs)
    assert _differences(before, _snapshot(model)), "the surgery changed nothing this test can see"
    attn_export.restore_attention(model, report)
    assert _differences(before, _snapshot(model)) == []
    assert torch.equal(_run(model, inputs), expected)
    torch.testing.assert_close(fused, expected, atol=2e-5, rtol=1e-4)


def test_the_module_route_restores_use_nested_tensor():
    model, inputs = _encoder()
    report = attn_export.replace_attention(model)
    assert model.use_nested_tensor is False and any("use_nested_tensor" in note for note in report.notes)
    attn_export.restore_attention(model, report)
    assert model.use_nested_tensor is True and type(model.layers[0].self_attn) is nn.MultiheadAttention


def test_restore_refuses_a_plan_another_model_and_a_second_undo():
    model, _ = _transformer()
    with pytest.raises(ValueError, match="nothing to restore"):
        attn_export.restore_attention(model, attn_export.inspect_attention(model))
    from attn_export.surgery.plan import plan_export

    with pytest.raises(ValueError, match="nothing to restore"):
        attn_export.restore_attention(model, plan_export(model, {"src": torch.randn(2, 5, 16),
                                                                  "tgt": torch.randn(2, 4, 16)}))
    report = attn_export.replace_attention(model)
    with pytest.raises(ValueError, match="another model"):
        attn_export.restore_attention(_transformer()[0], report)
    attn_export.restore_attention(model, report)
    with pytest.raises(ValueError, match="already undone"):
        attn_export.restore_attention(model, report)


def test_fused_calls_counts_the_sdpa_route_and_its_deprecated_alias_agrees():
    from attn_export.surgery import sdpa_route

    model, inputs = _whisper()
    report = attn_export.replace_attention(model, inputs)
    _run(model, inputs)
    for layer in report.layers:
        module = model.get_submodule(layer.path)
        count = fused_calls(module)
        assert count.fused >= 1 and count.unfused == {}, layer.path
        with pytest.warns(DeprecationWarning, match="fused_calls"):
            assert sdpa_route.calls(module) == {"fused": count.fused}


def test_fused_calls_counts_transformers_layers_fused_and_unfused():
    model, inputs = _gpt2()
    report = attn_export.replace_attention(model)
    _run(model, inputs)
    layers = [model.get_submodule(layer.path) for layer in report.layers]
    assert [fused_calls(layer) for layer in layers] == [CallCount(1, {})] * len(layers)
    from attn_export.surgery import transformers as hf

    assert all(hf.unfused_calls(layer) == {} for layer in layers)
    assert fused_calls(nn.Linear(2, 2)) == CallCount()


def test_fused_calls_counts_the_diffusers_processors_and_processor_calls_agrees():
    model, inputs = _unet()
    report = attn_export.replace_attention(model, inputs)
    _run(model, inputs)
    from attn_export.surgery.routes.diffusers import processor_calls

    counts = [fused_calls(model.get_submodule(layer.path)) for layer in report.layers]
    assert counts == [CallCount(1, {})] * 8
    assert processor_calls(model) == {"fused": 8}
    assert all(type(model.get_submodule(layer.path).processor).__name__ == "FusedAttnProcessor2_0"
               for layer in report.layers)
    assert not any("forward" in vars(model.get_submodule(layer.path)) for layer in report.layers)


class _Doubler(nn.Module):
    """Not attention at all: a module a test route reaches (its name says nothing to the walk)."""

    def forward(self, x):
        return 2 * x


class _FakeAttention(nn.Module):
    """Named like attention, reached by no route: the report says what it lacks for each."""

    def forward(self, x):
        return x


class _HalvingRoute(Route):
    """A route written in a test: it claims _Doubler modules and gives them an instance forward
    that halves instead, counting the calls; a site that was not called is not confirmed."""

    name = "halving"

    def claim(self, scan, module, parent, path):
        if isinstance(module, _Doubler):
            return AttentionLayer(path, "test._Doubler", None, None, WILL_ROUTE)
        return None

    def missing(self, scan):
        return "it is not a _Doubler"

    def unconfirmed(self, module):
        return None if self.calls(module) else "it was not called"

    def notes(self, sites, applied):
        return [f"{len(sites)} halving site(s)"] if sites else []

    def apply(self, model, sites):
        done = []
        for site in sites:
            def halve(x, module=site.module):
                module.__dict__["halving_calls"] = module.__dict__.get("halving_calls", 0) + 1
                return x / 2
            site.module.forward = halve
            site.layer.status = ROUTED
            done.append(site.layer.path)
        return [], done

    def undo(self, model, applied):
        for path in applied:
            for name in ("forward", "halving_calls"):
                model.get_submodule(path).__dict__.pop(name, None)

    def calls(self, module):
        return CallCount(module.__dict__["halving_calls"]) if "halving_calls" in vars(module) else None


def test_a_route_registered_with_one_line_drives_the_report_the_run_the_counter_and_the_undo():
    model = nn.Sequential(_Doubler(), nn.Linear(4, 4), _Doubler(), _FakeAttention())
    x = torch.randn(3, 4)
    expected = model(x)
    before = _snapshot(model)
    assert [layer.path for layer in attn_export.inspect_attention(model).layers] == ["3"]  # the fake one only
    table = list(routes.ROUTES)
    with routes.registered(_HalvingRoute()):
        plan = attn_export.inspect_attention(model)
        assert [(layer.path, layer.status, layer.found) for layer in plan.layers] == \
            [("0", WILL_ROUTE, "halving"), ("2", WILL_ROUTE, "halving"), ("3", "skipped", "")]
        assert plan.notes[0] == "2 halving site(s)"
        assert plan.layers[2].reason.startswith("its forward calls no F.scaled_dot_product_attention and it is not a "
                                                "torch.nn.MultiheadAttention and it is not a _Doubler (")
        assert plan.to_dict()["num_by_found"] == {"halving": 2, "": 1}
        report = attn_export.replace_attention(model)
        assert [layer.status for layer in report.layers[:2]] == [ROUTED, ROUTED]
        halved = model(x)
        torch.testing.assert_close(halved, model[1](x / 2) / 2)
        assert fused_calls(model[0]) == CallCount(1) and fused_calls(model[1]) == CallCount()
        assert report.confirm_calls(model) == []
        attn_export.restore_attention(model, report)
        assert _differences(before, _snapshot(model)) == []
        assert torch.equal(model(x), expected)
        unconfirmed = attn_export.replace_attention(model)
        assert unconfirmed.confirm_calls(model) == ["0: it was not called", "2: it was not called"]
        assert [layer.status for layer in unconfirmed.layers[:2]] == ["skipped", "skipped"]
        attn_export.restore_attention(model, unconfirmed)
    assert routes.ROUTES == table  # taken out again


def test_registered_places_a_route_by_name_and_refuses_a_name_taken():
    with routes.registered(_HalvingRoute(), before="sdpa") as route:
        assert [r.name for r in routes.ROUTES].index("halving") == [r.name for r in routes.ROUTES].index("sdpa") - 1
        with pytest.raises(ValueError, match="a name of its own"):
            with routes.registered(_HalvingRoute()):
                pass
    assert route not in routes.ROUTES


def test_the_report_names_each_site_by_its_route():
    """found is the name of the route that reached the site, for every route of the table."""
    model, inputs = _unet()
    assert {layer.found for layer in attn_export.inspect_attention(model, inputs).layers} == {"diffusers"}
    model, inputs = _transformer()
    assert {layer.found for layer in attn_export.inspect_attention(model, inputs).layers} == {"module"}


def test_the_old_homes_of_the_sdpa_and_diffusers_routes_still_answer_with_a_warning():
    from attn_export.surgery import diffusers as old_diffusers
    from attn_export.surgery import sdpa, sdpa_route
    from attn_export.surgery.routes import diffusers

    for name in ("route_module", "observe_calls", "calls_sdpa", "sdpa_via_operator", "known_equal", "RoutedForward"):
        with pytest.warns(DeprecationWarning, match=f"attn_export.surgery.sdpa.[a-z]+.{name}"):
            assert getattr(sdpa_route, name) is getattr(sdpa, name)
    for name in ("use_fused_processors", "processor_calls", "fused_processor", "is_fused_processor"):
        with pytest.warns(DeprecationWarning, match=f"attn_export.surgery.routes.diffusers.{name}"):
            assert getattr(old_diffusers, name) is getattr(diffusers, name)
    with pytest.raises(AttributeError):
        sdpa_route.no_such_name


def test_the_report_keeps_its_record_out_of_comparisons_and_copies():
    model, _ = _transformer()
    report = attn_export.replace_attention(model)
    assert "surgery" not in repr(report) and "surgery" not in report.to_dict()
    assert copy.deepcopy(report) == report


def test_the_sdpa_route_puts_back_an_instance_forward_the_module_had():
    model, inputs = _whisper()
    site = model.get_submodule(attn_export.inspect_attention(model, inputs).layers[0].path)

    def wrapped(*args, **kwargs):  # e.g. a hook wrapper some library installs per instance
        return type(site).forward(site, *args, **kwargs)

    site.forward = wrapped
    before = _snapshot(model)
    report = attn_export.replace_attention(model, inputs)
    assert site.forward is not wrapped
    attn_export.restore_attention(model, report)
    assert site.forward is wrapped and _differences(before, _snapshot(model)) == []
