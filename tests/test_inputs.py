"""Example inputs (attn_export.inputs): trtexec-style specs, dynamic-axis labels, forward's
parameters, and inputs generated at other sizes. Fast unit tests, one per rule."""
import pytest
import torch
from torch import nn

from attn_export.errors import InputError
from attn_export import inputs as I


# --------------------------------------------------------------------------------------------
# --input NAME:DIMS[:DTYPE] and --dynamic NAME:DIM=LABEL
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, name, shape, dtype", [
    ("src:2x16x64", "src", (2, 16, 64), torch.float32),
    ("ids:1X32:int64", "ids", (1, 32), torch.int64),
    ("m:4:BOOL", "m", (4,), torch.bool),
    ("_h2:3x1:half", "_h2", (3, 1), torch.float16),
])
def test_parse_input_spec(text, name, shape, dtype):
    assert I.parse_input_spec(text) == I.InputSpec(name, shape, dtype)


@pytest.mark.parametrize("text, words", [
    ("src", "expected NAME:DIMS[:DTYPE], e.g. src:2x16x64 or ids:1x32:int64"),
    ("a:1:fp32:x", "expected NAME:DIMS[:DTYPE]"),
    (":2x3", "expected NAME:DIMS[:DTYPE]"),
    ("src:", "expected NAME:DIMS[:DTYPE]"),
    ("2src:2x3", "'2src' is not a valid input name"),
    ("src:2xa", "dimensions must be integers separated by 'x', e.g. 2x16x64"),
    ("src:2x0", "every dimension must be >= 1"),
    ("src:2:complex", "unknown dtype 'complex'; one of bf16, bfloat16, bool"),
])
def test_parse_input_spec_refuses_with_the_fix(text, words):
    with pytest.raises(InputError) as err:
        I.parse_input_spec(text)
    assert f"--input {text!r}: " in str(err.value) and words in str(err.value)


def test_parse_dynamic_spec():
    assert I.parse_dynamic_spec("tgt:1=tgt_len") == ("tgt", 1, "tgt_len")
    for bad in ("tgt:1", "tgt:x=seq", "tgt:1=2seq", "tgt:1=seq extra", "1tgt:1=seq"):
        with pytest.raises(InputError, match=r"expected NAME:DIM=LABEL, e\.g\. src:1=seq"):
            I.parse_dynamic_spec(bad)


# --------------------------------------------------------------------------------------------
# forward's parameters
# --------------------------------------------------------------------------------------------

class Two(nn.Module):
    def forward(self, src, tgt=None, *args, mask=None, **kwargs):
        return src


class Plain(nn.Module):
    def forward(self, a, b, c=1):
        return a


def test_forward_parameters_and_required_parameters():
    assert I.forward_parameters(Two()) == (["src", "tgt", "mask"], True)
    assert I.forward_parameters(Plain()) == (["a", "b", "c"], False)
    assert I.required_parameters(Two()) == ["src"]
    assert I.required_parameters(Plain()) == ["a", "b"]


def test_order_for_model_orders_like_forward_and_names_the_problem():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert list(I.order_for_model(Plain(), {"c": c, "b": b, "a": a})) == ["a", "b", "c"]
    assert list(I.order_for_model(Two(), {"extra": a, "src": b})) == ["src", "extra"]  # **kwargs takes it
    with pytest.raises(InputError, match="unknown input name\\(s\\) z, y: Plain.forward takes a, b, c"):
        I.order_for_model(Plain(), {"a": a, "b": b, "z": c, "y": c})
    with pytest.raises(InputError, match="Plain.forward requires b; give it with --input b:DIMS"):
        I.order_for_model(Plain(), {"a": a})


def test_int_range_for_is_the_smallest_embedding_table():
    model = nn.Sequential(nn.Embedding(50, 4), nn.EmbeddingBag(30, 4), nn.Linear(4, 4))
    assert I.int_range_for(model) == (0, 30)
    assert I.int_range_for(nn.Linear(4, 4)) == (0, 2)


# --------------------------------------------------------------------------------------------
# Generated inputs
# --------------------------------------------------------------------------------------------

