"""The CUDA dispatch policy (csrc/kernels/cuda/dispatch_policy.h) and the split-KV chunk count
(split_kv.h), compiled alone with the host compiler and asked over a table of cases: without
the preview switch, nothing beyond what ran on the H200 at commit f427ebe may be dispatched.

The dispatch itself (attention_cuda.cu consulting the policy) is checked by running it under the
SIMT emulator in tests/ops/cuda/test_cuda_split_kv.py (slow); this file is the fast tier's check.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CUDA_KERNELS = ROOT / "csrc" / "kernels" / "cuda"

# What f427ebe's attention_cuda.cu dispatched to the flash kernels: head_dim == head_dim_v in
# {32, 64, 128} (its switch_flash_head_dim), every key/value head its own query head's (no
# num_heads_k), causality top-left only (no causal_alignment), one program per query tile, and
# the head-dim-128 backward on 4 warps without a column split (its FlashBwdTraits).
VERIFIED_FLASH_HEAD_DIMS = {32, 64, 128}

PROGRAM = r"""
#include <cstdio>
#include "kernels/cuda/dispatch_policy.h"
#include "kernels/cuda/forward_plan.h"
#include "kernels/cuda/split_kv.h"
using namespace attn_export;
using namespace attn_export::cuda;

int main() {
  std::printf("{\"flash\": [");
  const char* sep = "";
  for (int d = 8; d <= 256; d += 8) {
    for (int dv = 8; dv <= 256; dv += 8) {
      if (policy::verified_flash_head_dims(d, dv)) { std::printf("%s[%d, %d]", sep, d, dv); sep = ", "; }
    }
  }
  std::printf("], \"features\": {");
  AttentionParams p;
  p.batch = 2; p.num_heads = 8; p.num_heads_k = 8; p.seqlen_q = 5; p.seqlen_k = 9; p.is_causal = true;
  std::printf("\"mha\": %u, ", policy::needed_features(p));
  p.num_heads_k = 0; std::printf("\"mha_unset\": %u, ", policy::needed_features(p));
  p.num_heads_k = 2; std::printf("\"gqa\": %u, ", policy::needed_features(p));
  p.num_heads_k = 8; p.causal_alignment = kCausalBottomRight; std::printf("\"bottom_right\": %u, ", policy::needed_features(p));
  p.seqlen_k = 5; std::printf("\"bottom_right_square\": %u, ", policy::needed_features(p));
  p.seqlen_k = 9; p.is_causal = false; std::printf("\"bottom_right_not_causal\": %u, ", policy::needed_features(p));
  p.causal_alignment = kCausalTopLeft; p.window = 3; std::printf("\"window_not_causal\": %u, ", policy::needed_features(p));
  p.is_causal = true; std::printf("\"window\": %u, ", policy::needed_features(p));
  const float slopes[8] = {0.5f, 0.25f, 0.125f, 0.0625f, 0.5f, 0.25f, 0.125f, 0.0625f};
  p.window = 0; p.is_causal = false; p.alibi_slopes = slopes; std::printf("\"alibi\": %u", policy::needed_features(p));
  std::printf("}, \"allowed\": [%d, %d, %d, %d], ", policy::allowed(0, false), policy::allowed(policy::kGroupedQuery, false),
              policy::allowed(policy::kSplitKv, false), policy::allowed(policy::kSplitKv | policy::kBottomRight, true));
  std::printf("\"env\": [%d, %d, %d, %d, %d], ", policy::preview_from_env(nullptr), policy::preview_from_env("1"),
              policy::preview_from_env("0"), policy::preview_from_env("10"), policy::preview_from_env(""));
  std::printf("\"bwd_col_split_128\": [%d, %d], ", policy::flash_bwd_col_split_128(false),
              policy::flash_bwd_col_split_128(true));
  AttentionParams padded;
  const unsigned char pad_row[1] = {1};
  std::printf("\"skip_tiles\": [%d, %d, ", policy::skip_padded_key_tiles(padded, false),
              policy::skip_padded_key_tiles(padded, true));
  padded.key_padding_mask.ptr = pad_row; padded.key_padding_mask.kind = MaskKind::kBool;
  std::printf("%d, %d], ", policy::skip_padded_key_tiles(padded, false), policy::skip_padded_key_tiles(padded, true));
  // [num_heads, num_heads_k, seqlen_q, block_m, packs without the preview, packs with it]
  std::printf("\"pack_gqa\": [");
  const long long packs[][4] = {{8, 2, 1, 64}, {8, 8, 1, 64}, {8, 0, 1, 64}, {32, 4, 5, 64}, {8, 1, 9, 64},
                                {4, 1, 17, 64}, {2, 1, 33, 64}, {4, 1, 64, 64}, {8, 2, 0, 64}, {6, 4, 1, 64},
                                {4, 1, 65, 64}, {8, 1, 1 << 28, 64}};
  sep = "";
  for (const auto& c : packs) {
    AttentionParams g;
    g.num_heads = c[0]; g.num_heads_k = c[1]; g.seqlen_q = c[2];
    const int block_m = static_cast<int>(c[3]);
    std::printf("%s[%lld, %lld, %lld, %lld, %d, %d]", sep, c[0], c[1], c[2], c[3], policy::pack_gqa(g, block_m, false),
                policy::pack_gqa(g, block_m, true));
    sep = ", ";
  }
  std::printf("], ");
  // [batch, heads, heads_k, seqlen_q, seqlen_k, head_dim, sms]: the plan's block_m with the preview
  // off and on, whether it splits or packs (on), and the Hopper forward's decline (on, workspace given).
  std::printf("\"plans\": [");
  const long long plans[][7] = {{1, 2, 2, 64, 300, 64, 1}, {1, 2, 2, 130, 300, 64, 4}, {1, 2, 2, 130, 300, 64, 5}, {1, 2, 2, 130, 300, 64, 132},
                                {1, 2, 2, 130, 300, 96, 1}, {1, 2, 2, 130, 300, 32, 1}, {1, 2, 2, 130, 300, 128, 1},
                                {1, 8, 2, 1, 300, 64, 1}, {4, 16, 16, 1000, 1000, 64, 132}, {1, 2, 2, 130, 300, 64, 0}};
  sep = "";
  for (const auto& c : plans) {
    AttentionParams q;
    q.batch = c[0]; q.num_heads = c[1]; q.num_heads_k = c[2]; q.seqlen_q = c[3]; q.seqlen_k = c[4];
    q.head_dim = q.head_dim_v = c[5]; q.is_causal = true; q.causal_alignment = kCausalBottomRight;
    const int sms = static_cast<int>(c[6]);
    const FlashFwdPlan off = flash_fwd_plan(q, flash_tile_dim(q, true), sms, false);
    const FlashFwdPlan on = flash_fwd_plan(q, flash_tile_dim(q, true), sms, true);
    std::printf("%s[%lld, %lld, %lld, %lld, %lld, %lld, %d, %d, %d, %d, %d, %d, %d]", sep, c[0], c[1], c[2], c[3], c[4],
                c[5], sms, off.blocks.block_m, on.blocks.block_m, on.blocks.row_tiles, on.split.num_splits > 1,
                on.pack_gqa, hopper_forward_declines(on, q, on.workspace_bytes()));
    sep = ", ";
  }
  std::printf("], \"wide_policy\": [%d, %d, %d, %d, %d, %d], ", policy::wide_forward_tiles(true, 8, 4, 4, false),
              policy::wide_forward_tiles(true, 8, 4, 4, true), policy::wide_forward_tiles(false, 8, 4, 4, true),
              policy::wide_forward_tiles(true, 6, 3, 4, true), policy::wide_forward_tiles(true, 8, 4, 0, true),
              policy::wide_forward_tiles(true, 4, 4, 4, true));
  std::printf("\"env_var\": \"%s\", \"splits\": [", policy::kPreviewEnvVar);
  const long long cases[][3] = {{2, 16, 2}, {2, 16, 3}, {2, 16, 8}, {2, 16, 132}, {132, 64, 132}, {1, 1, 132},
                                {1, 3, 132}, {1, 4096, 132}, {4, 2, 132}, {0, 5, 132}};
  sep = "";
  for (const auto& c : cases) {
    const SplitCount s = split_count(c[0], c[1], static_cast<int>(c[2]));
    std::printf("%s[%lld, %lld, %lld, %d, %d]", sep, c[0], c[1], c[2], s.num_splits, s.blocks_per_split);
    sep = ", ";
  }
  std::printf("]}\n");
}
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    folder = tmp_path_factory.mktemp("policy")
    (folder / "policy.cpp").write_text(PROGRAM)
    subprocess.run([compiler, "-std=c++17", "-O0", "-I", str(ROOT / "csrc"), str(folder / "policy.cpp"),
                    "-o", str(folder / "policy")], check=True, capture_output=True, text=True)
    return json.loads(subprocess.run([str(folder / "policy")], check=True, capture_output=True, text=True).stdout)


