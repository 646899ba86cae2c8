"""The generation gate: greedy decoding through ONNX Runtime with the key/value cache of a cached
export (the cache's contract in its metadata, attn_export/cache_contract.py), against the PyTorch model's own
``generate()`` (docs/validation.md, "Generation").

    >>> result = check_generation(model, "model.onnx", new_tokens=16)
    >>> result.passed, result.failures, result.to_dict()

A left-padded batch of prompts of different lengths is prefilled with an empty past of the
shapes the metadata gives, then one token per step is fed with the presents of the step before,
the attention mask grown by one column and ``position_ids = cumsum(attention_mask) - 1`` (clipped
at 0), as ``generate()`` does. The reference is plain greedy decoding: every row runs to the end
(EOS does not stop it) and each step's token is the argmax of its logits. Passes when every step picks the reference's token and every
step's logits (and the prefill's, at the prompts' valid tokens) are within the dtype's
tolerance at the scale of those logits (validation/tolerances.py).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from attn_export._moved import moved
from attn_export.cache_contract import METADATA_KEY, CacheContract, generates, positions
from attn_export.errors import InputError, first_line
from attn_export.options import GateOptions, OrtOptions, with_fields
from attn_export.validation.generation_result import BackendGeneration, Comparison, GenerationResult
from attn_export.validation.genai_generation import genai_folder, genai_generation, genai_installed
from attn_export.validation.generation_steps import DTYPES, EngineSteps, OrtSteps
from attn_export.validation.quantized_reference import dequantize_reference
from attn_export.validation.runners import BACKEND_TRT, OnnxRuntimeRunner, RunnerError
from attn_export.validation.tolerances import compare, reduction_length, tolerance

DEFAULT_PROMPT_LENGTHS = (5, 9, 12)


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of the prompts, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def random_prompts(vocab_size: int, lengths: Sequence[int], seed: int, avoid: Sequence[int] = ()) -> List[List[int]]:
    """Prompts of the given lengths from the vocabulary (seeded), without the special tokens
    (unless they are all the vocabulary has)."""
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(avoid)] or list(range(vocab_size)))
    gen = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(len(allowed), (n,), generator=gen)].tolist() for n in lengths]


def _special_tokens(config) -> List[int]:
    ids = [getattr(config, name, None) for name in ("pad_token_id", "eos_token_id", "bos_token_id")]
    flat = [i for x in ids for i in (x if isinstance(x, (list, tuple)) else [x])]
    return [int(i) for i in flat if i is not None]


def vocabulary_size(model: nn.Module) -> int:
    """The number of token ids the model embeds: its config's ``vocab_size`` (the text config's
    for a composite model), else the rows of its input embeddings."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(config, "vocab_size", None) or getattr(text, "vocab_size", None)
    if size is None and hasattr(model, "get_input_embeddings"):
        size = model.get_input_embeddings().weight.shape[0]
    if not size:
        raise InputError("the generation gate could not tell the model's vocabulary size (no config.vocab_size)")
    return int(size)


def choose_pad_id(config, vocab_size: int) -> int:
    """The id that fills the left padding: the model's pad, else its EOS, else its BOS, the first
    of them inside the vocabulary (a config may name ids its vocabulary lacks: GPT-2's 50256 in a
    resized model); else 0. Padded positions are masked, so any id the model embeds serves."""
    return next((i for i in _special_tokens(config) if 0 <= i < vocab_size), 0)


