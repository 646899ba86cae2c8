// Tests of fusedAttentionCore (the plugin's fields, shape rules and params) with a plain C++
// compiler: no TensorRT, no CUDA. tests/trt/test_tensorrt_plugin.py compiles and runs it in CI.
//
//   core_test           run the checks; prints "core_test: N checks passed" (exit 1 on a failure)
//   core_test --fields  print the field table as JSON (compared with the spec, the ONNX node's
//                       attributes and the plugin README by the Python test)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fusedAttentionCore.h"
#include "reference_attention.h"

using namespace attn_export;
using namespace attn_export::trt_plugin;
using attn_export::trt_plugin::testing::reference_attention;

namespace {

int gChecks = 0;
int gFailures = 0;

void check(bool ok, const std::string& what) {
  ++gChecks;
  if (!ok) {
    ++gFailures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void check_error(const std::string& why, const std::string& expected, const std::string& what) {
  check(contains(why, expected), what + ": expected an error containing '" + expected + "', got '" + why + "'");
}

Shape shape(std::initializer_list<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) {
    s.d[s.rank++] = d;
  }
  return s;
}

Field int_field(const char* name, const int32_t* value) { return Field{name, value, 5, 1}; }
Field float_field(const char* name, const float* value) { return Field{name, value, 1, 1}; }

void test_fields_round_trip() {
  Config c;
  c.num_heads = 4;
  c.scale = 0.125F;
  c.is_causal = 1;
  c.has_key_padding_mask = 1;
  c.has_attn_mask = 0;
  c.softcap = 30.0F;
  c.causal_alignment = 1;
  c.kv_num_heads = 2;
  c.window = 3;
  Field fields[kNumFields];
  fields_to_serialize(c, fields);
  for (int32_t i = 0; i < kNumFields; ++i) {
    check(std::strcmp(fields[i].name, kFields[i].name) == 0, "serialized field order follows kFields");
    check(fields[i].type == static_cast<int32_t>(kFields[i].type) && fields[i].length == (i == kAlibiSlopesField ? 0 : 1),
          std::string("serialized type/length of ") + kFields[i].name);
  }
  check(fields[kAlibiSlopesField].data == nullptr, "no slopes: alibi_slopes serialized empty");
  Config back;
  const std::string why = parse_fields(fields, kNumFields, back);
  check(why.empty(), "round trip parses: " + why);
  check(back.num_heads == 4 && back.scale == 0.125F && back.is_causal == 1 && back.has_key_padding_mask == 1 &&
            back.has_attn_mask == 0 && back.softcap == 30.0F && back.causal_alignment == 1 && back.kv_num_heads == 2 &&
            back.window == 3,
        "round trip keeps every value");
  check(describe(back) == "num_heads=4 scale=0.125 is_causal=1 has_key_padding_mask=1 has_attn_mask=0 softcap=30 "
                          "causal_alignment=1 kv_num_heads=2 window=3 has_past=0",
        "describe: " + describe(back));

  // With slopes: a kFLOAT32 field of length num_heads, read back as written, and named by describe().
  c.alibi_slopes = {0.5F, 0.25F, 0.125F, 0.0625F};
  fields_to_serialize(c, fields);
  check(fields[kAlibiSlopesField].length == 4 && fields[kAlibiSlopesField].type == 1 &&
            fields[kAlibiSlopesField].data == c.alibi_slopes.data(),
        "slopes serialized as kFLOAT32 of length num_heads");
  Config with;
  check(parse_fields(fields, kNumFields, with).empty() && with.alibi_slopes == c.alibi_slopes,
        "round trip keeps the slopes");
  check(contains(describe(with), " has_past=0 alibi_slopes=[0.5,0.25,0.125,0.0625]"), "describe: " + describe(with));
}

void test_fields_defaults_and_errors() {
  const int32_t heads = 2, zero = 0, two = 2;
  const float scale = 0.5F, nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t heads64 = 2;
  Config c;

  Field required[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale)};
  check(parse_fields(required, 2, c).empty() && c.num_heads == 2 && c.scale == 0.5F && c.is_causal == 0 &&
            c.has_key_padding_mask == 0 && c.has_attn_mask == 0 && c.softcap == 0.0F && c.causal_alignment == 0 &&
            c.kv_num_heads == 0 && c.kv_heads() == 2,
        "optional fields default to 0 (the ONNX function's defaults; kv_num_heads 0 = num_heads)");

  Field unknown[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                     int_field("something_else", &two)};
  check(parse_fields(unknown, 3, c).empty(), "unknown fields are ignored");

  // ALiBi slopes: absent or empty = off; else one finite kFLOAT32 slope per query head.
  check(c.alibi_slopes.empty(), "alibi_slopes defaults to none");
  const float slopes[2] = {0.5F, 0.25F}, three_slopes[3] = {0.5F, 0.25F, 0.125F},
              bad_slopes[2] = {0.5F, nan};
  Field no_slopes[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                       Field{spec::kAttrAlibiSlopes, nullptr, 1, 0}};
  check(parse_fields(no_slopes, 3, c).empty() && c.alibi_slopes.empty(), "an empty alibi_slopes is no ALiBi");
  Field with_slopes[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                         Field{spec::kAttrAlibiSlopes, slopes, 1, 2}};
  check(parse_fields(with_slopes, 3, c).empty() && c.alibi_slopes == std::vector<float>{0.5F, 0.25F},
        "alibi_slopes read as float32, one per query head");
  Field wrong_count[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                         Field{spec::kAttrAlibiSlopes, three_slopes, 1, 3}};
  check_error(parse_fields(wrong_count, 3, c), "alibi_slopes must have one slope per query head (num_heads=2); got 3",
              "alibi_slopes of the wrong length");
  Field not_finite[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                        Field{spec::kAttrAlibiSlopes, bad_slopes, 1, 2}};
  check_error(parse_fields(not_finite, 3, c), "alibi_slopes must be finite; got nan for head 1", "NaN slope");
  const int32_t int_slopes[2] = {1, 2};
  Field int_typed[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                       Field{spec::kAttrAlibiSlopes, int_slopes, 5, 2}};
  check_error(parse_fields(int_typed, 3, c), "alibi_slopes must be kFLOAT32", "alibi_slopes as int32");
  Field no_data[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                     Field{spec::kAttrAlibiSlopes, nullptr, 1, 2}};
  check_error(parse_fields(no_data, 3, c), "with no data", "alibi_slopes without data");

  Field missing_heads[] = {float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(missing_heads, 1, c), "field num_heads is missing", "missing num_heads");
  Field missing_scale[] = {int_field(spec::kAttrNumHeads, &heads)};
  check_error(parse_fields(missing_scale, 1, c), "field scale is missing", "missing scale");

  Field float_heads[] = {Field{spec::kAttrNumHeads, &scale, 1, 1}, float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(float_heads, 2, c), "num_heads must be kINT32 of length 1; got kFLOAT32 of length 1",
              "num_heads as float");
  Field int64_heads[] = {Field{spec::kAttrNumHeads, &heads64, 10, 1}, float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(int64_heads, 2, c), "got kINT64", "num_heads as int64");
  Field long_heads[] = {Field{spec::kAttrNumHeads, &heads, 5, 2}, float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(long_heads, 2, c), "of length 2", "num_heads of length 2");
  Field null_heads[] = {Field{spec::kAttrNumHeads, nullptr, 5, 1}, float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(null_heads, 2, c), "with no data", "num_heads without data");
  Field twice[] = {int_field(spec::kAttrNumHeads, &heads), int_field(spec::kAttrNumHeads, &heads),
                   float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(twice, 3, c), "num_heads is given twice", "duplicate field");

  Field zero_heads[] = {int_field(spec::kAttrNumHeads, &zero), float_field(spec::kAttrScale, &scale)};
  check_error(parse_fields(zero_heads, 2, c), "num_heads must be >= 1; got 0", "num_heads 0");
  Field nan_scale[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &nan)};
  check_error(parse_fields(nan_scale, 2, c), "scale must be finite", "NaN scale");
  Field inf_scale[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &inf)};
  check_error(parse_fields(inf_scale, 2, c), "scale must be finite", "inf scale");
  for (const char* flag :
       {spec::kAttrIsCausal, spec::kAttrHasKeyPaddingMask, spec::kAttrHasAttnMask, spec::kAttrCausalAlignment}) {
    Field bad_flag[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                        int_field(flag, &two)};
    check_error(parse_fields(bad_flag, 3, c), std::string(flag) + " must be 0 or 1; got 2", flag);
  }
  const int32_t three = 3, minus_one = -1, one = 1;
  for (const int32_t* bad : {&three, &minus_one}) {
    Field bad_kv[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                      int_field(spec::kAttrKvNumHeads, bad)};
    check_error(parse_fields(bad_kv, 3, c),
                "kv_num_heads must divide num_heads=2 (0 = num_heads); got " + std::to_string(*bad), "bad kv_num_heads");
  }
  Field mqa[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                 int_field(spec::kAttrKvNumHeads, &one)};
  check(parse_fields(mqa, 3, c).empty() && c.kv_heads() == 1, "kv_num_heads 1: multi-query");
  const float negative = -1.0F;
  for (const float* bad : {&nan, &inf, &negative}) {
    Field bad_cap[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                       float_field(spec::kAttrSoftcap, bad)};
    check_error(parse_fields(bad_cap, 3, c), "softcap must be finite and >= 0", "bad softcap");
  }
  Field int_cap[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                     int_field(spec::kAttrSoftcap, &two)};
  check_error(parse_fields(int_cap, 3, c), "softcap must be kFLOAT32", "softcap as int");
  const float cap = 2.5F;
  Field with_cap[] = {int_field(spec::kAttrNumHeads, &heads), float_field(spec::kAttrScale, &scale),
                      float_field(spec::kAttrSoftcap, &cap)};
  check(parse_fields(with_cap, 3, c).empty() && c.softcap == 2.5F, "softcap is read as float32");
  Config untouched;
  untouched.num_heads = 7;
  parse_fields(zero_heads, 2, untouched);
  check(untouched.num_heads == 7, "a failed parse leaves the config as it was");
  check_error(parse_fields(nullptr, 3, c), "no field array", "null field array");
}

