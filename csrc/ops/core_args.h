// The attention core's arguments, said once. Every implementation of the core operators (CPU,
// CUDA, the CUDA emulator's test ops) takes one of these structs. The operators' flat
// signatures (csrc/attention_spec.h, kSchemaAttention*) are expanded here, in the adapters
// TORCH_LIBRARY registers, from the fixed leading arguments and the trailing arguments below
// (ATTN_EXPORT_TRAILING_ARGUMENTS: attention_params.h's ATTN_EXPORT_TRAILING_ATTRIBUTES, then the
// ALiBi slopes). The static_asserts below hold the
// schemas to that list by name at compile time (torch checks the types when the library loads),
// and dispatch.h calls the operators through the same lists, so a new attribute needs no edit
// here (docs/architecture.md lists what it touches).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "../attention_params.h"
#include "../attention_spec.h"

// The core operators' trailing arguments: the scalar attributes of attention_params.h, then the
// ALiBi slopes, a list (schema `float[]? alibi_slopes=None`: None or empty = off) that
// AttentionParams carries as a float32 pointer (attention_binding.h's kernel_alibi_slopes).
#define ATTN_EXPORT_TRAILING_ARGUMENTS(X) \
  ATTN_EXPORT_TRAILING_ATTRIBUTES(X)      \
  X(std::optional<std::vector<double>>, alibi_slopes, std::nullopt)

// Expansions of ATTN_EXPORT_TRAILING_ARGUMENTS: `, type name` (a parameter) and `, name` (an
// argument).
#define ATTN_EXPORT_ATTRIBUTE_PARAMETER(type, name, default_value) , type name
#define ATTN_EXPORT_ATTRIBUTE_ARGUMENT(type, name, default_value) , name

namespace attn_export::ops {

// Everything of the core besides its tensors: masks, causality, scale and the trailing
// attributes (softcap, ...: attention_params.h), in schema order.
struct CoreOptions {
  std::optional<at::Tensor> attn_mask;
  std::optional<at::Tensor> key_padding_mask;
  bool is_causal = false;
  std::optional<double> scale;  // default 1/sqrt(head_dim)
  ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_FIELD)

  // Whether ALiBi is on: slopes given and not empty.
  bool has_alibi() const { return alibi_slopes.has_value() && !alibi_slopes->empty(); }

  // The non-tensor options as one value (what autograd keeps for the backward) and back.
  c10::IValue scalars() const {
    return c10::ivalue::Tuple::create({is_causal, scale ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_ARGUMENT)});
  }
  static CoreOptions from(std::optional<at::Tensor> attn_mask, std::optional<at::Tensor> key_padding_mask,
                          const c10::IValue& scalars) {
    const auto& s = scalars.toTupleRef().elements();
    CoreOptions o{std::move(attn_mask), std::move(key_padding_mask), s[0].toBool(), s[1].toOptional<double>()};
    size_t next = 2;
#define ATTN_EXPORT_ATTRIBUTE_READ(type, name, default_value) o.name = s[next++].to<type>();
    ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_READ)
#undef ATTN_EXPORT_ATTRIBUTE_READ
    return o;
  }
};

// attn_export::_attention_forward: q, k, v [B, H, L, D].
struct ForwardArgs {
  at::Tensor query, key, value;
  CoreOptions options;
  bool need_weights = false;
};

// attn_export::_attention_backward: the output's gradient (and the weights', when returned),
// the forward's inputs, its log-sum-exp and, when kept, its output (the flash backwards read
// rowsum(dO * O) from it).
struct BackwardArgs {
  at::Tensor grad_output;
  std::optional<at::Tensor> grad_weights;
  at::Tensor query, key, value, logsumexp;
  std::optional<at::Tensor> output;
  CoreOptions options;
};

using ForwardResults = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // output, logsumexp, weights
using CoreGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;       // dq, dk, dv

using ForwardImpl = ForwardResults (*)(const ForwardArgs&);
using BackwardImpl = CoreGrads (*)(const BackwardArgs&);

