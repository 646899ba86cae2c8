// Operator schemas of the attn_export library; this file only declares what the operators
// are. Each backend registers its kernels in its own folder: cpu/ (attention_cpu_binding.cpp,
// multi_head_attention_cpu_binding.cpp), cuda/ (attention_cuda_binding.cu,
// multi_head_attention_cuda_binding.cpp) and autograd/ (attention_autograd.cpp). The operator
// names are the spec's (csrc/attention_spec.h: kTorchNamespace, kOp*), which the Python fake
// kernels read too.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "../attention_spec.h"

namespace {

// A schema string: the operator's qualified name from the spec, then its signature.
std::string qualified_schema(const char* qualified_name, const char* signature) {
  return std::string(qualified_name) + signature;
}

}  // namespace

// `import attn_export._C` loads this shared library, which runs the TORCH_LIBRARY
// registrations below and in the backends' files. The module itself is empty.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "attn_export operators (registered under torch.ops.attn_export)",
      -1,  // size of per-interpreter state
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

// The library's namespace must be spec::kTorchNamespace (a macro argument cannot name a
// constant; m.def rejects a qualified name from another namespace).
TORCH_LIBRARY(attn_export, m) {
  using namespace attn_export::spec;
  // The attention core: softmax(cap(scale * q k^T) + masks) v for q [B, H, Lq, D],
  // k [B, H, Lk, D], v [B, H, Lk, Dv]. Masks follow torch.nn.MultiheadAttention (bool: true =
  // masked out). cap(x) = softcap * tanh(x / softcap) when softcap > 0 (logit soft-capping,
  // Gemma 2 / Grok), the identity when softcap = 0; softcap is last so that callers written
  // before it existed keep working.
  m.def(qualified_schema(
      kOpAttention, "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "Tensor? key_padding_mask=None, bool is_causal=False, float? scale=None, "
      "float softcap=0.0) -> Tensor").c_str());

  // The core's kernels. The forward also returns the row log-sum-exp the backward needs, and
  // the attention probabilities when need_weights is set (an empty tensor otherwise). The
  // backward may be given the forward's probabilities (accumulation dtype) to skip recomputing
  // them, and the forward's output (the flash-style CUDA backward needs rowsum(dO * O));
  // kernels ignore what they do not need and recompute what is not given.
  m.def(qualified_schema(
      kOpAttentionForward, "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor? key_padding_mask, bool is_causal, float? scale, bool need_weights, "
      "float softcap=0.0) -> (Tensor output, Tensor logsumexp, Tensor weights)").c_str());
  m.def(qualified_schema(
      kOpAttentionBackward, "(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, "
      "Tensor value, Tensor logsumexp, Tensor? attn_mask, Tensor? key_padding_mask, "
      "bool is_causal, float? scale, Tensor? output=None, "
      "float softcap=0.0) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)").c_str());

  // The whole torch.nn.MultiheadAttention layer in one call: input projection, attention,
  // output projection. Arguments and results mirror F.multi_head_attention_forward; `weights`
  // is an empty tensor when need_weights is false.
  m.def(qualified_schema(
      kOpMultiHeadAttention, "(Tensor query, Tensor key, Tensor value, int num_heads, "
      "Tensor in_proj_weight, Tensor? in_proj_bias, Tensor out_proj_weight, "
      "Tensor? out_proj_bias, Tensor? attn_mask=None, Tensor? key_padding_mask=None, "
      "bool need_weights=True, bool average_attn_weights=True, bool is_causal=False, "
      "bool batch_first=False) -> (Tensor output, Tensor weights)").c_str());

  // The layer's forward kernel, returning what its backward needs: the input projections
  // (packed_qkv: one [Nq, 3E] tensor, key and value ignored; else q [Nq, E] and k|v [Nk, 2E]),
  // the attention output before the output projection and the row log-sum-exp.
  m.def(qualified_schema(
      kOpMultiHeadAttentionForward, "(Tensor query, Tensor key, Tensor value, int num_heads, "
      "Tensor in_proj_weight, Tensor? in_proj_bias, Tensor out_proj_weight, "
      "Tensor? out_proj_bias, Tensor? attn_mask, Tensor? key_padding_mask, bool need_weights, "
      "bool average_attn_weights, bool is_causal, bool batch_first, bool packed_qkv) -> "
      "(Tensor output, Tensor weights, Tensor q_proj, Tensor kv_proj, Tensor attn, Tensor logsumexp)").c_str());

  // The layer's backward from what _multi_head_attention_forward saved. Gradients for query,
  // key, value, in_proj_weight, in_proj_bias, out_proj_weight and out_proj_bias; an entry is
  // an empty tensor where output_mask is false or where the gradient flows through another
  // argument (packed_qkv: all of it to query; shared_kv: key and value are one tensor, to key).
  m.def(qualified_schema(
      kOpMultiHeadAttentionBackward, "(Tensor grad_output, Tensor? grad_weights, Tensor query, "
      "Tensor key, Tensor value, int num_heads, Tensor in_proj_weight, Tensor? in_proj_bias, "
      "Tensor out_proj_weight, Tensor? out_proj_bias, Tensor? attn_mask, "
      "Tensor? key_padding_mask, bool need_weights, bool average_attn_weights, bool is_causal, "
      "bool batch_first, bool packed_qkv, bool shared_kv, Tensor q_proj, Tensor kv_proj, "
      "Tensor attn, Tensor logsumexp, bool[7] output_mask) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value, Tensor grad_in_proj_weight, Tensor grad_in_proj_bias, "
      "Tensor grad_out_proj_weight, Tensor grad_out_proj_bias)").c_str());
}
