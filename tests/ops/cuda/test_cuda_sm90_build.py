"""Offline gates of the Hopper (sm_90a) forward, csrc/kernels/cuda/hopper/ (no GPU needed): its
instantiations compile for sm_90a, spill no registers, and their SASS runs on Hopper's own
instructions -- HGMMA (wgmma), UTMALDG (TMA loads), USETMAXREG (register reallocation) and no
HMMA (the sm80 path's mma.sync) -- and follows its tile table's schedule (ping-pong: named
barriers; overlap: a wgmma wait that leaves one batch in flight); plus its host-side dispatch rules
and tile table (dispatch_policy.h, hopper/flash_fwd_sm90.h), compiled alone.

Needs nvcc, the CUTLASS/CuTe headers (`pip install --no-deps nvidia-cutlass==4.2.0.0`, which `make
install` runs, or ATTN_EXPORT_CUTLASS_INCLUDE) and cuobjdump with nvdisasm (the CUDA toolkit's, or the
wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm of the `test` extra); each test skips naming what
is missing. CI compiles the first of GATE_UNITS (~1.5 min on 2 shared cores), `make test-all` the
other two (exhaustive); ATTN_EXPORT_SM90_GATE=all compiles every one of the twenty-four.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_cuda_build import _nvcc, ptxas_spills

ROOT = pathlib.Path(__file__).resolve().parents[3]
INSTANTIATIONS = ROOT / "csrc" / "kernels" / "cuda" / "instantiations"
# The CI set, the most distinct code paths in three units: ping-pong with overlap at 128 (causal,
# 128-byte swizzle, 2 stages), a head dim added later with narrower rows (96: 64-byte swizzle, 3
# stages, not causal), and the serial schedule at 256 (80-key tiles, an extended wgmma shape, the
# fullest shared memory and registers); both element types.
GATE_UNITS = ("sm90_flash_fwd_hdim128_bf16_causal.cu", "sm90_flash_fwd_hdim96_fp16.cu", "sm90_flash_fwd_hdim256_fp16.cu")
KERNEL = "flash_fwd_sm90_kernel"


def _cutlass_include() -> str | None:
    given = os.environ.get("ATTN_EXPORT_CUTLASS_INCLUDE")
    if given:
        return given
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = pathlib.Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return str(include) if (include / "cute").is_dir() else None


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    toolkit = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"
    if toolkit.exists():
        return str(toolkit)
    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin/cuobjdump
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(pathlib.Path(folder).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    return None


# ---- SASS checks, as a pure function of cuobjdump's text.

REQUIRED_SASS = {
    "HGMMA": "wgmma (the tensor cores' Hopper instruction)",
    "UTMALDG": "TMA bulk tensor loads",
    "USETMAXREG": "setmaxnreg (warp-specialized register reallocation)",
}
FORBIDDEN_SASS = {
    "HMMA": "mma.sync, the sm80 path's tensor-core instruction",
    "LDL": "local-memory loads (a register array spilled or indexed at run time)",
    "STL": "local-memory stores",
}


def sass_functions(sass: str) -> dict[str, str]:
    """{mangled function name: its SASS} from `cuobjdump -sass`."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def sass_problems(body: str) -> list[str]:
    """What a Hopper kernel's SASS lacks or has that it must not."""
    opcodes = set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", body))
    problems = [f"no {op} ({why})" for op, why in REQUIRED_SASS.items() if op not in opcodes]
    problems += [f"{op} ({why})" for op, why in FORBIDDEN_SASS.items() if op in opcodes]
    return problems


# Named barriers 8 and 9 (the first two after CUTLASS's reserved ones) with 256 threads: the two
# consumer warpgroups' turns (hopper/flash_fwd_sm90_kernel.cuh, PingPong).
PING_PONG_SASS = [r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x8, 0x100", r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x9, 0x100",
                  r"BAR\.ARV 0x8, 0x100", r"BAR\.ARV 0x9, 0x100"]
# A wait for all but the last wgmma batch: Q K^T of tile n done while P V of tile n-1 runs.
OVERLAP_SASS = r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1"


