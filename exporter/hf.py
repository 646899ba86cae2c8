"""Hugging Face transformers models: their attention routed through ``attn_export::attention``
by transformers' own extension point, not by patching classes.

    >>> import attn_export.hf
    >>> attn_export.hf.register()                       # once; replace_attention does it too
    >>> model = AutoModel.from_pretrained(path, attn_implementation="attn_export")
    >>> # or, on a model already built:
    >>> report = attn_export.replace_attention(model)   # sets attn_implementation="attn_export"

How it works (docs/huggingface.md):

* :func:`attention_forward` is registered in transformers' ``AttentionInterface`` under the name
  :data:`IMPLEMENTATION` (``"attn_export"``). Every attention layer written against that
  interface (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``: BERT,
  GPT-2, ViT and most current architectures) calls it with ``query``/``key``/``value``
  ``[B, H, L, D]``, the mask the model built, ``scaling`` and ``dropout``, and gets back the
  attention output ``[B, L, H, D]`` (and no weights), as from the ``sdpa`` implementation.
* :func:`attention_mask` is registered under the same name in ``AttentionMaskInterface``, so
  the models build the mask that :func:`attention_forward` expects: the boolean ``sdpa`` mask
  (``True`` = attend), except that a plain padding mask of a bidirectional model stays one row
  per key, ``[B, 1, 1, Lk]``, which becomes the operator's ``key_padding_mask`` (and in ONNX the
  node's rank-2 mask input) instead of a ``[B, 1, L, L]`` tensor.
* :func:`route` sets ``attn_implementation`` on a model that is already built
  (``model.set_attn_implementation``) and checks, layer by layer, that each attention module now
  dispatches to it.

Supported transformers versions: :data:`MIN_VERSION` and later (the first release with both
interfaces); checked with 4.53.0, 4.57.6 and 5.24.0. Which architectures dispatch through the
interface depends on the version (BERT from 5.0; GPT-2 and ViT in all of them): layers that do
not are reported as skipped. See docs/huggingface.md.
"""
from __future__ import annotations

import inspect
import sys
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from attn_export._errors import InputError

IMPLEMENTATION = "attn_export"
MIN_VERSION = (4, 53)
INSTALL_HINT = "pip install 'attn-export[hf]'"

# Keyword arguments some models pass to the attention function that change the math and that
# the fused operator does not implement: refuse them loudly instead of ignoring them.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "position_bias": "an additive position bias (T5-style)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}

class UnsupportedTransformersError(InputError):
    """transformers is missing or too old for the attention-interface routing."""


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedTransformersError(
            f"Hugging Face models need the transformers package: {INSTALL_HINT}"
        ) from exc
    if _version_tuple(transformers.__version__) < MIN_VERSION:
        raise UnsupportedTransformersError(
            f"transformers {transformers.__version__} is too old: attn-export routes attention through "
            f"AttentionInterface and AttentionMaskInterface, which need transformers >= "
            f"{'.'.join(map(str, MIN_VERSION))}"
        )
    return transformers


