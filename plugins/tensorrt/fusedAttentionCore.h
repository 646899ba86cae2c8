// The TensorRT-free half of the FusedAttention plugin: its fields, their validation and
// (de)serialization, the shape rules of the node and the AttentionParams an enqueue() fills.
//
// Nothing here includes TensorRT or CUDA headers, so tests/core_test.cpp compiles and runs it
// with a plain C++ compiler (tests/trt/test_tensorrt_plugin.py does, in CI). fusedAttentionPlugin.cpp
// is the only file that speaks TensorRT; it converts nvinfer1::PluginField <-> Field and
// nvinfer1::Dims <-> Shape and static_asserts that FieldType mirrors nvinfer1::PluginFieldType.
//
// Every name comes from csrc/attention_spec.h (the one spec of the node); the field table below
// is the only list of the plugin's fields: the creator declares it, createPlugin() parses it,
// getFieldsToSerialize() writes it, and the Python preflight compares it with the ONNX nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_params.h"
#include "attention_spec.h"

namespace attn_export::trt_plugin {

// The numeric values of nvinfer1::PluginFieldType for the field types the plugin uses.
enum class FieldType : int32_t { kFloat32 = 1, kInt32 = 5, kChar = 6 };

// The field type TensorRT's ONNX parser hands the creator for an attribute of ONNX type
// `attr_type` (spec::kAttrType*): INT -> kINT32, FLOAT -> kFLOAT32, each of length 1; FLOATS ->
// kFLOAT32 of the list's length.
constexpr FieldType field_type(int attr_type) {
  return attr_type == spec::kAttrTypeFloat || attr_type == spec::kAttrTypeFloats ? FieldType::kFloat32
      : attr_type == spec::kAttrTypeInt    ? FieldType::kInt32
                                           : FieldType::kChar;
}

struct FieldSpec {
  const char* name;
  FieldType type;
  bool required;        // no default: the exporter always writes it
  int32_t default_int;  // the value of an absent optional INT32 field
  float default_float;  // ... and of an absent optional FLOAT32 one
};

constexpr FieldSpec field_spec(const spec::Attribute& a) {
  return {a.name, field_type(a.type), a.required, a.default_int, static_cast<float>(a.default_float)};
}

// The plugin's fields: the node's attributes up to spec::kNumPluginFields, with the spec's
// names, types, required flags and defaults, in the order they are declared and serialized
// (their meaning: the parameters table of README.md). plugin_version / plugin_namespace, the
// attributes after them, are read by the parser itself and are not fields.
inline constexpr int32_t kNumFields = spec::kNumPluginFields;
inline constexpr FieldSpec kFields[kNumFields] = {
    field_spec(spec::kAttributes[0]), field_spec(spec::kAttributes[1]), field_spec(spec::kAttributes[2]),
    field_spec(spec::kAttributes[3]), field_spec(spec::kAttributes[4]), field_spec(spec::kAttributes[5]),
    field_spec(spec::kAttributes[6]), field_spec(spec::kAttributes[7]), field_spec(spec::kAttributes[8]),
    field_spec(spec::kAttributes[9]), field_spec(spec::kAttributes[10]),
};

// The one field of variable length: alibi_slopes, kFLOAT32 of length num_heads (or 0 / absent: off).
inline constexpr int32_t kAlibiSlopesField = 10;

// Config holds the fields in this order; the optional flags, causal_alignment, kv_num_heads,
// window and has_past are INT32 (defaults: default_int), softcap FLOAT32 (default: default_float) and
// alibi_slopes a FLOAT32 list (default: empty).
static_assert(kNumFields == 11 && kFields[0].name == spec::kAttrNumHeads && kFields[1].name == spec::kAttrScale &&
                  kFields[2].name == spec::kAttrIsCausal && kFields[3].name == spec::kAttrHasKeyPaddingMask &&
                  kFields[4].name == spec::kAttrHasAttnMask && kFields[5].name == spec::kAttrSoftcap &&
                  kFields[6].name == spec::kAttrCausalAlignment && kFields[7].name == spec::kAttrKvNumHeads &&
                  kFields[8].name == spec::kAttrWindow && kFields[9].name == spec::kAttrHasPast &&
                  kFields[kAlibiSlopesField].name == spec::kAttrAlibiSlopes,
              "Config and slot() follow the spec's attribute order");
static_assert(kFields[0].type == FieldType::kInt32 && kFields[1].type == FieldType::kFloat32 &&
                  kFields[2].type == FieldType::kInt32 && kFields[3].type == FieldType::kInt32 &&
                  kFields[4].type == FieldType::kInt32 && kFields[5].type == FieldType::kFloat32 &&
                  kFields[6].type == FieldType::kInt32 && kFields[7].type == FieldType::kInt32 &&
                  kFields[8].type == FieldType::kInt32 && kFields[9].type == FieldType::kInt32 &&
                  kFields[kAlibiSlopesField].type == FieldType::kFloat32,
              "Config's members have the spec's types");

// A plugin field as nvinfer1::PluginField holds it, without TensorRT's types.
struct Field {
  const char* name = nullptr;
  const void* data = nullptr;
  int32_t type = 0;  // a FieldType value (nvinfer1::PluginFieldType)
  int32_t length = 0;
};

// The plugin's configuration: one value per field; optional fields start at their defaults.
struct Config {
  int32_t num_heads = 0;
  float scale = 0.0F;
  int32_t is_causal = kFields[2].default_int;
  int32_t has_key_padding_mask = kFields[3].default_int;
  int32_t has_attn_mask = kFields[4].default_int;
  float softcap = kFields[5].default_float;  // 0 = off; else softcap * tanh(x / softcap)
  int32_t causal_alignment = kFields[6].default_int;  // 0 top-left, 1 bottom-right
  int32_t kv_num_heads = kFields[7].default_int;      // Hkv dividing num_heads; 0 = num_heads
  int32_t window = kFields[8].default_int;            // with is_causal: the last `window` keys; 0 = all
  int32_t has_past = kFields[9].default_int;          // 1: the cache form (7 inputs, 3 outputs)
  // ALiBi: one finite slope per query head (num_heads of them), -slope[h] * |i + Lk - Lq - j| added
  // with the masks; empty = off. The plugin copies them to device memory it owns (AttentionParams).
  std::vector<float> alibi_slopes;