def schedule_problems(body: str, ping_pong: bool, overlap: bool) -> list[str]:
    """Where a kernel's SASS departs from its tile table's schedule switches."""
    problems = []
    turns = [bool(re.search(pattern, body)) for pattern in PING_PONG_SASS]
    if ping_pong and not all(turns):
        problems.append("ping-pong on, but not every named-barrier sync/arrive of the turns is there")
    if not ping_pong and any(turns):
        problems.append("ping-pong off, but named-barrier turns are there")
    if overlap != bool(re.search(OVERLAP_SASS, body)):
        problems.append(f"overlap {'on' if overlap else 'off'}, but a wgmma wait leaving one batch in flight is "
                        f"{'missing' if overlap else 'there'}")
    return problems


def kernel_config(mangled: str) -> tuple[int, bool]:
    """(head dim, causal) of a flash_fwd_sm90_kernel<FwdTraits<Element, kHeadDim, kIsCausal>, ...>."""
    found = re.search(r"FwdTraitsIN7cutlass\d+\w+?_tELi(\d+)ELb([01])E", mangled)
    assert found, f"not a Hopper forward kernel name: {mangled}"
    return int(found.group(1)), found.group(2) == "1"


HOPPER_SNIPPET = """
        Function : _Z6kernelv
        /*0010*/                   USETMAXREG.TRY URZ, 0xf0 ;
        /*0020*/                   UTMALDG.4D [UR8], [UR4] ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0040*/              @!P0 SYNCS.PHASECHK.TRANS64 P0, [UR4], R3 ;
"""


def test_sass_check_accepts_hopper_code():
    assert sass_problems(sass_functions(HOPPER_SNIPPET)["_Z6kernelv"]) == []


def test_sass_check_fails_a_kernel_on_mma_sync():
    sm80_like = HOPPER_SNIPPET.replace("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", "HMMA.16816.F32.BF16 R4, R8, R12, R4")
    sm80_like = sm80_like.replace("UTMALDG.4D [UR8], [UR4]", "LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64]")
    problems = sass_problems(sass_functions(sm80_like)["_Z6kernelv"])
    assert any(p.startswith("no HGMMA") for p in problems)
    assert any(p.startswith("no UTMALDG") for p in problems)
    assert any(p.startswith("HMMA") for p in problems)


PING_PONG_SNIPPET = HOPPER_SNIPPET + """\
        /*0060*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x8, 0x100 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x9, 0x100 ;
        /*0080*/                   BAR.ARV 0x8, 0x100 ;
        /*0090*/                   BAR.ARV 0x9, 0x100 ;
        /*00a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
"""


def test_schedule_check_follows_both_switches():
    body = sass_functions(PING_PONG_SNIPPET)["_Z6kernelv"]
    assert schedule_problems(body, ping_pong=True, overlap=True) == []
    assert len(schedule_problems(body, ping_pong=False, overlap=False)) == 2
    one_turn_lost = body.replace("BAR.ARV 0x9, 0x100", "NOP")
    assert schedule_problems(one_turn_lost, ping_pong=True, overlap=True) == [
        "ping-pong on, but not every named-barrier sync/arrive of the turns is there"]
    serial = sass_functions(HOPPER_SNIPPET)["_Z6kernelv"]
    assert schedule_problems(serial, ping_pong=False, overlap=False) == []
    assert len(schedule_problems(serial, ping_pong=True, overlap=True)) == 2


def test_kernel_config_reads_the_mangled_traits():
    name = ("_ZN11attn_export4cuda4sm9021flash_fwd_sm90_kernelINS1_9FwdTraitsIN7cutlass10bfloat16_tELi192ELb1EEE"
            "13__nv_bfloat16Lb1EEEvNS1_15FwdKernelParamsIT_EE")
    assert kernel_config(name) == (192, True)
    assert kernel_config(name.replace("bfloat16_tELi192ELb1E", "half_tELi32ELb0E").replace("10bfloat16", "6half")) \
        == (32, False)


def test_sass_check_fails_local_memory():
    spilled = HOPPER_SNIPPET + "        /*0050*/                   STL.64 [R1+0x8], R4 ;\n"
    assert sass_problems(sass_functions(spilled)["_Z6kernelv"]) == ["STL (local-memory stores)"]


# ---- Host-side rules: the policy and the launcher's operand checks, compiled alone.

