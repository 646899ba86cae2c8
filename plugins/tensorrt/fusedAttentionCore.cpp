#include "fusedAttentionCore.h"

#include <cmath>
#include <cstring>
#include <sstream>

namespace attn_export::trt_plugin {
namespace {

const char* type_name(int32_t type) {
  // nvinfer1::PluginFieldType, by value.
  static const char* const kNames[] = {"kFLOAT16", "kFLOAT32", "kFLOAT64", "kINT8", "kINT16", "kINT32",
                                       "kCHAR",    "kDIMS",    "kUNKNOWN", "kBF16", "kINT64"};
  return type >= 0 && type < static_cast<int32_t>(sizeof(kNames) / sizeof(kNames[0])) ? kNames[type] : "unknown";
}

bool known(int64_t d) { return d >= 0; }

std::string shape_text(const Shape& s) {
  std::ostringstream out;
  out << "[";
  for (int32_t i = 0; i < s.rank && i < 4; ++i) {
    out << (i ? ", " : "");
    if (known(s.d[i])) {
      out << s.d[i];
    } else {
      out << "?";
    }
  }
  out << "]";
  return out.str();
}

// Field i of kFields as stored in a Config: the 4-byte scalars (not alibi_slopes, a list).
void* slot(Config& c, int32_t i) {
  switch (i) {
    case 0: return &c.num_heads;
    case 1: return &c.scale;
    case 2: return &c.is_causal;
    case 3: return &c.has_key_padding_mask;
    case 4: return &c.has_attn_mask;
    case 5: return &c.softcap;
    case 6: return &c.causal_alignment;
    case 7: return &c.kv_num_heads;
    case 8: return &c.window;
    case 9: return &c.has_past;
    default: return nullptr;
  }
}

const void* slot(const Config& c, int32_t i) { return slot(const_cast<Config&>(c), i); }

// `d` may stand for `full` in a broadcast mask: 1, equal, or not known yet.
bool broadcastable(int64_t d, int64_t full) { return !known(d) || !known(full) || d == 1 || d == full; }

int64_t stride_or_zero(int64_t size, int64_t stride) { return size == 1 ? 0 : stride; }

const char* input_name(int32_t i) {
  return i < spec::kNumInputs ? spec::kInputNames[i] : spec::kPastInputNames[i - spec::kNumInputs];
}

// Lk: the key length, or in the cache form P + S (-1 when either is unknown).
int64_t key_length(const Config& c, const Shape* in) {
  const int64_t s = in[spec::kInputKey].d[1];
  if (c.has_past == 0) {
    return s;
  }
  const int64_t p = in[spec::kInputPastKey].d[2];
  return known(p) && known(s) ? p + s : -1;
}

// The cache form's past_key [B, Hkv, P, D] and past_value [B, Hkv, P, Dv] against query, key and
// value (ranks already checked). "" when fine.
std::string check_past(const Config& c, const Shape* in) {
  const Shape& q = in[spec::kInputQuery];
  const Shape& pk = in[spec::kInputPastKey];
  const Shape& pv = in[spec::kInputPastValue];
  const int64_t kv_heads = c.kv_heads();
  const auto differ = [](int64_t a, int64_t b) { return known(a) && known(b) && a != b; };
  const auto head_size = [&](int32_t input) {
    const int64_t width = in[input].d[2];
    return known(width) ? width / kv_heads : -1;
  };
  const bool bad = differ(pk.d[0], q.d[0]) || differ(pv.d[0], q.d[0]) || differ(pk.d[1], kv_heads) ||
      differ(pv.d[1], kv_heads) || differ(pk.d[2], pv.d[2]) || differ(pk.d[3], head_size(spec::kInputKey)) ||
      differ(pv.d[3], head_size(spec::kInputValue));
  if (!bad) {
    return "";
  }
  std::ostringstream why;
  why << spec::kPastInputNames[0] << " and " << spec::kPastInputNames[1]
      << " must be [B, Hkv, P, D] and [B, Hkv, P, Dv] (the key/value heads Hkv=" << kv_heads
      << ", their head sizes, one past length P); got " << shape_text(pk) << " and " << shape_text(pv) << " with query "
      << shape_text(q) << ", key " << shape_text(in[spec::kInputKey]) << ", value "
      << shape_text(in[spec::kInputValue]);
  return why.str();
}

// The masks whose has_* is 1 against query and the key length (P + S in the cache form).
std::string check_masks(const Config& c, const Shape* in, const std::string& shapes) {
  const Shape& q = in[spec::kInputQuery];
  const int64_t lk = key_length(c, in);
  if (c.has_key_padding_mask) {
    const Shape& m = in[spec::kInputKeyPaddingMask];
    if (!broadcastable(m.d[0], q.d[0]) || !broadcastable(m.d[1], lk)) {
      return std::string(spec::kInputNames[spec::kInputKeyPaddingMask]) + " must be [B or 1, Lk or 1]; got " +
          shape_text(m) + " with " + shapes;
    }
  }
  if (c.has_attn_mask) {
    const Shape& m = in[spec::kInputAttnMask];
    if (!broadcastable(m.d[0], q.d[0]) || !broadcastable(m.d[1], c.num_heads) || !broadcastable(m.d[2], q.d[1]) ||
        !broadcastable(m.d[3], lk)) {
      std::ostringstream why;
      why << spec::kInputNames[spec::kInputAttnMask] << " must be [B or 1, H or 1, Lq or 1, Lk or 1] with H="
          << c.num_heads << "; got " << shape_text(m) << " with " << shapes;
      return why.str();
    }
  }
  return "";
}

}  // namespace

std::string validate_config(const Config& c) {
  std::ostringstream why;
  if (c.num_heads < 1) {
    why << spec::kAttrNumHeads << " must be >= 1; got " << c.num_heads;
  } else if (!std::isfinite(c.scale)) {
    why << spec::kAttrScale << " must be finite; got " << c.scale;
  } else if (!std::isfinite(c.softcap) || c.softcap < 0.0F) {
    // tanh(x / softcap) is defined for softcap > 0; 0 is "off", a negative cap is meaningless.
    why << spec::kAttrSoftcap << " must be finite and >= 0; got " << c.softcap;
  } else if (c.kv_num_heads < 0 || c.num_heads % c.kv_heads() != 0) {
    // Query head h reads key/value head h / (H / Hkv): the groups must be whole.
    why << spec::kAttrKvNumHeads << " must divide " << spec::kAttrNumHeads << "=" << c.num_heads
        << " (0 = " << spec::kAttrNumHeads << "); got " << c.kv_num_heads;
  } else if (c.window < 0 || (c.window > 0 && c.is_causal == 0)) {
    // The window ends at the causal diagonal: only causal attention has one.
    why << spec::kAttrWindow << " must be >= 0 (0 = no window), and > 0 only with " << spec::kAttrIsCausal
        << "=1; got " << spec::kAttrWindow << "=" << c.window << " " << spec::kAttrIsCausal << "=" << c.is_causal;
  } else if (!c.alibi_slopes.empty() && static_cast<int64_t>(c.alibi_slopes.size()) != c.num_heads) {
    // One slope per QUERY head (grouped-query attention indexes them by h, not by the key/value head).
    why << spec::kAttrAlibiSlopes << " must have one slope per query head (" << spec::kAttrNumHeads << "="
        << c.num_heads << "); got " << c.alibi_slopes.size();
  } else {
    for (size_t h = 0; h < c.alibi_slopes.size(); ++h) {
      if (!std::isfinite(c.alibi_slopes[h])) {
        why << spec::kAttrAlibiSlopes << " must be finite; got " << c.alibi_slopes[h] << " for head " << h;
        return why.str();
      }
    }
    const int32_t flags[] = {c.is_causal, c.has_key_padding_mask, c.has_attn_mask, c.causal_alignment, c.has_past};
    const char* const names[] = {kFields[2].name, kFields[3].name, kFields[4].name, kFields[6].name, kFields[9].name};
    for (int32_t i = 0; i < 5; ++i) {
      if (flags[i] != 0 && flags[i] != 1) {
        why << names[i] << " must be 0 or 1; got " << flags[i];
        break;
      }
    }
  }
  return why.str();
}

std::string parse_fields(const Field* fields, int32_t count, Config& out) {
  Config c;
  bool seen[kNumFields] = {};
  if (count > 0 && fields == nullptr) {
    return "the field collection has fields but no field array";
  }
  for (int32_t f = 0; f < count; ++f) {
    const Field& field = fields[f];
    if (field.name == nullptr) {
      continue;
    }
    for (int32_t i = 0; i < kNumFields; ++i) {
      if (std::strcmp(field.name, kFields[i].name) != 0) {
        continue;
      }
      std::ostringstream why;
      if (seen[i]) {
        why << "field " << kFields[i].name << " is given twice";
      } else if (i == kAlibiSlopesField) {
        // A list: kFLOAT32 of any length (0 = off; validate_config wants num_heads of them).
        if (field.type != static_cast<int32_t>(FieldType::kFloat32) || field.length < 0 ||
            (field.length > 0 && field.data == nullptr)) {
          why << "field " << kFields[i].name << " must be kFLOAT32 (one slope per query head); got "
              << type_name(field.type) << " of length " << field.length << (field.data == nullptr ? " with no data" : "");
          return why.str();
        }
        const float* data = static_cast<const float*>(field.data);
        c.alibi_slopes.assign(data, data + field.length);
        seen[i] = true;
        continue;
      } else if (field.type != static_cast<int32_t>(kFields[i].type) || field.length != 1 || field.data == nullptr) {
        why << "field " << kFields[i].name << " must be " << type_name(static_cast<int32_t>(kFields[i].type))
            << " of length 1; got " << type_name(field.type) << " of length " << field.length
            << (field.data == nullptr ? " with no data" : "");
      }
      if (!why.str().empty()) {
        return why.str();
      }
      std::memcpy(slot(c, i), field.data, 4);  // int32_t and float: 4 bytes each
      seen[i] = true;
    }
  }
  for (int32_t i = 0; i < kNumFields; ++i) {
    if (kFields[i].required && !seen[i]) {
      return std::string("field ") + kFields[i].name + " is missing (every " + spec::kOpType +
          " node written by attn-export carries the attribute)";
    }
  }
  std::string why = validate_config(c);
  if (why.empty()) {
    out = c;
  }
  return why;
}

void fields_to_serialize(const Config& config, Field (&out)[kNumFields]) {
  for (int32_t i = 0; i < kNumFields; ++i) {
    out[i] = Field{kFields[i].name, slot(config, i), static_cast<int32_t>(kFields[i].type), 1};
  }
  const std::vector<float>& slopes = config.alibi_slopes;
  out[kAlibiSlopesField].data = slopes.empty() ? nullptr : slopes.data();
  out[kAlibiSlopesField].length = static_cast<int32_t>(slopes.size());
}

std::string describe(const Config& c) {
  std::ostringstream out;
  out << spec::kAttrNumHeads << "=" << c.num_heads << " " << spec::kAttrScale << "=" << c.scale << " "
      << spec::kAttrIsCausal << "=" << c.is_causal << " " << spec::kAttrHasKeyPaddingMask << "="
      << c.has_key_padding_mask << " " << spec::kAttrHasAttnMask << "=" << c.has_attn_mask << " "
      << spec::kAttrSoftcap << "=" << c.softcap << " " << spec::kAttrCausalAlignment << "=" << c.causal_alignment
      << " " << spec::kAttrKvNumHeads << "=" << c.kv_num_heads << " " << spec::kAttrWindow << "=" << c.window << " "
      << spec::kAttrHasPast << "=" << c.has_past;
  if (!c.alibi_slopes.empty()) {  // only with slopes: a node without them describes itself as before
    out << " " << spec::kAttrAlibiSlopes << "=[";
    for (size_t h = 0; h < c.alibi_slopes.size(); ++h) {
      out << (h ? "," : "") << c.alibi_slopes[h];
    }
    out << "]";
  }
  return out.str();
}

std::string check_shapes(const Config& c, const Shape* in, int32_t count) {
  std::ostringstream why;
  if (count != c.num_inputs() || in == nullptr) {
    why << spec::kOpType << " takes " << c.num_inputs() << " inputs with " << spec::kAttrHasPast << "=" << c.has_past
        << "; got " << count;
    return why.str();
  }
  for (int32_t i = 0; i < count; ++i) {
    const int32_t rank = i < spec::kNumInputs ? spec::kInputRanks[i] : spec::kCacheRank;
    if (in[i].rank != rank) {
      why << "input " << i << " (" << input_name(i) << ") must have rank " << rank << "; got " << shape_text(in[i])
          << " (rank " << in[i].rank << ")";
      return why.str();
    }
  }
  const Shape& q = in[spec::kInputQuery];
  const Shape& k = in[spec::kInputKey];
  const Shape& v = in[spec::kInputValue];
  const int64_t heads = c.num_heads, kv_heads = c.kv_heads();
  const auto differ = [](int64_t a, int64_t b) { return known(a) && known(b) && a != b; };
  const std::string shapes =
      "query " + shape_text(q) + ", key " + shape_text(k) + ", value " + shape_text(v);
  if (differ(k.d[0], q.d[0]) || differ(v.d[0], q.d[0])) {
    return "query, key and value must share the batch dimension; got " + shapes;
  }
  if (differ(v.d[1], k.d[1])) {
    return "key and value must have the same length Lk; got " + shapes;
  }
  if (c.has_past != 0) {
    const std::string past = check_past(c, in);
    if (!past.empty()) {
      return past;
    }
  }
  for (const int32_t i : {spec::kInputQuery, spec::kInputValue}) {
    const int64_t width = in[i].d[2], n = i == spec::kInputQuery ? heads : kv_heads;
    if (known(width) && (width < n || width % n != 0)) {
      why << (i == spec::kInputQuery || c.kv_num_heads == 0 ? spec::kAttrNumHeads : spec::kAttrKvNumHeads) << "=" << n
          << " must divide the last dimension of " << spec::kInputNames[i] << " (heads*D with D >= 1); got "
          << shapes;
      return why.str();
    }
  }
  if (known(k.d[2]) && known(q.d[2]) && k.d[2] * heads != q.d[2] * kv_heads) {
    // Hkv heads of query's head size D = query width / H.
    why << "key must be as wide as query times " << spec::kAttrKvNumHeads << " / " << spec::kAttrNumHeads
        << " (Hkv*D with " << spec::kAttrNumHeads << "=" << heads << ", Hkv=" << kv_heads << "); got " << shapes;
    return why.str();
  }
  return check_masks(c, in, shapes);
}

Shape output_shape(const Config& c, const Shape* in) {
  Shape out;
  out.rank = spec::kOutputRank;
  out.d[0] = in[spec::kInputQuery].d[0];
  out.d[1] = in[spec::kInputQuery].d[1];
  const int64_t width_v = in[spec::kInputValue].d[2];
  out.d[2] = known(width_v) ? width_v / c.kv_heads() * c.num_heads : width_v;
  return out;
}

Shape present_shape(const Config& c, const Shape* in, int32_t which) {
  const Shape& past = in[which == 0 ? spec::kInputPastKey : spec::kInputPastValue];
  Shape out = past;
  out.rank = spec::kCacheRank;
  out.d[2] = key_length(c, in);
  return out;
}

std::vector<Copy2D> present_copies(const Config& c, const Shape* in, int32_t which, int64_t e) {
  const int32_t past_input = which == 0 ? spec::kInputPastKey : spec::kInputPastValue;
  const int32_t new_input = which == 0 ? spec::kInputKey : spec::kInputValue;
  const int64_t batch = in[spec::kInputQuery].d[0], heads = c.kv_heads();
  const int64_t p = in[past_input].d[2], s = in[new_input].d[1], d = in[new_input].d[2] / heads, l = p + s;
  const int64_t row = d * e;  // one head's vector, in bytes
  std::vector<Copy2D> copies;
  if (p > 0) {  // every (b, h) block of the past: P*D contiguous in both, at pitch L*D in the present
    copies.push_back(Copy2D{past_input, 0, p * row, 0, l * row, p * row, batch * heads});
  }
  if (s <= 0) {
    return copies;
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (s <= heads) {  // per token: its Hkv heads are consecutive in the input, L*D apart in the present
      for (int64_t t = 0; t < s; ++t) {
        copies.push_back(Copy2D{new_input, (b * s + t) * heads * row, row, (b * heads * l + p + t) * row, l * row, row,
                                heads});
      }
    } else {  // per head: its S tokens are Hkv*D apart in the input, consecutive in the present
      for (int64_t h = 0; h < heads; ++h) {
        copies.push_back(Copy2D{new_input, (b * s * heads + h) * row, heads * row, ((b * heads + h) * l + p) * row,
                                row, row, s});
      }
    }
  }
  return copies;
}

AttentionParams make_params(const Config& c, const Shape* in, DataType dtype, const void* const* ptrs,
                            void* output, void* lse, const void* present_key, const void* present_value,
                            const float* alibi_slopes) {
  const Shape& q = in[spec::kInputQuery];
  const Shape& k = in[spec::kInputKey];
  const Shape& v = in[spec::kInputValue];
  const int64_t heads = c.num_heads, kv_heads = c.kv_heads();
  const int64_t width = q.d[2], width_k = k.d[2], width_v = v.d[2];

  AttentionParams p;
  p.batch = q.d[0];
  p.num_heads = heads;
  p.num_heads_k = kv_heads;
  p.seqlen_q = q.d[1];
  p.seqlen_k = key_length(c, in);
  p.head_dim = width / heads;
  p.head_dim_v = width_v / kv_heads;
  const int64_t width_out = p.head_dim_v * heads;
  p.dtype = dtype;

  // Token-major [B, L, H*D]: head h of row l of batch b starts at b*L*H*D + l*H*D + h*D (key and
  // value: Hkv heads).
  p.q = ptrs[spec::kInputQuery];
  p.q_batch_stride = p.seqlen_q * width;
  p.q_head_stride = p.head_dim;
  p.q_row_stride = width;
  p.k = ptrs[spec::kInputKey];
  p.k_batch_stride = p.seqlen_k * width_k;
  p.k_head_stride = p.head_dim;
  p.k_row_stride = width_k;
  p.v = ptrs[spec::kInputValue];
  p.v_batch_stride = p.seqlen_k * width_v;
  p.v_head_stride = p.head_dim_v;
  p.v_row_stride = width_v;
  if (c.has_past != 0) {
    // The presents, head-major [B, Hkv, Lk, D]: head g of row j of batch b at (b*Hkv + g)*Lk*D + j*D.
    p.k = present_key;
    p.k_batch_stride = kv_heads * p.seqlen_k * p.head_dim;
    p.k_head_stride = p.seqlen_k * p.head_dim;
    p.k_row_stride = p.head_dim;
    p.v = present_value;
    p.v_batch_stride = kv_heads * p.seqlen_k * p.head_dim_v;
    p.v_head_stride = p.seqlen_k * p.head_dim_v;
    p.v_row_stride = p.head_dim_v;
  }
  p.out = output;
  p.out_batch_stride = p.seqlen_q * width_out;
  p.out_head_stride = p.head_dim_v;
  p.out_row_stride = width_out;
  p.lse = lse;

  if (c.has_key_padding_mask) {
    const Shape& m = in[spec::kInputKeyPaddingMask];  // contiguous [Bm, Lkm]
    p.key_padding_mask.ptr = ptrs[spec::kInputKeyPaddingMask];
    p.key_padding_mask.kind = MaskKind::kAdditive;
    p.key_padding_mask.dtype = DataType::kFloat32;
    p.key_padding_mask.batch_stride = stride_or_zero(m.d[0], m.d[1]);
    p.key_padding_mask.col_stride = stride_or_zero(m.d[1], 1);
  }
  if (c.has_attn_mask) {
    const Shape& m = in[spec::kInputAttnMask];  // contiguous [Bm, Hm, Lqm, Lkm]
    p.attn_mask.ptr = ptrs[spec::kInputAttnMask];
    p.attn_mask.kind = MaskKind::kAdditive;
    p.attn_mask.dtype = DataType::kFloat32;
    p.attn_mask.batch_stride = stride_or_zero(m.d[0], m.d[1] * m.d[2] * m.d[3]);
    p.attn_mask.head_stride = stride_or_zero(m.d[1], m.d[2] * m.d[3]);
    p.attn_mask.row_stride = stride_or_zero(m.d[2], m.d[3]);
    p.attn_mask.col_stride = stride_or_zero(m.d[3], 1);
  }
  p.scale = c.scale;
  p.softcap = c.softcap;
  p.is_causal = c.is_causal != 0;
  p.causal_alignment = c.causal_alignment;
  p.window = c.window;
  p.alibi_slopes = c.alibi_slopes.empty() ? nullptr : alibi_slopes;
  return p;
}

size_t workspace_bytes(const Config& c, int64_t batch, int64_t seqlen_q) {
  if (batch <= 0 || seqlen_q <= 0 || c.num_heads <= 0) {
    return 0;
  }
  const size_t bytes = static_cast<size_t>(batch) * static_cast<size_t>(c.num_heads) *
      static_cast<size_t>(seqlen_q) * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

}  // namespace attn_export::trt_plugin
