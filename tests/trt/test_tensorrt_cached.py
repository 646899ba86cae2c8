"""TensorRT for cached decoder exports (--with-past --to tensorrt), without TensorRT: the
optimization profile derived from the cache's contract and the longest context, the CLI's
acceptance and refusals, and CachedEngineSteps (past/present bound by name, shapes set per step,
the presents fed back as the next past) driven against a stand-in execution context that reads
and writes the memory at the bound addresses and runs the ONNX file in ONNX Runtime
(trt_stand_ins.BoundMemoryContext). What needs TensorRT is in test_tensorrt_gpu.py."""
import re
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from attn_export import tensorrt as attn_trt
from attn_export.errors import InputError
from attn_export.cache_contract import CacheContract
from attn_export.tensorrt.cache_profile import PAST, SEQUENCE, TOTAL
from attn_export.validation.generation_steps import OrtSteps
from helpers import invoke, one_line_error
from trt_stand_ins import CachedEngineStandIn, shared_library

LAYOUT = CacheContract(num_layers=2, num_kv_heads=2, head_dim=8, position_ids=True)
VOCAB = 11


def cached_graph(past_symbols=("past_sequence",) * 4, total="total_sequence"):
    """A runnable cached export of the contract's names and layouts: present.{i}.* is the past
    with the new tokens (as floats, times i + 1; values negated) appended along the sequence,
    and logits[b, s, v] = (v == input_ids[b, s]) + sum of present.0.key[b] + sum of the mask's
    row b + position_ids[b, s]: a past fed wrong changes the logits."""
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["ids_f", "axes13"], ["ids_u"]),
             helper.make_node("Mul", ["ids_u", "ones"], ["new_kv"])]
    pasts = [f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]
    for i in range(2):
        nodes += [helper.make_node("Mul", ["new_kv", f"scale{i}"], [f"new_key{i}"]),
                  helper.make_node("Neg", [f"new_key{i}"], [f"new_value{i}"]),
                  helper.make_node("Concat", [f"past_key_values.{i}.key", f"new_key{i}"], [f"present.{i}.key"], axis=2),
                  helper.make_node("Concat", [f"past_key_values.{i}.value", f"new_value{i}"], [f"present.{i}.value"],
                                   axis=2)]
    nodes += [helper.make_node("ReduceSum", ["present.0.key", "axes123"], ["kv_sum"], keepdims=0),
              helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
              helper.make_node("ReduceSum", ["mask_f", "axes1"], ["mask_sum"], keepdims=0),
              helper.make_node("Add", ["kv_sum", "mask_sum"], ["row"]),
              helper.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["row", "axes1"], ["row_u"]),
              helper.make_node("Add", ["pos_f", "row_u"], ["per_token"]),
              helper.make_node("Unsqueeze", ["per_token", "axes2"], ["per_token_u"]),
              helper.make_node("Gather", ["eye", "input_ids"], ["onehot"], axis=0),
              helper.make_node("Add", ["onehot", "per_token_u"], ["logits"])]
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    inits = [ints("axes13", [1, 3]), ints("axes123", [1, 2, 3]), ints("axes1", [1]), ints("axes2", [2]),
             helper.make_tensor("ones", TensorProto.FLOAT, [1, 2, 1, 8], [1.0] * 16),
             helper.make_tensor("scale0", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("scale1", TensorProto.FLOAT, [], [2.0]),
             helper.make_tensor("eye", TensorProto.FLOAT, [VOCAB, VOCAB], np.eye(VOCAB, dtype=np.float32).ravel())]
    vi = helper.make_tensor_value_info
    inputs = [vi("input_ids", TensorProto.INT64, ["batch", "sequence"]),
              vi("attention_mask", TensorProto.INT64, ["batch", total]),
              vi("position_ids", TensorProto.INT64, ["batch", "sequence"])]
    inputs += [vi(n, TensorProto.FLOAT, ["batch", 2, s, 8]) for n, s in zip(pasts, past_symbols)]
    outputs = [vi("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB])]
    outputs += [vi(n.replace("past_key_values.", "present."), TensorProto.FLOAT, ["batch", 2, total, 8]) for n in pasts]
    graph = helper.make_graph(nodes, "cached", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def dims(value):
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


# --------------------------------------------------------------------------------------------
# The profile
# --------------------------------------------------------------------------------------------

def check_covers_the_graph(model, profile):
    """Every input has a min/opt/max of its rank; static axes as the graph has them; every dynamic
    axis min <= opt <= max; one bound per axis kind across inputs."""
    seen = {}
    kinds = attn_trt.cache_profile.axis_kinds(LAYOUT)
    for value in model.graph.input:
        mn, opt, mx = profile.shapes[value.name]
        for axis, d in enumerate(dims(value)):
            if isinstance(d, int):
                assert mn[axis] == opt[axis] == mx[axis] == d
                continue
            assert mn[axis] <= opt[axis] <= mx[axis], (value.name, axis)
            bound = seen.setdefault(kinds[value.name][axis], (mn[axis], opt[axis], mx[axis]))
            assert bound == (mn[axis], opt[axis], mx[axis]), (value.name, axis)
    return seen


def test_the_profile_runs_the_past_from_zero_to_the_context():
    model = cached_graph()
    profile = attn_trt.cached_profile(model, LAYOUT, max_context=64, batch=2)
    bounds = check_covers_the_graph(model, profile)
    assert bounds == {"batch": (1, 2, 8), SEQUENCE: (1, 1, 64), PAST: (0, 32, 63), TOTAL: (1, 33, 64)}
    # The generation gate's steps fit: 3 prompts of up to 12 tokens, then 16 tokens one by one.
    for past, new in [(0, 12)] + [(12 + k, 1) for k in range(16)]:
        shapes = {"input_ids": (3, new), "attention_mask": (3, past + new), "position_ids": (3, new),
                  **{n: (3, 2, past, 8) for n in LAYOUT.past_names()}}
        assert profile.outside(shapes) is None
    assert "past_key_values.1.value[2]=64" in profile.outside({"past_key_values.1.value": (1, 2, 64, 8)})


def test_past_axes_with_symbols_of_their_own_get_one_bound():
    """torch.export may keep a symbol per past tensor: the profile still bounds them as one."""
    model = cached_graph(past_symbols=("s0", "s1", "s2", "s3"))
    profile = attn_trt.cached_profile(model, LAYOUT, max_context=32, batch=1,
                                      max_shapes={"past_key_values.0.key": (4, 2, 20, 8)})
    assert check_covers_the_graph(model, profile)[PAST] == (0, 16, 20)
    assert {profile.shapes[n][2][2] for n in LAYOUT.past_names()} == {20}


@pytest.mark.parametrize("option, specs, words", [
    ("min_shapes", {"past_key_values.0.key": (1, 2, 1, 8)}, "past_sequence axis: the minimum must be 0"),
    ("max_shapes", {"past_key_values.0.key": (4, 2, 20, 8), "past_key_values.1.key": (4, 2, 30, 8)},
     "past_sequence axis is 20 in past_key_values.0.key[2] but 30"),
    ("max_shapes", {"past_key_values.0.key": (4, 4, 20, 8)}, "that dimension is static (2)"),
    ("max_shapes", {"attention_mask": (8, 40)}, "longest past (63) plus one new token exceeds"),
    ("opt_shapes", {"input_ids": (2, 100)}, "need min <= opt <= max"),
    ("max_shapes", {"logits": (1, 1, 1)}, "no such engine input"),
])
def test_profile_overrides_that_disagree_are_refused(option, specs, words):
    with pytest.raises(InputError, match=re.escape(words)):
        attn_trt.cached_profile(cached_graph(), LAYOUT, max_context=64, batch=2, **{option: specs})


def test_a_symbol_shared_by_two_axis_kinds_is_refused():
    with pytest.raises(InputError, match="one symbol 'sequence'"):
        attn_trt.cached_profile(cached_graph(total="sequence"), LAYOUT, max_context=64, batch=2)


def test_the_longest_context_comes_from_the_flag_or_the_config():
    config = SimpleNamespace(max_position_embeddings=128)
    assert attn_trt.max_context_of(config, None) == 128
    assert attn_trt.max_context_of(config, 40) == 40
    with pytest.raises(InputError, match="beyond the model's max_position_embeddings"):
        attn_trt.max_context_of(config, 4096)
    with pytest.raises(InputError, match="give --max-context N"):
        attn_trt.max_context_of(SimpleNamespace(), None)


# --------------------------------------------------------------------------------------------
# CachedEngineSteps against memory at the bound addresses
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cached-trt") / "cached.onnx"
    onnx.save(cached_graph(), str(path))
    return path


def stand_in(path, max_context=64):
    return CachedEngineStandIn(path, attn_trt.cached_profile(onnx.load(str(path)), LAYOUT, max_context=max_context,
                                                             batch=2))


def steps_feeds(ids, tokens):
    """The feeds of a prefill of ``ids`` and one decode step per column of ``tokens``."""
    mask = torch.ones_like(ids)
    feeds = [{"input_ids": ids, "attention_mask": mask}]
    for k in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(ids[:, :1])], dim=1)
        feeds.append({"input_ids": tokens[:, k:k + 1], "attention_mask": mask})
    for feed in feeds:
        new = feed["input_ids"].shape[1]
        feed["position_ids"] = torch.arange(feed["attention_mask"].shape[1] - new, feed["attention_mask"].shape[1]
                                            ).expand(ids.shape[0], new)
    return feeds


def test_engine_steps_bind_by_name_and_feed_the_presents_back(graph_file):
    ids, tokens = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[7, 8, 9], [10, 1, 2]])
    engine = stand_in(graph_file)
    steps = attn_trt.CachedEngineSteps(engine)
    history = engine.context.history
    seen = ids.clone()
    for k, feed in enumerate(steps_feeds(ids, tokens)):
        logits = steps.step(feed)["logits"]
        if k:
            seen = torch.cat([seen, tokens[:, k - 1:k]], dim=1)
        # The reference: the graph's definition, on every token fed so far.
        kv_sum = 16.0 * seen.sum(1, keepdim=True)
        expected = torch.eye(VOCAB)[feed["input_ids"]] + (
            kv_sum + feed["attention_mask"].sum(1, keepdim=True) + feed["position_ids"]).unsqueeze(-1)
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(steps.past["past_key_values.1.value"][:, 0, :, 0], -2.0 * seen.float())
        bound = {name: (shape, address) for name, shape, address in history[-1]}
        assert bound["input_ids"][0] == tuple(feed["input_ids"].shape)
        assert bound["past_key_values.0.key"][0] == (2, 2, seen.shape[1] - feed["input_ids"].shape[1], 8)
        if k:  # the past read is the memory the step before wrote its presents to: no copy
            before = {name: address for name, _, address in history[-2]}
            assert all(bound[f"past_key_values.{n}"][1] == before[f"present.{n}"]
                       for n in ("0.key", "0.value", "1.key", "1.value"))
    assert len(history) == 1 + tokens.shape[1]