def test_synthesize_follows_the_specs():
    specs = [I.InputSpec("x", (3, 5), torch.float16), I.InputSpec("ids", (4, 50), torch.int64),
             I.InputSpec("pos", (2, 50), torch.int32), I.InputSpec("attention_mask", (6, 9), torch.int64),
             I.InputSpec("pad", (6, 9), torch.bool)]
    out = I.synthesize(specs, (3, 7), seed=1, int_ranges={"pos": (100, 102)})
    assert out["x"].dtype == torch.float16 and out["x"].shape == (3, 5) and out["x"].std() > 0.3
    assert out["ids"].min() == 3 and out["ids"].max() == 6
    assert out["pos"].dtype == torch.int32 and set(out["pos"].unique().tolist()) == {100, 101}
    keep = out["attention_mask"]
    assert keep.dtype == torch.int64 and set(keep.unique().tolist()) == {0, 1}
    assert (keep[:, 0] == 1).all() and (keep[0] == 1).all()  # 1 = keep, one full row
    pad = out["pad"]
    assert pad.dtype == torch.bool and not pad[:, 0].any() and pad.any()  # True = padding
    again = I.synthesize(specs, (3, 7), seed=1, int_ranges={"pos": (100, 102)})
    assert all(torch.equal(out[n], again[n]) for n in out)
    with pytest.raises(InputError, match="--input x given twice"):
        I.synthesize(specs[:1] * 2, (0, 2))


def test_padding_mask_rows_are_a_visible_prefix():
    gen = torch.Generator().manual_seed(3)
    mask = I.padding_mask((2, 3, 40), gen)
    assert mask.shape == (2, 3, 40)
    rows = mask.reshape(6, 40)
    assert not rows[0].any()  # one full row
    assert (~rows).any(-1).all() and rows.any()
    # a prefix of visible positions, then padding
    assert (rows.int()[:, 1:] >= rows.int()[:, :-1]).all()
    assert I.padding_mask((1, 5), gen).shape == (1, 5)
    assert I.padding_mask((), gen).item() is False
    assert I.padding_mask((), gen, true_is_masked=False).item() is True
    keep = I.padding_mask((4, 6), gen, true_is_masked=False)
    assert keep[:, 0].all() and keep[0].all()


def test_default_axes():
    inputs = {"src": torch.zeros(2, 5, 3), "lens": torch.zeros(2), "scalar": torch.tensor(1.0),
              "tgt": torch.zeros(2, 4), "not_a_tensor": 3}
    assert I.default_axes(inputs) == {"src": {0: "batch", 1: "seq"}, "lens": {0: "batch"},
                                      "tgt": {0: "batch", 1: "tgt_seq"}}
    assert I.default_axes({"x": torch.zeros(4), "y": torch.zeros(4, 5)}) == \
        {"x": {0: "batch"}, "y": {0: "batch", 1: "y_seq"}}
    # a 4-D floating input is an image batch [B, C, H, W]: dim 1 is channels
    assert I.default_axes({"img": torch.zeros(2, 3, 8, 8), "ids": torch.zeros(2, 3, 8, 8, dtype=torch.long)}) == \
        {"img": {0: "batch"}, "ids": {0: "batch", 1: "ids_seq"}}


def test_resolve_axes_applies_overrides_per_input():
    inputs = {"src": torch.zeros(2, 5, 3), "tgt": torch.zeros(2, 4, 3)}
    assert I.resolve_axes(inputs) == {"src": {0: "batch", 1: "seq"}, "tgt": {0: "batch", 1: "tgt_seq"}}
    assert I.resolve_axes(inputs, static=True) == {}
    over = I.resolve_axes(inputs, [("tgt", 1, "seq"), ("tgt", 2, "width")])
    assert over == {"src": {0: "batch", 1: "seq"}, "tgt": {1: "seq", 2: "width"}}
    assert I.resolve_axes(inputs, [("src", 2, "w")], static=True) == {"src": {2: "w"}}
    assert I.resolve_axes(inputs, defaults={"src": {0: "n"}, "tgt": {}}) == {"src": {0: "n"}}
    with pytest.raises(InputError, match=r"--dynamic mem:0=b: no input named 'mem' \(inputs: src, tgt\)"):
        I.resolve_axes(inputs, [("mem", 0, "b")])
    with pytest.raises(InputError, match="--dynamic src:3=x: src has only 3 dimensions"):
        I.resolve_axes(inputs, [("src", 3, "x")])