Config config(int32_t heads, bool kpm, bool mask) {
  Config c;
  c.num_heads = heads;
  c.scale = 1.0F;
  c.has_key_padding_mask = kpm ? 1 : 0;
  c.has_attn_mask = mask ? 1 : 0;
  return c;
}

void test_shapes() {
  const Config c = config(2, true, true);
  // B=2, Lq=3, Lk=5, H=2, D=4, Dv=6
  Shape ok[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({2, 5}), shape({2, 2, 3, 5})};
  check(check_shapes(c, ok, 5).empty(), "full shapes: " + check_shapes(c, ok, 5));
  const Shape out = output_shape(c, ok);
  check(out.rank == 3 && out.d[0] == 2 && out.d[1] == 3 && out.d[2] == 12, "output shape [B, Lq, H*Dv]");

  Shape symbolic[] = {shape({-1, -1, 8}), shape({-1, -1, 8}), shape({-1, -1, 12}), shape({-1, -1}),
                      shape({1, 1, -1, -1})};
  check(check_shapes(c, symbolic, 5).empty(), "unknown dims are not judged: " + check_shapes(c, symbolic, 5));

  Shape broadcast[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({1, 5}), shape({1, 2, 1, 5})};
  check(check_shapes(c, broadcast, 5).empty(), "size-1 mask dims broadcast");

  check_error(check_shapes(c, ok, 4), "takes 5 inputs with has_past=0; got 4", "input count");
  Shape rank[] = {shape({2, 3, 2, 4}), shape({2, 5, 8}), shape({2, 5, 12}), shape({2, 5}), shape({2, 2, 3, 5})};
  check_error(check_shapes(c, rank, 5), "input 0 (query) must have rank 3; got [2, 3, 2, 4] (rank 4)", "rank");
  Shape batch[] = {shape({2, 3, 8}), shape({3, 5, 8}), shape({2, 5, 12}), shape({2, 5}), shape({2, 2, 3, 5})};
  check_error(check_shapes(c, batch, 5), "share the batch dimension", "batch mismatch");
  Shape lk[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 4, 12}), shape({2, 5}), shape({2, 2, 3, 5})};
  check_error(check_shapes(c, lk, 5), "same length Lk", "Lk mismatch");
  Shape width[] = {shape({2, 3, 8}), shape({2, 5, 6}), shape({2, 5, 12}), shape({2, 5}), shape({2, 2, 3, 5})};
  check_error(check_shapes(c, width, 5), "key must be as wide as query", "key width");
  const Config three = config(3, false, false);
  Shape heads[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({1, 1}), shape({1, 1, 1, 1})};
  check_error(check_shapes(three, heads, 5), "num_heads=3 must divide the last dimension of query", "H | H*D");
  Shape narrow[] = {shape({2, 3, 0}), shape({2, 5, 0}), shape({2, 5, 12}), shape({1, 1}), shape({1, 1, 1, 1})};
  check_error(check_shapes(c, narrow, 5), "last dimension of query", "D >= 1");
  Shape kpm[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({3, 5}), shape({2, 2, 3, 5})};
  check_error(check_shapes(c, kpm, 5), "key_padding_mask must be [B or 1, Lk or 1]; got [3, 5]", "kpm batch");
  Shape mask[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({2, 5}), shape({2, 3, 3, 5})};
  check_error(check_shapes(c, mask, 5), "attn_mask must be [B or 1, H or 1, Lq or 1, Lk or 1] with H=2", "mask heads");
  // A mask whose has_* is 0 is the placeholder and is not looked at.
  const Config none = config(2, false, false);
  Shape placeholder[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({7, 7}), shape({7, 7, 7, 7})};
  check(check_shapes(none, placeholder, 5).empty(), "masks with has_*=0 are not checked");
}

