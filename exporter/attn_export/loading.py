"""Loading models without running code from the file.

``torch.save(model)`` writes a pickle, and unpickling can call any function the file names.
:func:`load_model` therefore uses ``torch.load(weights_only=True)`` with an explicit, audited
allowlist (:data:`ALLOWED_GLOBALS`: torch.nn module classes and activation functions that
unpickle as plain data, plus this package's own layer), so models built from torch.nn alone
(``nn.TransformerEncoder`` and friends) load with no flag. Anything else is refused before any
byte is unpickled, with the names of the classes and the two ways forward:

* ``allow_classes=["pkg.module:Class"]`` (CLI ``--allow-class``): the class is imported by name
  from the installed package and allowlisted;
* ``trust_file=True`` (CLI ``--trust-model-file``): full unpickling, which executes whatever
  code the file names. Only for files you trust.

Models built by code: :func:`load_factory` (``--model module:factory``, optionally with
``--weights state_dict.pt``, loaded weights-only).
"""
from __future__ import annotations

import importlib
import pickle
import re
import sys
import zipfile
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch
from torch import nn

from attn_export.errors import InputError, first_line as _first_line
from attn_export.ops.module import StockMultiheadAttention

# The audited allowlist, as (module, qualified name). Each entry is a torch.nn class whose
# unpickling only restores attributes (no __reduce__/__setstate__ that runs external code),
# or an activation function stored by reference (TransformerEncoderLayer keeps F.relu/F.gelu).
_NN_CLASSES = {
    "torch.nn.modules.container": ["Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"],
    "torch.nn.modules.linear": ["Linear", "Bilinear", "Identity", "NonDynamicallyQuantizableLinear"],
    "torch.nn.modules.sparse": ["Embedding", "EmbeddingBag"],
    "torch.nn.modules.normalization": ["LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm"],
    "torch.nn.modules.batchnorm": ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"],
    "torch.nn.modules.dropout": ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout"],
    "torch.nn.modules.activation": [
        "MultiheadAttention", "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid", "Softmax",
        "LogSoftmax", "LeakyReLU", "ELU", "SELU", "CELU", "GLU", "Hardswish", "Hardsigmoid", "Hardtanh",
        "Softplus", "Softsign", "PReLU", "Tanhshrink", "Threshold",
    ],
    "torch.nn.modules.transformer": [
        "Transformer", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
        "TransformerDecoderLayer",
    ],
    "torch.nn.modules.conv": ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d"],
    "torch.nn.modules.pooling": ["AvgPool1d", "AvgPool2d", "MaxPool1d", "MaxPool2d", "AdaptiveAvgPool1d",
                                 "AdaptiveAvgPool2d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d"],
    "torch.nn.modules.flatten": ["Flatten", "Unflatten"],
    "torch.nn.modules.padding": ["ZeroPad1d", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d"],
    "torch.nn.modules.pixelshuffle": ["PixelShuffle", "PixelUnshuffle"],
    "torch.nn.modules.upsampling": ["Upsample"],
}
_FUNCTIONS = {
    "torch.nn.functional": ["relu", "relu6", "silu", "elu", "leaky_relu", "mish", "glu", "hardswish"],
    "torch._C._nn": ["gelu", "softplus"],
}
_OWN = {"attn_export.ops.module": ["FusedMultiheadAttention", "_keep_native_fast_paths_off"]}
# Names a code base may rebind to the drop-in (``torch.nn.MultiheadAttention =
# FusedMultiheadAttention``) before this module is imported: the allowlist holds the real class.
_PINNED = {("torch.nn.modules.activation", "MultiheadAttention"): StockMultiheadAttention}


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _allowlist() -> List[object]:
    objects = []
    for table in (_NN_CLASSES, _FUNCTIONS, _OWN):
        for module, names in table.items():
            for name in names:
                try:
                    objects.append(_PINNED.get((module, name)) or _resolve(module, name))
                except (ImportError, AttributeError):  # not in this torch version
                    continue
    return objects


ALLOWED_GLOBALS = _allowlist()


def global_name(obj) -> str:
    """The name a pickle uses for ``obj``: ``module.qualname``."""
    return f"{obj.__module__}.{obj.__qualname__}"


def as_cli_name(dotted: str) -> str:
    """``pkg.mod.Class`` -> ``pkg.mod:Class`` (the --allow-class form)."""
    module, _, name = dotted.rpartition(".")
    return f"{module}:{name}" if module else dotted


def import_class(spec: str):
    """``module:Class`` (or ``module.Class``) imported by name from the installed packages."""
    if ":" in spec:
        module, _, qualname = spec.partition(":")
    else:
        module, _, qualname = spec.rpartition(".")
    if not module or not qualname:
        raise InputError(f"--allow-class {spec!r}: expected module:Class, e.g. mypkg.models:Net")
    _add_cwd_to_path()
    try:
        return _resolve(module, qualname)
    except ImportError as exc:
        raise InputError(f"--allow-class {spec}: cannot import module {module!r} ({exc})") from exc
    except AttributeError:
        raise InputError(f"--allow-class {spec}: module {module!r} has no {qualname!r}") from None


def _add_cwd_to_path() -> None:
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def _refusal(path: Path, names: Sequence[str]) -> InputError:
    listed = ", ".join(as_cli_name(n) for n in names)
    example = as_cli_name(names[0])
    return InputError(
        f"{path} references {'a class' if len(names) == 1 else 'classes'} outside the allowlist of safe "
        f"torch.nn classes: {listed}. Nothing was unpickled. Either allow it by name with "
        f"--allow-class {example} (repeatable; imported from the installed package), or, only for a file "
        "you trust, --trust-model-file (full unpickling: runs code from the file)"
    )


_TORCHSCRIPT_MARKERS = ("constants.pkl", "code/")


def load_model(path: str | Path, *, allow_classes: Iterable[str] = (), trust_file: bool = False) -> nn.Module:
    """The ``nn.Module`` saved at ``path`` by ``torch.save(model)``, loaded safely (see module doc)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a model file")
    if trust_file:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"cannot load {path}: {_first_line(exc)}") from exc
        return _as_module(path, obj)

    allowed = ALLOWED_GLOBALS + [import_class(spec) for spec in allow_classes]
    allowed_names = {global_name(obj) for obj in allowed}
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise InputError(f"cannot read {path}: corrupt or truncated ({exc})") from exc
        if any(marker in n for n in names for marker in _TORCHSCRIPT_MARKERS):
            raise InputError(
                f"{path} is a TorchScript archive (torch.jit.save); attn-export needs the nn.Module: "
                "save it with torch.save(model), or use --model module:factory"
            )
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"cannot read {path}: not a PyTorch file, or corrupt or truncated ({_first_line(exc)})") from exc
        refused = sorted(n for n in unsafe if n not in allowed_names)
        if refused:
            raise _refusal(path, refused)
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.findall(r"GLOBAL ([\w.]+)", str(exc)) or re.findall(r"Unsupported global: ([\w.]+)", str(exc))
        if found:
            raise _refusal(path, sorted(set(found))) from None
        raise InputError(f"cannot read {path}: not a PyTorch file, or corrupt or truncated ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"cannot read {path}: not a PyTorch file, or corrupt or truncated ({_first_line(exc)})") from None
    return _as_module(path, obj)


def _as_module(path: Path, obj) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(
            f"{path} holds a state_dict, not a model; build the model in code and load the weights with "
            f"--model module:factory --weights {path}"
        )
    raise InputError(f"{path} holds a {type(obj).__name__}, not a torch.nn.Module")


def load_factory(spec: str, weights: Optional[str | Path] = None) -> nn.Module:
    """``module:factory``: the module is imported (the current directory is on the path) and
    ``factory()`` called; it must return an ``nn.Module``. ``weights``: a state_dict file,
    loaded weights-only, applied with ``load_state_dict(strict=True)``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"--model {spec!r}: expected module:factory, e.g. mypkg.models:build")
    _add_cwd_to_path()
    try:
        factory = _resolve(module_name, attr)
    except ImportError as exc:
        raise InputError(f"--model {spec}: cannot import {module_name!r} ({exc})") from exc
    except AttributeError:
        raise InputError(f"--model {spec}: {module_name!r} has no {attr!r}") from None
    if isinstance(factory, nn.Module):
        model = factory
    elif callable(factory):
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"--model {spec}: calling it failed: {_first_line(exc)}") from exc
    else:
        raise InputError(f"--model {spec}: {attr!r} is neither callable nor an nn.Module")
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
    if weights is not None:
        weights = Path(weights)
        if not weights.is_file():
            raise InputError(f"--weights {weights}: no such file")
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"--weights {weights}: cannot load it weights-only ({_first_line(exc)})") from exc
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise InputError(f"--weights {weights}: expected a state_dict, got a {type(state).__name__}")
        try:
            model.load_state_dict(state, strict=True)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"--weights {weights}: does not fit the model: {_first_line(exc)}") from exc
    return model