def test_only_the_verified_flash_head_dims_run_by_default(policy):
    assert {tuple(pair) for pair in policy["flash"]} == {(d, d) for d in VERIFIED_FLASH_HEAD_DIMS}


def test_grouped_heads_and_a_shifted_diagonal_need_the_preview(policy):
    f = policy["features"]
    assert f["mha"] == 0 and f["mha_unset"] == 0 and f["bottom_right_square"] == 0 and f["bottom_right_not_causal"] == 0
    assert f["gqa"] != 0 and f["bottom_right"] != 0 and f["gqa"] != f["bottom_right"]
    assert policy["allowed"] == [1, 0, 0, 1]  # nothing but the verified set without the preview


def test_a_sliding_window_needs_the_preview(policy):
    f = policy["features"]
    assert f["window"] != 0 and f["window"] not in (f["gqa"], f["bottom_right"])
    assert f["window_not_causal"] == 0  # the window is read only under is_causal


def test_alibi_slopes_in_the_kernels_need_the_preview(policy):
    """Without the preview the binding passes the ALiBi bias as a mask (verified_inputs.cpp)."""
    f = policy["features"]
    assert f["alibi"] != 0 and f["alibi"] not in (f["gqa"], f["bottom_right"], f["window"])


def test_the_head_dim_128_backward_keeps_the_verified_tiles(policy):
    assert policy["bwd_col_split_128"] == [1, 2]


