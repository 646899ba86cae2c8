"""FusedMultiheadAttention: a drop-in torch.nn.MultiheadAttention backed by one fused operator."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn



_MULTI_HEAD_ATTENTION = torch.ops.attn_export.multi_head_attention.default


class UnsupportedAttentionError(ValueError):
    """An nn.MultiheadAttention configuration the fused operator does not implement."""


def _keep_native_fast_paths_off(module, args):
    """A forward pre-hook that does nothing. Its presence is the point: torch.nn's
    TransformerEncoderLayer skips its native inference fast path (which calls
    ``torch._transformer_encoder_layer_fwd`` with the attention weights directly, bypassing the
    ``self_attn`` submodule) when any of its submodules has a forward hook, so a fused layer
    placed inside one is really called, in eval mode too. Per instance; no global switch.

    It sits on ``out_proj``, whose forward is never called (the fused operator only reads its
    parameters): a hook on the fused module itself would send every call through nn.Module's
    slower hook-handling path, a few microseconds that show on small inputs."""
    return None


def _relayout_column_major(weight: nn.Parameter) -> None:
    """Stores a projection weight column-major, in place: the same Parameter object, shape and
    values, with ``weight.t()`` contiguous.

    The fused operator computes ``x @ weight.t()``; BLAS reads a contiguous ``weight.t()``
    directly, while a row-major weight is repacked on every call. On the small inputs where the
    fused layer spends most of its time in these GEMMs, that is 5-25% of a forward pass
    (docs/benchmarks.md). Gradients come back in the same layout (no copy when autograd
    accumulates them), optimizers create their state with ``zeros_like`` (the same layout), and
    state_dicts, which hold values, load either way."""
    if weight.dim() == 2 and weight.size(0) > 1 and weight.stride(0) != 1:
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()


def unsupported_options(module: nn.MultiheadAttention) -> List[str]:
    """Why ``module`` cannot be fused, one reason per unsupported option ([] if it can)."""
    reasons = []
    if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
        reasons.append("add_bias_kv=True (learned key/value bias rows) is not supported")
    if getattr(module, "add_zero_attn", False):
        reasons.append("add_zero_attn=True is not supported")
    if not getattr(module, "_qkv_same_embed_dim", True):
        reasons.append(
            f"kdim={module.kdim}/vdim={module.vdim} differ from embed_dim={module.embed_dim} "
            "(separate q/k/v projection weights) is not supported"
        )
    return reasons


class FusedMultiheadAttention(nn.Module):
    r"""Multi-head attention computed by one fused operator, ``attn_export::multi_head_attention``.

    A drop-in replacement for :class:`torch.nn.MultiheadAttention`: the same constructor, the
    same ``forward`` signature and return value, and the same parameters and state_dict keys
    (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), so a
    state_dict loads either way. One call runs the packed QKV projection, the attention and the
    output projection, with a hand-written C++ backward.

    Differences from ``nn.MultiheadAttention``:

    * A query whose keys are all masked yields a zero output row and zero weights, where
      ``nn.MultiheadAttention`` yields NaN.
    * ``is_causal=True`` applies a causal mask by itself (``attn_mask`` may be omitted); when a
      mask is given too, both apply.
    * ``add_bias_kv``, ``add_zero_attn`` and ``kdim``/``vdim`` different from ``embed_dim`` are
      not supported and raise :class:`UnsupportedAttentionError`.
    * Its ``out_proj`` carries a no-op forward pre-hook so that an enclosing
      ``nn.TransformerEncoderLayer`` in eval mode cannot bypass it through PyTorch's native
      fast path.
    * With ``dropout > 0`` in training mode, the layer runs PyTorch's unfused
      ``F.multi_head_attention_forward`` (dropout on the attention weights is not fused); in
      eval mode, or with ``dropout == 0``, it always runs the fused operator.

    Args:
        embed_dim: total model dimension ``E``.
        num_heads: number of heads ``H``; ``E`` must be divisible by ``H``.
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the input and output projections.
        batch_first: inputs are ``Tensor[B, L, E]`` instead of ``Tensor[L, B, E]``.
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive; got {embed_dim} and {num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        for name, value, default in (
            ("add_bias_kv", add_bias_kv, False),
            ("add_zero_attn", add_zero_attn, False),
        ):
            if value != default:
                raise UnsupportedAttentionError(
                    f"FusedMultiheadAttention does not support {name}={value}; "
                    "keep torch.nn.MultiheadAttention for this layer"
                )
        for name, value in (("kdim", kdim), ("vdim", vdim)):
            if value is not None and value != embed_dim:
                raise UnsupportedAttentionError(
                    f"FusedMultiheadAttention does not support {name}={value} != embed_dim={embed_dim}; "
                    "keep torch.nn.MultiheadAttention for this layer"
                )
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim
        self.vdim = embed_dim
        self._qkv_same_embed_dim = True
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = False
        self.bias_k = self.bias_v = None
        # Projection weights are stored column-major (see _relayout_column_major).
        self.in_proj_weight = nn.Parameter(torch.empty((embed_dim, 3 * embed_dim), **factory).t())
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        _relayout_column_major(self.out_proj.weight)
        self._reset_parameters()
        self.out_proj.register_forward_pre_hook(_keep_native_fast_paths_off)

    def _reset_parameters(self) -> None:
        # The initialization of nn.MultiheadAttention.
        if self.in_proj_weight.is_meta:
            return
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention) -> "FusedMultiheadAttention":
        """A fused layer that shares ``module``'s parameters (the same Parameter objects, so
        optimizers and tied weights keep working) and its train/eval mode. The two projection
        weights are re-laid out column-major in place (same objects, same values; see
        ``_relayout_column_major``)."""
        reasons = unsupported_options(module)
        if reasons:
            raise UnsupportedAttentionError(f"cannot fuse {type(module).__name__}: " + "; ".join(reasons))
        fused = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            batch_first=module.batch_first,
            device="meta",
        )
        fused.in_proj_weight = module.in_proj_weight
        fused.in_proj_bias = module.in_proj_bias
        fused.out_proj.weight = module.out_proj.weight
        fused.out_proj.bias = module.out_proj.bias
        _relayout_column_major(fused.in_proj_weight)
        _relayout_column_major(fused.out_proj.weight)
        fused.train(module.training)
        return fused

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if self.training and self.dropout > 0.0:
            return self._unfused_forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        # The operator is called directly, positionally: on small inputs every microsecond of
        # Python overhead shows.
        out_proj = self.out_proj
        output, weights = _MULTI_HEAD_ATTENTION(
            query, key, value, self.num_heads, self.in_proj_weight, self.in_proj_bias,
            out_proj.weight, out_proj.bias, attn_mask, key_padding_mask, need_weights,
            average_attn_weights, is_causal, self.batch_first,
        )
        return output, (weights if need_weights else None)

    def _unfused_forward(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
    ):
        """Training with dropout: PyTorch's reference implementation, same parameters."""
        batched = query.dim() == 3
        if is_causal and attn_mask is None:
            seq_dim = 1 if (batched and self.batch_first) else 0
            attn_mask = torch.ones(
                query.size(seq_dim), key.size(seq_dim), dtype=torch.bool, device=query.device
            ).triu(1)
        if self.batch_first and batched:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        output, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads,
            self.in_proj_weight, self.in_proj_bias, None, None, False, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=True,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=False,
        )
        if self.batch_first and batched:
            output = output.transpose(0, 1)
        return output, weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"bias={self.in_proj_bias is not None}, batch_first={self.batch_first}"
        )
