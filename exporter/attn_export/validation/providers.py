"""ONNX Runtime's execution providers in the parity gate: which ones were asked for
(``--ort-provider cpu|cuda|tensorrt``), whether the installed ONNX Runtime and this machine have
them, the session's provider list and options for each, and ONNX Runtime's silent fall back to
the CPU told from the session's actual providers.

    >>> names = parse_providers(["cuda", "tensorrt"])
    >>> setups = provider_setups(names, onnx_model, plugin="libattn_export_trt_plugin.so")
    >>> [s.backend for s in setups]
    ['onnxruntime-cuda', 'onnxruntime-tensorrt']

Each setup is one runner, one backend row of the report. ONNX Runtime itself runs in the gate's
child process (isolation.py, worker.py): the machine facts (available providers, GPUs) come
from there too, and the setup's provider list and options travel there with the load request.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from attn_export.errors import AttnExportError, InputError

CPU, CUDA, TENSORRT = "cpu", "cuda", "tensorrt"
EXECUTION_PROVIDERS = {CPU: "CPUExecutionProvider", CUDA: "CUDAExecutionProvider",
                       TENSORRT: "TensorrtExecutionProvider"}
DEFAULT_PROVIDERS = (CPU,)
_ORT_WORKER = "onnxruntime"  # the kind of warm worker ONNX Runtime's runners (runners.py) and the probe take

INSTALL_ORT_GPU = (
    "pip install 'attn-export[gpu]' pulls onnxruntime-gpu, which replaces the CPU wheel (both are the `onnxruntime` "
    "module): then pip uninstall -y onnxruntime && pip install --force-reinstall --no-deps onnxruntime-gpu "
    "(docs/validation.md)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
TF32_MIN_CAPABILITY = (8, 0)  # Ampere: cuBLAS and TensorRT round float32 matmul inputs to TF32 from here on


class ProviderUnavailable(AttnExportError):
    """An execution provider that was asked for is missing from the installed ONNX Runtime, or
    the machine has no usable GPU (exit 2); the message says what to install."""


def parse_providers(names: Sequence[str], *, trt_cache_dir=None, trt_fp16: bool = False) -> Tuple[str, ...]:
    """The providers in the order given (each once), checked; the TensorRT provider's options
    need that provider. InputError otherwise."""
    names = tuple(str(n).lower() for n in names) or DEFAULT_PROVIDERS
    unknown = [n for n in names if n not in EXECUTION_PROVIDERS]
    if unknown:
        raise InputError(f"unknown ONNX Runtime provider {unknown[0]!r}; choose from {', '.join(EXECUTION_PROVIDERS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InputError(f"ONNX Runtime provider {repeated[0]} given twice; each provider is one backend row")
    if (trt_cache_dir is not None or trt_fp16) and TENSORRT not in names:
        raise InputError("the TensorRT provider's engine cache and fp16 options go with --ort-provider tensorrt")
    return names


# --------------------------------------------------------------------------------------------
# What the machine has: asked of ONNX Runtime's own process
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    name: str
    capability: Tuple[int, int]

    def describe(self, index: int) -> str:
        return f"cuda:{index} ({self.name}, sm_{self.capability[0]}{self.capability[1]})"


@dataclass(frozen=True)
class MachineFacts:
    """What ONNX Runtime's process found: its version, the providers the installed build has
    (``onnxruntime.get_available_providers()``), and the GPUs the CUDA driver sees (or why none)."""

    onnxruntime: str
    available: Tuple[str, ...]
    gpus: Tuple[Gpu, ...] = ()
    gpu_problem: Optional[str] = None

    @classmethod
    def from_probe(cls, reply: dict) -> "MachineFacts":
        return cls(onnxruntime=reply["version"], available=tuple(reply["available"]),
                   gpus=tuple(Gpu(g["name"], tuple(g["capability"])) for g in reply["gpus"]),
                   gpu_problem=reply.get("gpu_problem"))


def probe(timeout_s: float) -> MachineFacts:
    """Asks ONNX Runtime's (warm) child process what it has. The process stays warm for the runners."""
    from attn_export.validation import isolation

    worker = isolation.take(_ORT_WORKER, timeout_s)
    try:
        reply = worker.probe()
    except isolation.RuntimeCrash as exc:
        worker.close()
        raise ProviderUnavailable(f"ONNX Runtime's process died while listing its providers: {exc}") from exc
    isolation.release(worker, _ORT_WORKER)
    return MachineFacts.from_probe(reply)