# What both host programs share: the headers, a buffer for the operands' pointers, the policy's answer
# for every (compute capability major, preview switch, sm90 switch), and CASE: `supports` of base()
# after one edit, as one JSON entry.
HOST_PRELUDE = r"""
#include <cstdio>
#include <initializer_list>
#include "kernels/cuda/dispatch_policy.h"
#include "kernels/cuda/hopper/flash_bwd_sm90.h"
#include "kernels/cuda/hopper/flash_fwd_sm90.h"
using namespace attn_export;
using namespace attn_export::cuda;

alignas(16) static unsigned char buffer[1 << 16];

void print_allowed(bool (*allowed)(int, bool, bool)) {
  const char* sep = "";
  for (int major : {8, 9, 10}) for (int preview : {0, 1}) for (int sw : {0, 1}) {
    std::printf("%s[%d, %d, %d, %d]", sep, major, preview, sw, allowed(major, preview, sw));
    sep = ", ";
  }
}

// A supported bf16 head-dim-128 problem: 2 x 4 heads on 2 key/value heads, 100 queries, 300 keys.
AttentionParams forward_base() {
  AttentionParams p;
  p.batch = 2; p.num_heads = 4; p.num_heads_k = 2; p.seqlen_q = 100; p.seqlen_k = 300;
  p.head_dim = p.head_dim_v = 128; p.dtype = DataType::kBFloat16;
  p.q = p.k = p.v = buffer; p.out = buffer; p.lse = buffer;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.out_row_stride = 128;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.out_head_stride = 128 * 300;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 4 * 128 * 300;
  return p;
}

#define CASE(name, edit, supports) \
  do { p = base(); edit; std::printf("%s\"%s\": %d", sep, name, supports(p)); sep = ", "; } while (0)
"""

def _cases(cases, supports: str) -> str:
    """C++ lines printing `supports` after each (name, edit) of base(): HOST_PRELUDE's CASE."""
    return "".join(f'  CASE("{name}", {edit}, {supports});\n' for name, edit in cases)


def _head_dims(*dims: int) -> list[tuple[str, str]]:
    return [(f"d{d}", f"p.head_dim = p.head_dim_v = {d}") for d in dims]


# The forward's operand cases (test_hopper_dispatch_rules): base() is a supported bf16 head-dim-128 problem.
DTYPE_CASES = [("base", ""), ("fp16", "p.dtype = DataType::kFloat16"), ("fp32", "p.dtype = DataType::kFloat32")]
SUPPORTS_CASES = [
    *DTYPE_CASES, *_head_dims(64, 256, 96, 80), ("dv_differs", "p.head_dim_v = 64"), ("k_misaligned", "p.k = buffer + 8"),
    ("v_row_stride_132", "p.v_row_stride = 132"), ("q_head_stride_0", "p.q_head_stride = 0"),
    ("out_row_stride_130", "p.out_row_stride = 130"), ("no_keys", "p.seqlen_k = 0"),
    ("alibi", "p.alibi_slopes = reinterpret_cast<const float*>(buffer)"),  # declined: the sm80 forward adds them
]

POLICY_PROGRAM = HOST_PRELUDE + r"""
AttentionParams base() { return forward_base(); }

int main() {
  std::printf("{\"allowed\": [");
  print_allowed(policy::hopper_forward_allowed);
  std::printf("], \"supports\": {");
  AttentionParams p;
  const char* sep = "";
""" + _cases(SUPPORTS_CASES, "sm90::supports") + r"""
  std::printf("}, \"tiles\": [");
  sep = "";
  for (int d : sm90::kHeadDims) for (bool causal : {false, true}) {
    const sm90::FwdTile t = sm90::fwd_tile(d, causal);
    std::printf("%s[%d, %d, %d, %d, %d, %d]", sep, d, causal, t.block_n, t.stages, t.ping_pong, t.overlap);
    sep = ", ";
  }
  std::printf("]}\n");
}
"""


def _host_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _cuda_include() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"


def _host_rules(tmp_path: pathlib.Path, program: str = POLICY_PROGRAM) -> dict:
    """A host-rules program's answers (POLICY_PROGRAM's: the dispatch rules and the tile table),
    compiled with g++ alone and run."""
    source = tmp_path / "policy.cpp"
    source.write_text(program)
    binary = tmp_path / "policy"
    subprocess.run([_host_compiler(), "-std=c++17", "-Wall", "-Werror", "-I", str(ROOT / "csrc"), "-I",
                    str(_cuda_include()), str(source), "-o", str(binary)], check=True, capture_output=True, text=True)
    return json.loads(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)