def test_padded_key_tiles_are_skipped_with_the_preview_only(policy):
    """[no mask, preview off], [no mask, on], [key-padding mask, off], [mask, on]: computing and
    masking the padded tiles is what ran at f427ebe; skipping them waits for a GPU."""
    assert policy["skip_tiles"] == [0, 0, 0, 1]


def test_the_switch_is_on_for_1_only(policy):
    assert policy["env_var"] == "ATTN_EXPORT_CUDA_PREVIEW"
    assert policy["env"] == [0, 1, 0, 0, 0]


def test_split_counts(policy):
    """[programs, key tiles, SMs, chunks, tiles per chunk]: no split once the programs fill the
    SMs or with fewer than 2 x 2 key tiles; otherwise about 2 programs per SM, no empty chunk."""
    got = {tuple(c[:3]): tuple(c[3:]) for c in policy["splits"]}
    assert got[(2, 16, 2)][0] == 1 and got[(132, 64, 132)][0] == 1 and got[(0, 5, 132)][0] == 1
    assert got[(1, 1, 132)][0] == 1 and got[(1, 3, 132)][0] == 1
    assert got[(2, 16, 3)] == (3, 6) and got[(2, 16, 8)] == (8, 2) and got[(2, 16, 132)] == (8, 2)
    assert got[(1, 4096, 132)] == (128, 32)  # capped at kMaxSplits
    assert got[(4, 2, 132)] == (1, 0)
    for (programs, tiles, _), (chunks, per) in got.items():
        if chunks > 1:
            assert (chunks - 1) * per < tiles <= chunks * per, "every chunk holds at least one key tile"


def test_grouped_query_heads_are_packed_with_the_preview_when_fewer_tiles_result(policy):
    """pack_gqa: never without the preview; with it, under grouped heads (G = H / Hkv dividing),
    when ceil(G * Lq / block_m) < G * ceil(Lq / block_m)."""
    got = {tuple(c[:4]): tuple(c[4:]) for c in policy["pack_gqa"]}
    assert all(off == 0 for off, _ in got.values())
    on = {key: with_preview for key, (_, with_preview) in got.items()}
    assert on[(8, 2, 1, 64)] and on[(32, 4, 5, 64)]  # decode: 4 or 8 heads' rows in one tile
    assert on[(8, 1, 9, 64)] and on[(4, 1, 17, 64)]  # 72 and 68 rows: 2 tiles instead of 8 and 4
    assert on[(4, 1, 65, 64)]  # 260 rows: 5 tiles instead of 4 x 2
    assert not on[(8, 8, 1, 64)] and not on[(8, 0, 1, 64)]  # multi-head attention: nothing to pack
    assert not on[(2, 1, 33, 64)] and not on[(4, 1, 64, 64)]  # as many tiles either way
    assert not on[(8, 2, 0, 64)] and not on[(6, 4, 1, 64)]  # no query; a group that does not divide
    assert not on[(8, 1, 1 << 28, 64)]  # G * Lq past the kernel's int rows


