"""The graph passes as an ordered list (attn_export.onnx.passes): the export runs them in order
and reports each that ran; a new pass is one module and one line; a pass runs only where it
applies (its flavors, its own condition)."""
import onnx
import pytest
from onnx import helper

from attn_export import spec
from attn_export.onnx import export_onnx, passes
from attn_export.onnx.passes import GraphPass, PassContext, PassOutcome
from attn_export.onnx_options import ATTENTION_FLAVORS

S = spec.load()
ORDER = ["label_axes", "project_before_transpose", "standard_attention", "fold_past_custom", "ort_attention",
         "ort_fusions", "ort_rotary", "ort_reshapes", "ort_pack_matmuls", "ort_gqa_rotary", "ort_unpack_splits",
         "last_logits", "ort_compact_rows", "ort_quantize", "ort_one_branch", "attach_functions", "inline_functions",
         "record_shapes"]


class StampNodeCount(GraphPass):
    """A toy pass, as a user would write one: stamps the graph's node count into the metadata."""

    name = "stamp_node_count"

    def run(self, model, context):
        count = len(model.graph.node)
        model.metadata_props.add(key="toy.nodes", value=str(count))
        return PassOutcome(1, (f"toy: the graph has {count} nodes",))


class StandardOnly(StampNodeCount):
    name = "standard_only"
    flavors = ("standard",)


def test_the_passes_are_one_ordered_list_of_named_passes():
    assert passes.names() == ORDER
    assert all(set(p.flavors) <= set(ATTENTION_FLAVORS) for p in passes.PASSES)


def test_the_export_reports_the_passes_that_ran_in_order(exported_seq2seq):
    ran = [p.name for p in exported_seq2seq.passes]
    # The custom flavor with model-local functions: no standard rewrite, nothing inlined.
    assert ran == ["label_axes", "project_before_transpose", "fold_past_custom", "attach_functions", "record_shapes"]
    reported = exported_seq2seq.to_dict()["passes"]
    assert [p["name"] for p in reported] == ran
    changed = {p["name"]: p["changed"] for p in reported}
    assert changed["label_axes"] == sum(len(d) for d in exported_seq2seq.dynamic_axes.values()) > 0
    assert changed["attach_functions"] >= 2  # the generic body and a lean one at least
    assert changed["fold_past_custom"] == 0  # no cache
    assert exported_seq2seq.passes_text().startswith("label_axes (")


def test_a_new_pass_is_one_module_and_one_line(small_seq2seq, tmp_path, monkeypatch):
    monkeypatch.setattr(passes, "PASSES", [*passes.PASSES, StampNodeCount()])  # the one line
    result = export_onnx(small_seq2seq, small_seq2seq.example_inputs, tmp_path / "toy.onnx")
    assert [p.name for p in result.passes][-2:] == ["record_shapes", "stamp_node_count"]
    model = onnx.load(str(result.path))
    stamped = {p.key: p.value for p in model.metadata_props}["toy.nodes"]
    assert stamped == str(len(model.graph.node))
    assert f"toy: the graph has {stamped} nodes" in result.notes
    assert result.to_dict()["passes"][-1] == {"name": "stamp_node_count", "changed": 1,
                                              "notes": [f"toy: the graph has {stamped} nodes"]}


def test_register_places_a_pass_by_name(monkeypatch):
    monkeypatch.setattr(passes, "PASSES", list(passes.PASSES))
    passes.register(StampNodeCount(), after="label_axes")
    assert passes.names()[:2] == ["label_axes", "stamp_node_count"]
    passes.register(StandardOnly(), before="record_shapes")
    assert passes.names()[-2:] == ["standard_only", "record_shapes"]
    with pytest.raises(ValueError, match="already in the list"):
        passes.register(StampNodeCount())
    with pytest.raises(ValueError, match="no pass named 'nope'"):
        passes.register(type("Other", (StampNodeCount,), {"name": "other"})(), before="nope")


def _one_node_model():
    """A graph of one bare FusedAttention node: enough for the passes' conditions."""
    node = helper.make_node(S.op_type, list(S.input_names), list(S.output_names), domain=S.domain)
    graph = helper.make_graph([node], "g", [], [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(S.domain, 1)])


@pytest.mark.parametrize("attention, functions, expected", [
    ("custom", "local", ["attach_functions", "fold_past_custom"]),
    ("custom", "inline", ["attach_functions", "fold_past_custom", "inline_functions"]),
    ("standard", "local", ["attach_functions", "fold_past_custom", "standard_attention", "standard_only"]),
])
def test_a_pass_runs_only_where_it_applies(attention, functions, expected):
    context = PassContext(opset=23, attention=attention, functions=functions, model=_one_node_model())
    candidates = [*passes.PASSES, StandardOnly()]
    applies = sorted(p.name for p in candidates if p.applies(context))
    assert applies == sorted(expected + ["label_axes", "project_before_transpose", "record_shapes"])
    context.model = helper.make_model(helper.make_graph([], "empty", [], []))  # no attention node left
    assert not {"attach_functions", "fold_past_custom", "inline_functions"} & {
        p.name for p in candidates if p.applies(context)}


def test_the_loop_skips_a_pass_that_does_not_apply():
    model = _one_node_model()
    ran = passes.run_passes(model, PassContext(opset=20, attention="custom"), passes=[StandardOnly(), StampNodeCount()])
    assert [o.name for o in ran] == ["stamp_node_count"]
    assert [p.key for p in model.metadata_props] == ["toy.nodes"]


def test_convert_prints_the_passes_with_verbose(exported_seq2seq, capsys):
    from attn_export.cli._common import Session
    from attn_export.cli.convert import ConsoleProgress

    for verbose in (False, True):
        ConsoleProgress(Session(verbose=verbose), "custom").exported("model.onnx", exported_seq2seq)
    printed = capsys.readouterr()
    assert printed.err.count("graph passes: label_axes (") == 1, printed


def test_the_former_homes_still_give_their_names():
    from attn_export.onnx import editing
    from attn_export.onnx.custom_past import fold_past
    from attn_export.onnx.graph import _rename_symbols, attach_function, attention_nodes, record_shapes  # noqa: F401
    from attn_export.onnx.passes.fold_past_custom import fold_past as fold_past_now
    from attn_export.onnx.standard import NodeBuilder, remove_unused, to_standard_attention  # noqa: F401
    from attn_export.onnx.standard_past import GraphIndex, find_past  # noqa: F401

    assert (fold_past, NodeBuilder, GraphIndex, attention_nodes) == (
        fold_past_now, editing.NodeBuilder, editing.GraphIndex, editing.attention_nodes)
    with pytest.warns(DeprecationWarning, match="import it from attn_export.onnx.passes.attach_functions"):
        from attn_export.onnx.pipeline import attach_function as from_pipeline
    assert from_pipeline is attach_function
