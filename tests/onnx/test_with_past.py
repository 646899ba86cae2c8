"""Decoders exported with their key/value cache (``export_onnx(..., with_past=True)``,
attn_export/onnx/with_past.py): Optimum's names and layouts, the metadata a runtime builds an
empty past from, one ``batch`` symbol, and generation through ONNX Runtime: a prefill with an
empty past and decode steps that feed the presents back, against the stock PyTorch model with
transformers' DynamicCache at the same steps, for a left-padded batch of two prompts."""
import json

import pytest

transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from attn_export.cache_contract import CacheContract, positions  # noqa: E402
from attn_export.errors import InputError  # noqa: E402
from attn_export.onnx import export_onnx, read_metadata  # noqa: E402
from attn_export.surgery.transformers import cache as _cache  # noqa: E402
from attn_export.validation.tolerances import tolerance  # noqa: E402
from hf_models import HF5, genai_greedy_tokens, padded_batch, tiny_bert, tiny_gpt2, tiny_llama  # noqa: E402
from helpers import ci_sample  # noqa: E402

pytestmark = pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")

PROMPT_LENGTHS = (5, 3)  # left-padded to 5
DECODE_STEPS = 3


def tiny_mistral(sliding_window=64):
    config = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=sliding_window)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


def tiny_qwen2():
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_gemma2():
    """Soft-capped attention and a sliding window (every other layer) shorter than the prompts."""
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=128, sliding_window=4)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).eval()


def tiny_phi():
    config = transformers.PhiConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=8, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.PhiForCausalLM(config).eval()


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2,
          "gemma2": tiny_gemma2, "phi": tiny_phi,
          "mistral-window4": lambda: tiny_mistral(sliding_window=4)}  # a window shorter than the prompts


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(model name, flavor) -> (stock model, ExportResult, ModelProto), exported once."""
    made = {}

    def get(name, attention="custom"):
        if (name, attention) not in made:
            model = MODELS[name]()
            path = tmp_path_factory.mktemp("with_past") / f"{name}_{attention}.onnx"
            result = export_onnx(model, padded_batch(PROMPT_LENGTHS, 5, left=True), path, with_past=True,
                                 attention=attention)
            made[(name, attention)] = (model, result, onnx.load(str(path)))
        return made[(name, attention)]

    return get


def dims(value):
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def torch_generation(model, prompt, steps):
    """The stock model's logits at the prefill and each decode step (transformers' DynamicCache,
    positions counted from the mask as generate() does), and the greedy tokens it fed."""
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    cache = transformers.DynamicCache(config=model.config)
    logits, tokens = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask, ids.shape[1]),
                        cache=cache, use_cache=True)
            logits.append(out.logits)
            ids = out.logits[:, -1:].argmax(-1)
            tokens.append(ids)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return logits, tokens


def ort_generation(path, geometry, prompt, tokens):
    """ONNX Runtime's logits at the same steps: an empty past for the prefill, then each step's
    presents fed back as the next past, the tokens ``torch_generation`` chose (its last one is
    never fed)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    past = geometry.empty_past(ids.shape[0], torch.float32)
    logits = []
    for step in range(len(tokens)):
        feeds = {"input_ids": ids, "attention_mask": mask, **past}
        if geometry.position_ids:
            feeds["position_ids"] = positions(mask, ids.shape[1])
        outs = dict(zip(output_names, session.run(None, {k: v.numpy() for k, v in feeds.items()})))
        logits.append(torch.from_numpy(outs["logits"]))
        past = {past_name: torch.from_numpy(outs[present]) for present, past_name in
                geometry.present_to_past().items()}
        ids = tokens[step]  # the next step's token
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return logits


def check_generation(model, result, proto):
    geometry = CacheContract.from_metadata(proto)
    prompt = padded_batch(PROMPT_LENGTHS, 5, left=True, seed=1)
    expected, tokens = torch_generation(model, prompt, DECODE_STEPS)
    got = ort_generation(result.path, geometry, prompt, tokens)  # the prefill and DECODE_STEPS steps
    assert len(got) == len(expected) == DECODE_STEPS + 1
    k = max(model.config.hidden_size, prompt["input_ids"].shape[1] + DECODE_STEPS)
    rtol = tolerance(torch.float32, k)
    valid = prompt["attention_mask"].bool()  # the prefill's padded positions predict nothing
    for step, (a, e) in enumerate(zip(got, expected)):
        keep = valid if step == 0 else torch.ones(a.shape[:2], dtype=torch.bool)
        err = (a - e).abs()[keep].max().item()
        scale = e[keep].abs().max().item()
        assert err <= rtol * scale, f"step {step}: max|ort - torch| = {err:.3g} > {rtol:.3g} * {scale:.3g}"
        assert torch.equal(a[:, -1].argmax(-1), e[:, -1].argmax(-1)), f"step {step}: another greedy token"


