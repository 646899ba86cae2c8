"""ONNX Runtime's execution providers in the gate (--ort-provider cpu|cuda|tensorrt), up to the
provider boundary without a GPU: option parsing, what the installed ONNX Runtime and the machine
have (asked of ONNX Runtime's own process), the exit-2 messages, the session options of the CUDA
and TensorRT providers as ONNX Runtime documents them, the plugin preflight against a stand-in
TensorRT registry, the tolerance of TF32/fp16 math, and ONNX Runtime's silent fall back to the
CPU — reproduced for real here: the CPU build drops a CUDA provider it does not have with a
warning. The GPU tests at the end (``cuda`` marker, scripts/gpu_check.sh) run the CUDA and
TensorRT providers against PyTorch; they skip here with the reason."""
import copy
import math
import shutil
import sys
import tempfile
import types
from pathlib import Path

import onnx
import pytest
import torch

from attn_export import tensorrt as attn_trt
from attn_export.errors import InputError
from attn_export.options import OrtOptions
from attn_export.validation import OnnxRuntimeRunner, Runner, providers, run_cases, tolerance, validate
from attn_export.validation import worker as worker_module
from helpers import invoke, one_line_error

H200 = providers.Gpu("NVIDIA H200", (9, 0))
GPU_BUILD = providers.MachineFacts("1.32.0", ("TensorrtExecutionProvider", "CUDAExecutionProvider",
                                              "CPUExecutionProvider"), (H200,))
CPU_BUILD = providers.MachineFacts("1.32.0", ("AzureExecutionProvider", "CPUExecutionProvider"), (),
                                   "no NVIDIA driver: libcuda.so.1: cannot open shared object file")


# --------------------------------------------------------------------------------------------
# Choosing providers, and what is missing
# --------------------------------------------------------------------------------------------

def test_providers_are_kept_in_order_and_checked():
    assert providers.parse_providers([]) == ("cpu",)
    assert providers.parse_providers(["tensorrt", "CPU"]) == ("tensorrt", "cpu")
    with pytest.raises(InputError, match="unknown ONNX Runtime provider 'rocm'; choose from cpu, cuda, tensorrt"):
        providers.parse_providers(["rocm"])
    with pytest.raises(InputError, match="provider cpu given twice"):
        providers.parse_providers(["cpu", "cuda", "cpu"])
    with pytest.raises(InputError, match="go with --ort-provider tensorrt"):
        providers.parse_providers(["cpu"], trt_fp16=True)


@pytest.mark.parametrize("names, facts, words", [
    (["cuda"], CPU_BUILD, ["has no CUDAExecutionProvider (it has AzureExecutionProvider, CPUExecutionProvider)",
                           "pip install 'attn-export[gpu]'", "onnxruntime-gpu, which replaces the CPU wheel"]),
    (["cpu", "tensorrt"], providers.MachineFacts("1.32.0", ("CUDAExecutionProvider", "CPUExecutionProvider"), (H200,)),
     ["--ort-provider tensorrt", "has no TensorrtExecutionProvider"]),
    (["tensorrt"], providers.MachineFacts("1.32.0", GPU_BUILD.available, (), "the NVIDIA driver sees no GPU"),
     ["no usable NVIDIA GPU (the NVIDIA driver sees no GPU)"]),
], ids=["cpu-build", "no-tensorrt-provider", "no-gpu"])
def test_missing_provider_or_gpu_says_what_to_install(names, facts, words):
    with pytest.raises(providers.ProviderUnavailable) as err:
        providers.require_providers(names, facts)
    assert err.value.exit_code == 2
    for word in words:
        assert word in str(err.value)


def test_this_machine_is_asked_in_onnxruntimes_process():
    import onnxruntime as ort

    facts = providers.probe(60)
    assert facts.onnxruntime == ort.__version__
    assert set(facts.available) == set(ort.get_available_providers())
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # this CPU machine
        with pytest.raises(providers.ProviderUnavailable, match=r"attn-export\[gpu\]"):
            providers.require_providers(["cuda"], facts)
    providers.require_providers(["cpu"], facts)


def _fail_if_probed(_timeout_s):
    raise AssertionError("the default provider must not wait for ONNX Runtime's process")