@contextlib.contextmanager
def _plain_generation_defaults(model: nn.Module):
    """The model's own generation_config set aside for one generate() call. transformers fills
    the fields a GenerationConfig leaves None from it (5.x always; 4.50+ through
    ``use_model_defaults``): its EOS would end rows (eos_token_id=None does not stop that), its
    repetition penalty, suppressed or forced tokens would pick other tokens than the argmax of
    the logits the gate compares."""
    import transformers

    saved = getattr(model, "generation_config", None)
    model.generation_config = transformers.GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def reference_generation(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, pad_id: int,
                         takes_positions: bool):
    """The model's own greedy generate(): tokens [B, N], each step's logits [N, B, V] (before any
    logits processor) and the prefill's logits [B, S, V]. EOS does not end generation and no
    logits processor runs: every row runs N steps, each picking the argmax of its logits."""
    import transformers

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0,
                                           eos_token_id=None, pad_token_id=pad_id, use_cache=True,
                                           output_logits=True, return_dict_in_generate=True)
    extra = {"position_ids": positions(mask)} if takes_positions else {}
    with torch.no_grad():
        try:
            with _plain_generation_defaults(model):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            prefill = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise InputError(f"the model's generate() or forward failed on {ids.shape[0]} left-padded prompts: "
                             f"{type(exc).__name__}: {first_line(exc)}") from exc
    if len(out.logits) != new_tokens:
        raise InputError(f"the model's generate() stopped after {len(out.logits)} of {new_tokens} tokens")
    tokens, logits = out.sequences[:, ids.shape[1]:], torch.stack([l.float() for l in out.logits])
    _require_greedy(tokens, logits)
    return tokens, logits, prefill.float()