def test_engine_steps_agree_with_the_onnx_runtime_steps(graph_file):
    """The same steps through ONNX Runtime's step runner (the cache on the CPU, fed as numpy),
    twice over: a prefill starts a new generation with an empty past in both."""
    ids, tokens = torch.tensor([[3, 1], [2, 2]]), torch.tensor([[4, 5, 6, 7], [1, 1, 1, 1]])
    from attn_export.validation.runners import OnnxRuntimeRunner

    trt_steps = attn_trt.CachedEngineSteps(stand_in(graph_file))
    with OnnxRuntimeRunner(graph_file) as runner:
        runner.load()
        ort_steps = OrtSteps(runner, LAYOUT, ["logits"] + LAYOUT.present_names())
        first = []
        for generation in range(2):
            for k, feed in enumerate(steps_feeds(ids, tokens)):
                logits = trt_steps.step(feed)["logits"]
                torch.testing.assert_close(logits, ort_steps.step(feed)["logits"], rtol=0, atol=0)
                if generation:
                    torch.testing.assert_close(logits, first[k], rtol=0, atol=0)
                first.append(logits)


def test_engine_steps_refuse_what_the_engine_cannot_take(graph_file):
    ids, tokens = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])
    feeds = steps_feeds(ids, tokens)
    steps = attn_trt.CachedEngineSteps(stand_in(graph_file, max_context=4))
    with pytest.raises(InputError, match="cache holds 0"):
        steps.step(feeds[1])  # a decode step first
    steps.step(feeds[0])
    steps.step(feeds[1])
    with pytest.raises(InputError, match=r"outside the engine's profile.*--max-context"):
        steps.step(feeds[2])  # 5 tokens of context > 4
    engine = stand_in(graph_file)
    engine.outputs = [n for n in engine.outputs if n != "present.1.value"]
    with pytest.raises(attn_trt.EngineError, match="without a partner: past_key_values.1.value"):
        attn_trt.CachedEngineSteps(engine)


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------