def test_label_helpers():
    assert I.label_is_batch("BatchSize") and not I.label_is_batch("seq")
    inputs = {"a": torch.zeros(2, 5), "b": torch.zeros(3, 7)}
    assert I.label_sizes(inputs, {"a": {0: "batch", 1: "seq"}, "b": {0: "batch", 1: "t"}}) == \
        {"batch": 2, "seq": 5, "t": 7}
    assert I.describe(inputs) == {"a": [2, 5], "b": [3, 7]}
    cast = I.cast_floats({"x": torch.zeros(1), "i": torch.zeros(1, dtype=torch.int64)}, torch.float16)
    assert cast["x"].dtype == torch.float16 and cast["i"].dtype == torch.int64
    same = {"x": torch.zeros(1)}
    assert I.cast_floats(same, None) == same and I.cast_floats(same, None) is not same


def test_resize_keeps_each_mask_convention():
    ints_keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # transformers: 1 = keep
    ints_pad = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])  # 1 = padding
    bool_keep = torch.tensor([[True, True, False, False], [True, True, True, True]])
    bool_pad = torch.tensor([[False, False, True, True], [False, False, False, False]])
    example = {"attention_mask": ints_keep, "pad_mask": ints_pad, "kpm": bool_pad, "keep": bool_keep,
               "counts": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), "x": torch.zeros(2, 4)}
    axes = {n: {0: "batch", 1: "seq"} for n in example}
    out = I.resize(example, axes, {"batch": 5, "seq": 12}, seed=4)
    assert all(t.shape == (5, 12) for t in out.values())
    assert out["attention_mask"].dtype == torch.int64 and (out["attention_mask"][:, 0] == 1).all()
    assert (out["attention_mask"] == 0).any()
    assert (out["pad_mask"][:, 0] == 0).all() and (out["pad_mask"] == 1).any()
    assert not out["kpm"][:, 0].any() and out["kpm"].any()
    assert out["keep"][:, 0].all() and not out["keep"].all()
    # "counts" is not named like a mask: integers within the example's range [0, 1]
    assert set(out["counts"].unique().tolist()) <= {0, 1}
    # an axis without a label keeps its size; a label without a size keeps the example's
    part = I.resize({"x": torch.zeros(2, 4, 3)}, {"x": {0: "batch", 1: "seq"}}, {"seq": 6})
    assert part["x"].shape == (2, 6, 3)


def test_resize_of_a_mask_whose_convention_is_unclear_treats_true_as_padding():
    unclear = torch.tensor([[True, False, True, False]])
    out = I.resize({"m": unclear}, {"m": {1: "seq"}}, {"seq": 9}, seed=0)
    assert out["m"].shape == (1, 9) and not out["m"][:, 0].any()


def test_random_floats_follow_the_example_and_survive_constant_examples():
    gen = torch.Generator().manual_seed(0)
    like = torch.randn(64, 64) * 0.01 - 30
    t = I._random_like((64, 64), torch.float32, gen, like=like)
    assert -30.01 < float(t.mean()) < -29.99 and 0.005 < float(t.std()) < 0.02
    flat = I._random_like((500,), torch.float32, gen, like=torch.full((10,), 4.0))
    assert 3.99 < float(flat.mean()) < 4.01 and 0 < float(flat.std()) < 2e-3  # std floored at 1e-3
    one = I._random_like((500,), torch.float64, gen, like=torch.ones(1))
    assert one.dtype == torch.float64 and 0.8 < float(one.std()) < 1.2  # a single value sets nothing
    masked = I._random_like((500,), torch.float32, gen, like=torch.tensor([float("-inf"), 2.0, 4.0]))
    assert 2.0 < float(masked.mean()) < 4.0  # statistics over the finite values
    ints = I._random_like((200,), torch.int64, gen, like=torch.tensor([7, 7]))
    assert (ints == 7).all()  # the range [min, max] of the example, never empty


@pytest.mark.parametrize("rows, convention", [
    ([[False, True, True]], True),
    ([[True, True, False]], False),
    ([[True, False, True]], None),
    ([[True, True, True]], None),
])
def test_mask_convention(rows, convention):
    assert I._mask_convention(torch.tensor(rows)) is convention
    assert I._mask_convention(torch.zeros(3, 0, dtype=torch.bool)) is None
    assert I._mask_convention(torch.tensor(True)) is None


def test_integer_masks_are_named_like_masks_and_hold_zeros_and_ones():
    assert I._is_int_mask("attention_mask", torch.tensor([[0, 1]]))
    assert not I._is_int_mask("attention_mask", torch.tensor([[0, 2]]))
    assert not I._is_int_mask("ids", torch.tensor([[0, 1]]))
    assert not I._is_int_mask("Mask", torch.tensor([[0.0, 1.0]]))
    assert not I._is_int_mask("mask", torch.tensor(1))
    assert not I._is_int_mask("mask", torch.zeros(0, dtype=torch.int64))
    assert not I._is_int_mask("mask", torch.tensor([True, False]))