def check_contract(model, result, proto):
    geometry = CacheContract.from_metadata(proto)
    config = model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, geometry.position_ids, geometry.dtype) == \
        (layers, kv_heads, head_dim, True, "fp32")
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    inputs = {v.name: v for v in proto.graph.input}
    outputs = {v.name: v for v in proto.graph.output}
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids"] + past
    assert list(outputs) == ["logits"] + present
    assert dims(inputs["input_ids"]) == dims(inputs["position_ids"]) == ["batch", "sequence"]
    total = dims(inputs["attention_mask"])[1]
    assert dims(inputs["attention_mask"])[0] == "batch" and total in ("total_sequence", "past_sequence + sequence")
    assert all(dims(inputs[n]) == ["batch", kv_heads, "past_sequence", head_dim] for n in past)
    assert all(inputs[n].type.tensor_type.elem_type == onnx.TensorProto.FLOAT for n in past)
    assert dims(outputs["logits"]) == ["batch", "sequence", config.vocab_size]
    # The presents' length is past + new tokens: the symbolic sum, or the mask's symbol where the
    # trace proved them equal.
    lengths = {"past_sequence + sequence", total}
    assert all(dims(outputs[n])[:2] + dims(outputs[n])[3:] == ["batch", kv_heads, head_dim] and dims(outputs[n])[2]
               in lengths for n in present)
    assert result.input_names == list(inputs) and result.output_names == list(outputs)
    assert result.with_past == json.loads(read_metadata(proto)["with_past"])
    onnx.checker.check_model(proto, full_check=True)