void test_grouped_query_shapes() {
  // H=4 query heads over Hkv=2 key/value heads, D=4, Dv=6.
  Config c = config(4, false, false);
  c.kv_num_heads = 2;
  Shape ok[] = {shape({2, 3, 16}), shape({2, 5, 8}), shape({2, 5, 12}), shape({1, 1}), shape({1, 1, 1, 1})};
  check(check_shapes(c, ok, 5).empty(), "grouped-query shapes: " + check_shapes(c, ok, 5));
  const Shape out = output_shape(c, ok);
  check(out.rank == 3 && out.d[2] == 24, "grouped-query output [B, Lq, H*Dv] from value [B, Lk, Hkv*Dv]");
  Shape full_key[] = {shape({2, 3, 16}), shape({2, 5, 16}), shape({2, 5, 12}), shape({1, 1}), shape({1, 1, 1, 1})};
  check_error(check_shapes(c, full_key, 5), "key must be as wide as query times kv_num_heads / num_heads (Hkv*D with "
              "num_heads=4, Hkv=2); got query [2, 3, 16], key [2, 5, 16]", "key with every query head");
  Shape odd_value[] = {shape({2, 3, 16}), shape({2, 5, 8}), shape({2, 5, 7}), shape({1, 1}), shape({1, 1, 1, 1})};
  check_error(check_shapes(c, odd_value, 5), "kv_num_heads=2 must divide the last dimension of value",
              "value width and Hkv");
  Shape symbolic[] = {shape({-1, -1, 16}), shape({-1, -1, 8}), shape({-1, -1, -1}), shape({1, 1}),
                      shape({1, 1, 1, 1})};
  check(check_shapes(c, symbolic, 5).empty() && output_shape(c, symbolic).d[2] == -1,
        "an unknown value width gives an unknown output width");
}

