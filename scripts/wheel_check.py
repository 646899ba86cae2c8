#!/usr/bin/env python
"""`make test-wheel`: the binary wheel tested the way a release pipeline installs it.

    python scripts/wheel_check.py dist/attn_export-<version>-cp311-cp311-manylinux_2_34_x86_64.whl

1. auditwheel: the platform tag is manylinux, and the only libraries it would still have to
   vendor are PyTorch's own (left out on purpose, see the Makefile's wheel target);
2. a fresh virtual environment in a temporary folder, `pip install WHEEL` (torch and the other
   dependencies from the package index, resolved from the wheel's metadata), nothing else;
3. every command below runs outside the checkout (cwd in the temporary folder, `python -I`, no
   PYTHONPATH, no user site), with no compiler reachable: PATH holds only the environment's
   python and attn-export, CC/CXX are /bin/false, CUDA_HOME names no folder, and
   torch.utils.cpp_extension's entry points raise if called; TORCH_EXTENSIONS_DIR must stay
   empty. Checked: the metadata pins the torch minor version of the build, `attn-export
   --version`, every module of the package imports, every data file the package reads at run
   time is found inside the installed package, `attn-export inspect` and `attn-export MODEL --to
   onnx` on the bundled example (attn_export.examples, saved with torch.save), `--to tensorrt`
   exits 2 saying what is missing, and a faked build record of another torch gives the one-line
   mismatch message instead of loading _C.

Exit 0 when every check passes, 1 otherwise. --keep leaves the temporary folder for inspection;
--venv DIR installs into an existing environment instead of a fresh one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CLASS = "attn_export.examples:TinySeq2Seq"
# What torch's own wheels provide (and load before _C): the Makefile's wheel target excludes
# exactly these from the wheel (`--torch-libs` prints them for it).
TORCH_LIBS = {"libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so", "libgomp.so.1",
              "libc10_cuda.so", "libtorch_cuda.so", "libcudart.so.12", "libcudart.so.13"}
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "nvcc", "ninja", "ld")
# Modules that need an optional extra: importing them without it must fail on that extra alone.
EXTRAS = {"transformers": "hf", "matplotlib": "plot", "tensorrt": "TensorRT"}

# Runs inside the fresh environment, before anything of attn_export is imported.
GUARD = textwrap.dedent("""
    import sys
    import torch.utils.cpp_extension as _ext

    def _refuse(*args, **kwargs):
        raise AssertionError("attn_export tried to compile an extension at run time")

    for _name in ("load", "load_inline", "_jit_compile", "_write_ninja_file_and_compile_objects"):
        if hasattr(_ext, _name):
            setattr(_ext, _name, _refuse)
