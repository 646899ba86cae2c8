"""The generation gate's reference cannot fail a correct export, and cannot crash: on the same
cached export of a tiny GPT-2 (``export_onnx(..., with_past=True)``), the model handed to the gate
with rows that reach their end-of-sequence token, special ids outside the vocabulary, a
generation_config with logits processors, one prompt or several: each gives a verdict (passed),
never a padded reference row or a Python exception. These run on every supported transformers
(the Makefile's test-transformers-oldest runs this file on the oldest)."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attn_export.errors import InputError  # noqa: E402
from attn_export.validation.generation import (  # noqa: E402
    check_generation,
    choose_pad_id,
    left_padded,
    positions,
    random_prompts,
    reference_generation,
)
from attn_export.onnx import export_onnx  # noqa: E402
from hf_models import padded_batch, tiny_gpt2  # noqa: E402

NEW_TOKENS = 8
VOCAB = 97  # tiny_gpt2's


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """The model and its stock cached export; the special ids are the config's only (the file
    does not depend on them), so every test below varies them on a copy of the model."""
    model = tiny_gpt2()
    path = tmp_path_factory.mktemp("gen_ref") / "gpt2.onnx"
    export_onnx(model, padded_batch((5, 3), 5, left=True), path, with_past=True)
    return model, path


def with_special_ids(model, **ids):
    """A copy of ``model`` whose config and generation_config name these special ids, as a
    checkpoint's would (``eos_token_id=5``, ``pad_token_id=50256``, ...)."""
    model = copy.deepcopy(model)
    for name, value in ids.items():
        setattr(model.config, name, value)
        setattr(model.generation_config, name, value)
    return model