void test_params_strides() {
  const Config c = config(2, true, true);
  Shape in[] = {shape({2, 3, 8}), shape({2, 5, 8}), shape({2, 5, 12}), shape({2, 5}), shape({1, 2, 1, 5})};
  int dummy[6];
  const void* ptrs[] = {&dummy[0], &dummy[1], &dummy[2], &dummy[3], &dummy[4]};
  const AttentionParams p = make_params(c, in, DataType::kFloat16, ptrs, &dummy[5], nullptr);
  check(p.batch == 2 && p.num_heads == 2 && p.num_heads_k == 2 && p.causal_alignment == 0 && p.seqlen_q == 3 && p.seqlen_k == 5 && p.head_dim == 4 &&
            p.head_dim_v == 6 && p.dtype == DataType::kFloat16,
        "params sizes");
  check(p.q == ptrs[0] && p.q_batch_stride == 24 && p.q_head_stride == 4 && p.q_row_stride == 8, "q strides");
  check(p.k == ptrs[1] && p.k_batch_stride == 40 && p.k_head_stride == 4 && p.k_row_stride == 8, "k strides");
  check(p.v == ptrs[2] && p.v_batch_stride == 60 && p.v_head_stride == 6 && p.v_row_stride == 12, "v strides");
  check(p.out == &dummy[5] && p.out_batch_stride == 36 && p.out_head_stride == 6 && p.out_row_stride == 12,
        "out strides");
  check(p.key_padding_mask.ptr == ptrs[3] && p.key_padding_mask.kind == MaskKind::kAdditive &&
            p.key_padding_mask.dtype == DataType::kFloat32 && p.key_padding_mask.batch_stride == 5 &&
            p.key_padding_mask.col_stride == 1,
        "key_padding_mask strides");
  check(p.attn_mask.ptr == ptrs[4] && p.attn_mask.batch_stride == 0 && p.attn_mask.head_stride == 5 &&
            p.attn_mask.row_stride == 0 && p.attn_mask.col_stride == 1,
        "attn_mask [1, H, 1, Lk] strides broadcast with 0");
  const AttentionParams none = make_params(config(2, false, false), in, DataType::kFloat32, ptrs, &dummy[5], nullptr);
  check(!none.key_padding_mask.present() && !none.attn_mask.present(), "has_*=0 masks are not passed to the kernels");
  check(workspace_bytes(c, 2, 3) == 256 && workspace_bytes(c, 64, 1000) == 64u * 2 * 1000 * 4 &&
            workspace_bytes(c, -1, 3) == 0,
        "workspace: float32 lse per (batch, head, query), 256-byte multiple");
  Config grouped = config(4, false, false);
  grouped.kv_num_heads = 1;
  grouped.is_causal = 1;
  grouped.causal_alignment = 1;
  Shape gin[] = {shape({2, 3, 16}), shape({2, 5, 4}), shape({2, 5, 6}), shape({1, 1}), shape({1, 1, 1, 1})};
  const AttentionParams g = make_params(grouped, gin, DataType::kFloat16, ptrs, &dummy[5], nullptr);
  check(g.num_heads == 4 && g.num_heads_k == 1 && g.head_dim == 4 && g.head_dim_v == 6 && g.causal_alignment == 1,
        "grouped params: num_heads_k, head dims from the kv widths, the alignment");
  check(g.k_batch_stride == 20 && g.k_head_stride == 4 && g.k_row_stride == 4 && g.v_batch_stride == 30 &&
            g.v_row_stride == 6 && g.out_batch_stride == 72 && g.out_head_stride == 6 && g.out_row_stride == 24,
        "grouped strides: key/value rows Hkv*D wide, output rows H*Dv");
}