def _tile_table(tmp_path: pathlib.Path) -> dict[tuple[int, bool], dict]:
    """fwd_tile() of every compiled head dim, causal and not."""
    return {(d, bool(c)): {"block_n": n, "stages": st, "ping_pong": bool(pp), "overlap": bool(ov)}
            for d, c, n, st, pp, ov in _host_rules(tmp_path)["tiles"]}


_HOST_TOOLS = _host_compiler() is not None and (_cuda_include() / "cuda_runtime_api.h").exists()


@pytest.mark.skipif(not _HOST_TOOLS, reason="needs a C++ compiler and the CUDA runtime headers")
def test_hopper_dispatch_rules(tmp_path):
    result = _host_rules(tmp_path)
    # Only a compute-capability-9 device, and only with both switches.
    assert [row[:3] for row in result["allowed"] if row[3]] == [[9, 1, 1]]
    assert result["supports"] == {
        "base": 1, "fp16": 1, "fp32": 0, "d64": 1, "d256": 1, "d96": 1, "d80": 0, "dv_differs": 0, "k_misaligned": 0,
        "v_row_stride_132": 0, "q_head_stride_0": 0, "out_row_stride_130": 0, "no_keys": 0, "alibi": 0,
    }


@pytest.mark.skipif(not _HOST_TOOLS, reason="needs a C++ compiler and the CUDA runtime headers")
def test_tile_table_fits_the_chip(tmp_path):
    tiles = _tile_table(tmp_path)
    # every head dim of the sm80 tensor-core path (kernel_traits.h kFlashHeadDims), causal and not
    flash_dims = re.search(r"kFlashHeadDims\[\]\s*=\s*\{([^}]*)\}",
                           (ROOT / "csrc" / "kernels" / "cuda" / "kernel_traits.h").read_text()).group(1)
    assert {d for d, _ in tiles} == {int(d) for d in flash_dims.split(",")}
    for (d, causal), t in tiles.items():
        # Q (128 rows) and the K/V ring of 2-byte elements in sm_90's 227 KB per block; a ring of at
        # least 2 (the overlapped schedule holds V of tile n-1 while it waits for K of tile n)
        smem = 2 * d * (128 + 2 * t["stages"] * t["block_n"])
        assert smem <= 227 * 1024 and t["stages"] >= 2, (d, causal, t)
        assert t["block_n"] % 16 == 0 and t["block_n"] <= 256, (d, causal, t)  # wgmma N, P V's K steps
        # FA3's rule: ping-pong pays where the softmax is the larger share, head dims <= 128 (a GPU
        # A/B run may flip it locally; the committed table follows the rule until numbers say otherwise)
        assert t["ping_pong"] == (d <= 128), (d, causal, t)


# Decode-shaped work stays on the sm80 forward (forward_plan.h hopper_forward_declines): where
# its plan splits the keys (given the workspace) or packs grouped heads of queries shorter than one
# of its tiles. Each case: [batch, heads, kv heads, Lq, Lk, head dim, causal, SMs].
DECODE_PROGRAM = r"""
#include <cstdio>
#include <string_view>
#include "kernels/cuda/forward_plan.h"
using namespace attn_export;
using namespace attn_export::cuda;

struct Case { const char* name; long long b, h, hkv, lq, lk, d; bool causal; int sms; };

int main() {
  const Case cases[] = {
    {"decode_gqa_32k", 1, 32, 8, 1, 32768, 128, false, 132},
    {"decode_mha_32k", 1, 32, 32, 1, 32768, 128, false, 132},
    {"decode_mha_b16_4k", 16, 32, 32, 1, 4096, 128, false, 132},
    {"decode_gqa_b16_4k", 16, 32, 8, 1, 4096, 128, true, 132},
    {"speculative_gqa_lq5", 4, 32, 8, 5, 8192, 64, true, 132},
    {"prefill_4k", 1, 32, 8, 4096, 4096, 128, true, 132},
    {"prefill_gqa_lq97_b16", 16, 8, 1, 97, 1025, 128, true, 132},
    {"prefill_gqa_lq97_b2", 2, 8, 1, 97, 1025, 128, true, 132},
    {"small_prefill_1025", 2, 3, 3, 1025, 1025, 128, false, 132},
    {"small_prefill_filled", 8, 3, 3, 1025, 1025, 128, false, 132},
    {"short_keys_d256", 2, 3, 3, 97, 96, 256, false, 132},
    {"decode_top_left_causal", 1, 32, 32, 1, 32768, 128, true, 132},
  };
  std::printf("{");
  const char* sep = "";
  for (const Case& c : cases) {
    AttentionParams p;
    p.batch = c.b; p.num_heads = c.h; p.num_heads_k = c.hkv; p.seqlen_q = c.lq; p.seqlen_k = c.lk;
    p.head_dim = p.head_dim_v = c.d; p.dtype = DataType::kBFloat16; p.is_causal = c.causal;
    p.causal_alignment = kCausalBottomRight;
    if (std::string_view(c.name) == "decode_top_left_causal") p.causal_alignment = kCausalTopLeft;
    const FlashFwdPlan plan = flash_fwd_plan(p, flash_tile_dim(p, true), c.sms, true);
    const size_t ws = plan.workspace_bytes();
    // [packs, chunks, workspace bytes, declines with that workspace, without any, without the preview]
    std::printf("%s\"%s\": [%d, %d, %zu, %d, %d, %d]", sep, c.name, plan.pack_gqa, plan.split.num_splits, ws,
                hopper_forward_declines(p, c.sms, ws, true), hopper_forward_declines(p, c.sms, 0, true),
                hopper_forward_declines(p, c.sms, ws, false));
    sep = ", ";
  }
  std::printf("}\n");
}
"""


