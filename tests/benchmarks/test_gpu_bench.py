"""The GPU benchmark's logic, checked without a GPU: issue 46's case list, the FLOP and byte
counts against hand-computed values, the best-backend and ratio logic and the tables with
stand-in timings, the flags, and the "n/a with its reason" path."""
import warnings

import pytest
import torch

from benchmarks import gpu, gpu_cases, gpu_plan, gpu_report, gpu_timing
from benchmarks.gpu_cases import Case, attention_flops, kv_bytes, select_cases
from benchmarks.gpu_impls import NotApplicable, Prepared, declines_early
from benchmarks.gpu_timing import Measurement, Timing, measure


def by_group(cases):
    out = {}
    for c in cases:
        out.setdefault(c.group, []).append(c)
    return out


def test_the_default_run_holds_every_row_of_issue_46():
    groups = by_group(select_cases(gpu_cases.DEFAULT_GROUPS))
    prefill = groups["prefill"]
    assert {(c.dtype, c.head_dim, c.q_len, c.causal, c.mode) for c in prefill} == {
        (dt, d, L, causal, mode) for dt in ("float16", "bfloat16") for d in (32, 64, 128)
        for L in (1024, 2048, 4096, 8192, 16384) for causal in (False, True) for mode in gpu_cases.MODES}
    assert all(c.batch * c.q_len == 16384 and c.heads * c.head_dim == 2048 and c.q_len == c.kv_len for c in prefill)
    assert {(c.head_dim, c.dtype, c.causal, c.q_len) for c in groups["hdims"]} == {
        (d, "bfloat16", True, 4096) for d in (80, 96, 256)}
    assert {(c.kv_len, c.n_kv_heads, c.q_len) for c in groups["decode"]} == {
        (kv, hkv, q) for kv in (4096, 32768) for hkv in (32, 8, 4) for q in (1, 4)}
    assert {(c.batch, c.heads, c.head_dim, c.dtype) for c in groups["decode"]} == {(16, 32, 128, "bfloat16")}
    assert [(c.dtype, c.head_dim, c.mode) for c in groups["padded"]] == [
        ("float16", 64, "forward"), ("float16", 64, "forward+backward")]
    assert groups["padded"][0].valid_lengths() == (1024, 2048, 3072, 4096) * 2
    assert [(c.batch, c.q_len, c.heads * c.head_dim, c.heads, c.dtype) for c in groups["layer"]] == [
        (4, 4096, 1024, 8, "bfloat16")] * 2
    assert "small" not in groups


def test_quick_keeps_every_group_with_fewer_rows():
    full, quick = by_group(select_cases(gpu_cases.GROUPS)), by_group(select_cases(gpu_cases.GROUPS, quick=True))
    assert set(quick) == set(full) == set(gpu_cases.GROUPS)
    assert len(quick["prefill"]) == 48 and len(full["prefill"]) == 120
    assert len(quick["decode"]) == 6 and all(c.q_len == 1 for c in quick["decode"])


def test_flops_as_flashattention_counts_them():
    case = Case("prefill", "float16", "forward", 16, 32, 1024, 1024, 64)
    assert attention_flops(case) == 4 * 16 * 32 * 1024 * 1024 * 64 == 2 ** 37
    causal = Case("prefill", "float16", "forward", 16, 32, 1024, 1024, 64, causal=True)
    assert attention_flops(causal) == 2 ** 36
    both = Case("prefill", "float16", "forward+backward", 16, 32, 1024, 1024, 64)
    assert attention_flops(both) == 3.5 * 2 ** 37
    padded = select_cases(["padded"])[0]  # B8 H16 L4096 D64, keys 1024+2048+3072+4096, twice
    assert attention_flops(padded) == 4 * 16 * 4096 * 20480 * 64 == 343597383680


def test_decode_counts_the_kv_bytes_read_once():
    gqa = Case("decode", "bfloat16", "forward", 16, 32, 1, 32768, 128, kv_heads=8)
    assert kv_bytes(gqa) == 2 * 16 * 8 * 32768 * 128 * 2 == 2 ** 31
    assert kv_bytes(Case("decode", "bfloat16", "forward", 16, 32, 4, 4096, 128)) == 2 ** 30
    assert gpu_cases.rate(gqa, 1e-3) == pytest.approx(2147.483648)  # GB/s
    assert gqa.metric == "GB/s" and "Hkv8" in gqa.label()


def test_rates_and_latencies():
    case = Case("prefill", "float16", "forward", 16, 32, 1024, 1024, 64)
    assert gpu_cases.rate(case, 1e-3) == pytest.approx(2 ** 37 / 1e-3 / 1e12)
    layer = select_cases(["layer"])[0]
    assert layer.metric == "ms" and gpu_cases.rate(layer, 2.5e-3) == pytest.approx(2.5)


