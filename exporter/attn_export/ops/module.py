"""FusedMultiheadAttention: a drop-in torch.nn.MultiheadAttention backed by fused operators."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from attn_export.ops.functional import attention as _attention
from attn_export.ops.module_checks import check_inputs as _check_inputs
from attn_export.ops.module_checks import forward_call as _forward_call, nested_forward as _nested_forward
from attn_export.ops.module_checks import stock_error as _stock_error

_MULTI_HEAD_ATTENTION = torch.ops.attn_export.multi_head_attention.default

# torch.nn's own class, held from import on. Code bases adopt a drop-in by rebinding the name
# (``torch.nn.MultiheadAttention = FusedMultiheadAttention``); "stock" must stay the real class
# under that patch: to_module builds it, the failure path asks it for its error (through the
# name, that would build another fused layer, which would ask again, without end), and surgery,
# the attention-map capture and the model loader's allowlist tell stock layers by it.
StockMultiheadAttention = nn.modules.activation.MultiheadAttention


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


def fusion_notes(module: nn.MultiheadAttention) -> List[str]:
    """How a layer of ``module``'s configuration runs once fused: one note naming the options
    that move it off the single layer operator ([] for the common packed configuration)."""
    options = []
    if not getattr(module, "_qkv_same_embed_dim", True):
        options.append(f"kdim={module.kdim}/vdim={module.vdim} != embed_dim={module.embed_dim}")
    if getattr(module, "bias_k", None) is not None:
        options.append("add_bias_kv=True")
    if getattr(module, "add_zero_attn", False):
        options.append("add_zero_attn=True")
    if not options:
        return []
    return [", ".join(options) + ": projections in PyTorch, attention on the core operator "
            "(attn_export::attention)"]


def _mixed_dtypes(*tensors: Optional[Tensor]) -> bool:
    return len({t.dtype for t in tensors if t is not None}) > 1


def _append_key_column(mask: Optional[Tensor]) -> Optional[Tensor]:
    """A mask widened by one key that every query may attend (False / 0.0), for a key row
    appended by add_bias_kv or add_zero_attn."""
    if mask is None:
        return None
    return torch.cat([mask, mask.new_zeros((*mask.shape[:-1], 1))], dim=-1)


def _attention_weights(q, k, attn_mask, key_padding_mask, is_causal, average):
    """softmax(q k^T / sqrt(D) + masks) per head, ``q`` ``[B, H, Lq, D]``, ``k`` ``[B, H, Lk, D]``:
    the weights the core operator does not return. A query that sees no key gets zeros (as the
    operator's output does) with finite gradients, where softmax alone gives NaN."""
    scores = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-2, -1))
    weights = masked_softmax(scores, attn_mask, key_padding_mask, is_causal)
    return weights.mean(dim=1) if average else weights


def masked_softmax(scores, attn_mask, key_padding_mask, is_causal):
    """softmax over the keys of ``scores`` ``[B, H, Lq, Lk]`` with the operator's masks
    (boolean ``True`` = masked, floating added); a query that sees no key gets zeros."""
    batch, heads, seqlen_q, seqlen_k = scores.shape
    masks = []
    if attn_mask is not None:
        # [Lq, Lk] and [1, Lq, Lk] broadcast; [B*H, Lq, Lk] is per batch element and head.
        per_head = attn_mask.dim() == 3 and attn_mask.size(0) != 1
        masks.append(attn_mask.reshape(batch, heads, seqlen_q, seqlen_k) if per_head else attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(batch, 1, 1, seqlen_k))  # reshape: masks may be expanded views
    if is_causal:
        masks.append(torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=scores.device).triu(1))
    for mask in masks:
        scores = scores.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


