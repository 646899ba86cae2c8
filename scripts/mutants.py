"""Mutation testing of the gate and the export (``make mutants``; docs/testing.md).

mutmut 3 finds the tests of each function by recording which tests call it, then runs only
those on each mutant, forked from a process that has imported torch once. It imports the code
under test from a source root of ``./``, ``src/`` or ``source/`` beside its config; ours is
``exporter/``. So each selection of modules gets a run folder, build/mutation/STAGE/, holding
the config (written here from the checkout's [tool.mutmut] and [tool.pytest.ini_options]) and
links to ``exporter/attn_export`` and ``tests``: mutmut copies both from there into its own
mutants/ as it always does (the tests must sit below its root for it to name them).

    python scripts/mutants.py                         # every module of MUTATED (slow)
    python scripts/mutants.py exporter/attn_export/validation     # a folder: the listed modules under it
    python scripts/mutants.py exporter/attn_export/inputs.py --report-only
    python scripts/mutants.py exporter/attn_export/onnx/node.py --only '*register_schema*' '*function_proto__mutmut_*0'
                                                      # a subset (mutmut's fnmatch patterns): here one
                                                      # function, and every tenth mutant of another

Prints one line per module (killed / survived / no tests / other) and every survivor; the
mutants themselves: ``cd build/mutation/STAGE && ../../../.venv/bin/mutmut show NAME``, where
STAGE names the selection (``all``, ``loading``, ``inputs+shapes``, ...). Exits 1 when
the kill rate is under --min-kill-rate.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "build" / "mutation"
SOURCE_ROOT, PACKAGE = ROOT / "exporter", "attn_export"

# The modules under mutation and the unit tests that exercise each directly; mutmut then
# narrows these down per function to the tests that call it. End-to-end files (an ONNX export
# and an ONNX Runtime process per run, test_validation.py) are left out: ~1 min per mutant here.
MUTATED = {
    "exporter/attn_export/validation/tolerances.py": ["tests/validation/test_tolerances.py"],
    "exporter/attn_export/shapes.py": ["tests/test_shapes.py"],
    "exporter/attn_export/inputs.py": ["tests/test_inputs.py"],
    "exporter/attn_export/surgery/replace.py": ["tests/surgery/test_replace.py", "tests/surgery/test_sdpa_discovery.py",
                                                "tests/surgery/test_routes.py"],
    **{f"exporter/attn_export/surgery/routes/{name}.py": ["tests/surgery/test_replace.py", "tests/surgery/test_routes.py"]
       for name in ("base", "undo", "module_swap", "sdpa")},
    "exporter/attn_export/loading.py": ["tests/test_loading.py"],
    "exporter/attn_export/onnx/node.py": ["tests/onnx/test_onnx_node.py"],
    "exporter/attn_export/onnx/body.py": ["tests/onnx/test_onnx_node.py", "tests/onnx/test_onnx_body.py"],
}


def selected(paths: list[str]) -> dict[str, list[str]]:
    if not paths:
        return dict(MUTATED)
    chosen = {}
    for path in paths:
        path = path.rstrip("/")
        hits = {m: t for m, t in MUTATED.items() if m == path or m.startswith(path + "/")}
        if not hits:
            sys.exit(f"mutants: {path!r} is not a mutated module nor a folder holding one; "
                     f"one of: {', '.join(MUTATED)}")
        chosen.update(hits)
    return chosen


def stage_for(modules) -> Path:
    """One stage per selection of modules: build/mutation/all, build/mutation/loading,
    build/mutation/inputs+shapes, ... mutmut forgets every result when the set of tests it
    runs changes, so a run of one module must not share its stage with a run of another."""
    names = sorted(Path(m).stem for m in modules)
    return STAGES / ("all" if set(modules) == set(MUTATED) else "+".join(names))


def import_path(path: str) -> str:
    """exporter/attn_export/x.py -> attn_export/x.py: the path below the source root."""
    return str((ROOT / path).relative_to(SOURCE_ROOT))


def toml_table(name: str, table: dict) -> str:
    # Strings, numbers, booleans and lists of strings only: their JSON spelling is valid TOML.
    return f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())


def write_stage(modules: dict[str, list[str]]) -> bool:
    """The run folder: the config and the link to the package. mutmut's own state (mutants/)
    is kept while the package's sources are unchanged, so a run resumes where the last one
    stopped; it is cleared when they changed. Returns whether the tests changed since the last
    run (then the survivors are tried again)."""
    stage = stage_for(modules)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    mutmut = dict(config["mutmut"])
    mutmut["source_paths"] = [PACKAGE]
    mutmut["only_mutate"] = [import_path(m) for m in modules]
    tests = sorted({t for ts in modules.values() for t in ts})
    mutmut["pytest_add_cli_args_test_selection"] = tests
    text = toml_table("tool.mutmut", mutmut) + "\n" + toml_table("tool.pytest.ini_options", config["pytest"]["ini_options"])

    stage.mkdir(parents=True, exist_ok=True)
    sources = _fingerprint(sorted((SOURCE_ROOT / PACKAGE).rglob("*.py")))
    test_files = _fingerprint(sorted((ROOT / "tests").rglob("*.py")))
    if _read(stage / "sources.stamp") != sources:
        shutil.rmtree(stage / "mutants", ignore_errors=True)
    tests_changed = _read(stage / "tests.stamp") != test_files
    for name, target in ((PACKAGE, SOURCE_ROOT / PACKAGE), ("tests", ROOT / "tests")):
        link = stage / name
        if not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
    (stage / "pyproject.toml").write_text(text)
    (stage / "sources.stamp").write_text(sources)
    (stage / "tests.stamp").write_text(test_files)
    return tests_changed


def _fingerprint(files: list[Path]) -> str:
    # Contents, not modification times: a checkout or an edit undone leaves the results valid.
    return "".join(f"{f.relative_to(ROOT)} {hashlib.sha256(f.read_bytes()).hexdigest()}\n" for f in files)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def tally(modules: dict[str, list[str]]) -> tuple[int, int, list[str]]:
    """(killed, counted, lines): counted = killed + survived (mutants no test reaches count as
    survivors; timeouts as killed, as mutmut does)."""
    stage = stage_for(modules)
    killed = counted = 0
    lines = []
    for module in modules:
        meta = stage / "mutants" / (import_path(module) + ".meta")
        if not meta.exists():
            lines.append(f"{module}: not run")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        status = {k: _status(c) for k, c in codes.items()}
        k = sum(s == "killed" for s in status.values())
        survivors = sorted(name for name, s in status.items() if s in ("survived", "no tests"))
        other = len(status) - k - len(survivors)
        killed, counted = killed + k, counted + k + len(survivors)
        rate = 100.0 * k / max(k + len(survivors), 1)
        lines.append(f"{module}: {k} killed, {len(survivors)} survived ({rate:.1f}% killed)"
                     + (f", {other} not run" if other else ""))
        lines += [f"    survived: {name}" for name in survivors]
    return killed, counted, lines


def _status(code) -> str:
    if code in (1, 3, 36, 24, -24, 152, 255, -11, -9):  # test failure, pytest error, timeout, crash
        return "killed"
    if code == 0:
        return "survived"
    if code in (5, 33):
        return "no tests"
    return "not run"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="modules or folders of the checkout (default: all of MUTATED)")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutants (default 1)")
    parser.add_argument("--min-kill-rate", type=float, default=90.0)
    parser.add_argument("--report-only", action="store_true", help="tally the last run, run nothing")
    parser.add_argument("--only", nargs="+", default=[], metavar="PATTERN",
                        help="run only the mutants whose names match (fnmatch, e.g. '*node_attributes*'); "
                             "the tally counts the others as not run")
    args = parser.parse_args()
    modules = selected([p for arg in args.paths for p in arg.replace(",", " ").split()])
    if not args.report_only:
        if not list((SOURCE_ROOT / PACKAGE).glob("_C*.so")):
            sys.exit("mutants: exporter/attn_export/_C*.so is missing: run `make install` first")
        tests_changed = write_stage(modules)
        retry = [name for line in tally(modules)[2] if line.startswith("    survived: ")
                 for name in [line.split(": ", 1)[1]]
                 if not args.only or any(fnmatch.fnmatch(name, p) for p in args.only)] if tests_changed else []
        mutmut = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(args.max_children)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # New mutants first; then, when the tests changed, the survivors of earlier runs again.
        for names in (args.only, retry) if retry else (args.only,):
            run = subprocess.run(mutmut + names, cwd=stage_for(modules), env=env)
            if run.returncode != 0:
                print(f"mutants: mutmut exited {run.returncode}", file=sys.stderr)
    killed, counted, lines = tally(modules)
    print("\n".join(lines))
    rate = 100.0 * killed / max(counted, 1)
    print(f"total: {killed} of {counted} mutants killed ({rate:.1f}%); threshold {args.min_kill_rate:.0f}%")
    return 0 if rate >= args.min_kill_rate else 1


if __name__ == "__main__":
    sys.exit(main())
