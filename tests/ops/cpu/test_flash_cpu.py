"""The flash-style CPU core (csrc/kernels/cpu/flash_cpu.cpp) where its structure could go wrong:
key blocks that the masks hide entirely (skipped), causality across query and key blocks with
Lq != Lk, dQ summed over key blocks that different threads own, float64 gradcheck across
blocks (every instruction set the machine has: tests/ops/cpu/test_instruction_sets.py). References: the float64 definition
(helpers.reference_attention) and torch.autograd.gradcheck."""

import pytest
import torch

import attn_export
from helpers import check_core, padding_mask

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

f32, f64 = torch.float32, torch.float64
# The kernel's blocks: 64 query rows, 128 keys.
QUERY_BLOCK, KEY_BLOCK = 64, 128


def hidden_blocks_masks(B, H, Lq, Lk):
    """Bool masks that hide whole blocks: keys [128, 256) padded for every batch element, the
    second query block's view of keys [256, 384) masked, and query row 3 sees nothing."""
    kpm = padding_mask(B, Lk)
    kpm[:, KEY_BLOCK:2 * KEY_BLOCK] = True
    am = torch.rand(Lq, Lk) < 0.3
    am[QUERY_BLOCK:2 * QUERY_BLOCK, 2 * KEY_BLOCK:3 * KEY_BLOCK] = True
    am[3] = True
    return {"attn_mask": am, "key_padding_mask": kpm}


def test_key_blocks_hidden_by_bool_masks_are_skipped_exactly():
    check_core("cpu", f32, 2, 2, 150, 420, 16, hidden_blocks_masks(2, 2, 150, 420))


# 97 queries: the second query block's last register tile (33 rows: a tile of 1 or 3 rows
# after whole tiles of 4, 6 or 8) ends on row 96, the first column of a key panel on every
# instruction set; the blocks on the diagonal skip the tiles that causality hides, and a tile
# that sees just its panel's first key must still be computed.
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(150, 400), (400, 150), (64, 129), (97, 200)])
def test_causal_across_blocks_with_lq_ne_lk(seqlen_q, seqlen_k):
    # Head dims 40 and 24: not multiples of the packed operands' padding.
    check_core("cpu", f32, 1, 2, seqlen_q, seqlen_k, 40, {"is_causal": True}, Dv=24)


@pytest.mark.parametrize("heads", [1, 3])
def test_dq_summed_over_key_blocks_owned_by_different_threads(heads):
    # 6 key blocks per head and 2 threads: with 1 head both threads' chunks cover it; with 3,
    # the middle head is split between them.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_core("cpu", f32, 1, heads, 200, 700, 8, {"key_padding_mask": padding_mask(1, 700)})
    finally:
        torch.set_num_threads(threads)


def test_softcap_across_blocks():
    check_core("cpu", f32, 2, 1, 130, 300, 16, hidden_blocks_masks(2, 1, 130, 300), softcap=2.0)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(70, 3 * KEY_BLOCK + 5, False), (140, 130, True)])
def test_gradcheck_across_blocks_float64(seqlen_q, seqlen_k, causal):
    masks = {"is_causal": True} if causal else hidden_blocks_masks(1, 1, seqlen_q, seqlen_k)
    q = torch.randn(1, 1, seqlen_q, 2, dtype=f64, requires_grad=True)
    k = torch.randn(1, 1, seqlen_k, 2, dtype=f64, requires_grad=True)
    v = torch.randn(1, 1, seqlen_k, 2, dtype=f64, requires_grad=True)
    # fast_mode: one random projection of the Jacobian instead of every column (seconds, not a minute).
    assert torch.autograd.gradcheck(lambda q, k, v: attn_export.attention(q, k, v, **masks), (q, k, v), fast_mode=True)


def _softmax_of_scores(path, x):
    """softmax(x) over the last dim of x [B, Lk] as the kernels compute it: one query of head
    dim 1 (q = 1, scale 1, so the scores are x exactly). "flash": the core, with V = I so that
    its output is the probabilities; "rows": the layer's row kernels, which return them."""
    B, Lk = x.shape
    if path == "flash":
        q = torch.ones(B, 1, 1, 1)
        v = torch.eye(Lk).expand(B, 1, Lk, Lk)
        return attn_export.attention(q, x.view(B, 1, Lk, 1), v, scale=1.0).reshape(B, Lk)
    _, weights = attn_export.multi_head_attention(
        torch.ones(B, 1, 1), x.unsqueeze(-1), torch.zeros(B, Lk, 1), 1, torch.ones(3, 1), None,
        torch.ones(1, 1), None, need_weights=True, batch_first=True)
    return weights.reshape(B, Lk)


@pytest.mark.parametrize("path", ["flash", "rows"])
@pytest.mark.parametrize("Lk", [128, 131])  # 131: the scalar tails of the row kernels
def test_softmax_exponentials_within_a_few_ulp_of_float64(path, Lk):
    # The exponentials are the kernels' own polynomial (csrc/kernels/cpu/exp.h), not libm's:
    # every probability down to e^-86 must keep float's precision, relative to float64.
    # Measured 2.2-2.8e-7 on both paths, with this polynomial and with Cephes' before it (the
    # rounding of the sum and of the division dominate); with the cubic coefficient off by 1e-4
    # it read 6.5e-6 on both paths (checked by hand).
    torch.manual_seed(0)
    x = torch.rand(64, Lk) * -86.0
    x[:, 0] = 0.0
    with torch.no_grad():
        p = _softmax_of_scores(path, x).double()
    ref = torch.softmax(x.double(), dim=-1)
    rel = ((p - ref).abs() / ref).max().item()
    assert rel < 4e-7, f"{path}: max relative error {rel:.3g}"