// The same attention read through AttentionParams, the way the kernels address memory.
std::vector<double> through_params(const AttentionParams& p) {
  std::vector<double> out(p.batch * p.seqlen_q * p.num_heads * p.head_dim_v, 0.0);
  const float* q = static_cast<const float*>(p.q);
  const float* k = static_cast<const float*>(p.k);
  const float* v = static_cast<const float*>(p.v);
  const int64_t group = p.num_heads / p.num_heads_k;
  const int64_t shift = p.causal_alignment == 1 ? p.seqlen_k - p.seqlen_q : 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.num_heads; ++h)
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        const int64_t g = h / group;  // the key/value head of query head h
        std::vector<double> s(p.seqlen_k);
        double top = -INFINITY;
        for (int64_t j = 0; j < p.seqlen_k; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < p.head_dim; ++d)
            dot += double(q[b * p.q_batch_stride + h * p.q_head_stride + i * p.q_row_stride + d]) *
                k[b * p.k_batch_stride + g * p.k_head_stride + j * p.k_row_stride + d];
          s[j] = p.scale * dot;
          if (p.softcap > 0) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
          if (p.key_padding_mask.present()) {
            const AttentionMask& m = p.key_padding_mask;
            s[j] += static_cast<const float*>(m.ptr)[b * m.batch_stride + j * m.col_stride];
          }
          if (p.attn_mask.present()) {
            const AttentionMask& m = p.attn_mask;
            s[j] += static_cast<const float*>(m.ptr)[b * m.batch_stride + h * m.head_stride + i * m.row_stride +
                                                      j * m.col_stride];
          }
          if (p.alibi_slopes != nullptr) s[j] -= double(p.alibi_slopes[h]) * std::abs(double(i + p.seqlen_k - p.seqlen_q - j));
          if (p.is_causal && j > i + shift) s[j] = -INFINITY;
          top = std::max(top, s[j]);
        }
        if (top == -INFINITY) continue;
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - top));
        for (int64_t j = 0; j < p.seqlen_k; ++j)
          for (int64_t d = 0; d < p.head_dim_v; ++d)
            out[b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride + d] +=
                s[j] / sum * v[b * p.v_batch_stride + g * p.v_head_stride + j * p.v_row_stride + d];
      }
  return out;
}

