"""FusedMultiheadAttention's float32 error against nn.MultiheadAttention run in float64, beside
stock float32's, per tensor (output, weights, every gradient), relative to two scales: the
tensor's own largest magnitude, and its kind's (the input gradients together, the parameter
gradients together). Run: .venv/bin/python scripts/precision.py"""
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_property as fuzz  # noqa: E402  (the operator fuzz's configurations and runner)
from attn_export import FusedMultiheadAttention  # noqa: E402
from helpers import make_pair  # noqa: E402


def errors(c):
    gen = torch.Generator().manual_seed(c["seed"])
    q, k, v, masks = fuzz._inputs(c, gen)
    ref, _ = make_pair(c["embed"], c["heads"], bias=c["bias"], batch_first=c["batch_first"], dtype=torch.float64)
    B, Lq, Lk, E, H = c["batch"], c["seqlen_q"], c["seqlen_k"], c["embed"], c["heads"]
    grad_out = fuzz._layout(torch.randn(B, Lq, E, generator=gen, dtype=torch.float64), c)
    grad_w = torch.randn((B, Lq, Lk) if c["average"] else (B, H, Lq, Lk), generator=gen, dtype=torch.float64)
    f32 = {n: (m.float() if m.is_floating_point() else m) for n, m in masks.items()}
    fused = FusedMultiheadAttention(E, H, bias=c["bias"], batch_first=c["batch_first"])
    fused.load_state_dict(ref.state_dict())
    runs = {}
    for name, module, dtype, m in [("exact", ref, torch.float64, masks), ("stock", copy.deepcopy(ref).float(),
                                   torch.float32, f32), ("fused", fused, torch.float32, f32)]:
        out, w, grads = fuzz._run(module, *fuzz._leaves(q, k, v, c, dtype), c, m, grad_out, grad_w)
        runs[name] = {"output": out, "weights": w, **grads}
    inputs = ("grad query", "grad key", "grad value")
    kind = {x: max(float(t.abs().max()) for n, t in runs["exact"].items() if n.startswith("grad") and (n in inputs) == x)
            for x in (True, False)}
    print(fuzz._describe(c))
    print(f"{'tensor':22} {'own scale':>10} | {'fused/own':>10} {'stock/own':>10} | {'fused/kind':>10} {'stock/kind':>10}")
    for n, e in runs["exact"].items():
        if e is None:
            continue
        own = float(e.detach().abs().max())
        scale = kind[n in inputs] if n.startswith("grad") else own
        err = {s: float((runs[s][n].double() - e).abs().max()) for s in ("fused", "stock")}
        print(f"{n:22} {own:10.3e} | {err['fused'] / own:10.2e} {err['stock'] / own:10.2e} | "
              f"{err['fused'] / scale:10.2e} {err['stock'] / scale:10.2e}")
    print()


if __name__ == "__main__":
    torch.set_num_threads(1)
    base = dict(seed=0, heads=4, embed=64, batch=8, unbatched=False, seqlen_q=16, seqlen_k=16, kind="self",
                batch_first=True, bias=True, attn_mask=None, padding="bool", causal=False, fully_masked=False,
                need_weights=True, average=True, dtype=torch.float32, add_bias_kv=False, strided=False,
                zero_batch=False)
    errors(base)
    errors(fuzz._config(18092))  # a bias gradient that nearly cancels (summed over 13 tokens)
