"""timm for the tests, without torchvision.

timm (1.0.x) imports torchvision when it is imported (``torchvision.ops.misc.FrozenBatchNorm2d``,
``torchvision.transforms``, ``torchvision.datasets`` ...), and torchvision's wheel on the package
index is a CUDA build that does not import with the CPU PyTorch (docs/attention_sites.md). The
models these tests build (VisionTransformer) use none of it, so when torchvision cannot be
imported, placeholder modules stand in for it while timm is imported: any name taken from them is a
class that raises when it is used. timm missing altogether skips the test."""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest


class _PlaceholderType(type):
    def __getattr__(cls, name):  # enum members and constants (InterpolationMode.NEAREST): a named token
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _Placeholder(metaclass=_PlaceholderType):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not importable here; this timm feature needs it")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # a submodule (torchvision.ops, .transforms, ...)
            return importlib.import_module(f"{self.__name__}.{name}")
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def torchvision_placeholders():
    """Placeholders for torchvision, while the block runs, when it does not import: timm,
    vit-pytorch and segment-anything import it at import time for features these tests do not
    use. Removed afterwards (the libraries keep the placeholders they took), so that libraries
    imported later (transformers asks whether torchvision is there and reads its version) see
    no torchvision rather than one without a version."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or the CUDA wheel failing against the CPU torch
        pass
    else:
        yield
        return
    _forget_torchvision()
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        _forget_torchvision()


def _forget_torchvision() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def import_timm():
    """``import timm`` (with torchvision placeholders when torchvision does not import), or skip."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (make install adds it)")
    with torchvision_placeholders():
        import timm
        import timm.models.swin_transformer  # noqa: F401
        import timm.models.vision_transformer  # noqa: F401

    return timm
