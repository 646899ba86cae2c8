// The one spec of the fused attention node and of the PyTorch operators: names, attribute
// types, required flags and defaults, accepted element types. The ONNX node the exporter
// writes, the model-local ONNX function beside it, the TensorRT plugin that replaces it, the
// torch operator registrations and the Python fake kernels all use the constants below.
// Plain constexpr C++ with no includes, so the TensorRT plugin (and any plain C++ test) can
// include it; the Python exporter reads this file (exporter/attn_export/spec.py) and
// tests/test_spec.py holds the exported models to it. Documented in docs/onnx_node.md.
//
// Changing a name, an attribute, an input or the semantics is a breaking change: bump
// kPluginVersion and kOnnxDomainVersion together. Version 2 added the softcap attribute; version
// 3 added kv_num_heads (grouped-query attention) and causal_alignment (bottom-right causal);
// version 4 added window (sliding-window causal attention); version 5 added the key/value cache
// form (has_past, inputs past_key/past_value, outputs present_key/present_value); version 6
// added alibi_slopes (ALiBi as one slope per query head, FlashAttention's alibi_slopes).
//
// ---------------------------------------------------------------------------------------------
// The node: the attention core, heads packed, token-major (no transposes in the graph; the
// kernels read [B, L, H, D] memory through strides, see attention_params.h).
//
//   inputs (always all five, in this order; never an empty name):
//     0 query             T    [B, Lq, H*D]
//     1 key               T    [B, Lk, Hkv*D]
//     2 value             T    [B, Lk, Hkv*Dv]
//     3 key_padding_mask  M    [B or 1, Lk or 1]                      additive
//     4 attn_mask         M    [B or 1, H or 1, Lq or 1, Lk or 1]     additive
//   output:
//     0 output            T    [B, Lq, H*Dv]
//
//   The cache form (has_past = 1): two more inputs and two more outputs, nothing else changes.
//     1 key               T    [B, S, Hkv*D]      the new keys (S tokens), token-major as above
//     2 value             T    [B, S, Hkv*Dv]
//     5 past_key          T    [B, Hkv, P, D]     the cache, head-major (Optimum's layout)
//     6 past_value        T    [B, Hkv, P, Dv]
//   outputs:
//     1 present_key       T    [B, Hkv, P+S, D]   past_key then the new keys along axis 2
//     2 present_value     T    [B, Hkv, P+S, Dv]
//   and attention runs over the present: Lk = P + S below (key[b, j, g*D:(g+1)*D] reads
//   present_key[b, g, j, :]); the masks' Lk is P + S; causal_alignment 1 (bottom-right) is the
//   decoder's alignment (the new tokens are the last S of the P + S). P may be 0 (prefill).
//   A consumer tells the forms apart by has_past (which the TensorRT plugin needs before it sees
//   the inputs: getNbOutputs()) and, equivalently, by the node's input count, 5 or 7.
//   T = float32 | float16 | bfloat16 (kTensorTypes); M = float32 (kMaskType).
//   H = num_heads; Hkv = kv_num_heads (0 or absent: H), which must divide H: grouped-query
//   attention, query head h reads key/value head g(h) = h // (H / Hkv) (multi-query: Hkv = 1).
//
//   output[b, i, h*Dv : (h+1)*Dv] = sum_j p[b,h,i,j] * value[b, j, g*Dv : (g+1)*Dv], where
//     g          = h // (H / Hkv)
//     x[b,h,i,j] = scale * <query[b, i, h*D : (h+1)*D], key[b, j, g*D : (g+1)*D]>
//     c[b,h,i,j] = softcap > 0 ? softcap * tanh(x[b,h,i,j] / softcap) : x[b,h,i,j]
//                                                  (logit soft-capping, Gemma 2 / Grok style)
//     s[b,h,i,j] = c[b,h,i,j] + key_padding_mask[b,j] + attn_mask[b,h,i,j]
//                  - alibi_slopes[h] * |i + Lk - Lq - j|        (ALiBi, when alibi_slopes is set)
//                  + (is_causal && j > i + a ? -inf : 0)        (causal mask)
//                  + (is_causal && window > 0 && j <= i + a - window ? -inf : 0)
//                                                  (sliding window: the last `window` keys up
//                                                  to the causal diagonal, as transformers'
//                                                  sliding_window_overlay kv > q - window)
//     a          = causal_alignment == 1 ? Lk - Lq : 0
//                  (0: top-left, query i sees keys j <= i; 1: bottom-right, j <= i + Lk - Lq,
//                  the last query sees every key: a decoder step over a KV cache)
//     p[b,h,i,:] = softmax_j(s[b,h,i,:]), or all zeros when every s[b,h,i,j] is -inf
//                  (a query that sees no key outputs zeros, never NaN).
//   The scores, the softmax and the sums accumulate in float32 whatever T is. Bottom-right with
//   Lq > Lk leaves the first Lq - Lk queries without a key: their rows are zeros.
//   Masks broadcast (a size-1 dimension stands for every index).
//
// Soft-capping bounds the scores to (-softcap, softcap) BEFORE the masks are added (as
// transformers' Gemma 2 attention does), so a -inf mask still removes a key. softcap = 0 (the
// default) is off: the node computes exactly what version 1 computed.
//
// ALiBi (Bloom, MPT; version 6): alibi_slopes, one float32 slope m[h] per QUERY head (H of them;
// grouped-query attention indexes it by h, not by the key/value head), adds -m[h] * |i + Lk - Lq - j|
// after the scale and the soft-cap, with the masks. The distance is FlashAttention's (its
// alibi_slopes): measured from the bottom-right diagonal whatever causal_alignment is, so that a
// decoder step over a KV cache (Lq = 1, Lk = P + 1) sees -m * (P - j) for key j. Empty (the
// default) is off: the node computes exactly what version 5 computed. The bias is finite, so a
// -inf mask still removes a key and a row without keys is still zeros.
//
// Masks are ADDITIVE float32 in the node: 0 = visible, -inf = masked out, other values are
// added to the scaled scores. The exporter turns a PyTorch boolean mask (true = masked out,
// torch.nn.MultiheadAttention's convention) into Where(mask, -inf, 0) before the node, so the
// plugin implements one mask kind.
//
// Absent masks. Both mask inputs are always connected: an absent mask is a float32 zero
// initializer of shape [1, 1] (key_padding_mask) or [1, 1, 1, 1] (attn_mask), and the attribute
// has_key_padding_mask / has_attn_mask is 0. Why not ONNX's empty input names for omitted
// optional inputs: TensorRT's ONNX parser (onnx-tensorrt ModelImporter parseNode and the
// FallbackPluginImporter) turns an empty input name into a null ITensor* in the plugin's input
// list, which a plugin and INetworkDefinition::addPluginV3 would have to special-case, and a
// model-local function has positional inputs, so "key_padding_mask absent, attn_mask present"
// cannot be expressed by omitting trailing inputs. With five real inputs the plugin always gets
// nbInputs == 5, the function body needs no optional-input logic, and the zero placeholder is a
// valid mask by itself: a runtime that ignores has_* computes the same result. A plugin may skip
// reading a mask whose has_* attribute is 0 (it is all zeros by contract).
// ---------------------------------------------------------------------------------------------
#pragma once