def test_cli_gpu_provider_without_onnxruntime_gpu_exits_2_before_loading(tmp_path, monkeypatch):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():  # else this machine's own answer is checked
        monkeypatch.setattr(providers, "probe", lambda _timeout_s: CPU_BUILD)
    # Neither file exists: the provider check comes first.
    one_line_error(invoke("validate", tmp_path / "model.pt", tmp_path / "model.onnx", "--ort-provider", "cuda"),
                   "--ort-provider cuda", "pip install 'attn-export[gpu]'")
    one_line_error(invoke(tmp_path / "model.pt", "--to", "onnx", "--ort-provider", "cpu", "--ort-provider", "cuda"),
                   "has no CUDAExecutionProvider")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, words", [
    (["validate", "m.pt", "m.onnx", "--ort-provider", "cpu", "--ort-provider", "cpu"], ["provider cpu given twice"]),
    (["validate", "m.pt", "m.onnx", "--ort-trt-fp16"], ["go with --ort-provider tensorrt"]),
    (["validate", "m.pt", "m.onnx", "--plugin", "lib.so"], ["--plugin goes with --engine or --ort-provider tensorrt"]),
    (["m.pt", "--to", "onnx", "--no-validate", "--ort-provider", "cuda"], ["choose how the export is validated"]),
])
def test_cli_provider_usage_errors(monkeypatch, args, words):
    monkeypatch.setattr(providers, "probe", _fail_if_probed)
    one_line_error(invoke(*args), *words)


# --------------------------------------------------------------------------------------------
# The session each provider gets (names and values as ONNX Runtime documents them)
# --------------------------------------------------------------------------------------------