// The operators' kernels over one implementation, for each backend's TORCH_LIBRARY_IMPL:
//   m.impl(spec::kOpAttention, &attention_kernel<attention_forward_cpu>);
// Each takes its schema's arguments: the leading ones spelled here, then the trailing attributes.
template <ForwardImpl Impl>
at::Tensor attention_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                            std::optional<double> scale
                                ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_PARAMETER)) {
  const CoreOptions options{attn_mask, key_padding_mask, is_causal,
                            scale ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_ARGUMENT)};
  return std::get<0>(Impl({query, key, value, options, false}));
}

template <ForwardImpl Impl>
ForwardResults attention_forward_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask,
                                        const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                        std::optional<double> scale, bool need_weights
                                            ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_PARAMETER)) {
  const CoreOptions options{attn_mask, key_padding_mask, is_causal,
                            scale ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_ARGUMENT)};
  return Impl({query, key, value, options, need_weights});
}

template <BackwardImpl Impl>
CoreGrads attention_backward_kernel(const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights,
                                    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& logsumexp, const std::optional<at::Tensor>& attn_mask,
                                    const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                    std::optional<double> scale, const std::optional<at::Tensor>& output
                                        ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_PARAMETER)) {
  const CoreOptions options{attn_mask, key_padding_mask, is_causal,
                            scale ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_ARGUMENT)};
  return Impl({grad_output, grad_weights, query, key, value, logsumexp, output, options});
}

// The schemas against the adapters above: each core schema is its leading arguments (7, 8 and
// 11, as the adapters spell them) followed by exactly the trailing arguments, by name.
namespace schema_check {

// The argument list of a schema "(type name[=default], ...) -> results" (no argument has
// parentheses), its length and the name of argument `index`.
constexpr std::string_view argument_list(std::string_view schema) { return schema.substr(1, schema.find(')') - 1); }

constexpr int count_arguments(std::string_view schema) {
  const std::string_view list = argument_list(schema);
  int count = list.empty() ? 0 : 1;
  for (const char c : list) count += c == ',';
  return count;
}

constexpr std::string_view argument_name(std::string_view schema, int index) {
  std::string_view rest = argument_list(schema);
  for (int i = 0; i < index; ++i) rest = rest.substr(rest.find(',') + 1);
  std::string_view argument = rest.substr(0, rest.find(','));
  argument = argument.substr(0, argument.find('='));
  while (!argument.empty() && argument.back() == ' ') argument.remove_suffix(1);
  return argument.substr(argument.rfind(' ') + 1);
}

#define ATTN_EXPORT_ATTRIBUTE_NAME(type, name, default_value) #name,
inline constexpr std::string_view kTrailingNames[] = {ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_ATTRIBUTE_NAME)};
#undef ATTN_EXPORT_ATTRIBUTE_NAME
inline constexpr int kNumTrailing = static_cast<int>(sizeof(kTrailingNames) / sizeof(kTrailingNames[0]));

constexpr bool ends_with_trailing_attributes(std::string_view schema, int leading) {
  if (count_arguments(schema) != leading + kNumTrailing) return false;
  for (int i = 0; i < kNumTrailing; ++i) {
    if (argument_name(schema, leading + i) != kTrailingNames[i]) return false;
  }
  return true;
}

static_assert(ends_with_trailing_attributes(spec::kSchemaAttention, 7),
              "kSchemaAttention (csrc/attention_spec.h) must end with ATTN_EXPORT_TRAILING_ARGUMENTS "
              "(csrc/ops/core_args.h): the same names in the same order");
static_assert(ends_with_trailing_attributes(spec::kSchemaAttentionForward, 8),
              "kSchemaAttentionForward (csrc/attention_spec.h) must end with ATTN_EXPORT_TRAILING_ARGUMENTS "
              "(csrc/ops/core_args.h): the same names in the same order");
static_assert(ends_with_trailing_attributes(spec::kSchemaAttentionBackward, 11),
              "kSchemaAttentionBackward (csrc/attention_spec.h) must end with ATTN_EXPORT_TRAILING_ARGUMENTS "
              "(csrc/ops/core_args.h): the same names in the same order");

}  // namespace schema_check

}  // namespace attn_export::ops