def first_greedy_token(model, prompts):
    """The token row 0 generates second (its EOS in the tests below), by plain greedy decoding
    with positions from the mask (GPT-2 would count them from the padding otherwise)."""
    ids, mask = left_padded(prompts, pad_id=1)
    with torch.no_grad():
        for _ in range(2):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
            ids, mask = torch.cat([ids, logits.argmax(-1)[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
    return int(ids[0, -1])


def passes_with_every_step(result):
    assert result.passed, result.failures
    (run,) = result.runs
    assert len(run.steps) == NEW_TOKENS and run.tokens == result.reference_tokens
    assert all(len(row) == NEW_TOKENS for row in result.reference_tokens)


@pytest.mark.parametrize("lengths", [(5, 9, 12), (7,)], ids=["batch3", "batch1"])
def test_rows_that_reach_their_eos_are_generated_to_the_end(gpt2, lengths):
    """transformers 5 ends a row on the model's EOS even when the GenerationConfig says
    ``eos_token_id=None`` and pads it from then on: the reference must not."""
    model, path = gpt2
    prompts = random_prompts(VOCAB, lengths, seed=3, avoid=[0])
    eos = first_greedy_token(model, prompts)
    stopping = with_special_ids(model, eos_token_id=eos, bos_token_id=eos, pad_token_id=0)
    result = check_generation(stopping, path, new_tokens=NEW_TOKENS, prompts=prompts)
    passes_with_every_step(result)
    assert result.reference_tokens[0][1] == eos  # the row went on past its EOS


@pytest.mark.parametrize("ids", [
    {"bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None},  # GPT2Config's defaults, vocab 97
    {"bos_token_id": 50256, "eos_token_id": [50256, 50257], "pad_token_id": 50256},
    {"bos_token_id": 50256, "eos_token_id": 3, "pad_token_id": -1},
], ids=["gpt2-defaults", "eos-list", "negative-pad"])
def test_special_ids_outside_the_vocabulary_pad_with_an_id_inside_it(gpt2, ids):
    model, path = gpt2
    passes_with_every_step(check_generation(with_special_ids(model, **ids), path, new_tokens=NEW_TOKENS))


def test_the_pad_id_is_the_first_special_id_the_vocabulary_has():
    config = transformers.GPT2Config(vocab_size=VOCAB, bos_token_id=50256, eos_token_id=50256)
    assert choose_pad_id(config, VOCAB) == 0
    config.eos_token_id = [50256, 7]
    assert choose_pad_id(config, VOCAB) == 7
    config.pad_token_id = 3
    assert choose_pad_id(config, VOCAB) == 3


def test_the_models_generation_config_does_not_change_the_reference(gpt2):
    """A checkpoint's generation_config.json (a repetition penalty, suppressed tokens, a
    minimum length, sampling) would make generate() pick other tokens than the argmax of the
    logits the gate compares: the gate runs plain greedy decoding, and leaves the model as it was."""
    model, path = gpt2
    plain = check_generation(model, path, new_tokens=NEW_TOKENS).reference_tokens
    tuned = copy.deepcopy(model)
    suppressed = plain[0][0]
    tuned.generation_config.update(repetition_penalty=3.0, suppress_tokens=[suppressed], no_repeat_ngram_size=1,
                                   do_sample=True, temperature=0.5, forced_eos_token_id=plain[1][0])
    saved = tuned.generation_config.to_dict()
    result = check_generation(tuned, path, new_tokens=NEW_TOKENS)
    passes_with_every_step(result)
    assert result.reference_tokens == plain
    assert tuned.generation_config.to_dict() == saved


def test_the_reference_is_every_steps_argmax(gpt2):
    model, _path = gpt2
    prompts = [[5, 6, 7], [8, 9]]
    eos = first_greedy_token(model, prompts)
    stopping = with_special_ids(model, eos_token_id=eos)
    ids, mask = left_padded(prompts, pad_id=1)
    tokens, logits, prefill = reference_generation(stopping, ids, mask, NEW_TOKENS, 1, takes_positions=False)
    assert torch.equal(logits.argmax(-1).T, tokens) and tokens.shape == (2, NEW_TOKENS)
    assert prefill.shape == (2, 3, VOCAB) and tokens[0, 1] == eos


def test_a_generate_that_fails_is_a_clear_usage_error(gpt2):
    model, path = gpt2

    class Broken(type(model)):
        def generate(self, *args, **kwargs):
            raise RuntimeError("index out of range in self")

    broken = copy.deepcopy(model)
    broken.__class__ = Broken
    with pytest.raises(InputError, match="generate\\(\\) or forward failed.*RuntimeError: index out of range"):
        check_generation(broken, path, new_tokens=NEW_TOKENS)


def test_the_cli_exits_0_for_a_gpt2_whose_special_ids_lie_outside_its_vocabulary(gpt2, tmp_path):
    """The issue's GPT-2 (GPT2Config's BOS/EOS 50256 with a small vocabulary) through
    ``attn-export validate``: exit 0, not ``IndexError`` (exit 2)."""
    from helpers import invoke

    model, path = gpt2
    with_special_ids(model, bos_token_id=50256, eos_token_id=50256, pad_token_id=None).save_pretrained(
        tmp_path / "gpt2")
    proc = invoke("validate", tmp_path / "gpt2", path, "--new-tokens", "4", "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["generation"]["passed"]


def test_transformers_ends_rows_on_the_models_eos_despite_eos_token_id_none(gpt2):
    """The behaviour the reference sets aside (``_plain_generation_defaults``), pinned by name:
    a GenerationConfig's ``eos_token_id=None`` counts as "unset", and generate() takes the
    model's own EOS (transformers 5: always; 4.50-4.57: ``use_model_defaults``), ends the row
    there and pads it. If this fails, a transformers release changed how generate() merges the
    model's generation_config; the gate's reference (tested above) must still run every row to
    the end."""
    model, _path = gpt2
    prompts = [[5, 6, 7], [8, 9]]
    eos, pad = first_greedy_token(model, prompts), 1
    stopping = with_special_ids(model, eos_token_id=eos)
    ids, mask = left_padded(prompts, pad_id=pad)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                           pad_token_id=pad)
    with torch.no_grad():
        row = stopping.generate(input_ids=ids, attention_mask=mask, generation_config=config)[0, ids.shape[1]:]
    ended = row.tolist().index(eos) if eos in row.tolist() else len(row)
    assert ended < 2 and (row[ended + 1:] == pad).all(), f"transformers {transformers.__version__}: {row.tolist()}"


def test_the_oldest_transformers_ci_runs_is_the_minimum_the_package_allows():
    """``make test-transformers-oldest`` (the Makefile's TRANSFORMERS_OLDEST), pyproject's
    ``transformers>=``, the refusal's MIN_VERSION and docs/install.md name one release."""
    from attn_export.surgery.transformers.compat import MIN_VERSION

    root = Path(__file__).resolve().parents[2]
    minimum = re.search(r'"transformers>=([\d.]+)"', (root / "pyproject.toml").read_text()).group(1)
    pinned = re.search(r"^TRANSFORMERS_OLDEST := ([\d.]+)$", (root / "Makefile").read_text(), re.M).group(1)

    def padded(text):
        return tuple(int(x) for x in text.split(".")) + (0,) * (3 - len(text.split(".")))

    assert padded(pinned) == padded(minimum) == padded(".".join(map(str, MIN_VERSION)))
    assert f"transformers {pinned} and newer" in (root / "docs" / "install.md").read_text()
