"""Training with the fused operator on PyTorch's own stack (docs/training.md): DDP and FSDP2 on a
real 2-rank gloo group (loopback, separate processes), distributed checkpoints, activation
checkpointing and torch.compile. The references are the stock nn.MultiheadAttention model under
DDP and a single-process run on the full batch.

The ranks run tests/ops/training/training_workers.py once for the whole module (each process imports torch:
launches are the expensive part); every launch is bounded in time and a failing rank's error is
shown."""
from __future__ import annotations

import os
import re
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel_close
import training_workers as tw

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")
pytestmark = [pytestmark, pytest.mark.slow]  # make test-fast leaves it out

WORKERS = Path(__file__).with_name("training_workers.py")
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 300.0
# float32 on a few reductions in another order (all-reduce, reduce-scatter, per-rank batches).
REL = 2e-5


def run_processes(commands, timeout_s: float, cwd: Path) -> list:
    """Runs every (argv, extra_env) at once; returns their outputs when all exit 0. A process that
    fails fails the test with its exit code and the end of its stderr; past ``timeout_s`` every
    process still running is killed (a rank blocked in a collective whose peer died would wait
    for the group's own timeout otherwise)."""
    procs = []
    for i, (argv, extra_env) in enumerate(commands):
        out, err = open(cwd / f"proc{i}.out", "w+"), open(cwd / f"proc{i}.err", "w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKERS.parent), os.environ.get("PYTHONPATH", "")]),
               **extra_env}
        procs.append((subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd), out, err))
    timed_out = False
    try:
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=max(0.1, timeout_s))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports, outputs = [], []
    for i, (proc, out, err) in enumerate(procs):
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close(), err.close()
        outputs.append(stdout)
        if proc.returncode != 0:
            reports.append(f"--- process {i} ({' '.join(commands[i][0][1:])}) exited {proc.returncode}:\n"
                           f"{stderr[-3000:]}")
    if timed_out or reports:
        pytest.fail((f"timed out after {timeout_s:.0f} s\n" if timed_out else "") + "\n".join(reports),
                    pytrace=False)
    return outputs


def launch_ranks(out_dir: Path) -> None:
    rank_env = [{"RANK": str(r), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(r), "GLOO_SOCKET_IFNAME": "lo"}
                for r in range(WORLD_SIZE)]
    run_processes([([sys.executable, str(WORKERS), "ranks", str(out_dir)], env) for env in rank_env],
                  LAUNCH_TIMEOUT_S, out_dir)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The ranks' results (tests/ops/training/training_workers.py:run_rank) and their output directory."""
    out_dir = tmp_path_factory.mktemp("ranks")
    launch_ranks(out_dir)
    return torch.load(out_dir / "results.pt"), out_dir


def assert_runs_match(actual: dict, expected: dict, what: str, grads: bool = True) -> None:
    assert len(actual["losses"]) == len(expected["losses"]) > 0
    assert_rel_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), REL, f"{what}: losses")
    assert actual["params"].keys() == expected["params"].keys()
    for name, p in expected["params"].items():
        assert_rel_close(actual["params"][name], p, REL, f"{what}: updated {name}")
    if grads:
        for step, (got, want) in enumerate(zip(actual["grads"], expected["grads"])):
            assert got.keys() == want.keys()
            for name, g in want.items():
                assert_rel_close(got[name], g, REL, f"{what}: step {step} gradient of {name}")


def test_ddp_matches_stock_attention_under_ddp_and_one_process_on_the_full_batch(ranks):
    results, _ = ranks
    # The training actually moved the parameters: a test of equal losses would pass on a no-op.
    assert results["ddp_fused"]["losses"][-1] < results["ddp_fused"]["losses"][0]
    assert_runs_match(results["ddp_fused"], results["ddp_stock"], "DDP fused vs DDP nn.MultiheadAttention")
    single = tw.train(tw.build_model(), tw.batches())
    assert_runs_match(results["ddp_fused"], single, "DDP fused vs one process, full batch")


def test_fsdp2_matches_ddp(ranks):
    results, _ = ranks
    assert_runs_match(results["fsdp_fused"], results["ddp_fused"], "FSDP2 vs DDP")


