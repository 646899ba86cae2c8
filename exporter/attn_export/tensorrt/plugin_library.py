"""The FusedAttention plugin library: finding it, checking that it loads and exports TensorRT's
entry points, and registering it with TensorRT's plugin registry once per process."""
from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from attn_export.errors import first_line as _first_line
from attn_export.tensorrt.runtime import PluginError

PLUGIN_ENV = "ATTN_EXPORT_TRT_PLUGIN"
PLUGIN_FILENAME = "libattn_export_trt_plugin.so"
ENTRY_POINTS = ("getCreators", "setLoggerFinder")

# The plugin is not part of the wheel (it is built against the TensorRT and CUDA of the machine
# that runs it): an installed package points at the source repository's build.
BUILD_PLUGIN = (
    "build it from attn-export's source repository with `cmake -S plugins/tensorrt -B build/tensorrt "
    "-DTENSORRT_ROOT=<TensorRT dir> && cmake --build build/tensorrt -j` (docs/tensorrt.md), then pass "
    f"--plugin PATH or set {PLUGIN_ENV}"
)


def _checkout() -> Optional[Path]:
    """The source checkout this package is imported from, or None for an installed package."""
    root = Path(__file__).resolve().parents[3]  # exporter/attn_export/tensorrt/ -> the checkout
    return root if (root / "plugins" / "tensorrt" / "CMakeLists.txt").is_file() else None


def default_plugin_paths() -> List[Path]:
    """Where the library is looked for when no path is given: the build folder of a source
    checkout (docs/tensorrt.md builds into build/tensorrt/); nowhere for an installed wheel."""
    checkout = _checkout()
    return [checkout / "build" / "tensorrt" / PLUGIN_FILENAME] if checkout else []


def find_plugin_library(explicit: Optional[str | os.PathLike] = None) -> Path:
    """The plugin library: ``explicit`` (--plugin), else $ATTN_EXPORT_TRT_PLUGIN, else the source
    checkout's build/tensorrt/. PluginError naming what was tried and how to build it."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise PluginError(f"plugin library {path}: no such file; {BUILD_PLUGIN}")
        return path
    env = os.environ.get(PLUGIN_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise PluginError(f"{PLUGIN_ENV}={env}: no such file; {BUILD_PLUGIN}")
        return path
    tried = default_plugin_paths()
    for path in tried:
        if path.is_file():
            return path
    where = f", not at {', '.join(map(str, tried))}" if tried else ""
    raise PluginError(
        f"the FusedAttention plugin library was not found (no --plugin, no {PLUGIN_ENV}{where}); {BUILD_PLUGIN}"
    )


@dataclass
class LibraryInfo:
    path: str
    sha256: str
    size: int


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_plugin_library(path: str | os.PathLike) -> LibraryInfo:
    """The library loads (its dependencies resolve) and exports TensorRT's entry points.
    PluginError with the loader's own words otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PluginError(f"plugin library {path}: no such file; {BUILD_PLUGIN}")
    try:
        lib = ctypes.CDLL(str(path.resolve()))
    except OSError as exc:
        raise PluginError(
            f"plugin library {path} does not load: {_first_line(exc)} (a missing libcudart means the CUDA "
            "runtime the plugin was built with is not on the library path; see docs/tensorrt.md)"
        ) from exc
    missing = [name for name in ENTRY_POINTS if not hasattr(lib, name)]
    if missing:
        raise PluginError(
            f"{path} is not a TensorRT plugin library: it does not export {' and '.join(missing)} "
            f"(IPluginRegistry::loadLibrary needs {' and '.join(ENTRY_POINTS)})"
        )
    return LibraryInfo(path=str(path), sha256=file_sha256(path), size=path.stat().st_size)


_REGISTERED: Dict[str, object] = {}  # resolved library path -> handle (the registry is process-global)


def register_plugin_library(plugin: str | os.PathLike, registry, load_library: Optional[Callable[[str], object]] = None):
    """Loads the library into TensorRT's plugin registry, once per process and path (loading it
    twice would register its creators twice). PluginError when TensorRT refuses it."""
    key = path = str(Path(plugin).resolve())
    if key in _REGISTERED:
        return _REGISTERED[key]
    loader = load_library or registry.load_library
    try:
        handle = loader(path)
    except Exception as exc:  # noqa: BLE001 - TensorRT raises or returns None, depending on the version
        raise PluginError(f"TensorRT could not load the plugin library {plugin}: {_first_line(exc)}") from exc
    if handle is None:
        raise PluginError(f"TensorRT could not load the plugin library {plugin} (IPluginRegistry.load_library failed)")
    _REGISTERED[key] = handle
    return handle