def check_no_kv_expansion(proto, kv_heads):
    """Each attention node takes the past itself (no Concat over a past outside the nodes), reads
    the new keys and values with their own heads (through Reshape/Transpose alone), and says how
    many heads they are."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    past = {v.name for v in proto.graph.input if v.name.startswith("past_key_values.")}
    nodes = [n for n in proto.graph.node if n.op_type in ("FusedAttention", "Attention")]
    assert nodes
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["kv_num_heads"] == kv_heads
        for name in node.input[1:3]:
            chain = []  # back from the node's new keys/values, through Reshape/Transpose (and a
            # Concat of rotary parts, phi's partial rotary), never through a past
            while name in producer and producer[name].op_type in ("Reshape", "Transpose", "Concat"):
                made_by = producer[name]
                chain.append(made_by.op_type)
                assert not set(made_by.input) & past, chain
                if made_by.op_type == "Concat":
                    break
                name = made_by.input[0]
        # The past is the node's own input (the Concat folded in): opset-23 Attention's inputs 4
        # and 5, the FusedAttention cache form's 5 and 6.
        assert set(node.input[4:6] if node.op_type == "Attention" else node.input[5:7]) <= past
    assert not any(n.op_type == "Expand" and any(i in past for i in n.input) for n in proto.graph.node)
    assert not any(n.op_type in ("Concat", "Transpose") and any(i in past for i in n.input) for n in proto.graph.node)


# --------------------------------------------------------------------------------------------
# The wrapper (no export)
# --------------------------------------------------------------------------------------------

def test_positions_count_from_the_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = positions(mask, 2)
    assert pos.tolist() == [[1, 2], [3, 4]]
    assert pos.is_contiguous() and pos._base is None


def test_the_wrapper_matches_the_model_with_its_cache():
    model = tiny_llama()
    wrapped = _cache.DecoderWithPast.wrap(model)
    prompt = padded_batch(PROMPT_LENGTHS, 5, left=True)
    inputs = wrapped.example_inputs(prompt)
    assert inputs["attention_mask"].shape == (2, _cache.TRACE_PAST_LENGTH + 5)
    assert inputs["past_key_values.1.value"].shape == (2, 2, _cache.TRACE_PAST_LENGTH, 8)
    cache = transformers.DynamicCache(config=model.config)
    for i in range(2):
        cache.update(inputs[f"past_key_values.{i}.key"], inputs[f"past_key_values.{i}.value"], i)
    with torch.no_grad():
        got = wrapped(**inputs)
        expected = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         position_ids=inputs["position_ids"], cache=cache, use_cache=True)
    torch.testing.assert_close(got["logits"], expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(got["present.1.key"], expected.past_key_values.layers[1].keys, rtol=0, atol=0)


@pytest.mark.parametrize("make, what", [
    (lambda: tiny_bert(), "does not generate text with a key/value cache"),
    (lambda: torch.nn.Linear(4, 4), "is not a transformers model"),
])
def test_models_that_are_not_decoders_are_refused_with_the_fix(make, what, tmp_path):
    with pytest.raises(InputError, match=what) as info:
        export_onnx(make(), {"input_ids": torch.zeros(2, 4, dtype=torch.int64)}, tmp_path / "m.onnx", with_past=True)
    assert "without --with-past" in str(info.value)
    assert not (tmp_path / "m.onnx").exists()


def test_dynamic_axes_are_refused_with_the_cache(tmp_path):
    with pytest.raises(InputError, match="--with-past sets the cached export's own dynamic axes"):
        export_onnx(tiny_llama(), padded_batch([4, 2], 4), tmp_path / "m.onnx", with_past=True,
                    dynamic_axes={"input_ids": {0: "batch"}})


# --------------------------------------------------------------------------------------------
# The exports
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_llama_gqa_export_has_the_contract_and_generates_like_pytorch(exports):
    model, result, proto = exports("llama")
    check_contract(model, result, proto)
    check_no_kv_expansion(proto, kv_heads=2)
    check_generation(model, result, proto)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_plain_causal_decoders_get_the_compact_mask_on_the_node(exports, name):
    """No [B, 1, L, L] mask built in the graph: the node takes causal masking aligned
    bottom-right and the padding as its key-padding mask (the compact masks of
    surgery/transformers/masks.py, issue 49)."""
    pytest.importorskip("attn_export.surgery.transformers.masks", reason="the compact masks are not in this build")
    from attn_export.onnx.graph import attention_nodes

    _, _, proto = exports(name)
    for node in attention_nodes(proto):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["is_causal"], attrs["causal_alignment"], attrs["has_key_padding_mask"], attrs["has_attn_mask"]) \
            == (1, 1, 1, 0), attrs


@pytest.mark.slow
@pytest.mark.parametrize("name,windowed", ci_sample([("mistral-window4", 2), ("gemma2", 1)]))  # CI: Mistral
def test_sliding_window_decoders_get_the_window_on_the_node(exports, name, windowed):
    """Sliding-window layers (window 4, shorter than the 5-token prompts plus the decode steps)
    keep the compact mask too: causal bottom-right, the padding as the key-padding mask, and the
    window as the node's window attribute; generation through ONNX Runtime with the cache matches
    the stock model's (transformers' own sliding-window cache) at every step."""
    from attn_export.onnx.graph import attention_nodes

    model, result, proto = exports(name)
    windows = []
    for node in attention_nodes(proto):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["is_causal"], attrs["causal_alignment"], attrs["has_key_padding_mask"], attrs["has_attn_mask"]) \
            == (1, 1, 1, 0), attrs
        windows.append(attrs["window"])
    assert sorted(windows) == [0] * (model.config.num_hidden_layers - windowed) + [4] * windowed
    check_generation(model, result, proto)


@pytest.mark.slow
@pytest.mark.parametrize("name", ci_sample(["gpt2", "mistral", "qwen2", "gemma2", "phi"]))  # CI: gpt2, qwen2, phi
def test_decoders_export_with_the_cache_and_generate_like_pytorch(exports, name):
    model, result, proto = exports(name)
    check_contract(model, result, proto)
    kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    check_no_kv_expansion(proto, kv_heads)
    check_generation(model, result, proto)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "gemma2", "phi"])
def test_every_family_passes_the_generation_gate(exports, name):
    """The issue's bar for each decoder family: 16 greedy tokens through ONNX Runtime with the
    cache, from a left-padded batch of prompts of different lengths, equal ``generate()``'s, and
    every step's logits are within tolerance (validation/generation.py)."""
    from attn_export.validation import check_generation as generation_gate

    model, result, _ = exports(name)
    outcome = generation_gate(model, result.path, new_tokens=16)
    assert outcome.passed, outcome.failures
    (run,) = outcome.runs
    assert len(run.steps) == 16 and run.first_divergence is None and run.tokens == outcome.reference_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ci_sample(["llama", "gpt2"]))  # CI: Llama (grouped-query)