def test_distributed_checkpoint_round_trips_and_the_loaded_model_exports_and_validates(ranks, tmp_path):
    import torch.distributed.checkpoint as dcp

    import attn_export

    results, out_dir = ranks
    trained = results["fsdp_fused"]["params"]
    for name, p in results["dcp_loaded"].items():  # loaded into a differently initialized FSDP2 model
        assert torch.equal(p, trained[name]), name
    # The sharded checkpoint loads into a plain model in a process without a group, too.
    model = tw.build_model(seed=2)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=out_dir / "checkpoint")
    model.load_state_dict(state)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name

    stock = tw.build_model(fused=False)
    stock.load_state_dict(model.state_dict())
    src, padding, _ = tw.batches(steps=1)[0]
    inputs = {"src": src, "src_key_padding_mask": padding}
    result = attn_export.export_onnx(model.eval(), inputs, tmp_path / "trained.onnx")
    assert result.num_attention_nodes == tw.LAYERS
    report = attn_export.validate(stock.eval(), tmp_path / "trained.onnx", inputs)
    assert report.passed, report.failures


def test_activation_checkpointing_gives_the_same_gradients():
    data = tw.batches(steps=1)
    plain = tw.train(tw.build_model(), data)
    checkpointed_model = tw.build_model()
    checkpointed_model.checkpointed = True
    checkpointed = tw.train(checkpointed_model, data)
    assert_runs_match(checkpointed, plain, "checkpointed vs plain")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_activation_checkpointing_lowers_peak_memory_at_a_long_sequence(tmp_path):
    # A fresh process (tests/ops/training/training_workers.py:probe_memory), its allocator set to return
    # large blocks on free: the peak resident memory of one step then follows the live tensors.
    (output,) = run_processes([([sys.executable, str(WORKERS), "memory"], {"MALLOC_MMAP_THRESHOLD_": "65536"})],
                              LAUNCH_TIMEOUT_S, tmp_path)
    peak = json.loads(output.strip().splitlines()[-1])
    # 6 layers: the plain step keeps every layer's activations (~15 MB each), the checkpointed
    # one the layer inputs and one layer's activations at a time.
    assert peak["plain_mb"] > 50, peak
    assert peak["checkpointed_mb"] < 0.6 * peak["plain_mb"], peak


def test_torch_compile_inductor_trains_without_graph_breaks(tmp_path, monkeypatch):
    # A cache of its own: inductor's FX graph cache does not key on the operators' schemas, so a
    # graph cached against an earlier build of the extension would call it with stale arguments.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    data = tw.batches()
    eager = tw.train(tw.build_model(layers=1), data)
    model = tw.build_model(layers=1)  # one layer: inductor's compile time is the cost here
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)  # fullgraph: a break raises
    optimizer = torch.optim.SGD(model.parameters(), lr=tw.LR)
    losses = []
    for src, padding, target in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(src, padding), target)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
    assert_rel_close(torch.tensor(losses), torch.tensor(eager["losses"]), REL, "compiled losses")
    for name, p in model.named_parameters():
        assert_rel_close(p.detach(), eager["params"][name], REL, f"compiled: updated {name}")
    explanation = torch._dynamo.explain(model)(*data[0][:2])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {node.target for graph in explanation.graphs for node in graph.graph.nodes}
    assert torch.ops.attn_export.multi_head_attention.default in targets


def test_the_train_ddp_example_runs_end_to_end(tmp_path):
    script = Path(__file__).resolve().parents[3] / "scripts" / "train_ddp.py"
    out = tmp_path / "out"
    (output,) = run_processes(
        [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--steps", "3", "--out", str(out)], {"GLOO_SOCKET_IFNAME": "lo"})],
        LAUNCH_TIMEOUT_S, tmp_path)
    losses = [float(m) for m in re.findall(r"step +\d+/3 +loss ([0-9.]+)", output)]
    assert len(losses) == 2 and losses[-1] < losses[0], output  # steps 1 and 3, printed by rank 0
    assert "6 found, 6 replaced" in output and "(6 FusedAttention nodes)" in output, output
    assert "validation PASSED" in output, output
    assert json.loads((out / "report.json").read_text())["passed"] is True
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt", "report.json"]


def test_a_failing_process_shows_its_error_and_a_hung_one_times_out(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)process 1 .* exited 1:.*rank 1 broke"):
        run_processes([([sys.executable, "-c", "pass"], {}),
                       ([sys.executable, "-c", "raise SystemExit('rank 1 broke')"], {})], 30, tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"timed out after 1 s"):
        run_processes([([sys.executable, "-c", "import time; time.sleep(60)"], {})], 1, tmp_path)
