"""attn_export.tensorrt and the TensorRT paths of the CLI, without TensorRT: optimization profiles
from the graph's dynamic axes, what the nodes ask the plugin for, the preflight's error paths
(with stand-ins for TensorRT's plugin registry and real shared libraries), exit codes and
messages where TensorRT or a GPU is missing, and the TensorRT backend of the parity gate with a
stand-in engine. What needs TensorRT and a GPU is in test_tensorrt_gpu.py (skipped here)."""
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from attn_export import spec as spec_mod
from attn_export import tensorrt as attn_trt
from attn_export.errors import InputError
from attn_export.shapes import label_kinds, shape_cases
from attn_export.validation import BACKEND_TRT
from helpers import invoke, one_line_error, run
from trt_stand_ins import Creator, Registry, one_node_model, shared_library

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")

try:
    import tensorrt  # noqa: F401

    HAVE_TENSORRT = True
except Exception:  # noqa: BLE001
    HAVE_TENSORRT = False


@pytest.fixture(autouse=True)
def _fresh_registry_cache():
    attn_trt.plugin_library._REGISTERED.clear()
    yield
    attn_trt.plugin_library._REGISTERED.clear()


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seq2seq_onnx(exported_seq2seq):
    return onnx.load(str(exported_seq2seq.path))


def test_default_profile_from_the_dynamic_axes(seq2seq_onnx, small_seq2seq):
    inputs = small_seq2seq.example_inputs
    profile = attn_trt.derive_profile(seq2seq_onnx, inputs)
    assert attn_trt.graph_input_dims(seq2seq_onnx) == {
        "src": ["batch", "seq", 8], "tgt": ["batch", "tgt_seq", 8], "src_key_padding_mask": ["batch", "seq"]}
    assert profile.shapes["src"] == ((1, 1, 8), tuple(inputs["src"].shape), (8, 64, 8))
    assert profile.shapes["src_key_padding_mask"] == ((1, 1), (2, 16), (8, 64))  # tied to src by the labels
    # tgt_seq: 4 x 12 = 48 < the validator's long case (2 x 16 + 2 = 50 for the second sequence label).
    assert profile.labels == {"batch": (1, 2, 8), "seq": (1, 16, 64), "tgt_seq": (1, 12, 50)}
    assert profile.lines()[0] == "src: min 1x1x8  opt 2x16x8  max 8x64x8"
    assert json.loads(json.dumps(profile.to_dict()))["dimensions"]["seq"] == {"min": 1, "opt": 16, "max": 64}


def test_default_profile_covers_every_shape_the_validator_sweeps(seq2seq_onnx, small_seq2seq):
    from attn_export import inputs as _inputs

    profile = attn_trt.derive_profile(seq2seq_onnx, small_seq2seq.example_inputs)
    axes = {n: {a: d for a, d in enumerate(dims) if isinstance(d, str)}
            for n, dims in attn_trt.graph_input_dims(seq2seq_onnx).items()}
    sizes = _inputs.label_sizes(small_seq2seq.example_inputs, axes)
    for name, overrides in shape_cases(sizes, label_kinds(axes)):
        case = _inputs.resize(small_seq2seq.example_inputs, axes, {**sizes, **overrides})
        assert profile.outside({n: t.shape for n, t in case.items()}) is None, name


def test_profile_options_set_tied_dimensions_once(seq2seq_onnx, small_seq2seq):
    specs = attn_trt.parse_shape_specs(["src:16x100x8"], "--max-shapes")
    profile = attn_trt.derive_profile(seq2seq_onnx, small_seq2seq.example_inputs, max_shapes=specs,
                                      min_shapes=attn_trt.parse_shape_specs(["tgt:2x3x8"], "--min-shapes"))
    assert profile.shapes["src_key_padding_mask"][2] == (16, 100)
    assert profile.shapes["tgt"] == ((2, 3, 8), (2, 12, 8), (16, 50, 8))
    assert profile.outside({"src": (17, 4, 8)}) == "src[0]=17 is outside the engine's profile [2, 16]"


