"""The command line's option groups are the library's (attn_export/options.py): for the same
options, `convert` and `validate` hand the library the objects a Python caller would build.
In-process (click's CliRunner); the library is stopped at its first call, nothing is loaded."""
import pytest

from attn_export import conversion
from attn_export.errors import InputError
from attn_export.options import ConvertOptions, CoverageOptions, EngineOptions, ExportOptions, GateOptions, OrtOptions
from helpers import invoke


class Stop(InputError):
    pass


@pytest.fixture
def captured(monkeypatch):
    """What the verbs hand the library: convert's preflight gets the ConvertOptions, validate's
    provider check the ONNX Runtime group and the gate's timeout."""
    seen = {}

    def preflight(options, progress=None):
        seen["options"] = options
        raise Stop("stopped before the model")

    def require_providers(ort, timeout_s, plugin):
        seen.update(ort=ort, timeout_s=timeout_s, plugin=plugin)
        raise Stop("stopped before the model")

    monkeypatch.setattr(conversion, "preflight", preflight)
    monkeypatch.setattr(conversion, "require_providers", require_providers)
    monkeypatch.setattr("attn_export.validation.runners.prestart_onnxruntime", lambda _timeout_s: None)
    return seen


def test_convert_hands_the_library_the_groups_it_would_build(captured, tmp_path):
    result = invoke("convert", "llama.pt", "--to", "tensorrt", "-o", tmp_path / "m.engine", "--opset", "23",
                    "--onnx-attention", "standard", "--dtype", "fp16", "--with-past", "--genai-config",
                    "--ort-provider", "cpu", "--ort-provider", "cuda", "--plugin", "lib.so",
                    "--min-shapes", "input_ids:1x1", "--max-shapes", "input_ids:4x64", "--workspace-mib", "512",
                    "--max-context", "64", "--min-replaced", "2", "--runtime-timeout", "50", "--new-tokens", "4",
                    "--seed", "3", "--verbose")
    assert result.returncode == 2 and "stopped before the model" in result.stderr, result.stderr
    assert captured["options"] == ConvertOptions(
        tmp_path / "m.engine", to="tensorrt", genai_config=True,
        export=ExportOptions(opset=23, attention="standard", dtype="fp16", with_past=True, seed=3, quiet=False),
        ort=OrtOptions(providers=("cpu", "cuda")),
        engine=EngineOptions(plugin="lib.so", min_shapes={"input_ids": (1, 1)}, max_shapes={"input_ids": (4, 64)},
                             workspace_mib=512, max_context=64),
        coverage=CoverageOptions(min_replaced=2),
        gate=GateOptions(seed=3, runtime_timeout_s=50.0, new_tokens=4))


def test_convert_defaults_are_the_librarys(captured):
    invoke("convert", "model.pt")
    assert captured["options"] == ConvertOptions("model.onnx")


def test_validate_hands_the_library_the_same_groups(captured):
    result = invoke("validate", "model.pt", "model.onnx", "--ort-provider", "tensorrt", "--ort-trt-fp16",
                    "--plugin", "lib.so", "--runtime-timeout", "7")
    assert "stopped before the model" in result.stderr, result.stderr
    assert captured == {"ort": OrtOptions(providers=("tensorrt",), trt_fp16=True), "timeout_s": 7.0,
                        "plugin": "lib.so"}


def test_a_value_a_group_refuses_is_one_line_and_exit_2():
    result = invoke("convert", "model.pt", "--onnx-attention", "standard", "--opset", "20")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --onnx-attention standard needs --opset 23 or later (the standard "
                                     "Attention operator is opset 23); got 20")
