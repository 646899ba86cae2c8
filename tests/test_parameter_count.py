"""No function of the package takes more than MAX_PARAMETERS parameters: a longer list is options
that belong in a group (attn_export.options, docs/architecture.md "Options"). Read from the
source with ``ast`` (nothing is imported); ``self``/``cls`` do not count, ``*args`` and
``**kwargs`` do."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "exporter" / "attn_export"
MAX_PARAMETERS = 10

# (subpackage, function): the functions whose parameters are an operator's own, mirrored one to
# one (its schema in csrc/attention_spec.h, or nn.MultiheadAttention's constructor), or an ONNX
# translation function, which torch.onnx calls with the operator's arguments.
MIRRORS = {
    ("ops", "multi_head_attention"),  # functional.py: the operator's Python entry point
    ("ops", "attention"),  # functional.py: the core operator's Python entry point, its schema's arguments
    ("ops", "FusedMultiheadAttention.__init__"),  # module.py: nn.MultiheadAttention(...)'s parameters
    ("ops", "check_multi_head_attention_inputs"),  # input_checks.py: the C++ layer's check, argument for argument
    ("ops", "_multi_head_attention_fake"),  # fake.py: the fake kernels take the schema's arguments
    ("ops", "_multi_head_attention_forward_fake"),
    ("ops", "_multi_head_attention_backward_fake"),
    ("onnx", "translate_multi_head_attention"),  # translation.py: the operator's arguments, from torch.onnx
    ("onnx", "_fused_node"),  # translation.py: the node of translate_* from the operator's arguments
    ("onnx", "node_attributes"),  # node.py: the node's attributes, one parameter per attribute of the spec
}


def _count(function: ast.FunctionDef, is_method: bool) -> int:
    args = function.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if is_method and named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def _functions(tree: ast.AST):
    """(function, its name, whether it is a method) for every function of the tree; a method's
    name is Class.method."""
    classes = {id(child): node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
               for child in node.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner = classes.get(id(node))
            yield node, f"{owner}.{node.name}" if owner else node.name, owner is not None


def long_signatures(root: Path = PACKAGE):
    """["path:line name (N parameters)"] of every function over the limit that is not a mirror."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        for function, name, is_method in _functions(ast.parse(path.read_text(), str(path))):
            count = _count(function, is_method)
            if count > MAX_PARAMETERS and (relative.parts[0], name) not in MIRRORS:
                found.append(f"{relative}:{function.lineno} {name} ({count} parameters)")
    return found


def test_no_function_takes_more_than_ten_parameters():
    offenders = long_signatures()
    assert not offenders, (f"more than {MAX_PARAMETERS} parameters: group the options (attn_export/options.py), "
                           "or add an operator's mirror to MIRRORS with its reason:\n  " + "\n  ".join(offenders))


def test_the_walk_finds_a_long_signature(tmp_path):
    (tmp_path / "mod.py").write_text(
        "def wide(a, b, c, d, e, f, g, h, i, j, *, k): pass\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g, h, i, j): pass\n"
        "    def wider(self, a, b, c, d, e, f, g, h, i, j, **more): pass\n")
    assert long_signatures(tmp_path) == ["mod.py:1 wide (11 parameters)", "mod.py:4 C.wider (11 parameters)"]
