"""For invalid inputs FusedMultiheadAttention raises what nn.MultiheadAttention raises: the same
exception type and the same message, found by calling the stock module on the same input while
the test runs, batch_first both ways, in training and in eval() + no_grad (stock's fast path
has checks of its own), for the packed layer and the configurations that run the core op.
(``is_causal=True`` without an attn_mask, which stock refuses, is accepted: a documented
difference, tested in test_module_api.py.)"""
import contextlib

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention

E, H, L, S, N = 8, 2, 4, 5, 3


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _batched(batch_first, length, width=E):
    return _x(N, length, width) if batch_first else _x(length, N, width)


# name -> (query, key, value, keyword arguments) for a layer with batch_first = bf.
CASES = {
    "key 2-D under a 3-D query": lambda bf: (_batched(bf, L), _x(S, E), _batched(bf, S), {}),
    "value 2-D under a 3-D query": lambda bf: (_batched(bf, L), _batched(bf, S), _x(S, E), {}),
    "key 3-D under a 2-D query": lambda bf: (_x(L, E), _batched(bf, S), _x(S, E), {}),
    "query 4-D": lambda bf: (_x(1, N, L, E), _x(1, N, S, E), _x(1, N, S, E), {}),
    "query 1-D": lambda bf: (_x(E), _x(E), _x(E), {}),
    "padding mask 1-D under a 3-D query": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                                      {"key_padding_mask": torch.zeros(S, dtype=torch.bool)}),
    "padding mask 2-D under a 2-D query": lambda bf: (_x(L, E), _x(S, E), _x(S, E),
                                                      {"key_padding_mask": torch.zeros(1, S, dtype=torch.bool)}),
    "padding mask of the wrong length": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                                    {"key_padding_mask": torch.zeros(N, S + 1, dtype=torch.bool)}),
    "attn_mask 4-D": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                 {"attn_mask": torch.zeros(1, 1, L, S, dtype=torch.bool)}),
    "attn_mask 2-D of the wrong shape": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                                    {"attn_mask": torch.zeros(L, S + 1, dtype=torch.bool)}),
    "attn_mask 3-D of the wrong shape": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                                    {"attn_mask": torch.zeros(N * H + 1, L, S, dtype=torch.bool)}),
    "attn_mask [1, S] (the core op would broadcast it)": lambda bf: (
        _batched(bf, L), _batched(bf, S), _batched(bf, S), {"attn_mask": torch.zeros(1, S, dtype=torch.bool)}),
    "attn_mask [heads, L, S] (the core op would read it per head)": lambda bf: (
        _batched(bf, L), _batched(bf, S), _batched(bf, S), {"attn_mask": torch.zeros(H, L, S, dtype=torch.bool)}),
    "unbatched attn_mask 3-D of the wrong shape": lambda bf: (_x(L, E), _x(S, E), _x(S, E),
                                                              {"attn_mask": torch.zeros(H + 1, L, S, dtype=torch.bool)}),
    "integer attn_mask": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                     {"attn_mask": torch.zeros(L, S, dtype=torch.int64)}),
    "integer padding mask": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S),
                                        {"key_padding_mask": torch.zeros(N, S, dtype=torch.int64)}),
    "wrong embedding dim": lambda bf: (_batched(bf, L, E + 1), _batched(bf, S, E + 1), _batched(bf, S, E + 1), {}),
    "key and value of different lengths": lambda bf: (_batched(bf, L), _batched(bf, S), _batched(bf, S + 1), {}),
    "key and value of different batches": lambda bf: (_batched(bf, L), _batched(bf, S), _x(N + 1, S, E) if bf
                                                      else _x(S, N + 1, E), {}),
}

CONFIGS = {"packed": {}, "bias_kv": {"add_bias_kv": True}, "kvdim": {"kdim": 6, "vdim": 6}}


def _outcome(module, query, key, value, kwargs):
    try:
        module(query, key, value, **kwargs)
    except Exception as error:  # noqa: BLE001
        return type(error), str(error)
    return None


@pytest.mark.parametrize("mode", ["train", "eval+no_grad"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_invalid_inputs_raise_stocks_type_and_message(case, config, batch_first, mode):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, **CONFIGS[config])
    fused = FusedMultiheadAttention.from_module(ref)
    query, key, value, kwargs = CASES[case](batch_first)
    if config == "kvdim" and key.size(-1) == E:  # the kdim/vdim configuration's own widths
        key, value = key[..., :6], value[..., :6]
    for m in (ref, fused):
        m.train(mode == "train")
    with torch.no_grad() if mode != "train" else contextlib.nullcontext():
        stock = _outcome(ref, query, key, value, kwargs)
        ours = _outcome(fused, query, key, value, kwargs)
    if stock is None:
        pytest.skip("stock accepts this input in this configuration and mode")
    assert ours == stock


def test_the_corpus_is_invalid_for_stock():
    """Every case is refused by stock in the packed configuration, so each compares an error."""
    for name, make in CASES.items():
        ref = nn.MultiheadAttention(E, H)
        query, key, value, kwargs = make(False)
        assert _outcome(ref, query, key, value, kwargs) is not None, name
