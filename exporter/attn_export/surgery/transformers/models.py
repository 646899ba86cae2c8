"""Preparing transformers models for export and validation (example inputs, dynamic axes, valid
tokens), and loading them from a save_pretrained folder or a config."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from attn_export.errors import InputError
from attn_export.surgery.transformers.compat import _transformers
from attn_export.surgery.transformers.routing import _outermost_pretrained

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                "decoder_input_ids", "decoder_attention_mask")


def prepare_for_export(model: nn.Module) -> nn.Module:
    """In place, on a copy: no key/value cache in the outputs (``use_cache=False``), outputs as
    ``ModelOutput`` (named)."""
    seen = set()
    # Every module's config, not only the top model's: some models give sub-modules copies of
    # their own (T5's decoder stack), which would still return a cache.
    owners = [m for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")]
    for owner in owners:
        for config in _configs(owner.config):
            if id(config) in seen:
                continue
            seen.add(id(config))
            if getattr(config, "use_cache", None):
                config.use_cache = False
            if hasattr(config, "return_dict"):
                try:
                    config.return_dict = True
                except Exception:  # noqa: BLE001 - a read-only property in some versions
                    pass
    return model


def onnx_translations() -> Dict:
    """The ONNX translations transformers ships for the ops its models emit that torch.onnx's
    torchlib does not translate (e.g. ``transformers::grouped_mm_fallback`` of mixture-of-experts
    layers, Mixtral and the like): ``{}`` for versions without its ONNX exporter module."""
    try:
        from transformers.exporters import exporter_onnx
    except Exception:  # noqa: BLE001 - an older or partial transformers: torchlib alone
        return {}
    table = getattr(exporter_onnx, "_ONNX_TRANSLATION_TABLE", None)
    return dict(table) if isinstance(table, dict) else {}


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
    or ``pixel_values`` at the configured image size, or log-mel ``input_features`` of the
    configured size (Whisper)."""
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
    if main == "input_features" and getattr(config, "num_mel_bins", None):
        from attn_export.surgery.transformers.seq2seq_cache import example_features

        # Whisper's log-mel features, sized by its config
        return _decoder_inputs(top, {main: example_features(config, batch, seed)}, gen)
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
    return _decoder_inputs(top, out, gen)


def _decoder_inputs(top: nn.Module, inputs: Dict[str, torch.Tensor], gen) -> Dict[str, torch.Tensor]:
    """An encoder-decoder's example: two decoder tokens beside the encoder's inputs (T5 and
    Whisper make none from the source; the cached export keeps the encoder's inputs alone)."""
    from attn_export import inputs as _inputs

    params, _ = _inputs.forward_parameters(top)
    if not getattr(top.config, "is_encoder_decoder", False) or "decoder_input_ids" not in params:
        return inputs
    batch = next(iter(inputs.values())).shape[0]
    low, high = int_ranges(top).get("input_ids", (0, 2))
    return {**inputs, "decoder_input_ids": torch.randint(low, high, (batch, 2), generator=gen, dtype=torch.int64)}


def valid_token_mask(inputs: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """``attention_mask != 0`` ([B, L] booleans) when the inputs carry transformers' 0/1
    padding mask, else None."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype.is_floating_point:
        return None
    return mask != 0


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
        from attn_export.errors import first_line

        raise InputError(f"cannot read the transformers config from {source}: {first_line(exc)}") from exc
    cls = _model_class(class_name, config)
    try:
        with _quiet_transformers(quiet):
            model = _build(cls, source, config, from_folder=path is not None, seed=seed)
    except Exception as exc:  # noqa: BLE001
        from attn_export.errors import first_line

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
