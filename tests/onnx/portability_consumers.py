"""ONNX consumers that install from the package index, each as one function: given an exported
file (and a folder to write into), a runner ``feeds -> outputs`` of what that consumer makes of
it. Tools that rewrite a model (optimizers, converters, the quantizer) hand their result to ONNX
Runtime; runtimes (onnx.reference, OpenVINO) run it themselves. A consumer whose package is
missing raises ``Missing`` with the reason, which the test turns into a skip."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import onnx

Runner = Callable[[Dict[str, np.ndarray]], List[np.ndarray]]


class Missing(Exception):
    """The consumer's package is not installed."""


def _need(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Missing(f"{package} is not installed ({exc}); pip install {package}") from exc


def ort_runner(model, level: str = "ORT_ENABLE_ALL") -> Runner:
    """ONNX Runtime (CPU) on a path or a ModelProto, at an optimization level."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    source = model if isinstance(model, (str, Path)) else model.SerializeToString()
    session = ort.InferenceSession(str(source) if isinstance(source, Path) else source, options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda feeds: session.run(None, {n: feeds[n] for n in names})


def _saved(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save_model(model, str(path))
    return path


def reference(path: Path, work: Path) -> Runner:
    """onnx.reference.ReferenceEvaluator: onnx's own Python implementation of every operator."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(onnx.load(str(path)))
    return lambda feeds: evaluator.run(None, {n: feeds[n] for n in evaluator.input_names})


def checker(path: Path, work: Path) -> Runner:
    """onnx.checker (full check) and strict shape inference; the checked model runs in ONNX Runtime."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    return ort_runner(inferred)


def onnxslim(path: Path, work: Path) -> Runner:
    slim = _need("onnxslim", "onnxslim")
    return ort_runner(_saved(slim.slim(onnx.load(str(path))), work / "slim.onnx"))


def onnxsim(path: Path, work: Path) -> Runner:
    sim = _need("onnxsim", "onnxsim")
    model, ok = sim.simplify(onnx.load(str(path)))
    assert ok, "onnxsim could not validate its simplified model"
    return ort_runner(_saved(model, work / "sim.onnx"))


def graphsurgeon(path: Path, work: Path) -> Runner:
    """onnx-graphsurgeon's round trip: import, fold constants, clean up, toposort, export."""
    gs = _need("onnx_graphsurgeon", "onnx-graphsurgeon")
    graph = gs.import_onnx(onnx.load(str(path)))
    graph.fold_constants().cleanup().toposort()
    return ort_runner(_saved(gs.export_onnx(graph), work / "gs.onnx"))


def polygraphy_sanitize(path: Path, work: Path) -> Runner:
    """``polygraphy surgeon sanitize --fold-constants`` (the console script as users run it)."""
    _need("polygraphy", "polygraphy")
    _need("onnx_graphsurgeon", "onnx-graphsurgeon")
    out = work / "sanitized.onnx"
    script = Path(sys.executable).with_name("polygraphy")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "polygraphy"]
    done = subprocess.run([*command, "surgeon", "sanitize", str(path), "--fold-constants", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"polygraphy surgeon sanitize failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return ort_runner(out)


def onnx_ir(path: Path, work: Path) -> Runner:
    """onnx_ir's load and save (the IR onnxscript's tools work on)."""
    ir = _need("onnx_ir", "onnx-ir")
    out = work / "ir.onnx"
    ir.save(ir.load(str(path)), str(out))
    return ort_runner(out)


def ort_offline(path: Path, work: Path) -> Runner:
    """ONNX Runtime's offline optimization (``optimized_model_filepath`` at the extended level,
    the portable one), the optimized file run with optimizations off."""
    import onnxruntime as ort

    out = work / "ort_optimized.onnx"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return ort_runner(out, level="ORT_DISABLE_ALL")


def ort_quantize(path: Path, work: Path) -> Runner:
    """ONNX Runtime's ``quantize_dynamic`` (int8 weights of MatMul/Gemm). It takes ``ai.onnx``
    Attention for its contrib op of the same name: on the standard flavor it is told to quantize
    MatMul and Gemm only, the documented workaround (docs/onnx_consumers.md).

    Weights in 7 bits (``reduce_range``): ONNX Runtime's uint8 x int8 kernels on x86 CPUs without
    VNNI (AVX2, AVX-512 before VNNI) saturate with 8-bit weights, so the default quantization's
    error depends on the CPU: 14-28% of the output's scale on an AVX2 EPYC, on torch.onnx's own
    export too, and within 1e-2 on an AVX-512 VNNI one. With 7 bits it is within 2e-2 on the AVX2 one."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = work / "quantized.onnx"
    standard = any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in onnx.load(str(path)).graph.node)
    only = {"op_types_to_quantize": ["MatMul", "Gemm"]} if standard else {}
    quantize_dynamic(str(path), str(out), weight_type=QuantType.QInt8, reduce_range=True, **only)
    return ort_runner(out)


def openvino(path: Path, work: Path) -> Runner:
    """OpenVINO's ONNX frontend and CPU plugin, float32 inference precision (its default on a
    CPU with bfloat16 units is bfloat16)."""
    ov = _need("openvino", "openvino")
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    names = [i.get_any_name() for i in compiled.inputs]

    def run(feeds):
        result = compiled({n: feeds[n] for n in names})
        return [np.asarray(result[o]) for o in compiled.outputs]

    return run


def version_converter(path: Path, work: Path) -> Runner:
    """``onnx.version_converter`` one opset up, run in ONNX Runtime."""
    from onnx import version_converter as vc

    model = onnx.load(str(path))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return ort_runner(vc.convert_version(model, opset + 1))


CONSUMERS = {
    "onnx.reference": reference,
    "onnx checker + strict shape inference": checker,
    "onnxslim": onnxslim,
    "onnxsim": onnxsim,
    "onnx-graphsurgeon": graphsurgeon,
    "polygraphy surgeon sanitize --fold-constants": polygraphy_sanitize,
    "onnx_ir": onnx_ir,
    "ORT offline-optimized": ort_offline,
    "ORT quantize_dynamic": ort_quantize,
    "OpenVINO": openvino,
    "onnx.version_converter": version_converter,
}
# Consumers that do not read model-local functions: they get the function-free export.
NEED_INLINE = {"OpenVINO", "onnx.version_converter"}