M = Measurement
DECODE = Case("decode", "bfloat16", "forward", 16, 32, 1, 32768, 128, kv_heads=8)


def stand_in_row():
    times = {"attn_export": M(2e-3), "flash": M(1e-3), "cudnn": M(0.5e-3),
             "efficient": M(None, "n/a: refused for a reason"), "math": M(4e-3)}
    return gpu_report.summarize(DECODE, times, peak_tbs=4.8)


def test_the_best_other_column_and_the_ratio_to_it():
    row = stand_in_row()
    assert row["best"] == "cudnn"
    assert row["ours_vs_best"] == pytest.approx(0.25)
    assert row["columns"]["cudnn"]["value"] == pytest.approx(2 ** 31 / 0.5e-3 / 1e9)
    assert row["best_of_peak"] == pytest.approx(2 ** 31 / 0.5e-3 / 4.8e12)
    assert row["ours_of_peak"] == pytest.approx(2 ** 31 / 2e-3 / 4.8e12)
    # latency rows: the best is the shortest time too, not the largest figure
    layer = select_cases(["layer"])[0]
    lrow = gpu_report.summarize(layer, {"attn_export": M(3e-3), "nn.MultiheadAttention": M(1e-3), "sdpa": M(2e-3)})
    assert lrow["best"] == "nn.MultiheadAttention" and lrow["ours_vs_best"] == pytest.approx(1 / 3)


def test_a_row_where_only_ours_ran_has_no_best():
    row = gpu_report.summarize(DECODE, {"attn_export": M(1e-3), "flash": M(None, "n/a: x")})
    assert row["best"] is None and row["ours_vs_best"] is None and "ours_of_peak" not in row