class FusedMultiheadAttention(nn.Module):
    r"""Multi-head attention computed by fused operators: a drop-in replacement for
    :class:`torch.nn.MultiheadAttention`.

    The same constructor (every configuration the stock module accepts), the same ``forward``
    signature and return value, the same attributes (``_qkv_same_embed_dim``, ``in_proj_weight``
    or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, ``in_proj_bias``, ``bias_k``/``bias_v``,
    ``add_zero_attn``, ``head_dim``, ...), the same classes (``out_proj`` is a
    ``NonDynamicallyQuantizableLinear``, which ``quantize_dynamic`` leaves alone) and the same
    state_dict keys, so a state_dict loads either way; :meth:`from_module` / :meth:`to_module`
    convert sharing the parameters.

    How it runs:

    * The packed configuration (``kdim == vdim == embed_dim``, no ``add_bias_kv`` or
      ``add_zero_attn``): one call of ``attn_export::multi_head_attention`` runs the QKV
      projection, the attention and the output projection, with a hand-written C++ backward.
    * ``kdim``/``vdim`` != ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``: the projections
      (and the appended bias / zero key rows) in PyTorch, the attention on the core operator
      ``attn_export::attention`` (hand-written backward too; ONNX: one ``FusedAttention`` node).
    * ``dropout > 0`` in training mode: PyTorch's unfused ``F.multi_head_attention_forward``
      (dropout on the attention weights is not fused); in eval mode, or with ``dropout == 0``,
      the fused operators.

    Differences from ``nn.MultiheadAttention``:

    * A query whose keys are all masked yields a zero output row and zero weights, where
      ``nn.MultiheadAttention`` yields NaN.
    * ``is_causal=True`` without an ``attn_mask`` applies a causal mask by itself, where
      ``nn.MultiheadAttention`` raises. With a mask, the packed configuration applies both (the
      same result for a causal mask); the others follow ``nn.MultiheadAttention`` exactly.
    * Nested tensors run on the stock module (unfused, parameters shared) where its inference
      fast path takes them: self-attention in eval without grad, as ``nn.TransformerEncoder``
      sends them with a padding mask. Elsewhere they are refused with an AssertionError naming
      the fix (pad them), as the stock module does outside that fast path.
    * Its ``out_proj`` carries a no-op forward pre-hook so that an enclosing
      ``nn.TransformerEncoderLayer`` in eval mode cannot bypass it through PyTorch's native
      fast path.

    Args:
        embed_dim: total model dimension ``E``.
        num_heads: number of heads ``H``; ``E`` must be divisible by ``H``.
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the input and output projections.
        add_bias_kv: learned bias rows appended to the projected keys and values.
        add_zero_attn: a zero row appended to the keys and values.
        kdim, vdim: feature sizes of key and value (default ``E``).
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
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads} instead")  # nn.MultiheadAttention's words
        if embed_dim % num_heads != 0:
            raise AssertionError("embed_dim must be divisible by num_heads")  # nn.MultiheadAttention's
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        # Parameters registered in nn.MultiheadAttention's order, so state_dicts list the same
        # keys in the same order, and in its layout: contiguous [out, in] weights, as FSDP2
        # (which refuses non-contiguous parameters), DDP buckets and optimizers expect. The
        # CPU operator packs them for its GEMMs itself (csrc/ops/cpu/projection.cpp).
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()
        self.out_proj.register_forward_pre_hook(_keep_native_fast_paths_off)

    def _reset_parameters(self) -> None:
        # The initialization of nn.MultiheadAttention.
        if self.out_proj.weight.is_meta:
            return
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _config(self) -> dict:
        """The constructor arguments of this layer (and of an equivalent stock layer)."""
        return dict(
            dropout=self.dropout, bias=self.in_proj_bias is not None, add_bias_kv=self.bias_k is not None,
            add_zero_attn=self.add_zero_attn, kdim=self.kdim, vdim=self.vdim, batch_first=self.batch_first,
        )

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention) -> "FusedMultiheadAttention":
        """A fused layer that shares ``module``'s parameters (the same Parameter objects, left
        untouched, so optimizers, tied weights, DDP and FSDP keep working) and its train/eval mode."""
        config = dict(
            dropout=module.dropout, bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first,
        )
        fused = cls(module.embed_dim, module.num_heads, **config, device="meta")
        _share_parameters(module, fused)
        fused.train(module.training)
        return fused

    def to_module(self) -> nn.MultiheadAttention:
        """The stock ``nn.MultiheadAttention`` of this configuration, sharing this layer's
        parameters (the same Parameter objects) and its train/eval mode."""
        stock = StockMultiheadAttention(self.embed_dim, self.num_heads, **self._config(), device="meta")
        _share_parameters(self, stock)
        stock.train(self.training)
        return stock

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
        in_proj_weight = self.in_proj_weight
        if in_proj_weight is None or self.bias_k is not None or self.add_zero_attn:
            try:
                return self._core_forward(
                    query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
                )
            except RuntimeError as refused:  # the core op's checks: stock's error where stock refuses too
                call = _forward_call(query, key, value, key_padding_mask, need_weights, attn_mask,
                                     average_attn_weights, is_causal)
                raise _stock_error(self, call) or refused from None
        # The operator is called directly, positionally: on small inputs every microsecond of
        # Python overhead shows. Its checks raise RuntimeError; where nn.MultiheadAttention
        # asserts instead, _check_inputs raises stock's error, on the failure path only.
        out_proj = self.out_proj
        try:
            output, weights = _MULTI_HEAD_ATTENTION(
                query, key, value, self.num_heads, in_proj_weight, self.in_proj_bias,
                out_proj.weight, out_proj.bias, attn_mask, key_padding_mask, need_weights,
                average_attn_weights, is_causal, self.batch_first,
            )
        except RuntimeError as refused:  # NotImplementedError (nested tensors) included
            call = _forward_call(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                 is_causal)
            if query.is_nested:
                return _nested_forward(self, call)
            _check_inputs(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                          is_causal)
            if not _mixed_dtypes(query, key, value, in_proj_weight, self.in_proj_bias, out_proj.weight, out_proj.bias):
                raise _stock_error(self, call) or refused from None
            # The operator wants one dtype; nn.MultiheadAttention promotes where F.linear does
            # (e.g. a float16 bias on a float64 batch_first layer), so the core path, which
            # projects with F.linear as stock does, gives stock's result or stock's error.
            return self._core_forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        return output, (weights if need_weights else None)

    def _projection_weights(self) -> Tuple[Tensor, Tensor, Tensor]:
        if self.in_proj_weight is not None:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def _core_forward(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
    ):
        """Separate q/k/v weights, add_bias_kv, add_zero_attn: the projections and the appended
        key/value rows in PyTorch, the attention on the core operator (``attn_export::attention``,
        which exports as one FusedAttention node)."""
        _check_inputs(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                      is_causal)
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # [L, B, *] from here on, as F.multi_head_attention_forward.
        if is_causal and attn_mask is not None:
            # nn.MultiheadAttention's reading of the hint: the mask alone when weights or a
            # padding mask are needed, the hint alone otherwise.
            if key_padding_mask is not None or need_weights:
                is_causal = False
            else:
                attn_mask = None
        w_q, w_k, w_v = self._projection_weights()
        b_q, b_k, b_v = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        seqlen_q, batch, embed_dim = q.shape
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(1, batch, embed_dim)])
            v = torch.cat([v, self.bias_v.expand(1, batch, embed_dim)])
            attn_mask, key_padding_mask = _append_key_column(attn_mask), _append_key_column(key_padding_mask)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros((1, batch, embed_dim))])
            v = torch.cat([v, v.new_zeros((1, batch, embed_dim))])
            attn_mask, key_padding_mask = _append_key_column(attn_mask), _append_key_column(key_padding_mask)
        heads, head_dim = self.num_heads, self.head_dim
        # [L, B, E] -> [B, H, L, D] as strides, no copy.
        q, k, v = (x.unflatten(-1, (heads, head_dim)).permute(1, 2, 0, 3) for x in (q, k, v))
        attn = _attention(q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal)
        output = F.linear(attn.permute(2, 0, 1, 3).reshape(seqlen_q, batch, embed_dim),
                          self.out_proj.weight, self.out_proj.bias)
        weights = None
        if need_weights:
            weights = _attention_weights(q, k, attn_mask, key_padding_mask, is_causal, average_attn_weights)
        if not batched:
            return output.squeeze(1), None if weights is None else weights.squeeze(0)
        return (output.transpose(0, 1) if self.batch_first else output), weights

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
            self.in_proj_weight, self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=True,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=not self._qkv_same_embed_dim, q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )
        if self.batch_first and batched:
            output = output.transpose(0, 1)
        return output, weights

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={value}" for name, value, default in (
                ("kdim", self.kdim, self.embed_dim), ("vdim", self.vdim, self.embed_dim),
                ("add_bias_kv", self.bias_k is not None, False), ("add_zero_attn", self.add_zero_attn, False),
            ) if value != default
        )
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"bias={self.in_proj_bias is not None}{extra}, batch_first={self.batch_first}"
        )


_PROJECTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _share_parameters(source: nn.Module, target: nn.Module) -> None:
    """``target`` (built on the meta device, same configuration) takes ``source``'s Parameter
    objects: every parameter name nn.MultiheadAttention has."""
    for name in (*_PROJECTION_WEIGHTS, "in_proj_bias", "bias_k", "bias_v"):
        setattr(target, name, getattr(source, name))
    target.out_proj.weight = source.out_proj.weight
    target.out_proj.bias = source.out_proj.bias
