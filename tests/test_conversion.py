"""attn_export.convert: the CLI's default verb as a library call. The model is the bundled
example; the reference for every verdict is the validation's own (ONNX Runtime against the
untouched PyTorch model), and one file is corrupted to prove the verdict can be "failed"."""
import onnx
import pytest
import torch
from torch import nn

import attn_export
from attn_export import ConvertOptions, convert
from attn_export.errors import EXIT_MISMATCH, InputError

# convert reads the groups, never the deprecated flat names (ConvertOptions.with_past, ...).
pytestmark = pytest.mark.filterwarnings(r"error:ConvertOptions\.:DeprecationWarning")


class Recorder:
    def __init__(self):
        self.events = []

    def step(self, what):
        import contextlib

        self.events.append(("step", what))
        return contextlib.nullcontext(lambda _detail: None)

    def note(self, message):
        self.events.append(("note", message))

    def plan(self, report, after_export):
        self.events.append(("plan", after_export, report.summary()))

    def exported(self, onnx_path, export):
        self.events.append(("exported", onnx_path.name, export.num_attention_nodes))

    def engine_built(self, engine_path, info):
        self.events.append(("engine", engine_path))


@pytest.fixture(scope="module")
def example():
    from attn_export.examples import tiny_seq2seq

    model = tiny_seq2seq()
    return model, model.example_inputs


def test_convert_fuses_exports_and_validates_the_example(example, tmp_path):
    model, inputs = example
    progress = Recorder()
    result = convert(model, inputs, ConvertOptions(output=tmp_path / "m.onnx"), progress=progress)
    assert result.passed and result.exit_code == 0 and result.failures == []
    assert result.onnx_path == tmp_path / "m.onnx" and result.engine_path is None
    assert result.report is not None and result.report.passed and len(result.report.cases) > 0
    nodes = [n.op_type for n in onnx.load(str(result.onnx_path)).graph.node]
    assert nodes.count("FusedAttention") == 6 == result.export.num_attention_nodes
    assert result.to_dict()["export"]["num_attention_nodes"] == 6
    kinds = [e[0] for e in progress.events]
    # The plan before the export, the export, then the validation: the order the CLI prints.
    assert kinds.index("plan") < kinds.index("exported") < kinds.index("step", kinds.index("exported"))
    assert ("exported", "m.onnx", 6) in progress.events
    # The caller's model is left as it was: convert works on a copy.
    assert not any(isinstance(m, attn_export.FusedMultiheadAttention) for m in model.modules())


def test_a_wrong_export_is_a_failed_result_not_an_exception(example, tmp_path, monkeypatch):
    model, inputs = example
    from attn_export import validation

    real = validation.validate

    def validate_a_corrupted_file(model, onnx_path, *args, **kwargs):
        proto = onnx.load(str(onnx_path))
        for init in proto.graph.initializer:
            if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2:
                array = onnx.numpy_helper.to_array(init) * 2.0
                init.CopyFrom(onnx.numpy_helper.from_array(array, init.name))
                break
        onnx.save(proto, str(onnx_path))
        return real(model, onnx_path, *args, **kwargs)

    monkeypatch.setattr(validation, "validate", validate_a_corrupted_file)
    result = convert(model, inputs, ConvertOptions(output=tmp_path / "m.onnx"))
    assert not result.passed and result.exit_code == EXIT_MISMATCH and result.failures


def test_the_coverage_gate_stops_before_the_export(tmp_path):
    model = nn.MultiheadAttention(16, 2)  # the model itself is the attention layer: nothing to swap
    inputs = {"query": torch.randn(3, 2, 16), "key": torch.randn(3, 2, 16), "value": torch.randn(3, 2, 16)}
    result = convert(model, inputs, ConvertOptions(output=tmp_path / "m.onnx", require_all=True, validate=False))
    assert not result.passed and result.exit_code == EXIT_MISMATCH
    assert "the model itself" in result.coverage_problem and result.failures == [result.coverage_problem]
    assert result.export is None and list(tmp_path.iterdir()) == []


def test_validate_false_skips_the_report(example, tmp_path):
    model, inputs = example
    result = convert(model, inputs, ConvertOptions(output=tmp_path / "m.onnx", validate=False))
    assert result.passed and result.report is None and result.onnx_path.exists()


@pytest.mark.parametrize("kwargs, words", [
    ({"to": "tflite"}, "unknown target 'tflite'"),
    ({"attention": "fast"}, "unknown ONNX attention flavor 'fast'"),
])
def test_options_are_checked_when_made(tmp_path, kwargs, words):
    with pytest.raises(InputError, match=words):
        ConvertOptions(output=tmp_path / "m.onnx", **kwargs)


def test_the_tensorrt_target_is_checked_before_the_model_is_touched(tmp_path):
    pytest.importorskip("attn_export.tensorrt")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("TensorRT is installed here: its absence cannot be checked")

    class Untouchable(nn.Module):
        def forward(self, x):
            raise AssertionError("the model ran before the preflight")

    from attn_export.tensorrt import TensorRTUnavailable

    with pytest.raises(TensorRTUnavailable, match="TensorRT is not installed"):
        convert(Untouchable(), {"x": torch.randn(2, 3)}, ConvertOptions(output=tmp_path / "m.engine", to="tensorrt"))
    assert list(tmp_path.iterdir()) == []


def test_the_onnx_file_and_the_engine_cannot_be_one_path(tmp_path):
    with pytest.raises(InputError, match="would both be"):
        convert(nn.Identity(), {}, ConvertOptions(output=tmp_path / "m.onnx", to="tensorrt"))
