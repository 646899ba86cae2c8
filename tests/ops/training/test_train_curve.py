"""scripts/train_curve.py: the 200-step loss curve of the fused operator against nn.MultiheadAttention's
(docs/training.md). On the CPU here; scripts/gpu_check.sh's `train` step runs it on a GPU."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from attn_export import FusedMultiheadAttention

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "train_curve.py"
spec = importlib.util.spec_from_file_location("train_curve", SCRIPT)
train_curve = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = train_curve  # dataclasses look their module up
spec.loader.exec_module(train_curve)

# Long enough for the copy to be learned (the loss falls from ln(32) to ~0.05 near step 120 at
# these sizes), so that the curves compared are those of a model that trains.
STEPS = ["--steps", "140", "--window", "20"]


class _KeyGradientShifted(torch.autograd.Function):
    """Identity forward; the key's gradient moved one position along the sequence: the off-by-one
    a key-block index in a backward kernel makes."""

    @staticmethod
    def forward(ctx, key):
        return key.view_as(key)

    @staticmethod
    def backward(ctx, grad):
        return grad.roll(1, dims=1)


@pytest.mark.slow
def test_fused_curve_follows_stock(tmp_path):
    assert train_curve.main([*STEPS, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "curve.json").read_text())
    means = report["window_means"]
    assert report["replaced"] == "2 found, 2 replaced, 0 skipped"
    assert {name: len(losses) for name, losses in report["losses"].items()} == {"stock": 140, "fused": 140, "reshuffled": 140}
    assert means["stock"][-1] < 0.1 * means["stock"][0]  # the model learned the copy
    assert report["passed"] and report["fused_gap"] <= report["noise"]
    assert report["fused_gap"] < 0.05 * report["noise"]  # float32 on both sides: far inside the noise
    assert "**PASSED**" in (tmp_path / "curve.md").read_text()


@pytest.mark.exhaustive  # ~40 s: the curve test's own power (it can fail), checked before a release
def test_a_wrong_key_gradient_fails(tmp_path, monkeypatch):
    """The curve sees a backward bug that leaves the forward exact."""
    forward = FusedMultiheadAttention.forward

    def shifted(self, query, key, value, *args, **kwargs):
        return forward(self, query, _KeyGradientShifted.apply(key), value, *args, **kwargs)

    monkeypatch.setattr(FusedMultiheadAttention, "forward", shifted)
    assert train_curve.main([*STEPS, "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "curve.json").read_text())
    assert report["losses"]["fused"][0] == pytest.approx(report["losses"]["stock"][0], rel=1e-5)
    assert not report["passed"] and report["fused_gap"] > report["noise"]
    assert "**FAILED**" in (tmp_path / "curve.md").read_text()


def test_compare_reads_window_gaps():
    curves = {"stock": [3.0, 3.0, 1.0, 1.0], "fused": [3.0, 3.0, 1.1, 1.1], "reshuffled": [3.0, 3.0, 1.2, 1.2]}
    verdict = train_curve.compare(curves, window=2)
    assert verdict["window_means"]["fused"] == [3.0, pytest.approx(1.1)]
    assert verdict["fused_gap"] == pytest.approx(0.1) and verdict["noise"] == pytest.approx(0.2) and verdict["passed"]
    curves["fused"] = [3.0, 3.0, 1.3, 1.3]
    assert not train_curve.compare(curves, window=2)["passed"]
    flat = {"stock": [3.0, 3.0, 2.9, 2.9], "fused": [3.0, 3.0, 2.9, 2.9], "reshuffled": [3.0, 3.0, 2.8, 2.8]}
    verdict = train_curve.compare(flat, window=2)  # no training yet: equal curves prove nothing
    assert verdict["fused_gap"] == 0 and not verdict["learned"] and not verdict["passed"]


def test_copy_batch_targets_only_the_copy():
    cfg, _ = train_curve.parse_args(["--batch", "3", "--seq-len", "9", "--vocab", "5"])
    tokens, targets = train_curve.copy_batch(cfg, data_seed=0, step=0, device=torch.device("cpu"))
    half = 5  # prefix, separator, the first 4 tokens of the prefix again: 10 tokens, 9 inputs
    assert tokens.shape == targets.shape == (3, 9)
    assert (tokens[:, half] == train_curve.SEPARATOR).all() and (tokens[:, :half] > 0).all()
    assert (targets[:, :half] == -100).all()
    assert torch.equal(targets[:, half:], tokens[:, :9 - half])  # the prefix again
    again, _ = train_curve.copy_batch(cfg, data_seed=0, step=0, device=torch.device("cpu"))
    other, _ = train_curve.copy_batch(cfg, data_seed=1, step=0, device=torch.device("cpu"))
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "60", "--heads", "8"], "not a multiple of --heads"),
    (["--steps", "0"], "at least 1"),
    (["--seq-len", "3"], "--seq-len >= 4"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_curve.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