# --------------------------------------------------------------------------------------------
# Inputs from a file and from the model
# --------------------------------------------------------------------------------------------

def test_load_example_file(tmp_path):
    good = tmp_path / "in.pt"
    torch.save({"src": torch.ones(2, 3)}, good)
    assert torch.equal(I.load_example_file(good)["src"], torch.ones(2, 3))
    with pytest.raises(InputError, match="no such file"):
        I.load_example_file(tmp_path / "missing.pt")
    for i, bad in enumerate(({}, [torch.ones(1)], {"a": 1}, {1: torch.ones(1)})):
        path = tmp_path / f"bad{i}.pt"
        torch.save(bad, path)
        with pytest.raises(InputError, match="expected a non-empty dict of name -> tensor"):
            I.load_example_file(path)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(InputError, match="cannot load it weights-only"):
        I.load_example_file(junk)


def test_from_attribute():
    model = Plain()
    assert I.from_attribute(model) is None
    model.example_inputs = torch.ones(1)
    assert list(I.from_attribute(model)) == ["a"]
    model.example_inputs = lambda: (torch.ones(1), torch.zeros(1))
    assert list(I.from_attribute(model)) == ["a", "b"]
    model.example_inputs = {"b": torch.ones(1)}
    assert list(I.from_attribute(model)) == ["b"]
    model.example_inputs = (torch.ones(1),) * 4
    with pytest.raises(InputError, match="model.example_inputs has 4 entries but forward takes 3"):
        I.from_attribute(model)
    for bad in ({"a": 1}, "text"):
        model.example_inputs = bad
        with pytest.raises(InputError, match="must be a tensor, a tuple of tensors or a dict"):
            I.from_attribute(model)


def test_what_the_first_mutation_run_left():
    """Rules the first `make mutants` run found unpinned (docs/testing.md)."""
    assert I._is_int_mask("attention_mask", torch.tensor([1, 1, 0]))  # an unbatched [L] mask
    assert I.parse_dynamic_spec("Tgt:1=Len") == ("Tgt", 1, "Len")

    class NoParams(nn.Module):
        def forward(self):
            return None

    with pytest.raises(InputError, match="NoParams.forward takes no named parameters"):
        I.order_for_model(NoParams(), {"x": torch.zeros(1)})
    with pytest.raises(InputError, match="Plain.forward requires a, b; give it"):
        I.order_for_model(Plain(), {})
    # resize: seeded, unchanged inputs kept as they are, inputs without axes left alone
    example = {"x": torch.zeros(2, 4), "kpm": torch.tensor([[False, False, True, True]] * 2), "w": torch.ones(3)}
    axes = {"x": {0: "batch", 1: "seq"}, "kpm": {0: "batch", 1: "seq"}}
    torch.manual_seed(1)
    one = I.resize(example, axes, {"batch": 6, "seq": 30}, seed=5)
    torch.manual_seed(2)
    two = I.resize(example, axes, {"batch": 6, "seq": 30}, seed=5)
    assert all(torch.equal(one[n], two[n]) for n in example)
    assert one["w"] is example["w"]
    kept = I.resize(example, axes, {"batch": 2, "seq": 4})
    assert kept["x"] is example["x"] and kept["kpm"] is example["kpm"]


