#!/usr/bin/env python
"""Runs a test module without pytest, for GPU machines that have torch but no pytest (and no
network to install it): scripts/gpu_check.sh falls back to this.

    python tests/run_without_pytest.py test_cuda [--junit FILE] [-k SUBSTRING]

Supports what tests/ops/cuda/test_cuda.py uses: plain test functions, stacked
@pytest.mark.parametrize, pytest.param (its marks are ignored), pytest.raises, pytest.skip and
module-level marks. Each test runs with torch.manual_seed(0), like conftest.py's autouse
fixture. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import itertools
import pathlib
import re
import sys
import time
import traceback
import types
from xml.sax.saxutils import escape, quoteattr

HERE = pathlib.Path(__file__).resolve().parent


class Skipped(Exception):
    pass


def _install_pytest_stand_in() -> None:
    if importlib.util.find_spec("pytest") is not None:
        return
    shim = types.ModuleType("pytest")

    def parametrize(argnames, argvalues, ids=None):
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)

        def decorate(fn):
            fn.__dict__.setdefault("_parametrize", []).append((names, list(argvalues)))
            return fn

        return decorate

    class _Mark:
        def __getattr__(self, name):
            if name == "parametrize":
                return parametrize
            return _NamedMark(name)

    class _NamedMark:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return self

    @contextlib.contextmanager
    def raises(exc, match=None):
        try:
            yield
        except exc as e:  # noqa: PERF203
            if match is not None and not re.search(match, str(e)):
                raise AssertionError(f"exception message {str(e)!r} does not match {match!r}") from e
        else:
            raise AssertionError(f"DID NOT RAISE {exc}")

    def skip(reason=""):
        raise Skipped(reason)

    def param(*values, marks=(), id=None):  # noqa: A002  (pytest's name)
        return values[0] if len(values) == 1 else values

    shim.mark = _Mark()
    shim.param = param
    shim.raises = raises
    shim.skip = skip
    shim.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    sys.modules["pytest"] = shim


def _cases(fn):
    layers = fn.__dict__.get("_parametrize")
    if not layers:  # real pytest marks (pytest installed but not used as the runner)
        layers = [(list(m.args[0].split(",")) if isinstance(m.args[0], str) else list(m.args[0]), list(m.args[1]))
                  for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        layers = [([n.strip() for n in names], values) for names, values in layers]
    if not layers:
        yield "", {}
        return
    for combo in itertools.product(*[values for _, values in layers]):
        kwargs, ids = {}, []
        for (names, _), value in zip(layers, combo):
            values = value if len(names) > 1 else (value,)
            kwargs.update(zip(names, values))
            ids.append("-".join(str(v) for v in values))
        yield "[" + "-".join(ids) + "]", kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="test module under tests/, e.g. ops/cuda/test_cuda")
    parser.add_argument("-k", dest="keyword", default=None, help="run only tests whose id contains this")
    parser.add_argument("--junit", type=pathlib.Path, default=None, help="write a JUnit XML report here")
    args = parser.parse_args()

    folder, _, name = args.module.rpartition("/")
    sys.path[:0] = [str(HERE / folder), str(HERE)]  # the module's folder, and tests/ for helpers
    _install_pytest_stand_in()
    import torch

    module = importlib.import_module(name)
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    no_gpu = any(getattr(m, "name", None) == "cuda" for m in marks) and not torch.cuda.is_available()
    results = []
    for name in dir(module):
        fn = getattr(module, name)
        if not name.startswith("test_") or not callable(fn):
            continue
        for suffix, kwargs in _cases(fn):
            test_id = f"{module.__name__}::{name}{suffix}"
            if args.keyword and args.keyword not in test_id:
                continue
            torch.manual_seed(0)
            start = time.perf_counter()
            status, detail = "passed", ""
            try:
                if no_gpu:
                    raise Skipped("needs an NVIDIA GPU (the module is marked cuda)")
                fn(**kwargs)
            except Skipped as e:
                status, detail = "skipped", str(e)
            except Exception:  # noqa: BLE001  (every failure is reported, then the run goes on)
                status, detail = "failed", traceback.format_exc()
            elapsed = time.perf_counter() - start
            results.append((test_id, status, elapsed, detail))
            print(f"{status.upper():7s} {test_id} ({elapsed:.2f}s)", flush=True)
            if status == "failed":
                print(detail, flush=True)

    counts = {s: sum(1 for r in results if r[1] == s) for s in ("passed", "failed", "skipped")}
    print(f"\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if args.junit:
        cases = []
        for test_id, status, elapsed, detail in results:
            body = ""
            if status == "failed":
                body = f"<failure message=\"failed\">{escape(detail)}</failure>"
            elif status == "skipped":
                body = f"<skipped message={quoteattr(detail)}/>"
            cases.append(f"<testcase name={quoteattr(test_id)} time=\"{elapsed:.3f}\">{body}</testcase>")
        args.junit.write_text(
            f"<testsuite name=\"{args.module}\" tests=\"{len(results)}\" failures=\"{counts['failed']}\" "
            f"skipped=\"{counts['skipped']}\">\n" + "\n".join(cases) + "\n</testsuite>\n"
        )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
