"""The shapes the gate sweeps (attn_export.shapes), pinned against the documented cases:
example, batch=1, seq=1, seq=odd (7, or 9 when a length already is 7), seq=long
(max(2 x longest, 48)), independent lengths kept distinct."""
import pytest
from onnx import TensorProto, helper

from attn_export.shapes import graph_axes, label_kinds, shape_cases


def _model(*inputs):
    graph = helper.make_graph(
        [helper.make_node("Identity", [inputs[0][0]], ["y"])], "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph)


def test_graph_axes_lists_the_symbolic_axes_of_the_named_inputs():
    model = _model(("skip", ["batch"]), ("src", ["Batch", 16, "seq_1"]), ("mask", ["b", "2x", ""]),
                   ("static", [2, 3]))
    assert graph_axes(model, ["src", "mask", "static"]) == {"src": {0: "Batch", 2: "seq_1"}, "mask": {0: "b"}}
    assert graph_axes(model, []) == {}


def test_graph_axes_skips_dimensions_without_a_name():
    model = _model(("x", [None, 4]))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = ""
    assert graph_axes(model, ["x"]) == {}


def test_label_kinds_by_name_then_by_position():
    axes = {
        "a": {0: "N", 1: "T", 2: "Batch_size"},
        "b": {3: "N", 0: "SeqLen", 1: "tgt_len"},  # N again: the first axis that carried it decides
    }
    assert label_kinds(axes) == {"N": "batch", "T": "seq", "Batch_size": "batch", "SeqLen": "seq",
                                 "tgt_len": "seq"}
    assert label_kinds({"x": {0: "sequence"}}) == {"sequence": "seq"}
    assert label_kinds({"x": {0: "max_len"}}) == {"max_len": "seq"}
    assert label_kinds({"x": {1: "width"}}) == {"width": "seq"}


def test_shape_cases_of_one_batch_and_one_sequence():
    assert shape_cases({"batch": 2, "seq": 16}, {"batch": "batch", "seq": "seq"}) == [
        ("example", {}), ("batch=1", {"batch": 1}), ("seq=1", {"seq": 1}), ("seq=odd", {"seq": 7}),
        ("seq=long", {"seq": 48}),
    ]


def test_shape_cases_keep_independent_lengths_distinct():
    cases = dict(shape_cases({"b": 3, "s": 7, "t": 40, "u": 5}, {"b": "batch", "s": "seq", "t": "seq", "u": "seq"}))
    assert cases["batch=1"] == {"b": 1}
    assert cases["seq=1"] == {"s": 1, "t": 1, "u": 1}
    assert cases["seq=odd"] == {"s": 9, "t": 11, "u": 13}  # 9: a length already is 7
    assert cases["seq=long"] == {"s": 80, "t": 82, "u": 84}  # 2 x the longest (40)


@pytest.mark.parametrize("sizes, kinds, names", [
    ({"batch": 4}, {"batch": "batch"}, ["example", "batch=1"]),
    ({"seq": 5}, {"seq": "seq"}, ["example", "seq=1", "seq=odd", "seq=long"]),
    ({"other": 5}, {}, ["example"]),
    ({}, {}, ["example"]),
])
def test_shape_cases_only_move_the_axes_there_are(sizes, kinds, names):
    assert [name for name, _ in shape_cases(sizes, kinds)] == names