def test_standard_flavor_folds_the_cache_into_attention(exports, name):
    model, result, proto = exports(name, "standard")
    check_contract(model, result, proto)
    attention = [n for n in proto.graph.node if n.op_type == "Attention"]
    assert len(attention) == model.config.num_hidden_layers and result.num_attention_nodes == 0
    presents = {o.name for o in proto.graph.output if o.name.startswith("present.")}
    assert {o for n in attention for o in n.output[1:3]} == presents
    kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    check_no_kv_expansion(proto, kv_heads)
    check_generation(model, result, proto)


@pytest.mark.slow
def test_a_float16_export_takes_and_returns_a_float16_cache(tmp_path):
    """--dtype fp16: the past and presents are float16, the metadata says so (what a runtime
    builds the empty past in), and the prefill's logits are within float16's tolerance."""
    model = tiny_llama()
    path = tmp_path / "m.onnx"
    result = export_onnx(model, padded_batch(PROMPT_LENGTHS, 5, left=True), path, with_past=True, dtype="fp16")
    proto = onnx.load(str(path))
    geometry = CacheContract.from_metadata(proto)
    assert geometry.dtype == result.dtype == "fp16"
    cache_values = [v for v in list(proto.graph.input) + list(proto.graph.output) if "." in v.name]
    assert cache_values and all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for v in cache_values)
    prompt = padded_batch(PROMPT_LENGTHS, 5, left=True, seed=1)
    feeds = {**prompt, "position_ids": positions(prompt["attention_mask"], 5),
             **geometry.empty_past(2)}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = torch.from_numpy(session.run(["logits"], {k: v.numpy() for k, v in feeds.items()})[0]).float()
    (expected,), _ = torch_generation(model, prompt, 0)
    keep = prompt["attention_mask"].bool()
    err = (logits - expected).abs()[keep].max().item()
    rtol = tolerance(torch.float16, model.config.hidden_size)
    assert err <= rtol * expected[keep].abs().max().item(), err


# --------------------------------------------------------------------------------------------
# The standard flavor's fold, on one hand-built node (no transformers model)
# --------------------------------------------------------------------------------------------

def cached_node_model(attrs, heads, kv_heads, head_dim):
    """Concat(past, new) -> Transpose -> Reshape -> FusedAttention, as a cached export has it,
    the Concats' outputs the graph's presents."""
    from attn_export import spec
    from attn_export.onnx import node as onnx_node

    S = spec.load()
    f32 = onnx.TensorProto.FLOAT
    nodes, inputs = [], [onnx.helper.make_tensor_value_info("query", f32, ["B", "S", heads * head_dim])]
    for kind in ("key", "value"):
        inputs += [onnx.helper.make_tensor_value_info(f"past_{kind}", f32, ["B", kv_heads, "P", head_dim]),
                   onnx.helper.make_tensor_value_info(f"new_{kind}", f32, ["B", kv_heads, "S", head_dim])]
        nodes += [onnx.helper.make_node("Concat", [f"past_{kind}", f"new_{kind}"], [f"present_{kind}"], axis=-2),
                  onnx.helper.make_node("Transpose", [f"present_{kind}"], [f"{kind}_t"], perm=[0, 2, 1, 3]),
                  onnx.helper.make_node("Reshape", [f"{kind}_t", "flat"], [kind])]
    inputs.append(onnx.helper.make_tensor_value_info("key_padding_mask", f32, ["B", "T"]))
    nodes.append(onnx.helper.make_node(S.op_type, ["query", "key", "value", "key_padding_mask", "attn_mask"], ["out"],
                                       domain=S.domain, **attrs))
    outputs = [onnx.helper.make_tensor_value_info("out", f32, ["B", "S", heads * head_dim])] + [
        onnx.helper.make_tensor_value_info(f"present_{kind}", f32, ["B", kv_heads, "T", head_dim])
        for kind in ("key", "value")]
    init = [onnx.helper.make_tensor("flat", onnx.TensorProto.INT64, [3], [0, 0, -1]),
            onnx.helper.make_tensor("attn_mask", f32, [1, 1, 1, 1], [0.0])]
    graph = onnx.helper.make_graph(nodes, "cached", inputs, outputs, initializer=init)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23),
                                                        onnx.helper.make_opsetid(S.domain, S.domain_version)],
                                  functions=[onnx_node.function_proto(23)])