class _ExploitOnLoad:
    """Unpickling this would write a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_what_the_second_mutation_run_left(tmp_path):
    """Rules the second `make mutants` run found unpinned (docs/testing.md, inputs.py)."""
    gen = torch.Generator().manual_seed(0)
    # _mask_convention: an unbatched [L] mask, and rows that rise then fall
    assert I._mask_convention(torch.tensor([False, True, True])) is True
    assert I._mask_convention(torch.tensor([[False, True, False]])) is None
    assert I._mask_convention(torch.tensor([[[True, False, False], [True, True, False]]])) is False
    # _random_like: two example values set mean and std; one finite value among infinities sets nothing
    two = I._random_like((2000,), torch.float32, gen, like=torch.tensor([10.0, 12.0]))
    assert 10.9 < float(two.mean()) < 11.1 and 1.3 < float(two.std()) < 1.5  # std of {10, 12} is sqrt(2)
    lone = I._random_like((2000,), torch.float32, gen, like=torch.tensor([-float("inf"), 5.0]))
    assert torch.isfinite(lone).all() and abs(float(lone.mean())) < 0.1
    # integers: the example's [min, max], one value enough; no example or an empty one: int_range
    spread = I._random_like((2000,), torch.int64, gen, like=torch.tensor([3, 9]))
    assert (int(spread.min()), int(spread.max())) == (3, 9)
    assert (I._random_like((50,), torch.int64, gen, like=torch.tensor([7])) == 7).all()
    assert (I._random_like((50,), torch.int32, gen, like=torch.zeros(0, dtype=torch.int32), int_range=(5, 9)) >= 5).all()
    assert (I._random_like((50,), torch.int64, gen, int_range=(5, 5)) == 5).all()  # an empty range: its low end
    # the draws do not depend on torch's default dtype (a seed gives the same inputs everywhere); 64
    # values: torch draws fewer than 16 normals alike in float32 and float64
    first = I._random_like((64,), torch.float16, torch.Generator().manual_seed(3))
    torch.set_default_dtype(torch.float64)
    try:
        again = I._random_like((64,), torch.float16, torch.Generator().manual_seed(3))
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(first, again)
    # a forward without a signature: nothing known, so any name may be passed
    class Builtin(nn.Module):
        forward = staticmethod(torch._C._nn.gelu)

    assert I.forward_parameters(Builtin()) == ([], True)
    # from_attribute: exactly as many entries as forward takes; the refusal in full
    model = Plain()
    model.example_inputs = (torch.ones(1),) * 3
    assert list(I.from_attribute(model)) == ["a", "b", "c"]
    model.example_inputs = "text"
    with pytest.raises(InputError) as info:
        I.from_attribute(model)
    assert str(info.value) == "model.example_inputs must be a tensor, a tuple of tensors or a dict name -> tensor"
    # load_example_file: weights-only (code in the file never runs), torch's reason in the message
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    torch.save({"x": _ExploitOnLoad(marker)}, evil)
    with pytest.raises(InputError, match="cannot load it weights-only"):
        I.load_example_file(evil)
    assert not marker.exists()
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a pickle")
    try:
        torch.load(junk, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's own words for the file
        reason = str(exc).strip().splitlines()[0].strip()
    with pytest.raises(InputError) as info:
        I.load_example_file(junk)
    assert str(info.value) == f"--example-inputs {junk}: cannot load it weights-only ({reason})"


def test_padding_mask_lengths_are_uniform_over_one_to_l():
    gen = torch.Generator().manual_seed(0)
    assert I.padding_mask((5,), gen).shape == (5,)  # an unbatched mask
    rows = I.padding_mask((4000, 2), gen)
    visible = (~rows).sum(-1)
    assert set(visible.tolist()) == {1, 2}
    assert 0.47 < float((visible == 2).float().mean()) < 0.53  # valid length uniform over {1, 2}
    lengths = (~I.padding_mask((600, 4), gen)).sum(-1)
    assert set(lengths.tolist()) == {1, 2, 3, 4}
    # one row: a random length; several rows: the first one full
    singles = [int((~I.padding_mask((1, 50), gen)).sum()) for _ in range(10)]
    assert min(singles) < 50
    assert all(bool((~I.padding_mask((2, 50), gen))[0].all()) for _ in range(10))


def test_generation_is_seeded_by_default_and_follows_the_example():
    specs = [I.InputSpec("x", (3, 4), torch.float32), I.InputSpec("attention_mask", (9,), torch.int64)]
    torch.manual_seed(1)
    one = I.synthesize(specs, (3, 7))
    torch.manual_seed(2)
    assert all(torch.equal(one[n], t) for n, t in I.synthesize(specs, (3, 7), seed=0).items())
    keep = one["attention_mask"]  # an unbatched attention_mask is a mask too: 0/1, 1 = keep first
    assert set(keep.unique().tolist()) <= {0, 1} and keep[0] == 1
    example = {"x": torch.randn(2, 4) * 0.1 + 100, "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])}
    axes = {n: {0: "batch", 1: "seq"} for n in example}
    torch.manual_seed(1)
    out = I.resize(example, axes, {"batch": 40, "seq": 50})
    torch.manual_seed(2)
    assert all(torch.equal(out[n], t) for n, t in I.resize(example, axes, {"batch": 40, "seq": 50}, seed=0).items())
    assert 99.9 < float(out["x"].mean()) < 100.1 and float(out["x"].std()) < 0.3  # the example's statistics
