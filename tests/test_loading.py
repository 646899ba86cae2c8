"""Safe model loading: torch.nn models load weights-only with no flag; anything else is refused
before a byte is unpickled; a pickle that runs code never runs it without trust_file."""
import os
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention
from attn_export.errors import InputError
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
    with pytest.raises(InputError) as info:
        load_model(path)
    assert str(info.value) == (f"{path} is a TorchScript archive (torch.jit.save); attn-export needs the "
                               "nn.Module: save it with torch.save(model), or use --model module:factory")


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


FACTORIES = """
    from torch import nn
    LAYER = nn.Linear(2, 2)
    NUMBER = 3
    def build():
        return nn.Sequential(nn.Linear(4, 3))
    def failing():
        raise RuntimeError("no GPU here\\nsecond line")
    def number():
        return 42
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module ``factories_mod`` in the current directory, importable only through the
    current-directory entry load_factory puts on sys.path."""
    (tmp_path / "factories_mod.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.delitem(sys.modules, "factories_mod", raising=False)
    return tmp_path


@pytest.mark.parametrize("spec,message", [
    ("factories_mod", "--model 'factories_mod': expected module:factory, e.g. mypkg.models:build"),
    (":build", "--model ':build': expected module:factory"),
    ("factories_mod:", "--model 'factories_mod:': expected module:factory"),
    ("no_such_mod_xyz:build", "--model no_such_mod_xyz:build: cannot import 'no_such_mod_xyz' (No module named"),
    ("factories_mod:nothing", "--model factories_mod:nothing: 'factories_mod' has no 'nothing'"),
    ("factories_mod:failing", "--model factories_mod:failing: calling it failed: no GPU here"),
    ("factories_mod:NUMBER", "--model factories_mod:NUMBER: 'NUMBER' is neither callable nor an nn.Module"),
    ("factories_mod:number", "--model factories_mod:number: returned a int, not a torch.nn.Module"),
    ("factories_mod:build:x", "--model factories_mod:build:x: 'factories_mod' has no 'build:x'"),
])
def test_every_bad_factory_is_named_with_the_fix(factories, spec, message):
    with pytest.raises(InputError) as info:
        load_factory(spec)
    assert str(info.value).startswith(message), str(info.value)
    assert "second line" not in str(info.value)  # one line, not the whole exception


def test_a_factory_module_in_the_current_directory_is_found(factories):
    model = load_factory("factories_mod:build")
    assert sys.path[0] == ""  # the current directory, as `python -m` would have it
    assert isinstance(model, nn.Sequential) and model[0].in_features == 4
    # An nn.Module instance is taken as it is, not called.
    from factories_mod import LAYER

    assert load_factory("factories_mod:LAYER") is LAYER


def test_weights_files_are_checked_and_wrapped_state_dicts_unwrapped(factories):
    reference = nn.Sequential(nn.Linear(4, 3))
    wrapped = factories / "wrapped.pt"
    torch.save({"state_dict": reference.state_dict(), "epoch": 3}, wrapped)
    model = load_factory("factories_mod:build", wrapped)
    assert torch.equal(model[0].weight, reference[0].weight) and torch.equal(model[0].bias, reference[0].bias)

    listed = factories / "listed.pt"
    torch.save([reference[0].weight], listed)
    evil = factories / "evil.pt"
    torch.save({"model": MarkerWriter(factories / "PWNED")}, evil)
    for weights, message in [
        (factories / "missing.pt", f"--weights {factories / 'missing.pt'}: no such file"),
        (factories, f"--weights {factories}: no such file"),
        (listed, f"--weights {listed}: expected a state_dict, got a list"),
        (evil, f"--weights {evil}: cannot load it weights-only ({torch_reason(evil)})"),
    ]:
        with pytest.raises(InputError) as info:
            load_factory("factories_mod:build", weights)
        assert str(info.value).startswith(message), str(info.value)
    assert not (factories / "PWNED").exists()
    torch.save(nn.Linear(5, 5).state_dict(), factories / "wrong.pt")
    with pytest.raises(InputError) as info:
        load_factory("factories_mod:build", factories / "wrong.pt")
    assert str(info.value).startswith(f"--weights {factories / 'wrong.pt'}: does not fit the model: Error(s) in "
                                      "loading state_dict for Sequential")


def torch_reason(path):
    """The first line of torch's own error for a weights-only load of ``path``."""
    with pytest.raises(Exception) as info:
        torch.load(path, weights_only=True)
    return str(info.value).strip().splitlines()[0].strip()


def test_allow_class_specs_take_either_separator_and_name_the_fix(tmp_path, monkeypatch):
    from attn_export.loading import as_cli_name, import_class

    assert as_cli_name("a.b.Net") == "a.b:Net" and as_cli_name("Net") == "Net"
    assert import_class("attn_export.examples.TinySeq2Seq") is TinySeq2Seq
    assert import_class("attn_export.examples:TinySeq2Seq") is TinySeq2Seq
    # the module is imported by its full dotted name, not reached attribute by attribute
    (tmp_path / "pkg_never_imported").mkdir()
    (tmp_path / "pkg_never_imported" / "__init__.py").write_text("")
    (tmp_path / "pkg_never_imported" / "sub.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_class("pkg_never_imported.sub.Thing").__name__ == "Thing"
    for spec, message in [
        (":Net", "--allow-class ':Net': expected module:Class, e.g. mypkg.models:Net"),
        ("Net", "--allow-class 'Net': expected module:Class, e.g. mypkg.models:Net"),
        ("no_such_mod_xyz:A:B", "--allow-class no_such_mod_xyz:A:B: cannot import module 'no_such_mod_xyz' ("),
    ]:
        with pytest.raises(InputError) as info:
            import_class(spec)
        assert str(info.value).startswith(message), str(info.value)


def test_the_refusal_lists_every_class_and_both_ways_forward(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    torch.save(TinySeq2Seq(features=8, d_model=16, heads=2, layers=1), one)
    torch.save({"m": TinySeq2Seq(features=8, d_model=16, heads=2, layers=1), "w": MarkerWriter(tmp_path / "x")}, two)
    ways = ("Nothing was unpickled. Either allow it by name with --allow-class attn_export.examples:TinySeq2Seq "
            "(repeatable; imported from the installed package), or, only for a file you trust, --trust-model-file "
            "(full unpickling: runs code from the file)")
    with pytest.raises(InputError) as info:
        load_model(one)
    assert str(info.value) == (f"{one} references a class outside the allowlist of safe torch.nn classes: "
                               f"attn_export.examples:TinySeq2Seq. {ways}")
    with pytest.raises(InputError) as info:
        load_model(two)
    listed = str(info.value).split("classes: ", 1)[1].split(". Nothing", 1)[0]
    assert str(info.value).startswith(f"{two} references classes outside the allowlist of safe torch.nn classes: ")
    assert listed.split(", ") == sorted(listed.split(", ")) and "attn_export.examples:TinySeq2Seq" in listed
    assert f"{os.system.__module__}:system" in listed and len(listed.split(", ")) == 2


@pytest.mark.parametrize("path_entries", [[""], ["."], ["", "."]])
def test_the_current_directory_is_put_on_the_path_once(factories, monkeypatch, path_entries):
    monkeypatch.setattr(sys, "path", path_entries + sys.path)
    load_factory("factories_mod:build")
    assert [p for p in sys.path if p in ("", ".")] == path_entries  # already there: nothing added


def test_a_file_holding_something_else_names_what_it_holds(tmp_path):
    path = tmp_path / "numbers.pt"
    torch.save([1, 2], path)
    for trust in (False, True):
        with pytest.raises(InputError) as info:
            load_model(path, trust_file=trust)
        assert str(info.value) == f"{path} holds a list, not a torch.nn.Module"


def test_every_load_failure_carries_torchs_reason(tmp_path):
    from attn_export.loading import import_class

    assert import_class("torch:nn.Linear") is nn.Linear  # a dotted qualified name, attribute by attribute
    # trust_file: a class outside the allowlist loads, tensors and all; junk names torch's reason
    model = tmp_path / "seq2seq.pt"
    reference = TinySeq2Seq(features=8, d_model=16, heads=2, layers=1)
    torch.save(reference, model)
    loaded = load_model(model, trust_file=True)
    assert isinstance(loaded, TinySeq2Seq)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), loaded.state_dict().values()))
    junk = tmp_path / "junk.pt"
    junk.write_text("not a model")
    with pytest.raises(InputError) as info:
        load_model(junk, trust_file=True)
    with pytest.raises(Exception) as torch_error:
        torch.load(junk, weights_only=False)
    assert str(info.value) == f"cannot load {junk}: {str(torch_error.value).strip().splitlines()[0].strip()}"
    with pytest.raises(InputError) as info:
        load_model(junk)
    assert str(info.value) == f"cannot read {junk}: not a PyTorch file, or corrupt or truncated ({torch_reason(junk)})"
    # a zip archive that is not a PyTorch file
    import zipfile

    archive = tmp_path / "notes.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("notes.txt", "hello")
    with pytest.raises(Exception) as torch_error:
        torch.serialization.get_unsafe_globals_in_checkpoint(archive)
    reason = str(torch_error.value).strip().splitlines()[0].strip()
    with pytest.raises(InputError) as info:
        load_model(archive)
    assert str(info.value) == f"cannot read {archive}: not a PyTorch file, or corrupt or truncated ({reason})"
    # a legacy pickle's refusal names the file
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": MarkerWriter(tmp_path / "PWNED")}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(InputError) as info:
        load_model(legacy)
    assert str(info.value).startswith(f"{legacy} references a class outside the allowlist")