@pytest.mark.parametrize("past, new", [(4, 3), (6, 1)], ids=["prefill-after-past", "decode"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("causal, alignment", [(False, 0), (True, 1), (True, 0)],
                         ids=["plain", "bottom-right", "top-left"])
def test_the_standard_rewrite_folds_the_past_into_attention(past, new, padding, causal, alignment):
    """Against the float64 definition over cat(past, new): the fused Attention node takes the past
    and writes the presents; top-left causal masking (which the operator would align bottom-right
    with a past) keeps the Concat."""
    from attn_export.onnx import node as onnx_node
    from attn_export.onnx import to_standard_attention
    from helpers import reference_attention

    B, H, Hkv, D = 2, 4, 2, 8
    attrs = onnx_node.node_attributes(H, 0.3, causal, padding, False, causal_alignment=alignment, kv_num_heads=Hkv)
    model = cached_node_model(attrs, H, Hkv, D)
    rewrite = to_standard_attention(model)
    onnx.checker.check_model(model, full_check=True)
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    folded = not (causal and alignment == 0)
    assert rewrite.converted == 1
    assert (list(attention.input[4:6]) == ["past_key", "past_value"]) == folded
    assert (list(attention.output[1:3]) == ["present_key", "present_value"]) == folded
    assert any(n.op_type == "Concat" and "past_key" in n.input for n in model.graph.node) != folded

    gen = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(B, H, new, D, generator=gen)
    k_past, v_past, k_new, v_new = (torch.randn(B, Hkv, n, D, generator=gen) for n in (past, past, new, new))
    k, v = torch.cat([k_past, k_new], 2), torch.cat([v_past, v_new], 2)
    masked = torch.zeros(B, past + new, dtype=torch.bool)
    if padding:
        masked[1, :2] = True  # left padding of the second sequence
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"query": q.transpose(1, 2).reshape(B, new, H * D), "past_key": k_past, "new_key": k_new,
             "past_value": v_past, "new_value": v_new,
             "key_padding_mask": torch.where(masked, float("-inf"), 0.0)}
    out, present_k, present_v = session.run(None, {n: t.numpy() for n, t in feeds.items()})
    ref, _ = reference_attention(q, k, v, key_padding_mask=masked if padding else None, is_causal=causal, scale=0.3,
                                 causal_alignment=alignment)
    expected = ref.transpose(1, 2).reshape(B, new, H * D)
    err = (torch.from_numpy(out) - expected).abs().max().item()
    assert err <= tolerance(torch.float32, past + new) * expected.abs().max().item(), err
    assert torch.equal(torch.from_numpy(present_k), k) and torch.equal(torch.from_numpy(present_v), v)


@pytest.mark.parametrize("past, new", [(0, 3), (4, 3), (6, 1)], ids=["prefill", "prefill-after-past", "decode"])
@pytest.mark.parametrize("causal, alignment", [(False, 0), (True, 1), (True, 0)],
                         ids=["plain", "bottom-right", "top-left"])
def test_the_custom_flavor_folds_the_past_into_the_node(past, new, causal, alignment):
    """Against the float64 definition over cat(past, new): the FusedAttention node takes the past
    in its cache form (has_past, 7 inputs, 3 outputs) and writes the presents, whatever its causal
    alignment (the node keeps its own); no Concat or Transpose reads the past outside the node."""
    from attn_export import spec
    from attn_export.onnx.custom_past import fold_past
    from attn_export.onnx.graph import attach_function
    from attn_export.onnx import node as onnx_node
    from helpers import reference_attention

    S = spec.load()
    B, H, Hkv, D = 2, 4, 2, 8
    attrs = onnx_node.node_attributes(H, 0.3, causal, True, False, causal_alignment=alignment, kv_num_heads=Hkv)
    model = cached_node_model(attrs, H, Hkv, D)
    del model.functions[:]
    assert fold_past(model) == 1
    attach_function(model, 23)
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if n.op_type == S.op_type]
    assert list(node.input[5:]) == ["past_key", "past_value"] and list(node.output) == ["out", "present_key",
                                                                                       "present_value"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}[S.attr_has_past] == 1
    assert not any(n.op_type in ("Concat", "Transpose") and {"past_key", "past_value"} & set(n.input)
                   for n in model.graph.node)
    generic = model.functions[0]  # the generic body, of the nodes' form
    assert generic.domain == S.domain and len(generic.input) == 7 and len(generic.output) == 3

    gen = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(B, H, new, D, generator=gen)
    k_past, v_past, k_new, v_new = (torch.randn(B, Hkv, n, D, generator=gen) for n in (past, past, new, new))
    k, v = torch.cat([k_past, k_new], 2), torch.cat([v_past, v_new], 2)
    masked = torch.zeros(B, past + new, dtype=torch.bool)
    masked[1, :2] = True  # left padding of the second sequence
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"query": q.transpose(1, 2).reshape(B, new, H * D), "past_key": k_past, "new_key": k_new,
             "past_value": v_past, "new_value": v_new, "key_padding_mask": torch.where(masked, float("-inf"), 0.0)}
    out, present_k, present_v = session.run(None, {n: t.numpy() for n, t in feeds.items()})
    ref, _ = reference_attention(q, k, v, key_padding_mask=masked, is_causal=causal, scale=0.3,
                                 causal_alignment=alignment)
    expected = torch.nan_to_num(ref).transpose(1, 2).reshape(B, new, H * D)
    err = (torch.from_numpy(out) - expected).abs().max().item()
    assert err <= tolerance(torch.float32, past + new) * expected.abs().max().item(), err
    assert torch.equal(torch.from_numpy(present_k), k) and torch.equal(torch.from_numpy(present_v), v)