@pytest.fixture
def llama_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_llama

    assert transformers
    tiny_llama().config.save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_the_cli_takes_the_cache_to_tensorrt_and_says_what_is_missing(llama_config, tmp_path, monkeypatch):
    args = ("--model", "transformers:AutoModelForCausalLM", "--config", llama_config, "--with-past")
    out = tmp_path / "m.engine"
    one_line_error(invoke(*args, "--to", "onnx", "--max-context", "64", "-o", tmp_path / "m.onnx"),
                   "--max-context go with --to tensorrt")
    one_line_error(invoke(*args[:4], "--to", "tensorrt", "--max-context", "64", "-o", out),
                   "goes with --with-past --to tensorrt")
    monkeypatch.setattr(attn_trt, "require_runtime", lambda: (_ for _ in ()).throw(
        attn_trt.TensorRTUnavailable("TensorRT is not installed (stand-in)")))
    one_line_error(invoke(*args, "--to", "tensorrt", "-o", out), "TensorRT is not installed")
    assert not list(tmp_path.glob("m.*"))


@pytest.fixture
def as_if_tensorrt(tmp_path, monkeypatch):
    """TensorRT and a GPU 'present', a library with the plugin entry points, and build_engine
    replaced by one that records the profile it was given and stops (no TensorRT here)."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    library = shared_library(tmp_path, "entry", 'extern "C" void* getCreators(int& n) { n = 0; return nullptr; }\n'
                                               'extern "C" void setLoggerFinder(void*) {}\n')
    built = {}

    def build_engine(onnx_path, engine_path, *, profile, **_kwargs):
        built.update(onnx=onnx_path, profile=profile)
        raise attn_trt.EngineError("stand-in: no TensorRT here")

    monkeypatch.setattr(attn_trt, "require_runtime", lambda: None)
    monkeypatch.setattr(attn_trt, "build_engine", build_engine)
    return library, built


def test_the_cli_refuses_a_context_beyond_the_model_before_exporting(llama_config, tmp_path, as_if_tensorrt):
    library, built = as_if_tensorrt
    proc = invoke("--model", "transformers:AutoModelForCausalLM", "--config", llama_config, "--with-past",
                  "--to", "tensorrt", "--plugin", library, "--max-context", "4096", "-o", tmp_path / "m.engine")
    one_line_error(proc, "--max-context 4096 is beyond the model's max_position_embeddings (128)")
    assert not (tmp_path / "m.onnx").exists() and not built


@pytest.mark.slow  # exports a decoder
def test_the_cli_builds_the_cached_export_with_the_past_profile(llama_config, tmp_path, as_if_tensorrt):
    library, built = as_if_tensorrt
    proc = invoke("--model", "transformers:AutoModelForCausalLM", "--config", llama_config, "--with-past",
                  "--to", "tensorrt", "--plugin", library, "--max-context", "96", "-o", tmp_path / "m.engine")
    one_line_error(proc, "stand-in: no TensorRT here")
    assert "profile past_key_values.1.value: min 1x2x0x8  opt 2x2x48x8  max 8x2x95x8" in proc.stderr
    model = onnx.load(str(built["onnx"]))
    profile = built["profile"]
    for value in model.graph.input:  # the ONNX file's own inputs, every dynamic axis bounded
        mn, opt, mx = profile.shapes[value.name]
        for axis, d in enumerate(dims(value)):
            assert (mn[axis], opt[axis], mx[axis]) == ((d, d, d) if isinstance(d, int) else
                                                       profile.labels[attn_trt.cache_profile.axis_kinds(
                                                           LAYOUT)[value.name][axis]])


# --------------------------------------------------------------------------------------------
# The generation gate through the engine's step runner
# --------------------------------------------------------------------------------------------

@pytest.mark.slow  # exports a decoder and generates
def test_validate_generates_through_the_engine_steps(tmp_path, monkeypatch):
    """``validate(..., engine=...)`` of a cached export: the engine's steps (here bound to the
    stand-in context) generate the same 8 greedy tokens as generate(), every step's logits
    within tolerance; with a profile too short for the gate's prompts the TensorRT row fails
    saying which flag widens it."""
    pytest.importorskip("transformers")
    from attn_export.onnx import export_onnx
    from attn_export.validation import validate
    from hf_models import padded_batch, tiny_llama

    model = tiny_llama()
    path = tmp_path / "llama.onnx"
    export_onnx(model, padded_batch((5, 3), 5, left=True), path, with_past=True)
    proto = onnx.load(str(path))
    layout = CacheContract(2, 2, 8, True)
    context = {"max": 128}
    monkeypatch.setattr(attn_trt, "EngineRunner", lambda engine, plugin=None: CachedEngineStandIn(
        path, attn_trt.cached_profile(proto, layout, max_context=context["max"], batch=2)))
    report = validate(model, path, {}, engine=tmp_path / "llama.engine", isolate=False, new_tokens=8).to_dict()
    assert report["passed"], report["failures"]
    runs = {run["backend"]: run for run in report["generation"]["runs"]}
    assert set(runs) == {"onnxruntime", "tensorrt"}
    assert runs["tensorrt"]["tokens"] == report["generation"]["reference_tokens"]
    assert len(runs["tensorrt"]["steps"]) == 8 and all(s["passed"] for s in runs["tensorrt"]["steps"])
    assert "generated tokens (tensorrt)" in {c["name"] for c in report["checks"]}

    context["max"] = 16  # prompts of up to 12 tokens and 8 new ones need 19
    report = validate(model, path, {}, engine=tmp_path / "llama.engine", isolate=False, new_tokens=8).to_dict()
    assert not report["passed"]
    (failure,) = [f for f in report["failures"] if "tensorrt" in f]
    assert "outside the engine's profile" in failure and "--max-context" in failure


def test_the_worker_backend_steps_the_engine_and_returns_the_logits_only(graph_file, monkeypatch):
    """TensorRT's child process (worker backend ``tensorrt-cached``), run in this process with
    the stand-in: numpy feeds of the tokens in, the logits out, the cache kept inside."""
    from attn_export.validation import worker

    monkeypatch.setattr(attn_trt, "EngineRunner", lambda engine, plugin=None: stand_in(graph_file))
    backend = worker.BACKENDS["tensorrt-cached"]("x.engine", None)
    assert set(backend.info()["profile"]) == set(LAYOUT.input_names())
    ids, tokens = torch.tensor([[1, 2]]), torch.tensor([[3]])
    outs = [backend.run({n: t.numpy() for n, t in feed.items()}) for feed in steps_feeds(ids, tokens)]
    assert [set(o) for o in outs] == [{"logits"}, {"logits"}]
    logits, kind = outs[1]["logits"]
    assert kind == "torch.float32" and logits.shape == (1, 1, VOCAB)
    # 16 * (1 + 2 + 3) from the cache, 3 mask columns, position 2, and the token's own one-hot
    assert logits[0, 0, 3] == 16 * 6 + 3 + 2 + 1