void test_params_address_the_node_layout() {
  // Odd sizes, broadcast masks of every kind, causal and not, a fully masked query row.
  // Key/value with every head and with one shared head (multi-query), both causal alignments.
  const int64_t B = 2, Lq = 3, Lk = 5, H = 3, D = 4, Dv = 2;
  for (const int64_t Hkv : {H, int64_t{1}})
   for (const int alignment : {0, 1}) {
  unsigned seed = 1;
  auto rnd = [&seed]() { seed = seed * 1664525u + 1013904223u; return (seed >> 8) / 16777216.0F - 0.5F; };
  std::vector<float> q(B * Lq * H * D), k(B * Lk * Hkv * D), v(B * Lk * Hkv * Dv);
  for (float& x : q) x = rnd();
  for (float& x : k) x = rnd();
  for (float& x : v) x = rnd();
  const std::vector<Shape> kpm_shapes = {shape({B, Lk}), shape({1, Lk}), shape({B, 1}), shape({1, 1})};
  const std::vector<Shape> mask_shapes = {shape({B, H, Lq, Lk}), shape({1, 1, Lq, Lk}), shape({B, 1, 1, Lk}),
                                          shape({1, H, Lq, 1})};
  const std::vector<float> slopes = {0.5F, 0.25F, 0.125F};  // one per query head (H = 3)
  for (int causal = 0; causal < 2; ++causal)
   for (const bool alibi : {false, true})
   for (const float softcap : {0.0F, 0.3F})
    for (const Shape& ks : kpm_shapes)
      for (const Shape& ms : mask_shapes) {
        Config c = config(static_cast<int32_t>(H), true, true);
        c.scale = 0.5F;
        c.is_causal = causal;
        c.softcap = softcap;
        c.kv_num_heads = static_cast<int32_t>(Hkv);
        c.causal_alignment = alignment;
        if (alibi) c.alibi_slopes = slopes;
        std::vector<float> kpm_small(ks.d[0] * ks.d[1]), mask_small(ms.d[0] * ms.d[1] * ms.d[2] * ms.d[3]);
        for (float& x : kpm_small) x = rnd();
        for (float& x : mask_small) x = rnd();
        if (ms.d[0] == B && ms.d[3] == Lk) {
          for (int64_t j = 0; j < Lk; ++j) mask_small[j] = -INFINITY;  // batch 0, head 0(/all), query 0: nothing visible
        }
        // The same masks expanded to [B, Lk] and [B, H, Lq, Lk] for the naive formula.
        std::vector<float> kpm(B * Lk), mask(B * H * Lq * Lk);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < Lk; ++j)
            kpm[b * Lk + j] = kpm_small[(ks.d[0] == 1 ? 0 : b) * ks.d[1] + (ks.d[1] == 1 ? 0 : j)];
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < Lq; ++i)
              for (int64_t j = 0; j < Lk; ++j)
                mask[((b * H + h) * Lq + i) * Lk + j] =
                    mask_small[(((ms.d[0] == 1 ? 0 : b) * ms.d[1] + (ms.d[1] == 1 ? 0 : h)) * ms.d[2] +
                                (ms.d[2] == 1 ? 0 : i)) * ms.d[3] + (ms.d[3] == 1 ? 0 : j)];
        Shape in[] = {shape({B, Lq, H * D}), shape({B, Lk, Hkv * D}), shape({B, Lk, Hkv * Dv}), ks, ms};
        check(check_shapes(c, in, 5).empty(), "layout case passes the shape rules");
        const void* ptrs[] = {q.data(), k.data(), v.data(), kpm_small.data(), mask_small.data()};
        float out_dummy = 0;
        // The slopes' "device copy" is the config's own here (the plugin uploads them: upload_slopes()).
        const AttentionParams p = make_params(c, in, DataType::kFloat32, ptrs, &out_dummy, nullptr, nullptr, nullptr,
                                              alibi ? c.alibi_slopes.data() : nullptr);
        const std::vector<double> want = reference_attention(B, H, Lq, Lk, D, Dv, c.scale, causal, q, k, v, kpm, mask,
                                                             c.softcap, Hkv, alignment, c.alibi_slopes);
        const std::vector<double> got = through_params(p);
        double err = 0;
        for (size_t n = 0; n < want.size(); ++n) err = std::max(err, std::abs(want[n] - got[n]));
        check(p.softcap == softcap, "make_params passes softcap to the kernels");
        check((p.alibi_slopes != nullptr) == alibi, "make_params passes the slopes' device pointer, only with slopes");
        check(err < 1e-12, "params address [B, L, H*D] memory and broadcast masks like the node (causal=" +
                               std::to_string(causal) + ", alibi=" + std::to_string(alibi) + ", softcap=" +
                               std::to_string(softcap) + ", Hkv=" +
                               std::to_string(Hkv) + ", alignment=" + std::to_string(alignment) + ", kpm [" +
                               std::to_string(ks.d[0]) + "," + std::to_string(ks.d[1]) + "], err " +
                               std::to_string(err) + ")");
      }
   }
}