def test_the_custom_fold_is_all_or_none():
    """A model with a node that does not read a past keeps every node in the plain form: one
    form per model, so that its generic body (the first function) fits every node."""
    from attn_export import spec
    from attn_export.onnx.custom_past import fold_past
    from attn_export.onnx import node as onnx_node

    S = spec.load()
    attrs = onnx_node.node_attributes(4, 0.3, True, True, False, causal_alignment=1, kv_num_heads=2)
    model = cached_node_model(attrs, 4, 2, 8)
    plain = onnx.helper.make_node(S.op_type, ["query", "query", "query", "key_padding_mask", "attn_mask"], ["out2"],
                                  domain=S.domain, **onnx_node.node_attributes(4, 0.3, False, False, False))
    model.graph.node.append(plain)
    before = [onnx.helper.printable_node(n) for n in model.graph.node]
    assert fold_past(model) == 0
    assert [onnx.helper.printable_node(n) for n in model.graph.node] == before


# --------------------------------------------------------------------------------------------
# attn-export --with-past
# --------------------------------------------------------------------------------------------

@pytest.fixture
def llama_config(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)
    return tmp_path / "config.json"


def check_gate_ran(report):
    """The generation gate ran and passed: the prefill and the greedy steps in ONNX Runtime."""
    ran = {(c["case"], c["backend"]) for c in report["cases"] if c["status"] == "passed"}
    assert report["generation"]["passed"] and ("generate/prefill", "onnxruntime") in ran


