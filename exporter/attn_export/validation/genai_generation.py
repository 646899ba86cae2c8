"""The generation gate's row for ONNX Runtime GenAI (``onnxruntime-genai``), the runtime users
generate with: its generator runs the file as its ``genai_config.json`` says (the shared
past/present buffer included), greedy, and must pick the tokens of ``generate()``.

GenAI 0.18 reads a padded batch as right-padded (its pad id after each prompt), and a batch of
more than one row takes its prompt once (``append_tokens`` again needs a rewind to 0), so the
gate runs each prompt at batch 1: no padding, GenAI's own greedy ``generate_next_token`` at
every step, compared with the reference's token of that row (which generate() computed in the
left-padded batch). It shows only each step's last-position logits: the row's ``generate/step
k`` compares those with the reference's, and ``generate/prefill`` is step 0 (the prompts' last
position). A near tie of a quantized file (generation.near_tie) is rewound and the reference's
token appended, so the comparison goes on on the reference's path; a row that reaches the
config's EOS is done in GenAI and compared up to there.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

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


def _row(og, model, prompt: Sequence[int], ref_row: torch.Tensor, ref_steps, row: int, near_tie) -> tuple:
    """One prompt at batch 1: each step's logits [V] and GenAI's own greedy token. A token
    that differs by a near tie (``near_tie(logits, k)`` says so) is rewound and the reference's
    appended, so the row stays on the reference's path; another difference ends the row."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(ref_row), do_sample=False, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    logits, tokens, ties, diverged = [], [], [], None
    for k, expected in enumerate(ref_row.tolist()):
        step = torch.from_numpy(np.array(generator.get_logits())).reshape(-1).float()
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        logits.append(step)
        tokens.append(token)
        if token != expected:
            tie = near_tie(step[None], ref_steps[k][row:row + 1], ref_row[k:k + 1])
            if not tie:
                diverged = k
                break
            ties.append(f"step {k}: {tie.replace('row 0', f'row {row}')}")
            generator.rewind_to(generator.token_count() - 1)
            generator.append_tokens(np.asarray([[expected]], dtype=np.int32))
        if generator.is_done():  # its EOS: GenAI ends the row
            break
    return logits, tokens, ties, diverged


def genai_generation(folder: Path, prompts: Sequence[Sequence[int]], pad_id: int, reference,
                     rtol: float, ties: bool = False) -> BackendGeneration:
    """GenAI's greedy generation from ``folder`` against the reference (tokens, step logits,
    prefill logits) of the same prompts, each prompt at batch 1 (``pad_id`` unused: no padding).
    ``ties``: a token flipped by a near tie within the tolerance (generation.near_tie) is
    noted and the row continues on the reference's tokens."""
    import onnxruntime_genai as og

    from attn_export.validation.generation import near_tie

    ref_tokens, ref_steps, _ = reference
    result = BackendGeneration(BACKEND_GENAI)
    tie_check = (lambda logits, ref, tokens: near_tie(logits, ref, tokens, rtol)) if ties else (lambda *_: "")
    try:
        model = og.Model(str(folder))
        rows = [_row(og, model, p, ref_tokens[r], ref_steps, r, tie_check) for r, p in enumerate(prompts)]
    except Exception as exc:  # noqa: BLE001 - GenAI raises its own and RuntimeError alike: the row's error
        result.error = f"ONNX Runtime GenAI failed during generation: {type(exc).__name__}: {first_line(exc)}"
        return result
    steps = max(len(row[0]) for row in rows)
    vocab = ref_steps[0].shape[-1]
    for k in range(steps):
        ran = torch.tensor([len(row[0]) > k for row in rows])
        logits = torch.stack([r[0][k] if len(r[0]) > k else torch.zeros(vocab) for r in rows])
        result.steps.append(Comparison.of(compare(logits[ran], ref_steps[k][ran], rtol), [len(rows), vocab]))
    result.prefill = result.steps[0]
    result.tokens = [row[1] for row in rows]
    result.near_ties = [tie for row in rows for tie in row[2]]
    diverged = [(row[3], r) for r, row in enumerate(rows) if row[3] is not None]
    if diverged:
        k, r = min(diverged)
        result.first_divergence = k
        result.divergence = "; ".join(f"row {r}: token {rows[r][1][k]} instead of {int(ref_tokens[r, k])}"
                                      for k2, r in diverged if k2 == k)
    return result


__all__ = ["BACKEND_GENAI", "genai_folder", "genai_generation", "genai_installed"]
