"""The generation gate's row for ONNX Runtime GenAI (``onnxruntime-genai``), the runtime users
generate with: its generator runs the file as its ``genai_config.json`` says (the shared
past/present buffer included), greedy, and must pick the tokens of ``generate()``.

GenAI 0.18 reads a padded batch as right-padded (its pad id after each prompt), so the gate's
prompts are fed right-padded, one batch. Unlike the ONNX Runtime loop it generates on its own
(it is not fed the reference's tokens) and shows only each step's last-position logits, so its
row compares step k's logits with the reference's while every earlier token agreed; the
prefill's row is step 0 (the prompts' last position). A row that reaches the config's EOS is
done in GenAI: it is compared up to that token.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from attn_export.errors import first_line
from attn_export.validation.generation_result import BackendGeneration, Comparison
from attn_export.validation.tolerances import compare

BACKEND_GENAI = "onnxruntime-genai"
CONFIG_NAME = "genai_config.json"


def genai_installed() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


@contextlib.contextmanager
def genai_folder(onnx_path: Path, model_config, write: bool) -> Iterator[Optional[Path]]:
    """The folder GenAI loads: the file's own when its genai_config.json names the file; with
    ``write``, else a temporary one with links to the folder's files and a config written for
    the file; else None."""
    beside = onnx_path.with_name(CONFIG_NAME)
    if beside.exists() and json.loads(beside.read_text())["model"]["decoder"]["filename"] == onnx_path.name:
        yield onnx_path.parent
        return
    if not write:
        yield None
        return
    from attn_export.genai_config import write_genai_config

    with tempfile.TemporaryDirectory(prefix="attn_export_genai_") as tmp:
        for item in onnx_path.parent.iterdir():  # the file and its external data
            if item.name != CONFIG_NAME and item.is_file():
                (Path(tmp) / item.name).symlink_to(item.resolve())
        write_genai_config(Path(tmp) / onnx_path.name, model_config)
        yield Path(tmp)


def _eos_ids(folder: Path) -> set:
    eos = json.loads((folder / CONFIG_NAME).read_text())["model"].get("eos_token_id", [])
    return set(eos if isinstance(eos, list) else [eos])


def _running(ref_tokens: torch.Tensor, eos: set) -> torch.Tensor:
    """[B, N]: whether row b still generates at step k in GenAI (no EOS among its tokens before k)."""
    is_eos = torch.tensor([[int(t) in eos for t in row] for row in ref_tokens.tolist()], dtype=torch.long)
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return before == 0


def genai_generation(folder: Path, prompts: Sequence[Sequence[int]], pad_id: int, reference,
                     rtol: float) -> BackendGeneration:
    """GenAI's greedy generation from ``folder`` against the reference (tokens, step logits,
    prefill logits) of the same prompts."""
    import onnxruntime_genai as og

    ref_tokens, ref_steps, _ = reference
    result = BackendGeneration(BACKEND_GENAI)
    running = _running(ref_tokens, _eos_ids(folder))
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    try:
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=width + ref_tokens.shape[1], do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens = []
        for k in range(ref_tokens.shape[1]):
            logits = torch.from_numpy(np.array(generator.get_logits()))[:, -1].float()
            generator.generate_next_token()
            tokens.append(torch.from_numpy(np.array(generator.get_next_tokens())).long())
            rows = running[:, k]
            result.steps.append(Comparison.of(compare(logits[rows], ref_steps[k][rows], rtol), logits.shape))
            differ = rows & (tokens[-1] != ref_tokens[:, k])
            if differ.any():
                result.first_divergence = k
                result.divergence = "; ".join(f"row {r}: token {int(tokens[-1][r])} instead of {int(ref_tokens[r, k])}"
                                              for r in torch.nonzero(differ).flatten().tolist())
                break
            if not running[:, k + 1:].any():
                break
    except Exception as exc:  # noqa: BLE001 - GenAI raises its own and RuntimeError alike: the row's error
        result.error = f"ONNX Runtime GenAI failed during generation: {type(exc).__name__}: {first_line(exc)}"
        return result
    result.prefill = result.steps[0]
    result.tokens = torch.stack(tokens, dim=1).tolist()
    return result


__all__ = ["BACKEND_GENAI", "genai_folder", "genai_generation", "genai_installed"]