@pytest.mark.slow
def test_the_cli_exports_a_gqa_llama_with_its_cache_and_the_gate_passes(llama_config, tmp_path):
    """The issue's command: exit 0 with the generation gate passed; so does ``attn-export
    validate`` on the file."""
    from helpers import invoke

    out = tmp_path / "llama.onnx"
    proc = invoke("--model", "transformers:AutoModelForCausalLM", "--config", llama_config, "--with-past",
                  "-o", out, "--json", tmp_path / "report.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"]
    check_gate_ran(report)
    assert report["export"]["input_names"][3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    proto = onnx.load(str(out))
    assert json.loads(read_metadata(proto)["with_past"])["num_kv_heads"] == 2
    # attn-export validate reads the cache's geometry from the file and runs the same gate.
    proc = invoke("validate", "--model", "transformers:AutoModelForCausalLM", "--config", llama_config, out,
                  "--json", tmp_path / "validate.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_gate_ran(json.loads((tmp_path / "validate.json").read_text()))


@pytest.mark.slow
def test_a_decoder_without_generate_is_compared_after_a_non_empty_past(tmp_path):
    """Without ``generate()`` there is no generation reference: the parity gate runs the wrapped
    decoder on new tokens after a past (example and batch=1) and reports the cases that resize
    one length alone as skipped (the decoder's own length check)."""
    from attn_export import ConvertOptions, convert

    model = tiny_gpt2()
    model.generate = None  # an instance attribute hides the method
    result = convert(model, padded_batch(PROMPT_LENGTHS, 5, left=True),
                     ConvertOptions(output=tmp_path / "m.onnx", with_past=True))
    assert result.passed
    report = result.report.to_dict()
    assert report.get("generation") is None
    ran = {(c["case"], c["backend"]) for c in report["cases"] if c["status"] == "passed"}
    assert {("example", "onnxruntime"), ("batch=1", "onnxruntime")} <= ran
    skipped = [c for c in report["cases"] if c["status"] == "skipped"]
    assert skipped and all("give the mask over past + new tokens" in c["message"] for c in skipped)


def test_genai_config_goes_with_the_cache(tmp_path):
    from attn_export import ConvertOptions

    with pytest.raises(InputError, match="add with_past"):
        ConvertOptions(output=tmp_path / "m.onnx", genai_config=True)


@pytest.mark.slow
def test_convert_writes_the_genai_config_beside_a_cached_export(tmp_path):
    """``--genai-config``: the file ONNX Runtime GenAI reads, naming the export and the cache's
    geometry (the runtime itself runs in test_onnxruntime_genai_generates_the_models_tokens)."""
    from attn_export import ConvertOptions, convert

    model = tiny_llama()
    convert(model, padded_batch(PROMPT_LENGTHS, 5, left=True),
            ConvertOptions(output=tmp_path / "m.onnx", with_past=True, genai_config=True, validate=False))
    decoder = json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["filename"] == "m.onnx"
    assert (decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (2, model.config.num_hidden_layers)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"


# --------------------------------------------------------------------------------------------
# A generation runtime nobody here wrote
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
# CI: GPT-2 custom, Llama standard, Mistral (sliding window), Gemma 2 (soft-cap, window).
@pytest.mark.parametrize("name, attention", ci_sample([("gpt2", "custom"), ("gpt2", "standard"), ("llama", "standard"),
                                                       ("llama", "custom"), ("mistral", "custom"), ("qwen2", "custom"),
                                                       ("gemma2", "custom")]))
def test_onnxruntime_genai_generates_the_models_tokens(tmp_path, name, attention):
    """The cached export with the genai_config.json beside it (attn_export.genai_config), read by
    ONNX Runtime GenAI: 16 greedy tokens for three prompts of different lengths equal the stock
    model's (transformers' cache, left padding). Models with a sliding window get prompts of one
    length: GenAI right-pads (docs/onnx_consumers.md), and its pad slots would count in a window
    that transformers' left-padded batch does not have."""
    from attn_export import genai_config

    model = MODELS[name]()
    path = tmp_path / "model.onnx"
    export_onnx(model, padded_batch(PROMPT_LENGTHS, 5, left=True), path, with_past=True, attention=attention)
    genai_config.write_genai_config(path, model.config)
    gen = torch.Generator().manual_seed(0)
    lengths = (12, 12, 12) if getattr(model.config, "sliding_window", None) else (5, 9, 12)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    width = max(map(len, prompts))
    prompt = {"input_ids": torch.zeros(len(prompts), width, dtype=torch.int64),
              "attention_mask": torch.zeros(len(prompts), width, dtype=torch.int64)}
    for row, tokens in enumerate(prompts):
        prompt["input_ids"][row, width - len(tokens):] = torch.tensor(tokens)
        prompt["attention_mask"][row, width - len(tokens):] = 1
    _, expected = torch_generation(model, prompt, 15)
    expected = torch.cat(expected, dim=1)
    assert len({tuple(t) for t in expected.tolist()}) == len(prompts)  # a comparison that can tell rows apart
    got = torch.tensor(genai_greedy_tokens(tmp_path, prompts, 0, 16))
    # GenAI ends a row at its end-of-sequence token (and fills the rest): compare up to it.
    eos = model.config.eos_token_id
    for row in range(len(prompts)):
        ends = (expected[row] == eos).nonzero()
        steps = int(ends[0]) + 1 if len(ends) else expected.shape[1]
        assert torch.equal(got[row, :steps], expected[row, :steps]), (row, got[row], expected[row])
