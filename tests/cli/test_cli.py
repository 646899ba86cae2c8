"""The attn-export console script, run as users run it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXE = [sys.executable, "-m", "attn_export.cli"]


def run(*args, check=True):
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_lists_verbs():
    out = run("--help").stdout
    for verb in ("convert", "inspect", "validate", "heatmap"):
        assert verb in out
    assert "attn-export MODEL --to onnx" in out


@pytest.mark.slow  # a console-script process per verb; one runs in test_help_lists_verbs
@pytest.mark.parametrize("verb,words", [
    ("convert", ["--to", "--input", "--example-inputs", "--dynamic", "--static", "--opset", "--dtype",
                 "--no-validate", "--trust-model-file", "EXECUTES CODE", "--allow-class", "--model", "--weights",
                 "--quiet", "--verbose", "--json", "--junit", "--min-replaced", "transformers:CLASS",
                 "--config", "save_pretrained folder", "--onnx-attention", "--onnx-functions", "--ort-provider", "--html",
                 "--with-past", "present.{i}.key/value"]),
    ("inspect", ["--allow-class", "--trust-model-file", "--require-all"]),
    ("validate", ["[MODEL] ONNX", "--input", "--json", "--junit", "Exit codes", "--ort-provider", "--html",
                  "--new-tokens", "generate()"]),
    ("heatmap", ["--layer", "--batch-index", "--format", "--max-layers", "--max-heads", "--input"]),
    ("export", ["--to"]),  # alias of convert
])
def test_every_verb_explains_itself(verb, words):
    out = " ".join(run(verb, "--help").stdout.split())
    for word in words:
        assert word in out, word




def test_a_note_prints_its_brackets(capsys):
    # A note names shapes ("[batch, 1, vocab]"); rich would read them as markup and drop them.
    from attn_export.cli._common import Session

    Session().note("note: the last position's logits only ([batch, 1, vocab]); [bold]x[/bold]")
    assert "([batch, 1, vocab]); [bold]x[/bold]" in capsys.readouterr().err