def require_providers(names: Sequence[str], facts: MachineFacts) -> None:
    """ProviderUnavailable (exit 2) naming what to install when a provider is not in the
    installed ONNX Runtime or a GPU provider has no GPU to run on."""
    for name in names:
        provider = EXECUTION_PROVIDERS[name]
        if provider not in facts.available:
            raise ProviderUnavailable(
                f"--ort-provider {name}: this ONNX Runtime ({facts.onnxruntime}) has no {provider} (it has "
                f"{', '.join(facts.available)}); install the GPU build: {INSTALL_ORT_GPU}"
            )
        if name != CPU and not facts.gpus:
            raise ProviderUnavailable(
                f"--ort-provider {name}: no usable NVIDIA GPU ({facts.gpu_problem or 'the CUDA driver sees none'}); "
                f"{provider} runs on an NVIDIA GPU with its driver installed"
            )


# --------------------------------------------------------------------------------------------
# One runner's session: its provider list, options, device and precision
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProviderSetup:
    """One ONNX Runtime execution provider as one runner uses it: the session's providers in
    priority order with their options (what ``InferenceSession(providers=...)`` takes), where
    it computes, and ``precision``: the precision of its float32 matmuls when lower than float32
    ("tf32", "fp16"; None: the model's dtype), which widens the tolerance (tolerances.py)."""

    name: str
    session_providers: Tuple[Tuple[str, Dict[str, str]], ...]
    device: str = "cpu"
    precision: Optional[str] = None
    plugin: Optional[str] = None
    notes: Tuple[str, ...] = field(default=())

    @property
    def provider(self) -> str:
        return EXECUTION_PROVIDERS[self.name]

    @property
    def backend(self) -> str:
        """The report's row: "onnxruntime" for the CPU (as before providers were a choice)."""
        return "onnxruntime" if self.name == CPU else f"onnxruntime-{self.name}"

    def required(self) -> List[str]:
        """The providers that must be in the session: all but the CPU's, which ONNX Runtime
        always adds for the nodes the others do not take."""
        return [p for p, _ in self.session_providers if p != EXECUTION_PROVIDERS[CPU]]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "provider": self.provider, "device": self.device,
                "precision": self.precision or "model dtype",
                "session_providers": [[p, dict(o)] for p, o in self.session_providers],
                "plugin_library": self.plugin, "notes": list(self.notes)}


CPU_SETUP = ProviderSetup(CPU, ((EXECUTION_PROVIDERS[CPU], {}),))


def cuda_options(device_id: int = 0) -> Dict[str, str]:
    # use_tf32 is the CUDA provider's default (true); spelled out so that the tolerance and the
    # report say what ran. Values are strings: what the Python binding passes to the provider.
    return {"device_id": str(device_id), "use_tf32": "1"}


def tensorrt_options(device_id: int = 0, *, plugin: Optional[str] = None, cache_dir: Optional[str] = None,
                     fp16: bool = False) -> Dict[str, str]:
    """The TensorRT provider's options (its Python binding takes booleans as "True"/"False")."""
    options = {"device_id": str(device_id), "trt_fp16_enable": str(bool(fp16))}
    if plugin is not None:
        options["trt_extra_plugin_lib_paths"] = plugin
    if cache_dir is not None:
        options.update(trt_engine_cache_enable="True", trt_engine_cache_path=cache_dir)
    return options


def _tf32(gpu: Gpu) -> Optional[str]:
    return "tf32" if gpu.capability >= TF32_MIN_CAPABILITY else None


def cuda_setup(gpu: Gpu, device_id: int = 0) -> ProviderSetup:
    return ProviderSetup(CUDA, ((EXECUTION_PROVIDERS[CUDA], cuda_options(device_id)), CPU_SETUP.session_providers[0]),
                         device=gpu.describe(device_id), precision=_tf32(gpu))