@pytest.mark.parametrize("option, specs, words", [
    ("--max-shapes", ["src:8x100x8,src_key_padding_mask:8x90"], "dimension 'seq' is 100 in src[1] but 90"),
    ("--max-shapes", ["src:8x100x9"], "src[2]=9: that dimension is static (8)"),
    ("--max-shapes", ["src:8x100"], "src has rank 3"),
    ("--max-shapes", ["memory:1x2x3"], "no such engine input"),
    ("--min-shapes", ["src:4x1x8"], "need min <= opt <= max; got 4, 2, 8"),
])
def test_profile_options_that_disagree_with_the_graph(seq2seq_onnx, small_seq2seq, option, specs, words):
    key = {"--min-shapes": "min_shapes", "--max-shapes": "max_shapes"}[option]
    with pytest.raises(InputError, match=None) as err:
        attn_trt.derive_profile(seq2seq_onnx, small_seq2seq.example_inputs,
                                **{key: attn_trt.parse_shape_specs(specs, option)})
    assert words in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("src:1x", "expected NAME:DIMS"), ("src", "expected NAME:DIMS"), ("src:1x2,src:1x3", "src given twice")])
def test_shape_spec_syntax(text, words):
    with pytest.raises(InputError) as err:
        attn_trt.parse_shape_specs([text], "--opt-shapes")
    assert words in str(err.value) and "--opt-shapes" in str(err.value)


def test_example_inputs_must_fit_the_graph(seq2seq_onnx, small_seq2seq):
    inputs = dict(small_seq2seq.example_inputs)
    inputs["src"] = torch.zeros(2, 16, 9)
    with pytest.raises(InputError, match=r"example input src\[2\] is 9; the ONNX graph fixes it to 8"):
        attn_trt.derive_profile(seq2seq_onnx, inputs)
    with pytest.raises(InputError, match="have no example input"):
        attn_trt.derive_profile(seq2seq_onnx, {"src": inputs["src"]})


# --------------------------------------------------------------------------------------------
# What the nodes ask for
# --------------------------------------------------------------------------------------------

def test_nodes_ask_for_the_spec_plugin(seq2seq_onnx):
    s = spec_mod.load()
    (request,) = attn_trt.plugin_requests(seq2seq_onnx)
    assert (request.name, request.version, request.namespace) == (s.plugin_name, s.plugin_version, s.plugin_namespace)
    assert len(request.nodes) == 3 and set(request.types.values()) == {"float32"}
    assert attn_trt.expected_fields() == [("num_heads", "INT32"), ("scale", "FLOAT32"), ("is_causal", "INT32"),
                                          ("has_key_padding_mask", "INT32"), ("has_attn_mask", "INT32"),
                                          ("softcap", "FLOAT32"), ("causal_alignment", "INT32"),
                                          ("kv_num_heads", "INT32"), ("window", "INT32"), ("has_past", "INT32"),
                                          ("alibi_slopes", "FLOAT32")]


def test_node_attributes_decide_version_and_namespace():
    (request,) = attn_trt.plugin_requests(one_node_model(version="7", namespace="acme"))
    assert request.identity() == "FusedAttention version '7' namespace 'acme'"
    assert request.types == {"attn0": "float16"}