def test_session_options_of_the_gpu_provider():
    (setup,) = providers.provider_setups(["cuda"], None, facts=GPU_BUILD)
    assert setup.backend == "onnxruntime-cuda"
    assert setup.session_providers == (("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "1"}),
                                       ("CPUExecutionProvider", {}))
    assert setup.device == "cuda:0 (NVIDIA H200, sm_90)" and setup.precision == "tf32"
    turing = providers.MachineFacts("1.32.0", GPU_BUILD.available, (providers.Gpu("T4", (7, 5)),))
    assert providers.provider_setups(["cuda"], None, facts=turing)[0].precision is None  # no TF32 before Ampere


def test_tensorrt_session_options_and_plugin_preflight(tmp_path):
    from trt_stand_ins import Creator, Registry, one_node_model, shared_library

    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler (for a library with TensorRT's entry points)")
    library = shared_library(tmp_path, "entry", 'extern "C" void* getCreators(int& n) { n = 0; return nullptr; }\n'
                                                 'extern "C" void setLoggerFinder(void*) {}\n')
    model = one_node_model(onnx.TensorProto.FLOAT)  # one FusedAttention node, as the exporter writes it
    registry = Registry([Creator()])
    attn_trt.plugin_library._REGISTERED.clear()
    try:
        assert providers.tensorrt_plugin(model, library, registry=registry) == library
        assert registry.loaded == [str(library.resolve())]
        with pytest.raises(attn_trt.PluginError, match="TensorRT has FusedAttention only as version '1'"):
            providers.tensorrt_plugin(model, library, registry=Registry([Creator(version="1")]))
    finally:
        attn_trt.plugin_library._REGISTERED.clear()

    cache = tmp_path / "cache" / "trt"
    setup = providers.tensorrt_setup(H200, plugin=library, cache_dir=cache, fp16=True)
    assert setup.backend == "onnxruntime-tensorrt" and setup.precision == "fp16"
    assert cache.is_dir()
    assert setup.session_providers == (
        ("TensorrtExecutionProvider", {"device_id": "0", "trt_fp16_enable": "True",
                                       "trt_extra_plugin_lib_paths": str(library.resolve()),
                                       "trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache)}),
        ("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "1"}),
        ("CPUExecutionProvider", {}))
    plain = providers.tensorrt_setup(H200)
    assert plain.precision == "tf32" and "trt_extra_plugin_lib_paths" not in plain.session_providers[0][1]


def test_a_model_without_fusedattention_nodes_needs_no_plugin(monkeypatch):
    monkeypatch.setattr(attn_trt, "find_plugin_library", lambda *_a: pytest.fail("no plugin is needed"))
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph)
    assert providers.tensorrt_plugin(model, None) is None
    (setup,) = providers.provider_setups(["tensorrt"], model, facts=GPU_BUILD)
    assert setup.plugin is None and "without the plugin" in setup.notes[0]


def test_tolerance_follows_the_compute_precision():
    k = 64
    assert tolerance(torch.float32, k) == pytest.approx(8 * 2.0 ** -23 * 8)
    assert tolerance(torch.float32, k, "tf32") == pytest.approx(8 * 2.0 ** -10 * 8)  # TF32: 10 mantissa bits
    assert tolerance(torch.float32, k, "fp16") == pytest.approx(8 * 2.0 ** -10 * 8)
    assert tolerance(torch.bfloat16, k, "tf32") == pytest.approx(8 * 2.0 ** -7 * 8)  # bf16 is coarser still


class Noisy(Runner):
    """A backend whose outputs carry a relative error of 1e-4: TF32-sized, far above float32's."""

    def __init__(self, name, precision=None):
        self.name, self.precision = name, precision

    def run(self, inputs):
        return [inputs["x"] * (1 + 1e-4)]


class Exact(Runner):
    name = "reference"

    def run(self, inputs):
        return [inputs["x"].clone()]


def test_each_runner_is_judged_at_its_own_precision():
    results = run_cases(Exact(), [Noisy("tf32-backend", "tf32"), Noisy("fp32-backend")],
                        [("example", {"x": torch.randn(4, 64)})], ["y"],
                        rtol_for=lambda _inputs, precision: tolerance(torch.float32, 64, precision))
    by_backend = {r.backend: r for r in results}
    assert by_backend["tf32-backend"].passed and by_backend["tf32-backend"].rtol == tolerance(torch.float32, 64, "tf32")
    assert not by_backend["fp32-backend"].passed and by_backend["fp32-backend"].rtol == tolerance(torch.float32, 64)


# --------------------------------------------------------------------------------------------
# ONNX Runtime's silent fall back to the CPU
# --------------------------------------------------------------------------------------------

class StandInSession:
    """An InferenceSession that, like ONNX Runtime's, keeps only the providers that started."""

    started = ("CPUExecutionProvider",)

    def __init__(self, path, options, providers):
        self.requested = providers

    def get_providers(self):
        return [p if isinstance(p, str) else p[0] for p in self.requested if (p if isinstance(p, str) else p[0])
                in self.started]

    def get_inputs(self):
        return [types.SimpleNamespace(name="x", type="tensor(float)")]

    def get_outputs(self):
        return [types.SimpleNamespace(name="y")]


def test_worker_passes_the_options_and_reports_the_sessions_providers(monkeypatch):
    stand_in = types.ModuleType("onnxruntime")
    stand_in.__version__ = "0.0-stand-in"
    stand_in.SessionOptions = lambda: types.SimpleNamespace(add_session_config_entry=lambda *a: None)
    stand_in.GraphOptimizationLevel = types.SimpleNamespace(ORT_ENABLE_ALL=99)
    stand_in.InferenceSession = StandInSession
    monkeypatch.setitem(sys.modules, "onnxruntime", stand_in)
    (setup,) = providers.provider_setups(["cuda"], None, facts=GPU_BUILD)
    as_sent = OnnxRuntimeRunner("m.onnx", setup).providers  # what the runner pickles to the child
    backend = worker_module.OnnxRuntimeBackend("m.onnx", "ORT_ENABLE_ALL", as_sent)
    assert backend.session.requested == [("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "1"}),
                                         ("CPUExecutionProvider", {})]
    info = backend.info()
    assert info["providers"] == ["CPUExecutionProvider"]
    problem = providers.fallback_problem(setup, info["providers"],
                                         "[W:onnxruntime] Failed to create CUDAExecutionProvider. Require cuDNN 9")
    assert problem.startswith("ONNX Runtime fell back to CPUExecutionProvider: CUDAExecutionProvider did not start")
    assert "Require cuDNN 9" in problem
    assert providers.fallback_problem(setup, ["CUDAExecutionProvider", "CPUExecutionProvider"]) is None
    trt = providers.tensorrt_setup(H200)
    assert "TensorrtExecutionProvider did not start" in providers.fallback_problem(
        trt, ["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_gate_reports_the_fall_back_of_a_real_onnxruntime(small_seq2seq, exported_seq2seq, monkeypatch):
    """The CPU build of ONNX Runtime drops the CUDA provider with a warning and runs on the
    CPU: the CUDA row must fail, saying so, while the CPU row passes."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider: no fall back to reproduce")
    monkeypatch.setattr(providers, "probe", lambda _timeout_s: GPU_BUILD)  # pretend the GPU build and a GPU
    report = validate(small_seq2seq, exported_seq2seq.path, small_seq2seq.example_inputs,
                      ort=OrtOptions(providers=("cpu", "cuda")))
    assert not report.passed
    (cuda_row,) = [c for c in report.cases if c.backend == "onnxruntime-cuda"]
    assert cuda_row.status == "error"
    assert "fell back to CPUExecutionProvider: CUDAExecutionProvider did not start" in cuda_row.message
    assert "CUDAExecutionProvider" in cuda_row.message.split("did not start", 1)[1], "ONNX Runtime's own words"
    assert all(c.passed for c in report.cases if c.backend == "onnxruntime")
    entries = {e["backend"]: e for e in report.environment["onnxruntime_execution_providers"]}
    assert entries["onnxruntime-cuda"]["session_has"] == ["CPUExecutionProvider"]
    assert entries["onnxruntime-cuda"]["precision"] == "tf32" and entries["onnxruntime"]["precision"] == "model dtype"
    assert report.environment["onnxruntime_providers"] == ["CPUExecutionProvider", "CUDAExecutionProvider"]


# --------------------------------------------------------------------------------------------
# On a GPU with onnxruntime-gpu (scripts/gpu_check.sh). Plain functions without fixtures, named
# test_cuda_*, so that tests/run_without_pytest.py runs them too (-k ::test_cuda_).
# --------------------------------------------------------------------------------------------

def _gpu_provider_missing(name):
    try:
        facts = providers.probe(120)
        providers.require_providers([name], facts)
    except providers.ProviderUnavailable as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "PyTorch sees no GPU (a CUDA build of PyTorch is needed for the reference on the GPU)"
    return None


def _exported_tiny(directory):
    from attn_export.examples import TinySeq2Seq
    from attn_export.onnx import export_onnx

    torch.manual_seed(0)
    model = TinySeq2Seq(features=8, d_model=16, heads=2, layers=1).eval()
    path = Path(directory) / "tiny.onnx"
    export_onnx(model, model.example_inputs, path)
    return model, path


@pytest.mark.cuda
def test_cuda_provider_matches_pytorch_on_the_gpu():
    from attn_export.onnx import flatten_outputs
    from attn_export.validation import compare, reduction_length

    missing = _gpu_provider_missing("cuda")
    if missing:
        pytest.skip(missing)
    with tempfile.TemporaryDirectory() as d:
        model, path = _exported_tiny(d)
        inputs = model.example_inputs
        report = validate(model, path, inputs, ort=OrtOptions(providers=("cuda",)))
        assert report.passed, "\n".join(report.lines())
        (entry,) = report.environment["onnxruntime_execution_providers"]
        assert entry["session_has"][0] == "CUDAExecutionProvider"
        # Against the original model run by PyTorch on the GPU (float32; PyTorch's TF32 is off by default).
        (setup,) = providers.provider_setups(["cuda"], onnx.load(str(path)))
        runner = OnnxRuntimeRunner(path, setup)
        runner.load()
        try:
            got = runner.run(inputs)
        finally:
            runner.close()
        with torch.no_grad():
            expected = flatten_outputs(copy.deepcopy(model).cuda()(**{n: t.cuda() for n, t in inputs.items()}))
        rtol = tolerance(torch.float32, reduction_length(model, inputs, {}), setup.precision)
        for g, e in zip(got, expected):
            result = compare(g, e.cpu(), rtol)
            assert result["passed"], result["message"]


@pytest.mark.cuda
def test_cuda_tensorrt_provider_runs_the_nodes_with_the_plugin():
    missing = _gpu_provider_missing("tensorrt")
    if not missing:
        try:
            attn_trt.import_tensorrt()
            attn_trt.find_plugin_library()
        except (attn_trt.TensorRTUnavailable, attn_trt.PluginError) as exc:
            missing = str(exc)
    if missing:
        pytest.skip(missing)
    with tempfile.TemporaryDirectory() as d:
        model, path = _exported_tiny(d)
        cache = Path(d) / "trt-cache"
        report = validate(model, path, model.example_inputs, ort=OrtOptions(providers=("tensorrt",), trt_cache_dir=cache))
        assert report.passed, "\n".join(report.lines())
        (entry,) = report.environment["onnxruntime_execution_providers"]
        assert entry["session_has"][0] == "TensorrtExecutionProvider" and entry["plugin_library"]
        assert any(cache.iterdir()), "TensorRT's engines are cached in the directory given"
        assert not math.isnan(max(c.max_rel_err for c in report.cases if c.backend == "onnxruntime-tensorrt"))