def test_the_dispatch_reads_the_policy():
    """attention_cuda.cu and the forward's plan (forward_plan.h) route every choice through the policy
    (a rename or a removed check fails here)."""
    text = (CUDA_KERNELS / "attention_cuda.cu").read_text()
    plan = (CUDA_KERNELS / "forward_plan.h").read_text()
    for use in ("policy::allowed(policy::needed_features(p)",
                "policy::preview_from_env(std::getenv(policy::kPreviewEnvVar))",
                "cuda::flash_tile_dim(p, attention_preview_enabled())",
                "flash_fwd_plan(p, flash_tile_dim(p), sm_count, attention_preview_enabled())",
                "policy::flash_bwd_col_split_128(attention_preview_enabled())",
                "policy::skip_padded_key_tiles(p, attention_preview_enabled())"):
        assert use in text, use
    for use in ("policy::verified_flash_head_dims", "policy::allowed(policy::kSplitKv, preview)",
                "policy::pack_gqa(p, plan.blocks.block_m, preview)",
                "policy::wide_forward_tiles(compiled, programs, wide_programs, sm_count, preview)"):
        assert use in plan, use


def test_wide_forward_tiles_are_preview_only(policy):
    """[compiled, 64-row programs, wide programs, SMs, preview]: only with the preview, a compiled
    head dim (and a plan neither split nor packed: `compiled`), fewer programs than the 64-row
    kernel's (not with seqlen_q <= 64: as many, half their rows dead), and enough to fill the SMs."""
    assert policy["wide_policy"] == [0, 1, 0, 0, 0, 0]


def test_the_plan_widens_prefill_only(policy):
    """flash_fwd_plan's block_m: 64 without the preview always; with it 128 where the wide programs
    (batch x heads x ceil(Lq / 128)) fill the SMs and the plan neither splits nor packs, at the
    compiled head-dim tiles 32 and 64. The Hopper forward's decline reads split and pack only,
    so it stays what the 64-row plan gives: it declines split or packed (decode) work only."""
    got = {tuple(c[:7]): tuple(c[7:]) for c in policy["plans"]}
    # key: (batch, heads, heads_k, Lq, Lk, head_dim, SMs) -> (block_m off, on, row tiles, split, packed, declines)
    assert got[(1, 2, 2, 130, 300, 64, 4)] == (64, 128, 2, 0, 0, 0)    # 4 wide programs fill 4 SMs
    assert got[(1, 2, 2, 64, 300, 64, 1)] == (64, 64, 1, 0, 0, 0)      # Lq 64: as many programs, half dead
    assert got[(1, 2, 2, 130, 300, 64, 5)] == (64, 64, 1, 0, 0, 0)     # 4 < 5 SMs: 6 programs of 64 rows
    assert got[(1, 2, 2, 130, 300, 64, 132)] == (64, 64, 1, 1, 0, 1)   # split-KV: never wide; Hopper declines
    assert got[(1, 2, 2, 130, 300, 96, 1)] == (64, 64, 1, 0, 0, 0)     # no wide kernel at the 96 tile
    assert got[(1, 2, 2, 130, 300, 32, 1)] == (64, 128, 2, 0, 0, 0)
    assert got[(1, 2, 2, 130, 300, 128, 1)] == (64, 64, 1, 0, 0, 0)    # nor at 128 (kWideFwdHeadDims)
    assert got[(1, 8, 2, 1, 300, 64, 1)] == (64, 64, 1, 0, 1, 1)       # packed decode: never wide; Hopper declines
    assert got[(4, 16, 16, 1000, 1000, 64, 132)] == (64, 128, 2, 0, 0, 0)  # 4 x 16 x 8 = 512 programs: prefill
    assert got[(1, 2, 2, 130, 300, 64, 0)] == (64, 64, 1, 0, 0, 0)     # SMs unknown (0): never wide
