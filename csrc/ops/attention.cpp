// Operator schemas of the attn_export library; this file only declares what the operators
// are. Each backend registers its kernels in its own folder: cpu/ (attention_cpu_binding.cpp,
// multi_head_attention_cpu_binding.cpp), cuda/ (attention_cuda_binding.cu,
// multi_head_attention_cuda_binding.cpp) and autograd/ (attention_autograd.cpp). The operator
// names are the spec's (csrc/attention_spec.h: kTorchNamespace, kOp*), which the Python fake
// kernels read too; so are their signatures (kSchema*).
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
// constant; m.def rejects a qualified name from another namespace). What each operator does is
// said beside its schema in the spec.
TORCH_LIBRARY(attn_export, m) {
  using namespace attn_export::spec;
  m.def(qualified_schema(kOpAttention, kSchemaAttention).c_str());
  m.def(qualified_schema(kOpAttentionForward, kSchemaAttentionForward).c_str());
  m.def(qualified_schema(kOpAttentionBackward, kSchemaAttentionBackward).c_str());
  m.def(qualified_schema(kOpMultiHeadAttention, kSchemaMultiHeadAttention).c_str());
  m.def(qualified_schema(kOpMultiHeadAttentionForward, kSchemaMultiHeadAttentionForward).c_str());
  m.def(qualified_schema(kOpMultiHeadAttentionBackward, kSchemaMultiHeadAttentionBackward).c_str());
}