  // The key/value heads Hkv (kv_num_heads, or num_heads when 0).
  int32_t kv_heads() const { return kv_num_heads > 0 ? kv_num_heads : num_heads; }
  // The node's input and output counts: 5 and 1, or 7 and 3 in the cache form (has_past).
  int32_t num_inputs() const { return has_past != 0 ? spec::kNumPastInputs : spec::kNumInputs; }
  int32_t num_outputs() const { return has_past != 0 ? spec::kNumPastOutputs : spec::kNumOutputs; }
};

// The most inputs a node has (the cache form's), for arrays indexed by input.
inline constexpr int32_t kMaxInputs = spec::kNumPastInputs;

// Reads `count` fields into `out` (defaults for absent optional fields) and validates the
// result. Returns "" on success, otherwise one sentence naming the field and what is wrong.
// Unknown field names are ignored (they are not the plugin's).
std::string parse_fields(const Field* fields, int32_t count, Config& out);

// "" when every value is acceptable, otherwise why not.
std::string validate_config(const Config& config);

// The fields of `config` in kFields order, pointing into `config` (which must outlive them);
// alibi_slopes has the slopes' length (0 and no data when off).
void fields_to_serialize(const Config& config, Field (&out)[kNumFields]);

// "num_heads=4 scale=0.125 is_causal=0 has_key_padding_mask=1 has_attn_mask=0 softcap=0
//  causal_alignment=0 kv_num_heads=0 window=0 has_past=0" (then " alibi_slopes=[0.5,0.25,...]" with slopes)
std::string describe(const Config& config);

// A tensor shape as the plugin sees it; -1 marks a dimension unknown at build time.
struct Shape {
  int32_t rank = 0;
  int64_t d[4] = {0, 0, 0, 0};
};

// The node's shape rules (docs/onnx_node.md), checked on the dimensions that are known:
// config.num_inputs() inputs of ranks 3/3/3/2/4 (cache form: then 4/4), query/key/value sharing
// the batch, key/value sharing their length, H dividing the packed query width and Hkv the value
// width, key Hkv*D wide (D = query width / H), and each mask dimension 1 or equal to the
// dimension it stands for, Lk being the key length or, in the cache form, P + S. The cache form's
// past_key/past_value are [B, Hkv, P, D] / [B, Hkv, P, Dv] with one P. Masks whose has_* is 0 are
// not looked at. "" when fine.
std::string check_shapes(const Config& config, const Shape* inputs, int32_t count);

// The output shape [B, Lq, H*Dv] (Dv = value width / Hkv) for inputs that passed check_shapes.
Shape output_shape(const Config& config, const Shape* inputs);

// The cache form's present_key (`which` 0) or present_value (1): [B, Hkv, P+S, D or Dv] (-1 where
// P or S is unknown).
Shape present_shape(const Config& config, const Shape* inputs, int32_t which);

// The kernels' params for one enqueue(): q/out token-major [B, L, H*D] (row stride H*D, head
// stride D), k/v [B, Lk, Hkv*D] (num_heads_k = Hkv), or in the cache form the presents
// `present_key`/`present_value` head-major [B, Hkv, P+S, D] (Lk = P+S), the causal alignment as
// configured, masks additive float32 with stride 0 on size-1 dimensions, lse in `lse`
// (workspace_bytes() of float32), the ALiBi slopes from `alibi_slopes` (the config's slopes in
// device memory, [num_heads] float32; nullptr when the config has none). `inputs` must have
// passed check_shapes with known dims.
AttentionParams make_params(const Config& config, const Shape* inputs, DataType dtype,
                            const void* const* input_ptrs, void* output, void* lse,
                            const void* present_key = nullptr, const void* present_value = nullptr,
                            const float* alibi_slopes = nullptr);

// One strided copy, as cudaMemcpy2DAsync takes it (bytes): `height` rows of `width` bytes from
// input `src` at src_offset + r * src_pitch to the present at dst_offset + r * dst_pitch.
struct Copy2D {
  int32_t src = 0;  // the input index: spec::kInputPastKey / kInputKey / ...
  int64_t src_offset = 0, src_pitch = 0, dst_offset = 0, dst_pitch = 0, width = 0, height = 0;
};

// The copies that write present_key (`which` 0) or present_value (1) = [past | new] for inputs
// that passed check_shapes with known dims, elements of `element_bytes`: the past in one copy
// (B*Hkv rows of P*D), the new tokens token-major [B, S, Hkv*D] -> head-major in B*min(S, Hkv)
// copies (per batch and token when S <= Hkv, a decode step; per batch and head otherwise).
// Empty parts (P = 0, S = 0) give no copy.
std::vector<Copy2D> present_copies(const Config& config, const Shape* inputs, int32_t which, int64_t element_bytes);

// Workspace for the kernels' log-sum-exp output: batch * H * seqlen_q float32, rounded up
// to 256 bytes (the forward writes it; nothing reads it in inference).
size_t workspace_bytes(const Config& config, int64_t batch, int64_t seqlen_q);

}  // namespace attn_export::trt_plugin