@pytest.mark.skipif(not _HOST_TOOLS, reason="needs a C++ compiler and the CUDA runtime headers")
def test_hopper_forward_leaves_decode_to_the_sm80_path(tmp_path):
    got = {name: dict(zip(("packs", "chunks", "workspace", "declines", "declines_no_ws", "declines_no_preview"), row))
           for name, row in _host_rules(tmp_path, DECODE_PROGRAM).items()}
    for name, row in got.items():
        # the rule reads the sm80 plan: declined exactly where that plan splits (with its workspace)
        # or packs a short query; never without the preview (neither feature runs then)
        assert row["declines"] == (row["chunks"] > 1 or bool(row["declines_no_ws"])), (name, row)
        assert (row["workspace"] > 0) == (row["chunks"] > 1), (name, row)
        assert row["declines_no_preview"] == 0, (name, row)
    # Llama-style decode (8 query heads a key/value head, one query, 32k cache, one sequence):
    # packed and split on sm80; packed even without a workspace, so declined either way.
    assert got["decode_gqa_32k"] == {**got["decode_gqa_32k"], "packs": 1, "declines": 1, "declines_no_ws": 1}
    assert got["decode_gqa_32k"]["chunks"] > 1
    # multi-head decode of one sequence: split with a workspace (the binding's, the plugin's), else Hopper
    assert got["decode_mha_32k"]["chunks"] > 1 and got["decode_mha_32k"]["declines"] == 1
    assert got["decode_mha_32k"]["declines_no_ws"] == 0
    # 16 x 32 heads fill 132 SMs: no split; multi-head: the Hopper forward; grouped: packed, sm80
    assert got["decode_mha_b16_4k"] == {**got["decode_mha_b16_4k"], "chunks": 1, "declines": 0}
    assert got["decode_gqa_b16_4k"] == {**got["decode_gqa_b16_4k"], "packs": 1, "declines": 1}
    assert got["speculative_gqa_lq5"]["packs"] == 1 and got["speculative_gqa_lq5"]["declines_no_ws"] == 1
    # prefill stays on the Hopper forward, including grouped heads that sm80 would pack (97 rows)
    assert got["prefill_4k"] == {**got["prefill_4k"], "packs": 0, "chunks": 1, "declines": 0}
    assert got["prefill_gqa_lq97_b16"] == {**got["prefill_gqa_lq97_b16"], "packs": 1, "chunks": 1, "declines": 0}
    # ... unless its tiles cannot fill the SMs and sm80 splits it (2 x 13 packed tiles)
    assert got["prefill_gqa_lq97_b2"]["chunks"] > 1 and got["prefill_gqa_lq97_b2"]["declines"] == 1
    assert got["small_prefill_1025"]["chunks"] > 1 and got["small_prefill_1025"]["declines"] == 1
    assert got["small_prefill_filled"] == {**got["small_prefill_filled"], "chunks": 1, "declines": 0}
    # fewer than 2 x 2 key tiles: nothing to split
    assert got["short_keys_d256"] == {**got["short_keys_d256"], "chunks": 1, "declines": 0}
    # top-left causal decode sees one key: nothing to split either
    assert got["decode_top_left_causal"] == {**got["decode_top_left_causal"], "chunks": 1, "declines": 0}