# --------------------------------------------------------------------------------------------
# Preflight, with stand-ins for TensorRT's registry and real shared libraries
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """A library exporting the two entry points (not a real plugin: TensorRT is not here), one
    exporting neither, and one that cannot load (a missing dependency)."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    d = tmp_path_factory.mktemp("libs")
    entry = shared_library(d, "entry", 'extern "C" void* getCreators(int& n) { n = 0; return nullptr; }\n'
                                        'extern "C" void setLoggerFinder(void*) {}\n')
    plain = shared_library(d, "plain", 'extern "C" int something() { return 1; }\n')
    dep = shared_library(d, "dep", 'extern "C" int dep() { return 1; }\n')
    broken = d / "libbroken.so"
    subprocess.run(["c++", "-shared", "-fPIC", "-o", str(broken), "-x", "c++", "-", f"-L{d}", "-ldep"],
                   input='extern "C" int dep(); extern "C" int f() { return dep(); }\n', text=True, check=True,
                   capture_output=True)
    dep.unlink()  # libbroken.so now needs a library that is gone
    text = d / "notalib.so"
    text.write_text("not an ELF file\n")
    return {"entry": entry, "plain": plain, "broken": broken, "text": text, "missing": d / "libmissing.so"}


def test_preflight_passes_when_the_creator_matches(libraries, seq2seq_onnx):
    registry = Registry([Creator(), Creator("Other", "3", "x")])
    report = attn_trt.preflight(seq2seq_onnx, libraries["entry"], registry=registry)
    assert registry.loaded == [str(libraries["entry"].resolve())]
    assert report.library.sha256 == attn_trt.file_sha256(libraries["entry"])
    assert f"'FusedAttention' '{spec_mod.load().plugin_version}' ''" in report.creators
    attn_trt.preflight(seq2seq_onnx, libraries["entry"], registry=registry)
    assert len(registry.loaded) == 1, "a library is loaded into the registry once"


@pytest.mark.parametrize("which, words", [
    ("missing", "no such file; build it from attn-export's source repository with `cmake -S plugins/tensorrt"),
    ("text", "does not load"),
    ("broken", "does not load: libdep.so: cannot open shared object file"),
    ("plain", "is not a TensorRT plugin library: it does not export getCreators and setLoggerFinder"),
])
def test_preflight_library_problems(libraries, seq2seq_onnx, which, words):
    with pytest.raises(attn_trt.PluginError) as err:
        attn_trt.preflight(seq2seq_onnx, libraries[which], registry=Registry([Creator()]))
    assert words in str(err.value)


@pytest.mark.parametrize("creators, words", [
    # A plugin built before window (version 3) and a model exported with the current spec (version 6).
    ([Creator(version="3")], "3 node(s) ask for plugin FusedAttention version '6' namespace '', but TensorRT has "
                             "FusedAttention only as version '3' namespace ''"),
    ([Creator(namespace="acme")], "only as version '6' namespace 'acme'"),
    ([Creator("ROIAlign_TRT", "2")], "registered no creator of that name (TensorRT knows 1 creator(s): ROIAlign_TRT)"),
    ([], "registered no creator of that name (TensorRT knows 0 creator(s))"),
    ([Creator(fields=[("num_heads", "INT32"), ("scale", "FLOAT32")])],
     "built from a different csrc/attention_spec.h"),
    ([Creator(fields=[(n, "INT64" if n == "num_heads" else k) for n, k in attn_trt.expected_fields()])],
     "declares fields [('num_heads', 'INT64')"),
])
def test_preflight_creator_problems(libraries, seq2seq_onnx, creators, words):
    with pytest.raises(attn_trt.PluginError) as err:
        attn_trt.preflight(seq2seq_onnx, libraries["entry"], registry=Registry(creators))
    assert words in str(err.value)


def test_preflight_when_tensorrt_refuses_the_library(libraries, seq2seq_onnx):
    with pytest.raises(attn_trt.PluginError, match="TensorRT could not load the plugin library"):
        attn_trt.preflight(seq2seq_onnx, libraries["entry"], registry=Registry([Creator()], handle=None))

    def raising(path):
        raise RuntimeError("loadLibrary: undefined symbol: _ZN8nvinfer1")

    with pytest.raises(attn_trt.PluginError, match="undefined symbol"):
        attn_trt.preflight(seq2seq_onnx, libraries["entry"], registry=Registry([Creator()]), load_library=raising)


@pytest.mark.parametrize("model, capability, words", [
    (one_node_model(TensorProto.DOUBLE), None, "node attn0: query is double; the FusedAttention plugin supports"),
    (one_node_model(mask_type=TensorProto.FLOAT16), None, "node attn0: key_padding_mask is float16"),
    (one_node_model(TensorProto.BFLOAT16), (7, 5), "bfloat16 needs a GPU of compute capability 8.0 or newer"),
])
def test_preflight_refuses_unsupported_types_before_loading_anything(libraries, model, capability, words):
    registry = Registry([Creator()])
    with pytest.raises(attn_trt.PluginError) as err:
        attn_trt.preflight(model, libraries["entry"], registry=registry, compute_capability=capability)
    assert words in str(err.value)
    assert registry.loaded == []


def test_preflight_takes_the_cache_form(libraries):
    """A node in the cache form (has_past: past_key/past_value in, present_key/present_value out)
    asks for the same plugin, with its T from query, key and value."""
    model = one_node_model(past=True)
    (node,) = model.graph.node
    assert (len(node.input), len(node.output)) == (7, 3)
    registry = Registry([Creator()])
    report = attn_trt.preflight(model, libraries["entry"], registry=registry, compute_capability=(8, 0))
    (request,) = report.requests
    assert request.identity() == f"FusedAttention version {spec_mod.load().plugin_version!r} namespace ''"
    assert request.types == {"attn0": "float16"} and registry.loaded == [str(libraries["entry"])]


def test_preflight_accepts_bfloat16_on_ampere(libraries):
    registry = Registry([Creator()])
    report = attn_trt.preflight(one_node_model(TensorProto.BFLOAT16), libraries["entry"], registry=registry,
                                compute_capability=(8, 0))
    (request,) = report.requests
    assert request.types == {"attn0": "bfloat16"} and request.nodes == ["attn0"]
    assert registry.loaded == [str(libraries["entry"])] and report.notes == []


# --------------------------------------------------------------------------------------------
# Finding the library; TensorRT and the GPU missing
# --------------------------------------------------------------------------------------------

def test_find_plugin_library(tmp_path, monkeypatch, libraries):
    monkeypatch.delenv(attn_trt.PLUGIN_ENV, raising=False)
    monkeypatch.setattr(attn_trt.plugin_library, "default_plugin_paths", lambda: [tmp_path / "build" / attn_trt.PLUGIN_FILENAME])
    with pytest.raises(attn_trt.PluginError) as err:
        attn_trt.find_plugin_library()
    assert "was not found (no --plugin, no ATTN_EXPORT_TRT_PLUGIN, not at" in str(err.value)
    assert "-DTENSORRT_ROOT=" in str(err.value)
    assert attn_trt.find_plugin_library(libraries["entry"]) == libraries["entry"]
    monkeypatch.setenv(attn_trt.PLUGIN_ENV, str(libraries["plain"]))
    assert attn_trt.find_plugin_library() == libraries["plain"]
    monkeypatch.setenv(attn_trt.PLUGIN_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(attn_trt.PluginError, match="ATTN_EXPORT_TRT_PLUGIN=.*nope.so: no such file"):
        attn_trt.find_plugin_library()


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here")
def test_missing_tensorrt_says_what_to_install():
    with pytest.raises(attn_trt.TensorRTUnavailable) as err:
        attn_trt.import_tensorrt()
    assert "TensorRT is not installed" in str(err.value) and "pip install tensorrt-cu13" in str(err.value)
    assert err.value.exit_code == 2


def test_tensorrt_before_10_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", type(sys)("tensorrt"))
    sys.modules["tensorrt"].__version__ = "8.6.1"
    with pytest.raises(attn_trt.TensorRTUnavailable, match="TensorRT 8.6.1 has no IPluginV3 support"):
        attn_trt.import_tensorrt()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is available here")
def test_no_gpu_says_so():
    with pytest.raises(attn_trt.TensorRTUnavailable) as err:
        attn_trt.require_gpu()
    assert ("CPU build" in str(err.value)) or ("no usable NVIDIA GPU" in str(err.value))


# --------------------------------------------------------------------------------------------
# The CLI where TensorRT or a GPU is missing
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    from torch import nn

    d = tmp_path_factory.mktemp("trt-cli")
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1).eval()
    model.example_inputs = {"src": torch.randn(2, 8, 16)}
    torch.save(model, d / "model.pt")
    return d


@pytest.mark.slow  # two console-script runs; in process: test_missing_tensorrt_says_what_to_install
@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here")
def test_cli_to_tensorrt_without_tensorrt_exits_2_before_exporting(cli_dir):
    proc = run("model.pt", "--to", "tensorrt", cwd=cli_dir)
    one_line_error(proc, "TensorRT is not installed", "pip install tensorrt-cu13", "docs/tensorrt.md")
    assert not (cli_dir / "model.onnx").exists() and not (cli_dir / "model.engine").exists()
    proc = run("validate", "model.pt", "model.onnx", "--engine", "model.engine", cwd=cli_dir)
    one_line_error(proc, "TensorRT is not installed")


@pytest.mark.slow  # a whole export before the exit (~4 s)
@pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of PyTorch")
def test_cli_with_tensorrt_but_no_gpu_exits_2(cli_dir, tmp_path):
    fake = tmp_path / "site"
    (fake / "tensorrt").mkdir(parents=True)
    (fake / "tensorrt" / "__init__.py").write_text('__version__ = "10.9.0"\n')
    env = {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    proc = run("model.pt", "--to", "tensorrt", env=env, cwd=cli_dir)
    one_line_error(proc, "is a CPU build", "NVIDIA GPU", "download.pytorch.org/whl/cu130")
    proc = run("validate", "model.pt", "model.onnx", "--engine", "model.engine", env=env, cwd=cli_dir)
    one_line_error(proc, "is a CPU build")


def test_cli_tensorrt_options_need_to_tensorrt(cli_dir):
    one_line_error(invoke(cli_dir / "model.pt", "--to", "onnx", "--max-shapes", "src:8x64x16"), "go with --to tensorrt")
    one_line_error(invoke("validate", cli_dir / "model.pt", cli_dir / "model.onnx", "--plugin", "x.so"),
                   "--plugin goes with --engine")


def test_cli_to_tensorrt_checks_the_plugin_and_shapes_before_exporting(cli_dir, tmp_path, monkeypatch, libraries):
    monkeypatch.setattr(attn_trt, "require_runtime", lambda: None)  # as if TensorRT and a GPU were here
    monkeypatch.delenv(attn_trt.PLUGIN_ENV, raising=False)
    monkeypatch.setattr(attn_trt.plugin_library, "default_plugin_paths", lambda: [tmp_path / attn_trt.PLUGIN_FILENAME])
    out = tmp_path / "m.engine"
    one_line_error(invoke(cli_dir / "model.pt", "--to", "tensorrt", "-o", out),
                   "the FusedAttention plugin library was not found")
    one_line_error(invoke(cli_dir / "model.pt", "--to", "tensorrt", "-o", out, "--plugin", libraries["plain"]),
                   "does not export getCreators and setLoggerFinder")
    one_line_error(invoke(cli_dir / "model.pt", "--to", "tensorrt", "-o", out, "--plugin", libraries["entry"],
                          "--max-shapes", "src:8x"), "--max-shapes 'src:8x': expected NAME:DIMS")
    assert not list(tmp_path.glob("m.*")), "nothing is exported when the engine could not be built"


# --------------------------------------------------------------------------------------------
# The TensorRT backend of the parity gate, with a stand-in engine
# --------------------------------------------------------------------------------------------

class FakeEngineRunner:
    """Runs the ONNX model in ONNX Runtime under the EngineRunner interface; ``corrupt`` puts a
    NaN in the first output (what a broken fp16 kernel would do), ``max_seq`` narrows the profile."""

    corrupt = False
    max_seq = 10_000

    def __init__(self, engine_path, *, plugin=None):
        import onnxruntime as ort

        meta = json.loads(Path(str(engine_path) + ".json").read_text())
        self.session = ort.InferenceSession(meta["onnx"], providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.metadata = meta
        self.plugin_library = attn_trt.LibraryInfo(path="fake.so", sha256="0" * 64, size=1)

    def outside_profile(self, inputs):
        for name, t in inputs.items():
            if t.dim() >= 2 and t.shape[1] > self.max_seq:
                return f"{name}[1]={t.shape[1]} is outside the engine's profile [1, {self.max_seq}]"
        return None

    def run(self, inputs):
        outs = self.session.run(None, {n: inputs[n].numpy() for n in self.inputs})
        named = {n: torch.from_numpy(np.asarray(o)) for n, o in zip(self.outputs, outs)}
        if self.corrupt:
            first = named[self.outputs[0]]
            first.view(-1)[0] = float("nan")
        return named


@pytest.fixture(scope="module")
def exported_for_engine(cli_dir):
    from attn_export.onnx import export_onnx

    model = torch.load(cli_dir / "model.pt", weights_only=False)
    onnx_path = cli_dir / "engine-model.onnx"
    result = export_onnx(model, model.example_inputs, onnx_path)
    engine = cli_dir / "engine-model.engine"
    engine.write_bytes(b"not an engine")
    Path(str(engine) + ".json").write_text(json.dumps(
        {"onnx": str(onnx_path), "plugin_layers": result.num_attention_nodes, "plugin": None}))
    return model, onnx_path, engine


@pytest.fixture()
def fake_engine(exported_for_engine, monkeypatch):
    monkeypatch.setattr(attn_trt, "EngineRunner", FakeEngineRunner)
    monkeypatch.setattr(FakeEngineRunner, "corrupt", False)
    monkeypatch.setattr(FakeEngineRunner, "max_seq", 10_000)
    return exported_for_engine


def test_validate_adds_tensorrt_to_the_table_and_reports(fake_engine):
    from attn_export.validation import validate

    model, onnx_path, engine = fake_engine
    FakeEngineRunner.max_seq = 20  # the long sequence falls outside the profile
    report = validate(model, onnx_path, model.example_inputs, engine=engine, isolate=False)  # stand-in lives here
    trt_cases = [c for c in report.cases if c.backend == BACKEND_TRT]
    assert {c.status for c in trt_cases} == {"passed", "skipped"}, report.lines()
    assert any("outside the engine's profile" in c.message for c in trt_cases if c.status == "skipped")
    checks = {c.name: c for c in report.checks}
    assert checks["tensorrt engine"].passed and "plugin layer(s) for" in checks["tensorrt engine"].message
    assert checks["tensorrt coverage"].passed
    assert report.passed, report.failures
    payload = json.loads(report.to_json())
    assert payload["environment"]["engine"] == str(engine) and "tensorrt" in payload["environment"]
    assert any(c["backend"] == "tensorrt" for c in payload["cases"])
    junit = ET.fromstring(report.to_junit_xml())
    assert junit.findall(".//testcase[@classname='attn_export.validate.tensorrt']")


def test_validate_fails_on_a_nan_from_tensorrt(fake_engine):
    from attn_export.validation import validate

    model, onnx_path, engine = fake_engine
    FakeEngineRunner.corrupt = True
    report = validate(model, onnx_path, model.example_inputs, engine=engine, isolate=False)  # stand-in lives here
    assert not report.passed
    failed = [c for c in report.cases if c.backend == BACKEND_TRT and c.status == "failed"]
    assert failed and all("NaN/inf where the reference is finite" in c.message for c in failed)


def test_validate_fails_when_no_case_fits_the_profile(fake_engine):
    from attn_export.validation import validate

    model, onnx_path, engine = fake_engine
    FakeEngineRunner.max_seq = 0
    report = validate(model, onnx_path, model.example_inputs, engine=engine, isolate=False)  # stand-in lives here
    assert not report.passed
    assert any("no case ran in TensorRT" in f for f in report.failures)


# --------------------------------------------------------------------------------------------
# torch2trt
# --------------------------------------------------------------------------------------------

TORCH2TRT_DIR = Path(__file__).resolve().parents[2] / "plugins" / "torch2trt"


def _import_torch2trt_converters(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(TORCH2TRT_DIR))
    monkeypatch.delitem(sys.modules, "attn_export_torch2trt", raising=False)
    return importlib.import_module("attn_export_torch2trt")


def test_torch2trt_converters_import_cleanly_without_torch2trt(monkeypatch):
    import importlib.util

    torch2trt_converters = _import_torch2trt_converters(monkeypatch)
    assert torch2trt_converters.AVAILABLE == (importlib.util.find_spec("torch2trt") is not None)
    assert "unverified" in torch2trt_converters.__doc__.lower()
    assert "attn_export_torch2trt" not in {m.split(".")[-1] for m in sys.modules if m.startswith("attn_export.")}


def test_torch2trt_registration_with_a_stand_in(monkeypatch):
    """With torch2trt importable, both names of the core op get the converter."""
    import importlib

    registered = {}
    package, inner = type(sys)("torch2trt"), type(sys)("torch2trt.torch2trt")
    inner.tensorrt_converter = lambda name: (lambda fn: registered.setdefault(name, fn))
    package.torch2trt = inner
    package.__spec__ = importlib.machinery.ModuleSpec("torch2trt", None)
    monkeypatch.setitem(sys.modules, "torch2trt", package)
    monkeypatch.setitem(sys.modules, "torch2trt.torch2trt", inner)
    module = _import_torch2trt_converters(monkeypatch)
    assert module.REGISTERED
    assert set(registered) == {"attn_export.ops.functional.attention", "attn_export.attention"}
    assert all(fn is module.convert_attention for fn in registered.values())


def test_plugin_field_collection_uses_the_spec_names_and_types():
    trt = type(sys)("tensorrt")
    trt.PluginFieldType = type("PluginFieldType", (), {"INT32": "INT32", "FLOAT32": "FLOAT32"})
    trt.PluginField = lambda name, data, kind: (name, data.dtype.name, data.tolist(), kind)
    trt.PluginFieldCollection = list
    fields = attn_trt.plugin_field_collection(trt, num_heads=4, scale=0.25, is_causal=True, has_attn_mask=True)
    assert fields == [("num_heads", "int32", [4], "INT32"), ("scale", "float32", [0.25], "FLOAT32"),
                      ("is_causal", "int32", [1], "INT32"), ("has_key_padding_mask", "int32", [0], "INT32"),
                      ("has_attn_mask", "int32", [1], "INT32"), ("softcap", "float32", [0.0], "FLOAT32"),
                      ("causal_alignment", "int32", [0], "INT32"), ("kv_num_heads", "int32", [0], "INT32"),
                      ("window", "int32", [0], "INT32"), ("has_past", "int32", [0], "INT32")]
    capped = attn_trt.plugin_field_collection(trt, num_heads=4, scale=0.25, softcap=50.0)
    assert capped[5] == ("softcap", "float32", [50.0], "FLOAT32")
    grouped = attn_trt.plugin_field_collection(trt, num_heads=4, scale=0.25, is_causal=True, causal_alignment=1,
                                               kv_num_heads=2, window=5, has_past=True)
    assert grouped[6:] == [("causal_alignment", "int32", [1], "INT32"), ("kv_num_heads", "int32", [2], "INT32"),
                           ("window", "int32", [5], "INT32"), ("has_past", "int32", [1], "INT32")]


# --------------------------------------------------------------------------------------------
# Docs
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
TRT_DOCS = [ROOT / "docs" / "tensorrt.md", ROOT / "docs" / "cli.md", ROOT / "plugins" / "tensorrt" / "README.md",
            ROOT / "README.md"]


def test_docs_use_only_options_that_exist():
    import re

    from attn_export.cli import main

    def options(*verbs):
        # secondary_opts: the off side of a flag pair (--last-logits/--all-logits)
        return {opt for verb in verbs for p in main.commands[verb].params for opt in [*p.opts, *p.secondary_opts]}

    # A line that names a verb is held to that verb's options; the others (`attn-export MODEL`, a
    # continuation line) to those of convert and validate.
    default = options("convert", "validate")
    cmake = (ROOT / "plugins" / "tensorrt" / "CMakeLists.txt").read_text()
    for doc in TRT_DOCS:
        text = doc.read_text()
        for line in re.findall(r"^\s*(?:attn-export \S.*|--\S.*)$", text, flags=re.M):
            words = line.split()
            verb = words[1] if words[0] == "attn-export" and words[1] in main.commands else None
            allowed = options(verb) if verb else default
            for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
                assert opt in allowed, f"{doc.name}: {opt} in {line.strip()!r}"
        for var in re.findall(r"-D([A-Z][A-Z0-9_]+)=", text):
            assert var in cmake, f"{doc.name}: -D{var} is not a variable of plugins/tensorrt/CMakeLists.txt"