""")

PROBE = GUARD + textwrap.dedent("""
    import dataclasses, importlib, json, pkgutil, sys, traceback
    from pathlib import Path

    checkout, extras = sys.argv[1], json.loads(sys.argv[2])
    import torch
    import attn_export
    package = Path(attn_export.__file__).resolve().parent
    result = {"package": str(package), "problems": [], "modules": 0, "optional": {}, "data": {}}
    problems = result["problems"]
    if any(p and Path(p).resolve().is_relative_to(checkout) for p in sys.path):
        problems.append(f"the checkout is on sys.path: {sys.path}")
    if package.is_relative_to(checkout) or "site-packages" not in package.parts:
        problems.append(f"attn_export imported from {package}, not from the environment's site-packages")

    # Every module of the package.
    for info in pkgutil.walk_packages(attn_export.__path__, "attn_export."):
        if info.name.endswith(".__main__"):
            continue  # `python -m attn_export.cli`: importing it runs the command line
        try:
            importlib.import_module(info.name)
            result["modules"] += 1
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top in extras:
                result["optional"][info.name] = f"needs {top} ({extras[top]})"
            else:
                problems.append(f"import {info.name}: {exc!r}")
        except Exception:
            problems.append(f"import {info.name}: {traceback.format_exc(limit=3)}")

    # Every file the package reads at run time, found inside the installed package.
    from attn_export import _build_info, spec
    from attn_export.ops import library
    from attn_export.tensorrt import plugin_library
    from attn_export.validation import isolation
    import attn_export._C as _C
    files = {"spec header": spec.header_path(), "compiled operators": Path(_C.__file__),
             "runtime worker script": isolation.WORKER_SCRIPT}
    for what, path in files.items():
        path = Path(path).resolve()
        result["data"][what] = str(path.relative_to(package) if path.is_relative_to(package) else path)
        if not (path.is_file() and path.is_relative_to(package)):
            problems.append(f"{what}: {path} is not a file of the installed package")
    # The operators have kernels for every device the build says it has (CUDA: without a GPU too).
    S = spec.load()
    keys = ["CPU", "Autograd"] + (["CUDA"] if _build_info.CUDA_VERSION else [])
    ops = [getattr(S, f.name) for f in dataclasses.fields(S) if f.name.startswith("torch_op_")]
    missing = [f"{op}/{k}" for op in ops for k in keys if not torch._C._dispatch_has_kernel_for_dispatch_key(op, k)]
    if missing:
        problems.append(f"operators without a kernel: {missing}")
    result["data"]["kernels"] = f"{len(ops)} operators x {'/'.join(keys)}"
    if _build_info.TORCH_VERSION != torch.__version__:
        problems.append(f"built against torch {_build_info.TORCH_VERSION}, running {torch.__version__}")
    result["built_against"] = {"torch": _build_info.TORCH_VERSION, "cuda": _build_info.CUDA_VERSION}
    result["torch"] = torch.__version__
    # No source tree: the plugin is looked for nowhere by default, and the message says where to build it.
    if plugin_library.default_plugin_paths():
        problems.append(f"an installed package looks for the plugin in {plugin_library.default_plugin_paths()}")

    # The bundled example as a user would save it.
    from attn_export.examples import tiny_seq2seq
    torch.save(tiny_seq2seq(), "tiny_seq2seq.pt")
    print(json.dumps(result))
""")


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.start = time.monotonic()

    def step(self, name: str, ok: bool, detail: str = "") -> bool:
        status = "PASSED" if ok else "FAILED"
        print(f"{status} | {name} | {time.monotonic() - self.start:6.1f} s{' | ' + detail if detail else ''}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok


def run(cmd, env=None, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess, lines: int = 15) -> str:
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return "\n" + "\n".join("    " + line for line in text[-lines:]) if text else ""


def wheel_metadata(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    fields: dict = {"Requires-Dist": []}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Requires-Dist":
            fields[key].append(value)
        elif key in ("Name", "Version"):
            fields[key] = value
    return fields


def check_auditwheel(checks: Checks, wheel: Path) -> None:
    proc = run([sys.executable, "-m", "auditwheel", "show", "--json", wheel])
    if proc.returncode != 0:
        checks.step("auditwheel show", False, f"exit {proc.returncode}{tail(proc)}")
        return
    report = json.loads(proc.stdout)
    tag = report["sym_tag"]
    to_vendor = set(report["policy_upgrades"].get(tag, {}).get("libs_to_eliminate", []))
    ok = tag.startswith("manylinux_") and tag in wheel.name and to_vendor <= TORCH_LIBS
    checks.step("auditwheel show", ok, f"{tag}; external only torch's own: {sorted(to_vendor)}")


def restricted_env(tmp: Path, venv: Path) -> dict:
    """PATH with the environment's python and attn-export only; every compiler variable poisoned."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3", "attn-export"):
        (bin_dir / name).symlink_to(venv / "bin" / name)
    env = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM", "TMPDIR")}
    env.update(
        PATH=str(bin_dir), HOME=str(tmp / "home"), PYTHONNOUSERSITE="1", CC="/bin/false", CXX="/bin/false",
        CUDA_HOME=str(tmp / "no-cuda"), CUDA_PATH=str(tmp / "no-cuda"), TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
    )
    (tmp / "home").mkdir()
    return env