# ---- The compile gate.

def _gate_units(pattern: str, names: tuple[str, ...]) -> list[pathlib.Path]:
    """The instantiations a gate compiles: `names` (CI), or every one matching `pattern` with
    ATTN_EXPORT_SM90_GATE=all."""
    if os.environ.get("ATTN_EXPORT_SM90_GATE") == "all":
        return sorted(INSTANTIATIONS.glob(pattern))
    return [INSTANTIATIONS / name for name in names]


def _compile(unit: pathlib.Path, out_dir: pathlib.Path, include: str,
             flags: tuple[str, ...]) -> tuple[str, pathlib.Path]:
    obj = out_dir / f"{unit.stem}.o"
    result = subprocess.run(
        [_nvcc(), "-c", "-O3", *flags, "--expt-relaxed-constexpr", "-Xptxas", "-v",
         "-gencode=arch=compute_90a,code=sm_90a", "-DATTN_EXPORT_WITH_SM90=1",
         "-I", str(ROOT / "csrc"), "-I", include, str(unit), "-o", str(obj)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{unit.name}:\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr, obj


def _compile_and_disassemble(units: list[pathlib.Path], out_dir: pathlib.Path, kernel: str,
                             flags: tuple[str, ...]) -> tuple[list[str], dict, dict[str, str]]:
    """Compiles `units` in parallel: each one's ptxas log, ptxas's spill counts of every kernel, and
    the SASS of each `kernel` function."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        built = list(pool.map(lambda unit: _compile(unit, out_dir, _cutlass_include(), flags), units))
    spills, kernels = {}, {}
    # cuobjdump runs nvdisasm, which the wheels install beside it
    env = dict(os.environ, PATH=f"{pathlib.Path(_cuobjdump()).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for log, obj in built:
        assert "C7508" not in log, f"ptxas ignored setmaxnreg in {obj.name}:\n{log[-2000:]}"
        spills.update(ptxas_spills(log))
        sass = subprocess.run([_cuobjdump(), "-sass", str(obj)], check=True, capture_output=True, text=True,
                              env=env).stdout
        kernels.update({name: body for name, body in sass_functions(sass).items() if kernel in name})
    assert len(kernels) == len(units), f"expected one {kernel} per file, found {sorted(kernels)}"
    return [log for log, _ in built], spills, kernels


def sm90_gate(units, rest_id: str):
    """The gate's marks (slow; the tools it needs) and its two cases: the first unit in CI ("ci"),
    the others in `make test-all` (exhaustive). ATTN_EXPORT_SM90_GATE=all makes the ci case build
    every instantiation (_gate_units), so the other case is skipped then."""
    skip_rest = os.environ.get("ATTN_EXPORT_SM90_GATE") == "all"
    marks = [
        pytest.mark.slow,
        pytest.mark.skipif(_nvcc() is None, reason="needs nvcc"),
        pytest.mark.skipif(_cutlass_include() is None, reason="needs the CUTLASS headers: pip install --no-deps "
                           "nvidia-cutlass==4.2.0.0 (or ATTN_EXPORT_CUTLASS_INCLUDE)"),
        pytest.mark.skipif(_cuobjdump() is None,
                           reason="needs cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (CUDA 13)"),
        pytest.mark.parametrize("units", [
            pytest.param(units[:1], id="ci"),
            pytest.param(units[1:], id=rest_id, marks=[pytest.mark.exhaustive, *([pytest.mark.skip(
                reason="ATTN_EXPORT_SM90_GATE=all: the ci case compiles every instantiation")] if skip_rest else [])]),
        ]),
    ]

    def decorate(test):
        for mark in reversed(marks):
            test = mark(test)
        return test
    return decorate


@sm90_gate(GATE_UNITS, "other-schedules")
@pytest.mark.skipif(not _HOST_TOOLS, reason="needs a C++ compiler (the tile table is read from a host program)")
def test_sm90_forward_compiles_to_hopper_code(tmp_path, units):
    units = _gate_units("sm90_flash_fwd_*.cu", units)
    start = time.monotonic()
    logs, spills, kernels = _compile_and_disassemble(units, tmp_path, KERNEL, ("-std=c++17",))
    for log, unit in zip(logs, units):
        # (C7510 and its kin: a wgmma batch left to wait across a call, or too few registers for it)
        assert "instructions are serialized" not in log, f"ptxas serialized the wgmma in {unit.name}:\n{log[-2000:]}"
    assert {arch for _, arch in spills} == {"sm_90a"}
    spilling = [f"{name}: {stores} B stores, {loads} B loads" for (name, _), (stores, loads) in spills.items()
                if KERNEL in name and (stores or loads)]
    assert not spilling, "the sm_90a forward spills registers:\n" + "\n".join(spilling)
    tiles = _tile_table(tmp_path)
    failing = {}
    for name, body in kernels.items():
        tile = tiles[kernel_config(name)]
        problems = sass_problems(body) + schedule_problems(body, tile["ping_pong"], tile["overlap"])
        if problems:
            failing[name] = problems
    assert not failing, "SASS of the sm_90a forward:\n" + json.dumps(failing, indent=1)
    print(f"{len(units)} sm_90a instantiations compiled and checked in {time.monotonic() - start:.0f} s")


# ---- The Hopper backward (hopper/flash_bwd_sm90*): host-side rules and its compile gate.

# The backward's operand cases (test_hopper_backward_dispatch_rules).
BWD_SUPPORTS_CASES = [
    *DTYPE_CASES, *_head_dims(64, 256, 96, 32, 80, 192), ("dv_differs", "p.head_dim_v = 64"),
    ("dout_misaligned", "p.grad_out = buffer + 8"), ("dout_row_stride_132", "p.grad_out_row_stride = 132"),
    ("dk_row_stride_odd", "p.grad_k_row_stride = 127"), ("grad_weights", "p.grad_weights = buffer"),
    ("heads_not_divisible", "p.num_heads_k = 3"), ("no_queries", "p.seqlen_q = 0"),
    ("alibi", "p.alibi_slopes = reinterpret_cast<const float*>(buffer)"),  # declined: the sm80 backward adds them
]

BWD_POLICY_PROGRAM = HOST_PRELUDE + r"""
// forward_base() and its gradients, laid out as the forward's operands.
AttentionBackwardParams base() {
  AttentionBackwardParams p;
  static_cast<AttentionParams&>(p) = forward_base();
  p.grad_out = p.grad_q = p.grad_k = p.grad_v = buffer;
  p.grad_out_row_stride = p.grad_q_row_stride = p.grad_k_row_stride = p.grad_v_row_stride = 128;
  p.grad_out_head_stride = p.grad_q_head_stride = p.grad_k_head_stride = p.grad_v_head_stride = 128 * 300;
  p.grad_out_batch_stride = p.grad_q_batch_stride = p.grad_k_batch_stride = p.grad_v_batch_stride = 4 * 128 * 300;
  return p;
}

int main() {
  std::printf("{\"bits\": [");
  const char* sep = "";
  for (unsigned bit : {policy::kFlashHeadDim, policy::kGroupedQuery, policy::kBottomRight, policy::kSplitKv,
                       policy::kBwdColumnSplit, policy::kKeyTileSkip, policy::kWindow, policy::kHopperForward,
                       policy::kPackGqa, policy::kHopperBackward}) {
    std::printf("%s%u", sep, bit);
    sep = ", ";
  }
  std::printf("], \"backward_bit\": %u, \"allowed\": [", static_cast<unsigned>(policy::kHopperBackward));
  print_allowed(policy::hopper_backward_allowed);
  std::printf("], \"supports\": {");
  AttentionBackwardParams p;
  sep = "";
""" + _cases(BWD_SUPPORTS_CASES, "sm90::supports_backward") + r"""
  p = base();
  const sm90::BwdWorkspace w = sm90::bwd_workspace(p);
  p.deterministic = true;
  const sm90::BwdWorkspace wd = sm90::bwd_workspace(p);
  std::printf("}, \"workspace\": [%zu, %zu, %zu, %zu], \"deterministic_order\": %zu}\n", w.lse2, w.delta, w.dq,
              w.order, wd.order);
}
"""


@pytest.mark.skipif(not _HOST_TOOLS, reason="needs a C++ compiler and the CUDA runtime headers")
def test_hopper_backward_dispatch_rules(tmp_path):
    result = _host_rules(tmp_path, BWD_POLICY_PROGRAM)
    # Its own bit, one bit, colliding with no other preview feature.
    bits = result["bits"]
    assert result["backward_bit"] == 1 << 9 and len(set(bits)) == len(bits) and all(b & (b - 1) == 0 for b in bits)
    # Only a compute-capability-9 device, and only with both switches (the forward's gate).
    assert [row[:3] for row in result["allowed"] if row[3]] == [[9, 1, 1]]
    assert result["supports"] == {
        "base": 1, "fp16": 1, "fp32": 0, "d64": 1, "d256": 1, "d96": 1, "d32": 1, "d80": 0, "d192": 1,
        "dv_differs": 0, "dout_misaligned": 0,
        "dout_row_stride_132": 0, "dk_row_stride_odd": 0, "grad_weights": 0, "heads_not_divisible": 0,
        "no_queries": 0, "alibi": 0,
    }
    # d128 tiles 64 query rows: 100 rows pad to 128, over batch 2 x heads 4; sizes 256-byte aligned.
    rows = 2 * 4 * 128
    assert result["workspace"] == [rows * 4, rows * 4, rows * 128 * 4, 0]
    assert result["deterministic_order"] == 256  # one int per (batch, head, query block), 16 ints rounded up


def test_backward_gpu_tests_cover_every_tile_row():
    """test_cuda_sm90_bwd.py runs every head dim of kBwdTiles (sm90_gpu.py's HEAD_DIMS), the table
    that the generator and the dispatch walk: a row added without its GPU tests fails here."""
    script = ROOT / "csrc" / "kernels" / "cuda" / "generate_kernels.py"
    spec = importlib.util.spec_from_file_location("generate_kernels", script)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    here = pathlib.Path(__file__).resolve().parent
    assert re.search(r"^from sm90_gpu import .*\bHEAD_DIMS\b", (here / "test_cuda_sm90_bwd.py").read_text(), flags=re.M)
    found = re.search(r"^HEAD_DIMS = \[([^\]]*)\]", (here / "sm90_gpu.py").read_text(), flags=re.M)
    assert found, "sm90_gpu.py declares no HEAD_DIMS = [...]"
    head_dims = [int(d) for d in found.group(1).split(",")]
    assert head_dims == generate._sm90_bwd_head_dims() == [32, 64, 96, 128, 192, 256]


# The CI set: one unit per consumer. d128 bf16 causal -- the tightest register budget of `consume`
# (dK and dV take 128 of a consumer thread's 240 registers at d128) and the causal diagonal's mask
# code on top; the fp16, d32/d64/d96 and non-causal units share every line of it (d96 differs in
# K's shared-memory atom, 32-byte, and dQ's wgmma width, 48). d256 bf16 causal -- the other consumer
# (kSwapdKV: consume_swapped, dK^T/dV^T from shared memory, one P/dS buffer, dQ in two chunks),
# which d192 shares. ATTN_EXPORT_SM90_GATE=all compiles all twenty-four.
BWD_GATE_UNITS = ("sm90_flash_bwd_hdim128_bf16_causal.cu", "sm90_flash_bwd_hdim256_bf16_causal.cu")
BWD_KERNEL = "flash_bwd_sm90_kernel"
# The extension's own nvcc flags (setup.py, torch's CUDAExtension): C++20 and no implicit half conversions.
TORCH_NVCC_DEFINES = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")


@sm90_gate(BWD_GATE_UNITS, "widest")  # CI: the first unit (ping-pong's head dim); test-all the widest, 256
def test_sm90_backward_compiles_to_hopper_code(tmp_path, units):
    units = _gate_units("sm90_flash_bwd_*.cu", units)
    start = time.monotonic()
    _, spills, kernels = _compile_and_disassemble(units, tmp_path, BWD_KERNEL, ("-std=c++20", *TORCH_NVCC_DEFINES))
    # Every kernel of the units (the prepare and dQ-convert kernels too) spills nothing.
    spilling = [f"{name}: {stores} B stores, {loads} B loads" for (name, _), (stores, loads) in spills.items()
                if stores or loads]
    assert not spilling, "the sm_90a backward spills registers:\n" + "\n".join(spilling)
    failing = {name: problems for name, body in kernels.items() if (problems := sass_problems(body))}
    assert not failing, "SASS of the sm_90a backward:\n" + json.dumps(failing, indent=1)
    print(f"{len(units)} sm_90a backward instantiations compiled and checked in {time.monotonic() - start:.0f} s")
