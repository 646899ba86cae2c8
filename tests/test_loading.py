"""Safe model loading: torch.nn models load weights-only with no flag; anything else is refused
before a byte is unpickled; a pickle that runs code never runs it without trust_file."""
import os
import pickle
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention
from attn_export._errors import InputError
from attn_export.examples import TinySeq2Seq
from attn_export.loading import load_factory, load_model


class MarkerWriter:
    """Unpickling this writes a marker file: the classic pickle exploit."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("build", [
    lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2),
    lambda: nn.Transformer(16, 2, 1, 1, 32),
    lambda: nn.TransformerEncoderLayer(16, 2, 32, activation="gelu", norm_first=True),
    lambda: nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Dropout(0.1)),
    lambda: nn.Sequential(FusedMultiheadAttention(16, 2)),
])
def test_torch_nn_models_load_without_flags(tmp_path, build):
    model = build()
    path = tmp_path / "m.pt"
    torch.save(model, path)
    loaded = load_model(path)
    assert type(loaded) is type(model)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("legacy", [False, True])
def test_code_in_a_pickle_never_runs_without_trust(tmp_path, legacy):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save({"model": MarkerWriter(marker)}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(InputError) as info:
        load_model(path)
    message = str(info.value)
    assert "system" in message and "--allow-class" in message and "--trust-model-file" in message
    assert not marker.exists()
    # Allowing an unrelated class changes nothing.
    with pytest.raises(InputError):
        load_model(path, allow_classes=["attn_export.examples:TinySeq2Seq"])
    assert not marker.exists()
    # Positive control: the payload is real, and trust_file runs it.
    with pytest.raises(InputError, match="not a torch.nn.Module"):
        load_model(path, trust_file=True)
    assert marker.exists()


def test_plain_pickle_file_is_refused_without_running(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pkl"
    with open(path, "wb") as f:
        pickle.dump(MarkerWriter(marker), f)
    with pytest.raises(InputError):
        load_model(path)
    assert not marker.exists()


def test_other_classes_are_named_and_allow_class_admits_them(tmp_path):
    path = tmp_path / "seq2seq.pt"
    torch.save(TinySeq2Seq(features=8, d_model=16, heads=2, layers=1), path)
    with pytest.raises(InputError, match=r"attn_export.examples:TinySeq2Seq.*--allow-class attn_export.examples:TinySeq2Seq"):
        load_model(path)
    assert isinstance(load_model(path, allow_classes=["attn_export.examples:TinySeq2Seq"]), TinySeq2Seq)
    with pytest.raises(InputError, match="cannot import"):
        load_model(path, allow_classes=["no_such_module:Thing"])
    with pytest.raises(InputError, match="has no"):
        load_model(path, allow_classes=["attn_export.examples:NoSuchClass"])


def test_bad_files_are_input_errors(tmp_path):
    good = tmp_path / "good.pt"
    torch.save(nn.Linear(4, 4), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    state = tmp_path / "state.pt"
    torch.save(nn.Linear(4, 4).state_dict(), state)
    for path, words in [(tmp_path / "missing.pt", "no such file"), (truncated, "corrupt or truncated"),
                        (text, "not a PyTorch file"), (state, "state_dict"), (tmp_path, "directory")]:
        with pytest.raises(InputError, match=words):
            load_model(path)


def test_torchscript_archives_are_refused(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Linear(4, 4)), str(path))
    with pytest.raises(InputError, match="TorchScript"):
        load_model(path)


def test_factory_with_weights(tmp_path, monkeypatch):
    (tmp_path / "my_factory.py").write_text(textwrap.dedent("""
        from torch import nn
        def build():
            return nn.Sequential(nn.Linear(4, 3))
        def broken():
            return 42
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = tmp_path / "w.pt"
    reference = nn.Sequential(nn.Linear(4, 3))
    torch.save(reference.state_dict(), weights)
    model = load_factory("my_factory:build", weights)
    assert torch.equal(model[0].weight, reference[0].weight)
    with pytest.raises(InputError, match="not a torch.nn.Module"):
        load_factory("my_factory:broken")
    torch.save(nn.Linear(5, 5).state_dict(), tmp_path / "wrong.pt")
    with pytest.raises(InputError, match="does not fit"):
        load_factory("my_factory:build", tmp_path / "wrong.pt")
    with pytest.raises(InputError, match="module:factory"):
        load_factory("my_factory")
    assert Path.cwd() == tmp_path