def is_hf_model(model) -> bool:
    """True for a transformers ``PreTrainedModel`` (never imports transformers itself)."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def contains_hf_model(model: nn.Module) -> bool:
    return any(is_hf_model(m) for m in model.modules())


# --------------------------------------------------------------------------------------------
# The attention function and the mask function
# --------------------------------------------------------------------------------------------

def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, l, d).reshape(b, h * groups, l, d)


def _is_one(size) -> bool:
    """A dimension that is literally 1 (a Python int), never a symbolic size compared (which
    would add a guard under torch.export)."""
    return isinstance(size, int) and size == 1


def to_operator_masks(attention_mask: Optional[torch.Tensor], batch, key_length):
    """transformers' mask -> (attn_mask, key_padding_mask) in the operator's convention.

    * boolean (``True`` = attend, the ``sdpa`` convention): inverted (the operator's ``True`` =
      masked out);
    * floating: additive, as given (``eager``-style masks with large negatives included);
    * ``[B|1, 1, 1, Lk]`` (one row per key): the ``key_padding_mask`` ``[B, Lk]``;
    * ``[B|1, H|1, Lq, Lk]``: the ``attn_mask`` (a longer last axis is cut to ``Lk``).
    """
    if attention_mask is None:
        return None, None
    mask = attention_mask
    if mask.dtype == torch.bool:
        mask = ~mask
    if mask.dim() != 4:  # e.g. a flash-attention style [B, Lk] mask: not built for this implementation
        raise ValueError(
            f"attn_implementation='{IMPLEMENTATION}': expected a 4-D attention mask [B, 1, Lq, Lk], got shape "
            f"{list(mask.shape)}"
        )
    if not _same_size(mask.shape[-1], key_length):
        # Older transformers build causal masks longer than the keys and slice them in the
        # attention function (as their sdpa function does).
        mask = mask[..., :key_length]
    if _is_one(mask.shape[1]) and _is_one(mask.shape[2]):
        return None, mask[:, 0, 0, :].expand(batch, key_length)
    return mask, None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The function registered as ``attn_implementation="attn_export"``.

    Same contract as transformers' ``sdpa_attention_forward``: ``query`` ``[B, H, Lq, D]``,
    ``key``/``value`` ``[B, Hkv, Lk, D]`` (grouped-query heads repeated), ``attention_mask`` as
    built by the model (boolean ``True`` = attend, or additive floating, or ``None``), causality
    from ``is_causal`` or ``module.is_causal`` when there is no mask (a mask, when given, already
    holds the causal pattern). Returns ``(output [B, Lq, H, D], None)``.

    ``dropout > 0`` (training with attention dropout) runs transformers' ``sdpa`` function
    instead: dropout is not fused.
    """
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation='{IMPLEMENTATION}' does not implement {what} ({name}=...) used by "
                f"{type(module).__name__}; load the model with attn_implementation='sdpa' or 'eager'"
            )
    if dropout and dropout > 0.0 and module.training:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    from attn_export.ops import attention

    groups = getattr(module, "num_key_value_groups", 1)
    if isinstance(groups, int) and groups > 1:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_length = query.shape[2]
    attn_mask, key_padding_mask = to_operator_masks(attention_mask, query.shape[0], key.shape[2])
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # One query attends to every key (decoding with a cache), as in transformers' sdpa path.
        causal = bool(causal) and not _is_one(q_length)
    else:
        causal = False  # the mask holds the pattern
    if attn_mask is not None and attn_mask.dtype.is_floating_point and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    out = attention(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                    is_causal=causal, scale=scaling)
    # [B, H, Lq, D] laid out [B, Lq, H, D]: the transpose is free.
    return out.transpose(1, 2), None


def attention_mask(*args, **kwargs):
    """The mask function registered as ``"attn_export"`` in ``AttentionMaskInterface``.

    A plain bidirectional padding mask (no offsets, no local window, no overlay) comes back as
    ``[B, 1, 1, Lk]`` booleans (``True`` = attend), which :func:`attention_forward` passes to the
    operator as its key-padding mask; ``None`` without an ``attention_mask``. Everything else
    (causal, sliding windows, packed sequences, caches) is the ``sdpa`` mask, built by
    transformers' own function with every argument passed on unchanged."""
    from transformers import masking_utils

    bidirectional = getattr(masking_utils, "bidirectional_mask_function", None)  # transformers >= 5
    padding = kwargs.get("attention_mask")
    if (
        bidirectional is not None
        and not args
        and kwargs.get("mask_function") is bidirectional
        and not kwargs.get("kv_offset", 0)
        and not kwargs.get("q_offset", 0)
        and kwargs.get("local_size") is None
        and "kv_length" in kwargs
    ):
        if padding is None:
            return None
        if padding.dim() == 2 and padding.dtype == torch.bool and _same_size(padding.shape[-1], kwargs["kv_length"]):
            return padding[:, None, None, :]
    sdpa_mask = masking_utils.AttentionMaskInterface._global_mapping["sdpa"]
    return sdpa_mask(*args, **kwargs)


def _same_size(a, b) -> bool:
    """a == b known without adding a guard (symbolic sizes under torch.export)."""
    if a is b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return False


def register() -> None:
    """Registers :func:`attention_forward` and :func:`attention_mask` under ``"attn_export"``
    (idempotent). Raises :class:`UnsupportedTransformersError` when transformers is missing or
    older than :data:`MIN_VERSION`."""
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)


# --------------------------------------------------------------------------------------------
# Which modules dispatch through the interface, and routing a built model
# --------------------------------------------------------------------------------------------

_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "attention_interface")
_dispatch_cache: Dict[type, bool] = {}