def tensorrt_setup(gpu: Gpu, device_id: int = 0, *, plugin: Optional[Path] = None, cache_dir=None,
                   fp16: bool = False) -> ProviderSetup:
    """TensorRT first, the CUDA provider for the nodes TensorRT does not take, then the CPU
    (ONNX Runtime's documented order). TensorRT builds float32 layers with TF32 by default."""
    plugin_path = None if plugin is None else str(Path(plugin).resolve())
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir).resolve()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the TensorRT engine cache {cache_dir}: {exc.strerror or exc}") from exc
        cache = str(cache)
    notes = () if plugin is not None else \
        ("the model has no FusedAttention node: TensorRT runs it without the plugin library",)
    trt = (EXECUTION_PROVIDERS[TENSORRT], tensorrt_options(device_id, plugin=plugin_path, cache_dir=cache, fp16=fp16))
    return ProviderSetup(TENSORRT, (trt, (EXECUTION_PROVIDERS[CUDA], cuda_options(device_id)),
                                    CPU_SETUP.session_providers[0]),
                         device=gpu.describe(device_id), precision="fp16" if fp16 else _tf32(gpu),
                         plugin=plugin_path, notes=notes)


def tensorrt_plugin(onnx_model, plugin=None, *, registry=None, load_library=None) -> Optional[Path]:
    """The plugin library the TensorRT provider loads for the model's FusedAttention nodes, after
    the same preflight as ``--to tensorrt`` (attn_export.tensorrt.preflight: the library loads,
    TensorRT registers a creator under the nodes' name/version/namespace with their fields).
    None when the model has no such node (the standard-Attention flavor needs no plugin).
    PluginError / TensorRTUnavailable (exit 2) otherwise; ``registry``/``load_library`` as for
    preflight (tests pass stand-ins)."""
    from attn_export import tensorrt as attn_trt

    if not attn_trt.plugin_requests(onnx_model):
        return None
    library = attn_trt.find_plugin_library(plugin)
    attn_trt.preflight(onnx_model, library, registry=registry, load_library=load_library)
    return library


def provider_setups(names: Sequence[str], onnx_model, *, facts: Optional[MachineFacts] = None,
                    timeout_s: float = 300.0, plugin=None, trt_cache_dir=None, trt_fp16: bool = False,
                    device_id: int = 0) -> List[ProviderSetup]:
    """One setup per provider name, in order. GPU providers ask ONNX Runtime's process what it
    has first (``facts``: given, or probed) and raise ProviderUnavailable when it lacks them."""
    names = parse_providers(names, trt_cache_dir=trt_cache_dir, trt_fp16=trt_fp16)
    if names == DEFAULT_PROVIDERS:
        return [CPU_SETUP]  # no probe: the CPU provider is in every build
    facts = facts or probe(timeout_s)
    require_providers(names, facts)
    if device_id >= len(facts.gpus):
        raise InputError(f"GPU {device_id} does not exist; the CUDA driver sees {len(facts.gpus)}")
    gpu = facts.gpus[device_id]
    setups = []
    for name in names:
        if name == CPU:
            setups.append(CPU_SETUP)
        elif name == CUDA:
            setups.append(cuda_setup(gpu, device_id))
        else:
            setups.append(tensorrt_setup(gpu, device_id, plugin=tensorrt_plugin(onnx_model, plugin),
                                         cache_dir=trt_cache_dir, fp16=trt_fp16))
    return setups


def fallback_problem(setup: ProviderSetup, session_providers: Sequence[str], log: str = "") -> Optional[str]:
    """ONNX Runtime creates the session with the providers that did start and drops the others
    with no more than a warning (an unavailable provider, or one whose CUDA/cuDNN/TensorRT
    libraries do not load). The session's actual providers tell; ``log`` is ONNX Runtime's
    output, from which its reason is quoted."""
    missing = [p for p in setup.required() if p not in session_providers]
    if not missing:
        return None
    reason = _reason_in_log(log, missing)
    return (f"ONNX Runtime fell back to {', '.join(session_providers) or 'no provider'}: {', '.join(missing)} did not "
            f"start" + (f" ({reason})" if reason else "") + "; the model did not run where it was asked to")


def _reason_in_log(log: str, providers: Sequence[str]) -> str:
    lines = [_ANSI.sub("", line).strip() for line in log.splitlines() if line.strip()]  # ONNX Runtime colours its log
    for line in reversed(lines):
        if any(p in line for p in providers) or "EP Error" in line:
            return line[:300]
    return ""


def environment_entry(setup: ProviderSetup, session_providers: Optional[Sequence[str]]) -> dict:
    """The report's facts about one runner's provider: the setup plus what the session had."""
    entry = setup.to_dict()
    entry["session_has"] = list(session_providers) if session_providers is not None else None
    return entry