def check_mismatch(checks: Checks, venv: Path, env: dict, work: Path, package: Path, built: str, torch_version: str) -> None:
    """A build record of another torch: import and the CLI stop with one line naming both."""
    record = package / "_build_info.py"
    original = record.read_text()
    label = built.partition("+")[2]
    fake = ("2.12.0" if not torch_version.startswith("2.12") else "2.11.0") + (f"+{label}" if label else "")
    faked = original.replace(f"TORCH_VERSION = {built!r}", f"TORCH_VERSION = {fake!r}")
    if not checks.step("torch mismatch: build record faked", faked != original, f"{built} -> {fake}"):
        return
    record.write_text(faked)
    try:
        for what, cmd in (("import attn_export", [venv / "bin" / "python", "-I", "-c", "import attn_export"]),
                          ("attn-export --version", ["attn-export", "--version"])):
            proc = run(cmd, env=env, cwd=work)
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            ok = (proc.returncode != 0 and "TorchMismatchError" in last and f"torch {fake}" in last
                  and f"torch {torch_version}" in last and "torch==2.1" in last and "undefined symbol" not in proc.stderr)
            checks.step(f"torch mismatch: {what}", ok, last if ok else f"exit {proc.returncode}{tail(proc)}")
    finally:
        record.write_text(original)


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, nargs="?")
    parser.add_argument("--torch-libs", action="store_true", help="print the libraries `make wheel` leaves out, and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--venv", type=Path, help="install into this virtual environment instead of a fresh one "
                        "(e.g. one kept by --keep: a CUDA torch is 5 GB to install again)")
    parser.add_argument("--no-auditwheel", action="store_true", help="skip `auditwheel show` (not installed)")
    return parser


def check_wheel_file(checks: Checks, wheel: Path, auditwheel: bool) -> dict | None:
    """The file is a wheel whose metadata pins torch's minor version (and auditwheel accepts
    it): its metadata, or None when there is no wheel to go on with."""
    if not checks.step("wheel file", wheel.is_file() and wheel.suffix == ".whl", str(wheel)):
        return None
    meta = wheel_metadata(wheel)
    torch_pin = [r for r in meta["Requires-Dist"] if r.startswith("torch") and ";" not in r]
    checks.step("metadata pins torch", len(torch_pin) == 1 and torch_pin[0].startswith("torch==")
                and torch_pin[0].endswith(".*"), f"{meta['Name']} {meta['Version']}: Requires-Dist {torch_pin}")
    if auditwheel:
        check_auditwheel(checks, wheel)
    return meta


def install_wheel(checks: Checks, venv: Path, fresh: bool, wheel: Path) -> bool:
    """The wheel pip-installed into ``venv`` (created first when ``fresh``), and nothing but
    torch and its dependencies with it. False when there is no installed package to check."""
    if fresh:
        base = getattr(sys, "_base_executable", None) or sys.executable
        proc = run([base, "-m", "venv", venv])
        if not checks.step("fresh virtual environment", proc.returncode == 0, f"{venv}{tail(proc)}"):
            return False
    # The wheel alone: torch and the rest come from its metadata, as in a pipeline.
    # --no-compile: byte-compiling all of torch is half of the install's time, and no check needs it.
    proc = run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", wheel])
    if not checks.step("pip install WHEEL", proc.returncode == 0, tail(proc, 5).strip() if proc.returncode else ""):
        print(tail(proc, 40))
        return False
    proc = run([venv / "bin" / "python", "-m", "pip", "list", "--format=json", "--disable-pip-version-check"])
    installed = {p["name"].lower(): p["version"] for p in json.loads(proc.stdout)}
    torch_version = installed.get("torch", "?")
    # (setuptools comes with every Python 3.11 venv; it compiles nothing without a compiler.)
    unexpected = sorted(n for n in installed if n.startswith(("ninja", "cmake", "pybind11")))
    checks.step("installed: torch and the wheel's dependencies", not unexpected,
                f"torch {torch_version}, attn-export {installed.get('attn-export')}, {len(installed)} packages"
                + (f"; unexpected build tools {unexpected}" if unexpected else ""))
    return True


def check_probe(checks: Checks, venv: Path, env: dict, work: Path) -> dict | None:
    """PROBE in the installed environment: every module imports, every data file is inside the
    package. Its result, or None when it failed (nothing after it can be checked)."""
    proc = run([venv / "bin" / "python", "-I", "-c", PROBE, ROOT, json.dumps(EXTRAS)], env=env, cwd=work)
    probe = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    if not checks.step("imports and data files", probe is not None and not probe["problems"],
                       (f"{probe['modules']} modules imported; optional extras missing: {probe['optional'] or 'none'}; "
                        f"found {probe['data']}; problems: {probe['problems'] or 'none'}") if probe else tail(proc, 30)):
        return None
    return probe