def dispatches_through_interface(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` looks its attention function up in transformers'
    ``AttentionInterface`` (the same source test transformers applies to whole model files in
    ``_can_set_attn_implementation``, narrowed to the one method)."""
    cls = type(module)
    if cls not in _dispatch_cache:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _dispatch_cache[cls] = any(marker in source for marker in _DISPATCH_MARKERS)
    return _dispatch_cache[cls]


def module_config(module: nn.Module):
    config = getattr(module, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None


def layer_geometry(module: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """(heads, hidden size) of an attention module, from its attributes or its config."""
    config = module_config(module)
    heads = None
    for name in ("num_heads", "num_attention_heads", "n_head"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            heads = value
            break
    if heads is None and config is not None:
        heads = getattr(config, "num_attention_heads", None)
    embed = None
    for name in ("embed_dim", "hidden_size"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            embed = value
            break
    if embed is None and config is not None:
        embed = getattr(config, "hidden_size", None)
    return (heads if isinstance(heads, int) else None), (embed if isinstance(embed, int) else None)


def classify(module: nn.Module) -> Optional[Tuple[str, Optional[str], List[str]]]:
    """For a module of a transformers model: ``None`` if it is no attention layer that
    dispatches through the interface, else (state, reason, notes) with state ``"routed"`` (already
    ``attn_export``), ``"routable"`` or ``"not routable"``."""
    if not dispatches_through_interface(module):
        return None
    config = module_config(module)
    if config is None:
        return ("not routable", "dispatches through transformers' AttentionInterface but has no config with an "
                "attn_implementation to set", [])
    notes = []
    dropout = _attention_dropout(module, config)
    if dropout:
        notes.append(f"dropout={dropout}: unfused in training mode (transformers' sdpa runs then); fused in eval")
    if config._attn_implementation == IMPLEMENTATION:
        return ("routed", None, notes)
    return ("routable", None, notes)


def _attention_dropout(module: nn.Module, config) -> float:
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attention_dropout_prob"):
        value = getattr(module, name, None)
        if value is None:
            value = getattr(config, name, None)
        if isinstance(value, nn.Dropout):
            value = value.p
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 0.0


def _outermost_pretrained(model: nn.Module) -> List[nn.Module]:
    from transformers import PreTrainedModel

    found: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def route(model: nn.Module) -> List[str]:
    """Sets ``attn_implementation="attn_export"`` on every transformers model in ``model`` (the
    model itself or nested ones), through ``set_attn_implementation`` (sub-models included).
    Returns transformers' refusals, one line each (they are logged as warnings by transformers,
    not raised; the caller checks each layer)."""
    register()
    problems = []
    for pretrained in _outermost_pretrained(model):
        setter = getattr(pretrained, "set_attn_implementation", None)
        try:
            if setter is not None:
                setter(IMPLEMENTATION)
            else:  # transformers without set_attn_implementation: the config attribute
                pretrained.config._attn_implementation = IMPLEMENTATION
        except Exception as exc:  # noqa: BLE001 - reported per layer by the caller
            problems.append(f"{type(pretrained).__name__}: {exc}")
    return problems


# --------------------------------------------------------------------------------------------
# Export and validation helpers
# --------------------------------------------------------------------------------------------

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                "decoder_input_ids", "decoder_attention_mask")


def prepare_for_export(model: nn.Module) -> nn.Module:
    """In place, on a copy: no key/value cache in the outputs (``use_cache=False``), outputs as
    ``ModelOutput`` (named)."""
    for pretrained in _outermost_pretrained(model):
        for config in _configs(pretrained.config):
            if getattr(config, "use_cache", None):
                config.use_cache = False
            if hasattr(config, "return_dict"):
                try:
                    config.return_dict = True
                except Exception:  # noqa: BLE001 - a read-only property in some versions
                    pass
    return model


def _configs(config):
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


def default_axes(inputs: Mapping[str, torch.Tensor]) -> Dict[str, Dict[int, str]]:
    """Dynamic axes for a transformers model: batch and sequence (``batch``, ``seq``) on token
    inputs (``input_ids``, ``attention_mask``, ``token_type_ids``, ...), the batch only on the
    others (``pixel_values`` keeps its channels and image size)."""
    axes: Dict[str, Dict[int, str]] = {}
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if name in TOKEN_INPUTS and t.dim() >= 2:
            axes[name] = {0: "batch", 1: "seq"}
        else:
            axes[name] = {0: "batch"}
    return axes


def int_ranges(model: nn.Module) -> Dict[str, Tuple[int, int]]:
    """[low, high) for generated token inputs, from the config (vocabulary, token types)."""
    ranges: Dict[str, Tuple[int, int]] = {}
    models = _outermost_pretrained(model)
    if not models:
        return ranges
    config = models[0].config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        ranges["input_ids"] = (0, vocab)
        ranges["decoder_input_ids"] = (0, vocab)
    types = getattr(text, "type_vocab_size", None)
    if isinstance(types, int) and types > 0:
        ranges["token_type_ids"] = (0, types)
    return ranges


def max_positions(model: nn.Module) -> Optional[int]:
    models = _outermost_pretrained(model)
    if not models:
        return None
    config = models[0].config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Example inputs for a transformers model, from its ``main_input_name``: token ids
    (``input_ids`` within the vocabulary and an ``attention_mask`` whose second row is padded)
    or ``pixel_values`` at the configured image size."""
    from attn_export import inputs as _inputs

    gen = torch.Generator().manual_seed(seed)
    models = _outermost_pretrained(model)
    if not models:
        raise InputError("not a transformers model")
    top = models[0]
    config = top.config
    main = getattr(top, "main_input_name", "input_ids")
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", 224)
        size = size if isinstance(size, int) else int(size[0])
        channels = getattr(vision, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=gen)}
    if main != "input_ids":
        raise InputError(
            f"{type(top).__name__} takes {main!r} as its main input: give example inputs with --input or "
            "--example-inputs"
        )
    limit = max_positions(model)
    if limit is not None:
        seq = min(seq, limit)
    low, high = int_ranges(model).get("input_ids", (0, 2))
    ids = torch.randint(low, high, (batch, seq), generator=gen, dtype=torch.int64)
    mask = _inputs.padding_mask((batch, seq), gen, true_is_masked=False).to(torch.int64)
    params, var_kw = _inputs.forward_parameters(top)
    out = {"input_ids": ids}
    if "attention_mask" in params or var_kw:
        out["attention_mask"] = mask
    return out


def valid_token_mask(inputs: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """``attention_mask != 0`` ([B, L] booleans) when the inputs carry transformers' 0/1
    padding mask, else None."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype.is_floating_point:
        return None
    return mask != 0


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def is_pretrained_dir(path) -> bool:
    from pathlib import Path

    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def _model_class(name: Optional[str], config=None):
    transformers = _transformers()
    if name is None:
        for arch in getattr(config, "architectures", None) or []:
            cls = getattr(transformers, arch, None)
            if cls is not None:
                return cls
        name = "AutoModel"
    cls = getattr(transformers, name, None)
    is_model = isinstance(cls, type) and (
        issubclass(cls, transformers.PreTrainedModel)
        or (cls.__name__.startswith("AutoModel") and hasattr(cls, "from_config"))
    )
    if not is_model:
        raise InputError(
            f"--model transformers:{name}: {name!r} is not a transformers model class "
            "(e.g. AutoModel, AutoModelForCausalLM, BertModel)"
        )
    return cls


def load(class_name: Optional[str] = None, path=None, config_path=None, seed: int = 0,
         quiet: bool = True) -> nn.Module:
    """A transformers model, loaded locally (nothing is downloaded, no remote code runs):

    * ``path``: a ``save_pretrained`` folder: ``CLASS.from_pretrained(path)``; CLASS defaults
      to the config's ``architectures[0]``, else ``AutoModel``;
    * ``config_path`` (a config.json or a folder holding one): ``CLASS.from_config(config)``
      with random weights (seeded), e.g. to try the export of an architecture.

    ``quiet``: transformers' logs and progress bars off while loading.
    """
    from pathlib import Path

    _transformers()
    from transformers import AutoConfig

    if (path is None) == (config_path is None):
        raise InputError("a transformers model needs either its save_pretrained folder (MODEL) or --config")
    source = Path(path if path is not None else config_path)
    if not source.exists():
        raise InputError(f"{source}: no such file or directory")
    if path is not None and not is_pretrained_dir(source):
        raise InputError(f"{source}: not a save_pretrained folder (no config.json in it)")
    try:
        with _quiet_transformers(quiet):
            config = AutoConfig.from_pretrained(str(source), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001
        from attn_export._errors import first_line

        raise InputError(f"cannot read the transformers config from {source}: {first_line(exc)}") from exc
    cls = _model_class(class_name, config)
    try:
        with _quiet_transformers(quiet):
            model = _build(cls, source, config, from_folder=path is not None, seed=seed)
    except Exception as exc:  # noqa: BLE001
        from attn_export._errors import first_line

        raise InputError(f"cannot build {cls.__name__} from {source}: {first_line(exc)}") from exc
    return model.eval()


def _build(cls, source, config, *, from_folder: bool, seed: int):
    if from_folder:
        return cls.from_pretrained(str(source), local_files_only=True, trust_remote_code=False)
    torch.manual_seed(seed)
    if cls.__name__.startswith("Auto"):
        return cls.from_config(config, trust_remote_code=False)
    return cls(config)


class _quiet_transformers:
    """transformers' info/warning logs and progress bars off while loading (restored after)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return self
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        self._bars = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
        if self._bars:
            hf_logging.enable_progress_bar()
