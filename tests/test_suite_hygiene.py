"""The suite itself: every test can fail. A test passes vacuously when nothing in it can raise
on a wrong answer; this scan (of the source, nothing is run) finds test functions with no
``assert``, no ``pytest.raises``/``warns``/``fail``, and no call to a checking function (an
``assert*``/``check*`` function from a library such as torch.testing, or one of the suite's own
helpers that itself checks)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PYTEST_CHECKS = {"raises", "warns", "deprecated_call", "fail"}
# Library functions that raise on a wrong answer although their names do not say so.
CHECKING_CALLS = {"gradcheck", "gradgradcheck", "opcheck", "check_model", "verify_ninja_availability"}


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _is_check(node: ast.AST, is_checking_helper) -> bool:
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        name = _called_name(node)
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest":
            return name in PYTEST_CHECKS
        return name.startswith(("assert", "check_", "expect")) or name in CHECKING_CALLS or is_checking_helper(name)
    return False


def _functions():
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield str(path.relative_to(TESTS)), node


def _resolver(functions):
    """A function ``(file, name) -> bool``: does the helper ``name`` called from ``file`` check?
    A call resolves to the file's own function of that name, else (an import from helpers.py and
    the like) to any file's. Helpers that only call checking helpers check too (a fixed point)."""
    helpers = {(path, node.name): node for path, node in functions if not node.name.startswith("test_")}
    checking: set = set()

    def resolve(path):
        def is_checking(name):
            if (path, name) in helpers:
                return (path, name) in checking
            return any(n == name for _, n in checking)
        return is_checking

    changed = True
    while changed:
        changed = False
        for key, node in helpers.items():
            if key not in checking and any(_is_check(n, resolve(key[0])) for n in ast.walk(node)):
                checking.add(key)
                changed = True
    return resolve


def _collected(node) -> bool:
    """A test pytest collects (a test_ function, not e.g. a property named test_id)."""
    return node.name.startswith("test_") and not any(
        isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def vacuous_tests(functions=None):
    functions = list(_functions()) if functions is None else functions
    resolve = _resolver(functions)
    return [
        f"{path}:{node.lineno} {node.name}"
        for path, node in functions
        if _collected(node) and not any(_is_check(n, resolve(path)) for n in ast.walk(node))
    ]


def test_every_test_can_fail():
    assert vacuous_tests() == []


def test_the_scan_finds_a_test_that_asserts_nothing():
    one = ast.parse("def helper(x):\n    assert x\n\n"
                    "def test_ok():\n    helper(1)\n\n"
                    "def test_vacuous():\n    print(1 + 1)\n")
    other = ast.parse("def helper(x):\n    print(x)\n\n"
                      "def test_same_name_other_file():\n    helper(1)\n")
    functions = [(name, n) for name, tree in (("one.py", one), ("other.py", other))
                 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert vacuous_tests(functions) == ["one.py:7 test_vacuous", "other.py:4 test_same_name_other_file"]