def test_the_table_names_the_best_the_ratio_and_each_reason():
    table = gpu_report.markdown({"gpu": "NVIDIA H200"}, "python -m benchmarks.gpu --quick", [stand_in_row()],
                                skipped=[select_cases(["layer"])[0]])
    lines = table.splitlines()
    row = next(line for line in lines if line.startswith("| B16 H32 Hkv8"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["B16 H32 Hkv8 Lq1 Lk32768 D128 bfloat16 forward", "1073.7", "2147.5", "4295.0", "n/a", "536.9",
                     "cudnn", "0.25", "22%", "89%"]
    assert "- B16 H32 Hkv8 Lq1 Lk32768 D128 bfloat16 forward, efficient: n/a: refused for a reason" in lines
    assert "`python -m benchmarks.gpu --quick`" in table and "halved when causal" in table
    assert "1 cases skipped (time budget)" in table


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35),
                                        ("NVIDIA H100 PCIe", 2.0), ("NVIDIA A100-SXM4-80GB", 2.039),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_hbm_peak_by_device_name(name, peak):
    assert gpu_report.hbm_peak_tbs(name) == peak


def test_flags():
    args = gpu.parse_args(["--cases", "decode,hdims", "--quick", "--budget-s", "120", "--hbm-peak-tbs", "3.35"])
    assert args.cases == ["decode", "hdims"] and args.quick and args.budget_s == 120 and args.hbm_peak_tbs == 3.35
    assert gpu.timing_for(args).blocks == 3 and gpu.timing_for(gpu.parse_args([])).blocks == 5
    assert gpu.parse_args([]).cases == list(gpu_cases.DEFAULT_GROUPS)


def test_an_unknown_case_group_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args(["--cases", "prefill,decod"])
    assert exit_.value.code == 2
    assert "unknown case group(s) ['decod']: pick from decode, hdims, padded, layer, prefill, small" in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--cases" in out and "--quick" in out and "every backend of F.scaled_dot_product_attention" in out


def test_the_estimate_is_printed_and_nothing_runs(capsys):
    gpu.main(["--estimate", "--quick", "--cases", "decode,layer"])
    out = capsys.readouterr().out
    assert "decode      6 cases" in out and "layer       2 cases" in out and "estimated run time ~" in out


def test_the_estimate_follows_the_calls_the_timer_makes():
    timing = Timing(blocks=5, block_s=0.05, max_s=3.0, warmup=2)
    assert gpu_plan.column_s(0.001, timing) == pytest.approx(gpu_plan.SETUP_S + 3 * 0.001 + 5 * 0.05)
    assert gpu_plan.column_s(2.0, timing) == pytest.approx(gpu_plan.SETUP_S + 3 * 2.0 + 5.0)  # capped by max_s
    big = select_cases(["prefill"])[-1]  # seq 16k: math declines, so it costs nothing
    assert declines_early("math", big) and not declines_early("flash", big)
    assert gpu_plan.case_s(big, ["math"], timing) == 0


def test_cases_past_the_budget_are_skipped_not_run(monkeypatch):
    monkeypatch.setattr(gpu_timing, "measure", lambda *a: pytest.fail("ran a case past the budget"))
    rows, skipped = gpu.run_cases(select_cases(["layer"]), [10.0, 10.0], Timing(), "cpu", budget_s=5, peak_tbs=None)
    assert rows == [] and len(skipped) == 2


def refusing(message, warning=None):
    def prepare_fn(impl, case, device):
        if warning:
            warnings.warn(warning + " (Triggered internally at /x/sdp_utils.cpp:99.)")
        raise RuntimeError(message)
    return prepare_fn


def test_a_backend_that_raises_is_na_with_its_warned_reason():
    m = measure("flash", DECODE, "cpu", Timing(), refusing("No available kernel.", "Flash attention does not support X"))
    assert m.seconds is None and m.note == "n/a: Flash attention does not support X"
    m = measure("cudnn", DECODE, "cpu", Timing(), refusing("cuDNN refused this shape\nmore"))
    assert m.note == "n/a: cuDNN refused this shape"


def test_a_declined_column_and_a_real_refusal_are_na():
    def declined(impl, case, device):
        raise NotApplicable("not cheap")
    assert measure("math", DECODE, "cpu", Timing(), declined) == Measurement(None, "n/a: not cheap")
    tiny = Case("prefill", "float32", "forward", 1, 2, 8, 8, 16)
    m = measure("cudnn", tiny, "cpu", Timing(blocks=1, block_s=0, warmup=0))  # no cuDNN on the CPU
    assert m.seconds is None and m.note.startswith("n/a: ")


def test_a_column_that_runs_is_timed_as_the_best_block():
    calls = []
    prepared = Prepared(lambda: calls.append(1))
    m = measure("attn_export", DECODE, "cpu", Timing(blocks=3, block_s=0, warmup=2), lambda *a: prepared)
    assert m.seconds is not None and m.seconds >= 0 and len(calls) == 2 + 1 + 3


def test_ours_runs_gqa_on_the_cpu_with_the_expansion_said():
    case = Case("decode", "float32", "forward", 1, 4, 1, 16, 16, kv_heads=2)
    m = measure("attn_export", case, "cpu", Timing(blocks=1, block_s=0, warmup=0))
    assert m.seconds is not None
    from benchmarks.gpu_impls import operator_takes_gqa
    assert (m.note is None) == operator_takes_gqa("cpu")
    with torch.no_grad():  # the expanded call computes what SDPA's GQA computes
        from benchmarks.gpu_impls import attention_call, make_inputs
        q, k, v, pad = make_inputs(case, "cpu")
        ours, _ = attention_call("attn_export", case, q, k, v, pad)
        ref, _ = attention_call("math", case, q, k, v, pad)
        torch.testing.assert_close(ours(), ref())


def test_padded_columns_mask_the_same_keys():
    case = Case("padded", "float32", "forward", 4, 2, 8, 8, 16, pad_lengths=gpu_cases.PADDED_LENGTHS)
    from benchmarks.gpu_impls import attention_call, make_inputs
    q, k, v, pad = make_inputs(case, "cpu")
    assert pad.sum(1).tolist() == [6, 4, 2, 0]
    with torch.no_grad():
        ours, _ = attention_call("attn_export", case, q, k, v, pad)
        ref, _ = attention_call("math", case, q, k, v, pad)
        torch.testing.assert_close(ours(), ref())


def test_the_time_is_the_best_block_and_slow_columns_stop_early(monkeypatch):
    def scripted(times):
        seen = []

        def elapsed(fn, iters, device):
            seen.append(iters)
            return times[len(seen) - 1] * iters
        return elapsed, seen

    elapsed, seen = scripted([5.0, 3.0, 1.0, 2.0])  # one call, then three blocks of one call
    monkeypatch.setattr(gpu_timing, "elapsed_s", elapsed)
    assert gpu_timing.best_of_blocks(lambda: None, Timing(blocks=3, block_s=0, max_s=100, warmup=0), "cpu") == 1.0
    elapsed, seen = scripted([0.01, 0.02, 0.005])
    monkeypatch.setattr(gpu_timing, "elapsed_s", elapsed)
    assert gpu_timing.best_of_blocks(lambda: None, Timing(blocks=2, block_s=0.1, max_s=100, warmup=0), "cpu") == 0.005
    assert seen == [1, 10, 10]  # blocks of 10 calls fill block_s = 0.1 s
    elapsed, seen = scripted([2.0, 2.0, 1.0, 0.5])
    monkeypatch.setattr(gpu_timing, "elapsed_s", elapsed)
    assert gpu_timing.best_of_blocks(lambda: None, Timing(blocks=3, block_s=0, max_s=3.0, warmup=0), "cpu") == 2.0
    assert len(seen) == 2  # 4 s of timed work passed max_s: no third call