def _require_greedy(tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """Every reference token is the argmax of its step's logits: the gate compares the backend's
    argmax to it, so anything else (a row ended and padded, a logits processor) would fail a
    correct export. A transformers release that changes generate() shows up here, by name."""
    differ = torch.nonzero(logits.argmax(-1).T != tokens)
    if len(differ):
        row, step = (int(x) for x in differ[0])
        raise InputError(f"the model's generate() picked token {int(tokens[row, step])} at step {step} of row {row}, "
                         f"not the argmax of its logits ({int(logits[step, row].argmax())}): transformers "
                         "ended the row or ran a logits processor the gate did not turn off; the gate cannot judge "
                         "the export against it")


def _decode(steps, ids, mask, tokens, takes_positions: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The backend's prefill logits [B, S, V] and each step's last-position logits [B, V], fed
    ``tokens`` (the reference's) one per step; ``steps`` (generation_steps.py) holds the cache
    and feeds each step the presents of the step before."""
    feed = {"input_ids": ids, "attention_mask": mask}
    steps_logits, prefill = [], None
    for k in range(tokens.shape[1]):
        if takes_positions:
            feed["position_ids"] = positions(feed["attention_mask"])[:, -feed["input_ids"].shape[1]:]
        logits = steps.step(feed)["logits"]
        prefill = logits if prefill is None else prefill
        steps_logits.append(logits[:, -1])
        feed = {"input_ids": tokens[:, k:k + 1],
                "attention_mask": torch.cat([feed["attention_mask"], torch.ones_like(mask[:, :1])], dim=1)}
    return prefill, steps_logits


def _divergence(step_logits: torch.Tensor, ref_logits: torch.Tensor, ref_tokens: torch.Tensor) -> str:
    """Which rows picked another token at this step, and the reference's margin between its
    top two logits there (a near tie flips under rounding alone)."""
    chosen = step_logits.argmax(-1)
    parts = []
    for row in torch.nonzero(chosen != ref_tokens).flatten().tolist():
        top2 = ref_logits[row].double().topk(2).values
        parts.append(f"row {row}: token {int(chosen[row])} instead of {int(ref_tokens[row])} "
                     f"(reference margin between its top two logits {float(top2[0] - top2[1]):.3e})")
    return "; ".join(parts)


def near_tie(step_logits: torch.Tensor, ref_logits: torch.Tensor, ref_tokens: torch.Tensor, rtol: float) -> str:
    """Where every row that picked another token picked one whose reference logit is within
    2 * atol of the reference's top (atol = rtol * max|reference logits|: two logits each off by
    atol may swap), what the report says of it; else "" (a divergence)."""
    chosen = step_logits.argmax(-1)
    rows = torch.nonzero(chosen != ref_tokens).flatten()
    atol = rtol * float(ref_logits.abs().max())
    gaps = ref_logits[rows, ref_tokens[rows]] - ref_logits[rows, chosen[rows]]
    if not bool((gaps <= 2 * atol).all()):
        return ""
    return ", ".join(f"row {int(r)}: token {int(chosen[r])} instead of {int(ref_tokens[r])}, a near tie (reference gap "
                     f"{float(g):.2e} <= 2 * atol {2 * atol:.2e})" for r, g in zip(rows, gaps))


def run_backend(steps, layout: CacheContract, ids, mask, reference, rtol: float,
                ties: bool = False) -> BackendGeneration:
    """One backend (a step runner, generation_steps.py) against the reference (tokens, step
    logits, prefill logits). ``ties``: a token flipped by a near tie within the tolerance
    (:func:`near_tie`) is noted, not a divergence (a quantized file's int8 activations)."""
    ref_tokens, ref_steps, ref_prefill = reference
    result = BackendGeneration(steps.name)
    try:
        prefill, steps = _decode(steps, ids, mask, ref_tokens, layout.position_ids)
    except (RunnerError, RuntimeError, InputError) as exc:
        runtime = "TensorRT" if result.backend == BACKEND_TRT else "ONNX Runtime"
        result.error = f"{runtime} failed during generation: {first_line(exc)}"
        return result
    if layout.last_logits:  # the last position's alone, valid in every row of a left-padded batch
        ref_prefill, valid = ref_prefill[:, -1:], None
    else:
        valid = (mask != 0)[..., None].expand(ref_prefill.shape) if prefill.shape == ref_prefill.shape else None
    result.prefill = Comparison.of(compare(prefill.float(), ref_prefill, rtol, valid=valid), prefill.shape)
    result.steps = [Comparison.of(compare(s.float(), r, rtol), s.shape) for s, r in zip(steps, ref_steps)]
    result.tokens = torch.stack([s.argmax(-1) for s in steps], dim=1).tolist()
    for k, (s, r) in enumerate(zip(steps, ref_steps)):
        if not torch.equal(s.argmax(-1), ref_tokens[:, k]):
            tie = near_tie(s.float(), r, ref_tokens[:, k], rtol) if ties else ""
            if tie:
                result.near_ties.append(f"step {k}: {tie}")
                continue
            result.first_divergence, result.divergence = k, _divergence(s, r, ref_tokens[:, k])
            break
    return result


def check_generation(model: nn.Module, onnx_path: str | Path, *, prompts: Optional[Sequence[Sequence[int]]] = None,
                     prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS, onnx_model=None,
                     engine: Optional[str | Path] = None, plugin: Optional[str | Path] = None,
                     ort: Optional[OrtOptions] = None, gate: Optional[GateOptions] = None, **fields) -> GenerationResult:
    """Greedy generation of ``gate.new_tokens`` tokens through ONNX Runtime (each of
    ``ort.providers``) and, with ``engine``, a TensorRT engine of the file (the FusedAttention
    ``plugin``; in a child process unless ``gate.isolate`` is False), with the cache, against
    ``model.generate()`` (the ORIGINAL transformers decoder, run in float32; not modified).
    ``prompts``: token id lists (default: random prompts of ``prompt_lengths`` tokens, seeded by
    ``gate.seed``), left-padded into one batch. ``fields``: GateOptions' fields as keywords
    (``new_tokens=4``), applied over ``gate``."""
    import onnx

    from attn_export.validation.providers import provider_setups

    ort, fields = _legacy(fields, ort)
    providers = ort.providers
    gate = with_fields(GateOptions, gate, fields, "check_generation")
    new_tokens, seed, timeout_s, isolate = gate.new_tokens, gate.seed, gate.runtime_timeout_s, gate.isolate
    onnx_model = onnx_model if onnx_model is not None else onnx.load(str(onnx_path), load_external_data=False)
    layout = CacheContract.require(onnx_model, onnx_path)
    if not generates(model):
        raise InputError("the generation gate needs a transformers causal LM (a model with generate() and a config)")
    if new_tokens < 1:
        raise InputError(f"new_tokens must be at least 1, got {new_tokens}")
    if layout.encoder_decoder:  # the encoder file, then the decoder file (generation_seq2seq.py)
        from attn_export.validation.generation_seq2seq import check_seq2seq_generation

        if prompts is not None or engine is not None:
            raise InputError("an encoder-decoder's generation gate makes its own sources and runs ONNX Runtime alone "
                             "(no prompts=, no engine)")
        return check_seq2seq_generation(model, onnx_path, onnx_model, layout, prompt_lengths=prompt_lengths, ort=ort,
                                        gate=gate)
    reference_model = copy.deepcopy(model).float().eval()
    quantized = dequantize_reference(reference_model, onnx_model, str(Path(onnx_path).parent))
    vocab = vocabulary_size(reference_model)
    pad_id = choose_pad_id(reference_model.config, vocab)
    prompts = list(prompts) if prompts is not None else random_prompts(
        vocab, prompt_lengths, seed, avoid=_special_tokens(reference_model.config))
    if not prompts or min(len(p) for p in prompts) < 1:
        raise InputError("every prompt needs at least one token")
    if any(not 0 <= int(t) < vocab for p in prompts for t in p):
        raise InputError(f"prompt token ids must lie in [0, {vocab}), the model's vocabulary")
    ids, mask = left_padded(prompts, pad_id)
    reference = reference_generation(reference_model, ids, mask, new_tokens, pad_id, layout.position_ids)
    k = max(reduction_length(reference_model, {}, {}), ids.shape[1] + new_tokens)
    rtol = tolerance(DTYPES[layout.dtype], k, quantized.compute_precision if quantized else None)
    result = GenerationResult(new_tokens=new_tokens, prompt_lengths=[len(p) for p in prompts], dtype=layout.dtype,
                              rtol=rtol, reduction_length=k, reference_tokens=reference[0].tolist())
    if quantized is not None:
        result.reference = f"original PyTorch model, float32, generate(do_sample=False); {quantized.note}"
    output_names = [o.name for o in onnx_model.graph.output]
    for setup in provider_setups(providers, onnx_model, timeout_s=timeout_s):
        with OnnxRuntimeRunner(onnx_path, setup, timeout_s=timeout_s) as runner:
            try:
                runner.load()
            except RunnerError as exc:
                result.runs.append(BackendGeneration(runner.name, error=str(exc)))
                continue
            result.runtime_version = result.runtime_version or runner.version
            result.runs.append(run_backend(OrtSteps(runner, layout, output_names), layout, ids, mask, reference, rtol,
                                           ties=quantized is not None))
    if gate.genai is not False and genai_installed():
        with genai_folder(Path(onnx_path), reference_model.config, write=bool(gate.genai)) as folder:
            if folder is not None:
                result.runs.append(genai_generation(folder, prompts, pad_id, reference, rtol, ties=quantized is not None))
    if engine is not None:
        result.runs.append(_engine_run(engine, plugin, isolate, timeout_s, layout, ids, mask, reference, rtol))
    return result


def _legacy(fields: dict, ort: Optional[OrtOptions]) -> Tuple[OrtOptions, dict]:
    """``providers=`` and ``timeout_s=`` of before the groups (deprecated): ``ort.providers`` and
    GateOptions' ``runtime_timeout_s``."""
    if "providers" in fields or "timeout_s" in fields:
        warnings.warn("check_generation(providers=..., timeout_s=...) is deprecated: pass ort=OrtOptions(providers=...) "
                      "and runtime_timeout_s=... (attn_export.options)", DeprecationWarning, stacklevel=3)
    if "timeout_s" in fields:
        fields["runtime_timeout_s"] = fields.pop("timeout_s")
    if "providers" in fields:
        ort = OrtOptions(providers=fields.pop("providers"))
    return ort or OrtOptions(), fields


def _engine_run(engine, plugin, isolate: bool, timeout_s: float, layout, ids, mask, reference,
                rtol: float) -> BackendGeneration:
    """The engine's generation; a crash of TensorRT while it loads the engine is its error."""
    try:
        steps = EngineSteps(engine, plugin, isolate=isolate, timeout_s=timeout_s)
    except RunnerError as exc:
        return BackendGeneration(BACKEND_TRT, error=f"TensorRT could not load {engine}: {first_line(exc)}")
    try:
        return run_backend(steps, layout, ids, mask, reference, rtol)
    finally:
        steps.close()


def _cache_layout(onnx_model) -> Optional[CacheContract]:
    return CacheContract.from_metadata(onnx_model)


# Before the contract had a module of its own (cache_contract.py) the gate read it here.
_MOVED = {"WITH_PAST": ("attn_export.cache_contract.METADATA_KEY", lambda: METADATA_KEY),
          "cache_layout": ("attn_export.cache_contract.CacheContract.from_metadata", lambda: _cache_layout),
          "require_cache_layout": ("attn_export.cache_contract.CacheContract.require", lambda: CacheContract.require)}


__getattr__ = moved(__name__, _MOVED)