def check_bundled_example(checks: Checks, env: dict, work: Path) -> None:
    """The CLI on the example PROBE saved: inspect, --to onnx (validated), --to tensorrt (exit 2
    saying what is missing)."""
    allow = ["--allow-class", EXAMPLE_CLASS]
    proc = run(["attn-export", "inspect", "tiny_seq2seq.pt", *allow], env=env, cwd=work)
    words = [line.strip() for line in proc.stdout.splitlines() if line.strip()[:1].isalnum()]  # not the table
    checks.step("attn-export inspect (bundled example)", proc.returncode == 0, tail(proc, 4) if proc.returncode else
                (words[-1] if words else ""))

    proc = run(["attn-export", "tiny_seq2seq.pt", "--to", "onnx", *allow, "--json", "report.json"], env=env, cwd=work)
    report = json.loads((work / "report.json").read_text()) if (work / "report.json").is_file() else {}
    ok = proc.returncode == 0 and (work / "tiny_seq2seq.onnx").is_file() and report.get("passed") is True
    checks.step("attn-export MODEL --to onnx (bundled example)", ok,
                proc.stdout.strip().splitlines()[-1] if ok else f"exit {proc.returncode}{tail(proc)}")

    proc = run(["attn-export", "tiny_seq2seq.pt", "--to", "tensorrt", *allow], env=env, cwd=work)
    said = (proc.stdout + proc.stderr).strip()
    checks.step("attn-export MODEL --to tensorrt says what is missing", proc.returncode == 2 and "Traceback" not in said
                and "TensorRT" in said, said.splitlines()[-1] if said else f"exit {proc.returncode}")


def check_installed(checks: Checks, tmp: Path, venv: Path, fresh: bool, wheel: Path, meta: dict) -> bool:
    """Every check of the installed wheel, run outside the checkout with no compiler reachable.
    False when one failed that the later ones need."""
    work = tmp / "work"
    work.mkdir()
    if not install_wheel(checks, venv, fresh, wheel):
        return False
    env = restricted_env(tmp, venv)
    reachable = [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    checks.step("no compiler on PATH", not reachable, f"PATH={env['PATH']}" + (f"; found {reachable}" if reachable else ""))

    proc = run(["attn-export", "--version"], env=env, cwd=work)
    checks.step("attn-export --version", proc.returncode == 0 and meta["Version"] in proc.stdout,
                proc.stdout.strip() if proc.returncode == 0 else tail(proc))
    probe = check_probe(checks, venv, env, work)
    if probe is None:
        return False
    check_bundled_example(checks, env, work)
    extensions = tmp / "torch_extensions"
    checks.step("nothing compiled at run time", not extensions.exists() or not any(extensions.iterdir()),
                f"{extensions} {'absent' if not extensions.exists() else 'empty'}")
    check_mismatch(checks, venv, env, work, Path(probe["package"]), probe["built_against"]["torch"], probe["torch"])
    return True


def remove_later(tmp: Path) -> None:
    # In the background: deleting a 1 GB environment took 1-3 minutes on these disks, and
    # nothing waits for it.
    subprocess.Popen(["rm", "-rf", str(tmp)], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    parser = arg_parser()
    args = parser.parse_args()
    if args.torch_libs:
        print(" ".join(sorted(TORCH_LIBS)))
        return 0
    if args.wheel is None:
        parser.error("the wheel to check is required")
    wheel = args.wheel.resolve()
    checks = Checks()
    meta = check_wheel_file(checks, wheel, auditwheel=not args.no_auditwheel)
    if meta is None:
        return 1

    tmp = Path(tempfile.mkdtemp(prefix="attn-export-wheel-"))
    try:
        venv = args.venv.resolve() if args.venv else tmp / "venv"
        if not check_installed(checks, tmp, venv, not args.venv, wheel, meta):
            return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            remove_later(tmp)
    total = time.monotonic() - checks.start
    if checks.failures:
        print(f"FAILED: {len(checks.failures)} check(s): {', '.join(checks.failures)} ({total:.0f} s)")
        return 1
    print(f"PASSED: the wheel installs and runs without a compiler ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