// Runs `copies` the way cudaMemcpy2DAsync would, from the inputs `src` into `dst`.
void run_copies(const std::vector<Copy2D>& copies, const void* const* src, void* dst) {
  for (const Copy2D& c : copies)
    for (int64_t r = 0; r < c.height; ++r)
      std::memcpy(static_cast<char*>(dst) + c.dst_offset + r * c.dst_pitch,
                  static_cast<const char*>(src[c.src]) + c.src_offset + r * c.src_pitch, c.width);
}

void test_cache_form() {
  // H=4 query heads over Hkv=2, D=4, Dv=2: the presents = [past | new] head-major, attention over
  // them through the params = the node's formula over cat(past, new) token-major. A decode step
  // (S=1 <= Hkv: copies per token), a chunk after a past (S=3 > Hkv: per head), an empty past.
  const int64_t B = 2, H = 4, Hkv = 2, D = 4, Dv = 2;
  for (const int64_t P : {int64_t{0}, int64_t{5}})
   for (const int64_t S : {int64_t{1}, int64_t{3}}) {
    const int64_t L = P + S;
    Config c = config(static_cast<int32_t>(H), true, false);
    c.kv_num_heads = static_cast<int32_t>(Hkv);
    c.is_causal = 1;
    c.causal_alignment = 1;
    c.has_past = 1;
    unsigned seed = static_cast<unsigned>(P * 10 + S);
    auto rnd = [&seed]() { seed = seed * 1664525u + 1013904223u; return (seed >> 8) / 16777216.0F - 0.5F; };
    std::vector<float> q(B * S * H * D), k(B * S * Hkv * D), v(B * S * Hkv * Dv), pk(B * Hkv * P * D),
        pv(B * Hkv * P * Dv), kpm(B * L, 0.0F), mask(B * H * S * L, 0.0F);
    for (auto* t : {&q, &k, &v, &pk, &pv})
      for (float& x : *t) x = rnd();
    kpm[L] = -INFINITY;  // batch 1's first key is padding
    float placeholder = 0.0F;
    Shape in[] = {shape({B, S, H * D}), shape({B, S, Hkv * D}), shape({B, S, Hkv * Dv}), shape({B, L}),
                  shape({1, 1, 1, 1}), shape({B, Hkv, P, D}), shape({B, Hkv, P, Dv})};
    const std::string why = check_shapes(c, in, 7);
    check(why.empty(), "cache-form shapes: " + why);
    const Shape pks = present_shape(c, in, 0), pvs = present_shape(c, in, 1);
    check(pks.rank == 4 && pks.d[0] == B && pks.d[1] == Hkv && pks.d[2] == L && pks.d[3] == D && pvs.d[3] == Dv,
          "present shapes [B, Hkv, P+S, D]");
    const void* ptrs[] = {q.data(), k.data(), v.data(), kpm.data(), &placeholder, pk.data(), pv.data()};
    std::vector<float> present_k(B * Hkv * L * D, NAN), present_v(B * Hkv * L * Dv, NAN);
    const std::vector<Copy2D> kc = present_copies(c, in, 0, sizeof(float));
    run_copies(kc, ptrs, present_k.data());
    run_copies(present_copies(c, in, 1, sizeof(float)), ptrs, present_v.data());
    check(kc.size() == static_cast<size_t>((P > 0 ? 1 : 0) + B * std::min(S, Hkv)), "one copy for the past, "
          "B*min(S, Hkv) for the new tokens");
    // The concatenation, token-major [B, L, Hkv*D], for the reference; and the presents checked.
    std::vector<float> k_all(B * L * Hkv * D), v_all(B * L * Hkv * Dv);
    bool exact = true;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t j = 0; j < L; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            const float want = j < P ? pk[((b * Hkv + g) * P + j) * D + d] : k[((b * S + j - P) * Hkv + g) * D + d];
            exact = exact && present_k[((b * Hkv + g) * L + j) * D + d] == want;
            k_all[(b * L + j) * Hkv * D + g * D + d] = want;
          }
          for (int64_t d = 0; d < Dv; ++d) {
            const float want = j < P ? pv[((b * Hkv + g) * P + j) * Dv + d] : v[((b * S + j - P) * Hkv + g) * Dv + d];
            exact = exact && present_v[((b * Hkv + g) * L + j) * Dv + d] == want;
            v_all[(b * L + j) * Hkv * Dv + g * Dv + d] = want;
          }
        }
    check(exact, "present = [past | new] head-major (P=" + std::to_string(P) + ", S=" + std::to_string(S) + ")");
    float out_dummy = 0;
    const AttentionParams p = make_params(c, in, DataType::kFloat32, ptrs, &out_dummy, nullptr, present_k.data(),
                                          present_v.data());
    check(p.seqlen_k == L && p.k == present_k.data() && p.k_head_stride == L * D && p.k_row_stride == D &&
              p.v_batch_stride == Hkv * L * Dv,
          "the kernels read K/V from the presents, head-major");
    const std::vector<double> want = reference_attention(B, H, S, L, D, Dv, c.scale, true, q, k_all, v_all, kpm, mask,
                                                         0.0, Hkv, 1);
    const std::vector<double> got = through_params(p);
    double err = 0;
    for (size_t n = 0; n < want.size(); ++n) err = std::max(err, std::abs(want[n] - got[n]));
    check(err < 1e-12, "cache form: attention over the present (P=" + std::to_string(P) + ", S=" +
                           std::to_string(S) + ", err " + std::to_string(err) + ")");
  }
  Config c = config(4, false, false);
  c.kv_num_heads = 2;
  c.has_past = 1;
  Shape ok[] = {shape({2, 1, 16}), shape({2, 1, 8}), shape({2, 1, 4}), shape({1, 1}), shape({1, 1, 1, 1}),
                shape({2, 2, 6, 4}), shape({2, 2, 6, 2})};
  check_error(check_shapes(c, ok, 5), "takes 7 inputs with has_past=1; got 5", "cache form: input count");
  Shape heads[] = {shape({2, 1, 16}), shape({2, 1, 8}), shape({2, 1, 4}), shape({1, 1}), shape({1, 1, 1, 1}),
                   shape({2, 4, 6, 4}), shape({2, 4, 6, 2})};
  check_error(check_shapes(c, heads, 7), "past_key and past_value must be [B, Hkv, P, D] and [B, Hkv, P, Dv] (the "
              "key/value heads Hkv=2", "cache form: past heads");
  Shape lengths[] = {shape({2, 1, 16}), shape({2, 1, 8}), shape({2, 1, 4}), shape({1, 1}), shape({1, 1, 1, 1}),
                     shape({2, 2, 6, 4}), shape({2, 2, 5, 2})};
  check_error(check_shapes(c, lengths, 7), "one past length P", "cache form: P differs");
  Shape rank[] = {shape({2, 1, 16}), shape({2, 1, 8}), shape({2, 1, 4}), shape({1, 1}), shape({1, 1, 1, 1}),
                  shape({2, 12, 4}), shape({2, 2, 6, 2})};
  check_error(check_shapes(c, rank, 7), "input 5 (past_key) must have rank 4", "cache form: past rank");
  c.has_key_padding_mask = 1;
  Shape kpm[] = {shape({2, 1, 16}), shape({2, 1, 8}), shape({2, 1, 4}), shape({2, 6}), shape({1, 1, 1, 1}),
                 shape({2, 2, 6, 4}), shape({2, 2, 6, 2})};
  check_error(check_shapes(c, kpm, 7), "key_padding_mask must be [B or 1, Lk or 1]", "cache form: the mask spans P+S");
  Shape symbolic[] = {shape({-1, -1, 16}), shape({-1, -1, 8}), shape({-1, -1, 4}), shape({-1, -1}), shape({1, 1, 1, 1}),
                      shape({-1, 2, -1, 4}), shape({-1, 2, -1, 2})};
  check(check_shapes(c, symbolic, 7).empty() && present_shape(c, symbolic, 0).d[2] == -1,
        "unknown past and new lengths: an unknown present length");
  check(c.num_inputs() == 7 && c.num_outputs() == 3 && config(2, false, false).num_outputs() == 1,
        "the cache form has 7 inputs and 3 outputs, the plain one 5 and 1");
  c.has_past = 2;
  check_error(validate_config(c), "has_past must be 0 or 1; got 2", "has_past flag");
}

void print_fields() {
  std::printf("[");
  for (int32_t i = 0; i < kNumFields; ++i) {
    std::printf("%s{\"name\": \"%s\", \"type\": %d, \"required\": %s}", i ? ", " : "", kFields[i].name,
                static_cast<int32_t>(kFields[i].type), kFields[i].required ? "true" : "false");
  }
  std::printf("]\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--fields") == 0) {
    print_fields();
    return 0;
  }
  test_fields_round_trip();
  test_fields_defaults_and_errors();
  test_shapes();
  test_grouped_query_shapes();
  test_params_strides();
  test_params_address_the_node_layout();
  test_cache_form();
  if (gFailures) {
    std::fprintf(stderr, "core_test: %d of %d checks failed\n", gFailures, gChecks);
    return 1;
  }
  std::printf("core_test: %d checks passed\n", gChecks);
  return 0;
}