namespace attn_export::spec {

// ONNX identity of the node and of its model-local function (same domain and name).
inline constexpr const char* kOnnxDomain = "attn_export";
inline constexpr int kOnnxDomainVersion = 6;
inline constexpr const char* kOpType = "FusedAttention";

// TensorRT's ONNX parser maps the node to a plugin by op_type (= kPluginName) and the string
// attributes plugin_version / plugin_namespace, which the exporter writes on every node.
inline constexpr const char* kPluginName = "FusedAttention";
inline constexpr const char* kPluginVersion = "6";
inline constexpr const char* kPluginNamespace = "";

// Node attributes (ONNX type in the comment; TensorRT receives INT as int32, FLOAT as float32,
// STRING as char).
inline constexpr const char* kAttrNumHeads = "num_heads";                    // INT   H >= 1
inline constexpr const char* kAttrScale = "scale";                           // FLOAT multiplies q.k
inline constexpr const char* kAttrIsCausal = "is_causal";                    // INT   0 | 1
inline constexpr const char* kAttrHasKeyPaddingMask = "has_key_padding_mask";  // INT 0 | 1
inline constexpr const char* kAttrHasAttnMask = "has_attn_mask";             // INT   0 | 1
inline constexpr const char* kAttrSoftcap = "softcap";                       // FLOAT >= 0, 0 = off
inline constexpr const char* kAttrCausalAlignment = "causal_alignment";     // INT   0 top-left | 1 bottom-right
inline constexpr const char* kAttrKvNumHeads = "kv_num_heads";              // INT   Hkv | 0 = num_heads
inline constexpr const char* kAttrWindow = "window";                         // INT   >= 0, 0 = no window
inline constexpr const char* kAttrHasPast = "has_past";                      // INT   0 | 1: the cache form
inline constexpr const char* kAttrAlibiSlopes = "alibi_slopes";              // FLOATS [H] finite, empty = off
inline constexpr const char* kAttrPluginNamespace = "plugin_namespace";      // STRING
inline constexpr const char* kAttrPluginVersion = "plugin_version";          // STRING

// Attribute types: the values of ONNX's AttributeProto.AttributeType.
inline constexpr int kAttrTypeFloat = 1;
inline constexpr int kAttrTypeInt = 2;
inline constexpr int kAttrTypeString = 3;
inline constexpr int kAttrTypeFloats = 6;  // a list of FLOAT; its default is the empty list

// One node attribute: its name, type, whether every node must carry it, and otherwise its
// default (default_int for INT attributes, default_float for FLOAT ones, default_string for
// STRING ones; a FLOATS attribute defaults to the empty list).
struct Attribute {
  const char* name;
  int type;  // kAttrType*
  bool required;
  int default_int;
  double default_float;
  const char* default_string;
};

// Every attribute of the node, in the order the exporter writes them. The first
// kNumPluginFields are the TensorRT plugin's fields, in the order the plugin declares and
// serializes them; plugin_namespace and plugin_version are read by TensorRT's ONNX parser
// itself and are not fields (the parser's own defaults are "" and "1": the exporter writes both
// on every node, so a node always names this version). Every other attribute is a field (alibi_slopes,
// FLOATS: a kFLOAT32 field of length H, or absent/empty when off).
inline constexpr int kNumAttributes = 13;
inline constexpr int kNumPluginFields = 11;
inline constexpr Attribute kAttributes[kNumAttributes] = {
    {kAttrNumHeads, kAttrTypeInt, true, 0, 0.0, ""},
    {kAttrScale, kAttrTypeFloat, true, 0, 0.0, ""},
    {kAttrIsCausal, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrHasKeyPaddingMask, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrHasAttnMask, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrSoftcap, kAttrTypeFloat, false, 0, 0.0, ""},
    {kAttrCausalAlignment, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrKvNumHeads, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrWindow, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrHasPast, kAttrTypeInt, false, 0, 0.0, ""},
    {kAttrAlibiSlopes, kAttrTypeFloats, false, 0, 0.0, ""},
    {kAttrPluginNamespace, kAttrTypeString, false, 0, 0.0, kPluginNamespace},
    {kAttrPluginVersion, kAttrTypeString, false, 0, 0.0, kPluginVersion},
};

// The values a restricted attribute may take: finite, >= min and, when bounded_above, <= max
// (an INT attribute's values are integers by its type), with a short phrase of what they mean.
// The one check of the binding (csrc/ops/attention_binding.cpp, over the trailing attributes
// of attention_params.h), the fake kernels' (exporter/attn_export/ops/fake.py) and the
// exporter's node_attributes (onnx/node.py) read this table and word the refusal from it:
// "<name> must be finite and >= <min> (<meaning>); got <value>" without an upper bound,
// "<name> must be <min> or <max> (<meaning>)" when max = min + 1, "<min> to <max>" otherwise.
// An attribute not listed takes any value of its type.
struct AttributeRange {
  const char* name;
  double min;
  bool bounded_above;
  double max;
  const char* meaning;
};

inline constexpr int kNumAttributeRanges = 3;
inline constexpr AttributeRange kAttributeRanges[kNumAttributeRanges] = {
    {kAttrSoftcap, 0.0, false, 0.0, "0 = off"},
    {kAttrCausalAlignment, 0.0, true, 1.0,
     "0 = top-left: query i sees keys j <= i; 1 = bottom-right: keys j <= i + Lk - Lq"},
    {kAttrWindow, 0.0, false, 0.0, "0 = no window; w > 0 = each query sees its last w keys up to the causal diagonal"},
};

// Element types: the values of ONNX's TensorProto.DataType, with the names the exporter and
// the plugin print. T (query, key, value, output) is one of kTensorTypes; M (the masks) is
// kMaskType.
inline constexpr int kTypeFloat32 = 1;
inline constexpr int kTypeFloat16 = 10;
inline constexpr int kTypeBFloat16 = 16;
inline constexpr int kNumTensorTypes = 3;
inline constexpr int kTensorTypes[kNumTensorTypes] = {kTypeFloat32, kTypeFloat16, kTypeBFloat16};
inline constexpr const char* kTensorTypeNames[kNumTensorTypes] = {"float32", "float16", "bfloat16"};
inline constexpr int kMaskType = kTypeFloat32;

// Inputs and outputs, by position.
inline constexpr int kInputQuery = 0;
inline constexpr int kInputKey = 1;
inline constexpr int kInputValue = 2;
inline constexpr int kInputKeyPaddingMask = 3;
inline constexpr int kInputAttnMask = 4;
inline constexpr int kNumInputs = 5;
inline constexpr int kOutputOutput = 0;
inline constexpr int kNumOutputs = 1;

inline constexpr const char* kInputNames[kNumInputs] = {
    "query", "key", "value", "key_padding_mask", "attn_mask"};
inline constexpr const char* kOutputNames[kNumOutputs] = {"output"};

// Ranks of the inputs, in input order, and of the output.
inline constexpr int kInputRanks[kNumInputs] = {3, 3, 3, 2, 4};
inline constexpr int kOutputRank = 3;

// The cache form (has_past = 1): inputs 5 and 6 after the five above, outputs 1 and 2 after
// the output, all of rank 4 and type T.
inline constexpr int kInputPastKey = 5;
inline constexpr int kInputPastValue = 6;
inline constexpr int kNumPastInputs = 7;
inline constexpr int kOutputPresentKey = 1;
inline constexpr int kOutputPresentValue = 2;
inline constexpr int kNumPastOutputs = 3;
inline constexpr const char* kPastInputNames[2] = {"past_key", "past_value"};
inline constexpr const char* kPresentOutputNames[2] = {"present_key", "present_value"};
inline constexpr int kCacheRank = 4;

// The PyTorch operators (torch.ops.attn_export.*), by qualified name (csrc/ops/attention.cpp,
// whose TORCH_LIBRARY block must name kTorchNamespace, defines each from its kSchema* below),
// every backend's registrations, the C++ callers through the dispatcher and the Python fake
// kernels.
inline constexpr const char* kTorchNamespace = "attn_export";
inline constexpr const char* kOpAttention = "attn_export::attention";
inline constexpr const char* kOpAttentionForward = "attn_export::_attention_forward";
inline constexpr const char* kOpAttentionBackward = "attn_export::_attention_backward";
inline constexpr const char* kOpMultiHeadAttention = "attn_export::multi_head_attention";
inline constexpr const char* kOpMultiHeadAttentionForward = "attn_export::_multi_head_attention_forward";
inline constexpr const char* kOpMultiHeadAttentionBackward = "attn_export::_multi_head_attention_backward";

// The operators' signatures (TorchScript schema syntax, each after its kOp* name), said once:
// csrc/ops/attention.cpp registers them; exporter/attn_export/ops/signatures.py parses them with
// torch's own parser for the fake kernels, the ONNX translation and the Python entry points
// (tests/test_spec.py holds every Python signature to them); the C++ adapters are checked
// against them by torch when the library loads (csrc/ops/core_args.h).
//
// The core's attributes follow the tensors: attn_mask, key_padding_mask, is_causal, scale, then
// (after the internal operators' own need_weights / output) the trailing attributes of
// attention_params.h (ATTN_EXPORT_TRAILING_ATTRIBUTES) and last alibi_slopes (core_args.h's
// ATTN_EXPORT_TRAILING_ARGUMENTS), each with a default so that callers
// written before it existed keep working. A node attribute of the same name (kAttributes) is
// written from the operator's argument by the ONNX translation.

// The attention core: softmax(cap(scale * q k^T) + masks) v for q [B, H, Lq, D],
// k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], Hkv dividing H (grouped-query attention: query head h
// reads key/value head h / (H / Hkv), as SDPA's enable_gqa). Masks follow
// torch.nn.MultiheadAttention (bool: true = masked out). cap(x) = softcap * tanh(x / softcap)
// when softcap > 0 (logit soft-capping, Gemma 2 / Grok), the identity when softcap = 0.
// is_causal hides keys j > i + shift from query i: shift 0 when causal_alignment = 0
// (top-left), Lk - Lq when 1 (bottom-right, the KV-cache case; PyTorch's causal_lower_right).
// window > 0 (only with is_causal) also hides keys j <= i + shift - window: a sliding window of
// the last `window` keys up to the diagonal (Mistral, Gemma 2's local layers); 0 = no window.
// alibi_slopes (ALiBi: Bloom, MPT), one per query head, adds -alibi_slopes[h] * |i + Lk - Lq - j|
// with the masks (FlashAttention's alibi_slopes: bottom-right distance whatever causal_alignment);
// None or empty = off. A list, not a tensor: torch.export and the ONNX export see constants.
inline constexpr const char* kSchemaAttention =
    "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, Tensor? key_padding_mask=None, "
    "bool is_causal=False, float? scale=None, float softcap=0.0, int causal_alignment=0, int window=0, "
    "float[]? alibi_slopes=None) -> Tensor";

// The core's kernels. The forward also returns the row log-sum-exp the backward needs, and the
// attention probabilities when need_weights is set (an empty tensor otherwise). The backward
// may be given the forward's output (the flash-style CUDA backward needs rowsum(dO * O));
// kernels ignore what they do not need and recompute what is not given.
inline constexpr const char* kSchemaAttentionForward =
    "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor? key_padding_mask, "
    "bool is_causal, float? scale, bool need_weights, float softcap=0.0, int causal_alignment=0, int window=0, "
    "float[]? alibi_slopes=None) -> (Tensor output, Tensor logsumexp, Tensor weights)";
inline constexpr const char* kSchemaAttentionBackward =
    "(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, Tensor value, "
    "Tensor logsumexp, Tensor? attn_mask, Tensor? key_padding_mask, bool is_causal, float? scale, "
    "Tensor? output=None, float softcap=0.0, int causal_alignment=0, int window=0, float[]? alibi_slopes=None) "
    "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)";

// The whole torch.nn.MultiheadAttention layer in one call: input projection, attention, output
// projection. Arguments and results mirror F.multi_head_attention_forward; `weights` is an
// empty tensor when need_weights is false.
inline constexpr const char* kSchemaMultiHeadAttention =
    "(Tensor query, Tensor key, Tensor value, int num_heads, Tensor in_proj_weight, "
    "Tensor? in_proj_bias, Tensor out_proj_weight, Tensor? out_proj_bias, Tensor? attn_mask=None, "
    "Tensor? key_padding_mask=None, bool need_weights=True, bool average_attn_weights=True, "
    "bool is_causal=False, bool batch_first=False) -> (Tensor output, Tensor weights)";

// The layer's forward kernel, returning what its backward needs: the input projections
// (packed_qkv: one [Nq, 3E] tensor, key and value ignored; else q [Nq, E] and k|v [Nk, 2E]),
// the attention output before the output projection and the row log-sum-exp.
inline constexpr const char* kSchemaMultiHeadAttentionForward =
    "(Tensor query, Tensor key, Tensor value, int num_heads, Tensor in_proj_weight, "
    "Tensor? in_proj_bias, Tensor out_proj_weight, Tensor? out_proj_bias, Tensor? attn_mask, "
    "Tensor? key_padding_mask, bool need_weights, bool average_attn_weights, bool is_causal, "
    "bool batch_first, bool packed_qkv) -> (Tensor output, Tensor weights, Tensor q_proj, "
    "Tensor kv_proj, Tensor attn, Tensor logsumexp)";

// The layer's backward from what _multi_head_attention_forward saved. Gradients for query, key,
// value, in_proj_weight, in_proj_bias, out_proj_weight and out_proj_bias; an entry is an empty
// tensor where output_mask is false or where the gradient flows through another argument
// (packed_qkv: all of it to query; shared_kv: key and value are one tensor, to key).
inline constexpr const char* kSchemaMultiHeadAttentionBackward =
    "(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, Tensor value, "
    "int num_heads, Tensor in_proj_weight, Tensor? in_proj_bias, Tensor out_proj_weight, "
    "Tensor? out_proj_bias, Tensor? attn_mask, Tensor? key_padding_mask, bool need_weights, "
    "bool average_attn_weights, bool is_causal, bool batch_first, bool packed_qkv, bool shared_kv, "
    "Tensor q_proj, Tensor kv_proj, Tensor attn, Tensor logsumexp, bool[7] output_mask) "
    "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_in_proj_weight, "
    "Tensor grad_in_proj_bias, Tensor grad_out_proj_weight, Tensor grad_out_proj_bias)";

// The smallest default-domain ONNX opset the function body is written for (ReduceMax with axes
// as an input, Shape with start/end).
inline constexpr int kMinOnnxOpset = 18;

}  // namespace attn_export::spec
