// A mock TensorRT host for the built plugin library: loads it with dlopen, takes its creator
// from getCreators() the way IPluginRegistry::loadLibrary() does, and drives every IPluginV3
// method with the arguments TensorRT's ONNX parser, builder and runtime pass. Needs TensorRT's
// headers only (no libnvinfer): IExprBuilder/IDimensionExpr are mocked through their public
// apiv:: implementation interfaces.
//
//   cmake -S plugins/tensorrt -B build/tensorrt -DTENSORRT_ROOT=... -DATTN_EXPORT_TRT_HOST_CHECK=ON
//   cmake --build build/tensorrt -j && build/tensorrt/fused_attention_host_check
//
// Without a GPU, enqueue() must fail cleanly (non-zero status, a logged reason, no exception).
// With one, enqueue() runs the kernels on [B, L, H*D] inputs with broadcast masks and the
// result is compared with a float64 reference of the node's formula (docs/onnx_node.md).
#include <NvInferRuntime.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "attention_spec.h"
#include "reference_attention.h"

using namespace nvinfer1;
namespace spec = attn_export::spec;

namespace {

int gChecks = 0, gFailures = 0;

void check(bool ok, const std::string& what) {
  ++gChecks;
  if (!ok) {
    ++gFailures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

class Logger : public ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    messages.push_back(std::string(severity <= Severity::kERROR ? "ERROR " : "INFO ") + msg);
  }
  bool saw(const std::string& part) const {
    for (const auto& m : messages) {
      if (m.find(part) != std::string::npos) return true;
    }
    return false;
  }
  std::string last() const { return messages.empty() ? "(nothing logged)" : messages.back(); }
  std::vector<std::string> messages;
};

class LoggerFinder : public ILoggerFinder {
 public:
  explicit LoggerFinder(Logger* logger) : mLogger(logger) {}
  ILogger* findLogger() override { return mLogger; }

 private:
  Logger* mLogger;
};

// IDimensionExpr / IExprBuilder as TensorRT's builder provides them, through apiv::.
class DimImpl : public apiv::VDimensionExpr {
 public:
  DimImpl(bool constant, int64_t value) : mConstant(constant), mValue(value) {}
  bool isConstant() const override { return mConstant; }
  int64_t getConstantValue() const override { return mConstant ? mValue : INT64_MIN; }
  bool isSizeTensor() const override { return false; }

 private:
  bool mConstant;
  int64_t mValue;
};

class Dim : public IDimensionExpr {
 public:
  Dim(bool constant, int64_t value) : mImplStorage(constant, value) { mImpl = &mImplStorage; }
  ~Dim() noexcept override = default;

 private:
  DimImpl mImplStorage;
};

class ExprBuilderImpl : public apiv::VExprBuilder {
 public:
  IDimensionExpr const* constant(int64_t value) override { return &dims.emplace_back(true, value); }
  IDimensionExpr const* operation(DimensionOperation, IDimensionExpr const&, IDimensionExpr const&) override {
    return &dims.emplace_back(false, 0);
  }
  IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
    return nullptr;
  }
  std::deque<Dim> dims;
};

class ExprBuilder : public IExprBuilder {
 public:
  ExprBuilder() { mImpl = &impl; }
  ~ExprBuilder() noexcept override = default;
  ExprBuilderImpl impl;
};

std::vector<PluginField> parser_fields(const int32_t* heads, const float* scale, const int32_t* causal,
                                       const int32_t* kpm, const int32_t* mask, const float* softcap = nullptr,
                                       const int32_t* alignment = nullptr, const int32_t* kv_heads = nullptr,
                                       const std::vector<float>* alibi_slopes = nullptr) {
  // What onnx-tensorrt's FallbackPluginImporter passes: INT -> kINT32[1], FLOAT -> kFLOAT32[1],
  // FLOATS -> kFLOAT32[n].
  std::vector<PluginField> f;
  if (heads) f.emplace_back(spec::kAttrNumHeads, heads, PluginFieldType::kINT32, 1);
  if (scale) f.emplace_back(spec::kAttrScale, scale, PluginFieldType::kFLOAT32, 1);
  if (causal) f.emplace_back(spec::kAttrIsCausal, causal, PluginFieldType::kINT32, 1);
  if (kpm) f.emplace_back(spec::kAttrHasKeyPaddingMask, kpm, PluginFieldType::kINT32, 1);
  if (mask) f.emplace_back(spec::kAttrHasAttnMask, mask, PluginFieldType::kINT32, 1);
  if (softcap) f.emplace_back(spec::kAttrSoftcap, softcap, PluginFieldType::kFLOAT32, 1);
  if (alignment) f.emplace_back(spec::kAttrCausalAlignment, alignment, PluginFieldType::kINT32, 1);
  if (kv_heads) f.emplace_back(spec::kAttrKvNumHeads, kv_heads, PluginFieldType::kINT32, 1);
  if (alibi_slopes && !alibi_slopes->empty()) {
    f.emplace_back(spec::kAttrAlibiSlopes, alibi_slopes->data(), PluginFieldType::kFLOAT32,
                   static_cast<int32_t>(alibi_slopes->size()));
  }
  return f;
}

IPluginV3* create(IPluginCreatorV3One* creator, const std::vector<PluginField>& fields, TensorRTPhase phase,
                  const char* name = "attn_node_0") {
  PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
  return creator->createPlugin(name, &fc, phase);
}

PluginTensorDesc desc(std::initializer_list<int64_t> dims, DataType type) {
  PluginTensorDesc d{};
  d.dims.nbDims = 0;
  for (int64_t x : dims) d.dims.d[d.dims.nbDims++] = x;
  d.type = type;
  d.format = TensorFormat::kLINEAR;
  d.scale = -1.0F;
  return d;
}

DynamicPluginTensorDesc dyn(PluginTensorDesc d, Dims min, Dims opt, Dims max) {
  DynamicPluginTensorDesc x{};
  x.desc = d;
  x.min = min;
  x.opt = opt;
  x.max = max;
  return x;
}

Dims dims(std::initializer_list<int64_t> values) {
  Dims d{};
  for (int64_t v : values) d.d[d.nbDims++] = v;
  return d;
}

// ---- GPU numerics: enqueue() against the float64 reference of the node's formula.
void gpu_numerics(IPluginCreatorV3One* creator, DataType type) {
  const int64_t B = 2, Lq = 37, Lk = 53, H = 2, D = 64;
  const int32_t heads = H, on = 1;
  const float scale = 0.125F;
  // Each causality with and without ALiBi slopes (one per head; Lq < Lk: the distance from the
  // bottom-right diagonal, whatever the alignment).
  for (int variant = 0; variant < 4; ++variant) {
    const int causal = variant % 2;
    const std::vector<float> slopes = variant >= 2 ? std::vector<float>{0.25F, 0.0625F} : std::vector<float>{};
    const int32_t causal_flag = causal;
    const float softcap = causal ? 0.0F : 0.75F;  // capped (scores reach beyond it) and uncapped
    auto fields = parser_fields(&heads, &scale, &causal_flag, &on, &on, &softcap, nullptr, nullptr, &slopes);
    std::unique_ptr<IPluginV3> plugin(create(creator, fields, TensorRTPhase::kRUNTIME));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    std::vector<float> q(B * Lq * H * D), k(B * Lk * H * D), v(B * Lk * H * D), kpm(B * Lk, 0.0F), mask(H * Lq * Lk);
    unsigned seed = 7;
    auto rnd = [&seed]() { seed = seed * 1664525u + 1013904223u; return (seed >> 8) / 16777216.0F - 0.5F; };
    for (auto* t : {&q, &k, &v}) for (float& x : *t) x = 2 * rnd();
    for (float& x : mask) x = rnd();
    for (int64_t j = Lk - 5; j < Lk; ++j) kpm[1 * Lk + j] = -INFINITY;  // batch 1: last 5 keys padded
    for (int64_t j = 0; j < Lk; ++j) mask[(0 * Lq + 3) * Lk + j] = -INFINITY;  // head 0, query 3: nothing visible
    const bool half = type == DataType::kHALF;
    auto upload = [](const std::vector<float>& host, bool as_half) {
      void* dev = nullptr;
      if (as_half) {
        std::vector<__half> h(host.size());
        for (size_t n = 0; n < host.size(); ++n) h[n] = __float2half(host[n]);
        cudaMalloc(&dev, h.size() * sizeof(__half));
        cudaMemcpy(dev, h.data(), h.size() * sizeof(__half), cudaMemcpyHostToDevice);
      } else {
        cudaMalloc(&dev, host.size() * sizeof(float));
        cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
      }
      return dev;
    };
    // Round the inputs the way the device sees them, for the reference.
    if (half) for (auto* t : {&q, &k, &v}) for (float& x : *t) x = __half2float(__float2half(x));
    void* in[5] = {upload(q, half), upload(k, half), upload(v, half), upload(kpm, false), upload(mask, false)};
    void* out = nullptr;
    cudaMalloc(&out, B * Lq * H * D * (half ? 2 : 4));
    void* workspace = nullptr;
    cudaMalloc(&workspace, 1 << 20);
    PluginTensorDesc inDesc[5] = {desc({B, Lq, H * D}, type), desc({B, Lk, H * D}, type), desc({B, Lk, H * D}, type),
                                  desc({B, Lk}, DataType::kFLOAT), desc({1, H, Lq, Lk}, DataType::kFLOAT)};
    PluginTensorDesc outDesc[1] = {desc({B, Lq, H * D}, type)};
    check(runtime->onShapeChange(inDesc, 5, outDesc, 1) == 0, "onShapeChange accepts the GPU case");
    const int32_t status = runtime->enqueue(inDesc, outDesc, in, &out, workspace, nullptr);
    check(status == 0 && cudaDeviceSynchronize() == cudaSuccess, "enqueue runs on the GPU");
    std::vector<float> got(B * Lq * H * D);
    if (half) {
      std::vector<__half> h(got.size());
      cudaMemcpy(h.data(), out, h.size() * 2, cudaMemcpyDeviceToHost);
      for (size_t n = 0; n < h.size(); ++n) got[n] = __half2float(h[n]);
    } else {
      cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost);
    }
    std::vector<float> mask_full(B * H * Lq * Lk);  // the [1, H, Lq, Lk] mask for every batch
    for (int64_t b = 0; b < B; ++b) std::copy(mask.begin(), mask.end(), mask_full.begin() + b * H * Lq * Lk);
    const std::vector<double> want = attn_export::trt_plugin::testing::reference_attention(
        B, H, Lq, Lk, D, D, scale, causal, q, k, v, kpm, mask_full, softcap, 0, 0, slopes);
    double err = 0, top = 0;
    bool finite = true;
    for (size_t n = 0; n < want.size(); ++n) {
      finite = finite && std::isfinite(got[n]);
      err = std::max(err, std::abs(got[n] - want[n]));
      top = std::max(top, std::abs(want[n]));
    }
    const double tol = (half ? 8 * 9.8e-4 : 8 * 1.2e-7) * std::sqrt(double(Lk)) * top;
    check(finite, "GPU output is finite (fully masked rows are zeros, not NaN)");
    check(err <= tol, std::string(half ? "fp16" : "fp32") + " GPU output vs float64 reference: max abs err " +
                          std::to_string(err) + " (tolerance " + std::to_string(tol) + ")");
    std::printf("host_check: GPU %s causal=%d softcap=%g alibi=%d max abs err %.3e (tolerance %.3e)\n",
                half ? "fp16" : "fp32", causal, softcap, slopes.empty() ? 0 : 1, err, tol);
    for (void* p : in) cudaFree(p);
    cudaFree(out);
    cudaFree(workspace);
  }
}

}  // namespace

// The cache form (has_past = 1): 7 inputs, 3 outputs, the presents' shapes and types.
void cache_form(IPluginCreatorV3One* creator, Logger& logger) {
  const int32_t heads = 4, kv_heads = 2, on = 1, off = 0;
  const float scale = 0.125F;
  auto fields = parser_fields(&heads, &scale, &on, &on, &off, nullptr, &on, &kv_heads);
  fields.emplace_back(spec::kAttrHasPast, &on, PluginFieldType::kINT32, 1);
  std::unique_ptr<IPluginV3> plugin(create(creator, fields, TensorRTPhase::kBUILD, "attn_cache_0"));
  check(plugin != nullptr, "createPlugin with has_past=1");
  if (!plugin) return;
  auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  check(build->getNbOutputs() == 3, "the cache form has three outputs");
  // Types: everything but the masks follows query.
  DynamicPluginTensorDesc io[10] = {};
  for (int i = 0; i < 10; ++i) {
    io[i].desc.type = (i == 3 || i == 4) ? DataType::kFLOAT : DataType::kHALF;
    io[i].desc.format = TensorFormat::kLINEAR;
  }
  bool all = true;
  for (int pos = 0; pos < 10; ++pos) all = all && build->supportsFormatCombination(pos, io, 7, 3);
  check(all, "float16 cache form with float32 masks is supported");
  check(!build->supportsFormatCombination(0, io, 5, 1), "five inputs are refused for has_past=1");
  const DataType in7[7] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT,
                           DataType::kHALF, DataType::kHALF};
  DataType outTypes[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
  check(build->getOutputDataTypes(outTypes, 3, in7, 7) == 0 && outTypes[1] == DataType::kHALF &&
            outTypes[2] == DataType::kHALF,
        "the presents have query's type");
  DataType badPast[7] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT,
                         DataType::kFLOAT, DataType::kHALF};
  check(build->getOutputDataTypes(outTypes, 3, badPast, 7) != 0 && logger.saw("past_key must have query's type"),
        "a float32 past with float16 query is refused: " + logger.last());
  // Shapes: present [B, Hkv, P + S, D] with P + S an expression of both.
  ExprBuilder eb;
  Dim batch(false, 0), s(false, 0), p(false, 0), q_width(true, 64), kv_width(true, 32), hkv(true, 2), d(true, 16),
      one(true, 1);
  DimsExprs in[7] = {};
  in[0].nbDims = 3; in[0].d[0] = &batch; in[0].d[1] = &s; in[0].d[2] = &q_width;
  in[1].nbDims = 3; in[1].d[0] = &batch; in[1].d[1] = &s; in[1].d[2] = &kv_width;
  in[2].nbDims = 3; in[2].d[0] = &batch; in[2].d[1] = &s; in[2].d[2] = &kv_width;
  in[3].nbDims = 2; in[3].d[0] = &batch; in[3].d[1] = &one;
  in[4].nbDims = 4; in[4].d[0] = &one; in[4].d[1] = &one; in[4].d[2] = &one; in[4].d[3] = &one;
  for (int i : {5, 6}) {
    in[i].nbDims = 4; in[i].d[0] = &batch; in[i].d[1] = &hkv; in[i].d[2] = &p; in[i].d[3] = &d;
  }
  DimsExprs out[3] = {};
  check(build->getOutputShapes(in, 7, nullptr, 0, out, 3, eb) == 0 && out[1].nbDims == 4 && out[1].d[0] == &batch &&
            out[1].d[1] == &hkv && out[1].d[3] == &d && out[1].d[2] != &p && out[1].d[2] != &s &&
            !out[1].d[2]->isConstant() && out[2].nbDims == 4,
        "present [B, Hkv, P+S, D] from the past's dims and a sum");
  check(build->getOutputShapes(in, 5, nullptr, 0, out, 1, eb) != 0 && logger.saw("expected 7 inputs and 3 output(s)"),
        "five inputs for has_past=1 fail with a reason: " + logger.last());
  PluginTensorDesc good[7] = {desc({2, 1, 64}, DataType::kHALF),    desc({2, 1, 32}, DataType::kHALF),
                              desc({2, 1, 32}, DataType::kHALF),    desc({2, 6}, DataType::kFLOAT),
                              desc({1, 1, 1, 1}, DataType::kFLOAT), desc({2, 2, 5, 16}, DataType::kHALF),
                              desc({2, 2, 5, 16}, DataType::kHALF)};
  PluginTensorDesc outDesc[3] = {desc({2, 1, 64}, DataType::kHALF), desc({2, 2, 6, 16}, DataType::kHALF),
                                 desc({2, 2, 6, 16}, DataType::kHALF)};
  check(runtime->onShapeChange(good, 7, outDesc, 3) == 0, "onShapeChange accepts the cache form");
  good[3] = desc({2, 5}, DataType::kFLOAT);  // the padding mask must span P + S = 6 keys
  check(runtime->onShapeChange(good, 7, outDesc, 3) != 0 && logger.saw("key_padding_mask must be [B or 1, Lk or 1]"),
        "a padding mask over the past alone is refused: " + logger.last());
}

int main() {
  void* lib = dlopen(PLUGIN_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", PLUGIN_LIBRARY, dlerror());
    return 1;
  }
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(ILoggerFinder*);
  auto getCreatorsFn = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  auto setLoggerFinderFn = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
  check(getCreatorsFn != nullptr && setLoggerFinderFn != nullptr, "the library exports getCreators and setLoggerFinder");
  if (!getCreatorsFn || !setLoggerFinderFn) return 1;
  Logger logger;
  LoggerFinder finder(&logger);
  setLoggerFinderFn(&finder);

  int32_t n = 0;
  IPluginCreatorInterface* const* creators = getCreatorsFn(n);
  check(n == 1 && creators != nullptr && creators[0] != nullptr, "one creator");
  check(std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "an IPluginCreatorV3One");
  auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
  check(std::strcmp(creator->getPluginName(), spec::kPluginName) == 0 &&
            std::strcmp(creator->getPluginVersion(), spec::kPluginVersion) == 0 &&
            std::strcmp(creator->getPluginNamespace(), spec::kPluginNamespace) == 0,
        "creator name/version/namespace are the spec's");

  const PluginFieldCollection* declared = creator->getFieldNames();
  const char* names[] = {spec::kAttrNumHeads, spec::kAttrScale, spec::kAttrIsCausal, spec::kAttrHasKeyPaddingMask,
                         spec::kAttrHasAttnMask, spec::kAttrSoftcap, spec::kAttrCausalAlignment,
                         spec::kAttrKvNumHeads, spec::kAttrWindow, spec::kAttrHasPast, spec::kAttrAlibiSlopes};
  const PluginFieldType types[] = {PluginFieldType::kINT32, PluginFieldType::kFLOAT32, PluginFieldType::kINT32,
                                   PluginFieldType::kINT32, PluginFieldType::kINT32, PluginFieldType::kFLOAT32,
                                   PluginFieldType::kINT32, PluginFieldType::kINT32, PluginFieldType::kINT32,
                                   PluginFieldType::kINT32, PluginFieldType::kFLOAT32};
  constexpr int32_t kFieldCount = spec::kNumPluginFields;
  static_assert(sizeof(names) / sizeof(names[0]) == kFieldCount, "every plugin field is listed");
  check(declared != nullptr && declared->nbFields == kFieldCount, "the spec's declared fields");
  for (int32_t i = 0; declared && i < declared->nbFields && i < kFieldCount; ++i) {
    check(std::strcmp(declared->fields[i].name, names[i]) == 0 && declared->fields[i].type == types[i],
          std::string("declared field ") + names[i]);
  }

  // ---- createPlugin, as the ONNX parser calls it.
  const int32_t heads = 2, on = 1, off = 0, three = 3;
  const float scale = 0.125F, softcap = 30.0F, negative = -1.0F;
  check(create(creator, parser_fields(nullptr, &scale, nullptr, nullptr, nullptr), TensorRTPhase::kBUILD) == nullptr,
        "createPlugin without num_heads returns nullptr");
  check(logger.saw("FusedAttention[attn_node_0]: cannot create the plugin: field num_heads is missing"),
        "... and logs why: " + logger.last());
  check(create(creator, parser_fields(&heads, &scale, &off, &on, &off, &negative), TensorRTPhase::kBUILD) == nullptr &&
            logger.saw("softcap must be finite and >= 0; got -1"),
        "createPlugin refuses a negative softcap with a reason: " + logger.last());
  check(create(creator, parser_fields(&heads, &scale, &on, &off, &off, nullptr, &on, &three), TensorRTPhase::kBUILD) ==
                nullptr &&
            logger.saw("kv_num_heads must divide num_heads=2 (0 = num_heads); got 3"),
        "createPlugin refuses kv_num_heads that does not divide num_heads: " + logger.last());
  const std::vector<float> three_slopes = {0.5F, 0.25F, 0.125F};
  check(create(creator, parser_fields(&heads, &scale, &off, &on, &off, nullptr, nullptr, nullptr, &three_slopes),
               TensorRTPhase::kBUILD) == nullptr &&
            logger.saw("alibi_slopes must have one slope per query head (num_heads=2); got 3"),
        "createPlugin refuses alibi_slopes of another length than num_heads: " + logger.last());
  const auto fields = parser_fields(&heads, &scale, &off, &on, &off, &softcap);
  std::unique_ptr<IPluginV3> plugin(create(creator, fields, TensorRTPhase::kBUILD));
  check(plugin != nullptr, "createPlugin with the node's fields");
  if (!plugin) return 1;
  auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
  auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  check(core && build && runtime, "core, build and runtime capabilities");
  check(std::strcmp(core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0 &&
            std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0 &&
            std::strcmp(runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0,
        "capability interface kinds");
  check(std::strcmp(core->getPluginName(), spec::kPluginName) == 0 &&
            std::strcmp(core->getPluginVersion(), spec::kPluginVersion) == 0,
        "plugin name/version");
  check(build->getNbOutputs() == 1, "one output");

  // ---- formats and types.
  auto combo = [&](DataType t, DataType kpm, DataType out, TensorFormat fmt = TensorFormat::kLINEAR) {
    DynamicPluginTensorDesc io[6] = {};
    const DataType ts[6] = {t, t, t, kpm, DataType::kFLOAT, out};
    for (int i = 0; i < 6; ++i) {
      io[i].desc.type = ts[i];
      io[i].desc.format = i == 0 ? fmt : TensorFormat::kLINEAR;
    }
    bool all = true;
    for (int pos = 0; pos < 6; ++pos) all = all && build->supportsFormatCombination(pos, io, 5, 1);
    return all;
  };
  check(combo(DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT) && combo(DataType::kHALF, DataType::kFLOAT, DataType::kHALF) &&
            combo(DataType::kBF16, DataType::kFLOAT, DataType::kBF16),
        "linear float32/float16/bfloat16 with float32 masks are supported");
  check(!combo(DataType::kINT32, DataType::kFLOAT, DataType::kINT32), "int32 query is not");
  check(!combo(DataType::kHALF, DataType::kHALF, DataType::kHALF), "a float16 mask is not");
  check(!combo(DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT), "an output type other than the query's is not");
  check(!combo(DataType::kHALF, DataType::kFLOAT, DataType::kHALF, TensorFormat::kCHW32), "non-linear formats are not");

  DataType outType = DataType::kFLOAT;
  const DataType halfIn[5] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT};
  check(build->getOutputDataTypes(&outType, 1, halfIn, 5) == 0 && outType == DataType::kHALF, "output type = query type");
  const DataType badMask[5] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kFLOAT};
  check(build->getOutputDataTypes(&outType, 1, badMask, 5) != 0 &&
            logger.saw("key_padding_mask must be float32 (an additive mask); got float16"),
        "a float16 mask is refused with a reason: " + logger.last());

  // ---- shapes: symbolic batch and lengths, static widths.
  ExprBuilder eb;
  Dim batch(false, 0), lq(false, 0), lk(false, 0), width(true, 64), one(true, 1);
  DimsExprs in[5] = {};
  in[0].nbDims = 3; in[0].d[0] = &batch; in[0].d[1] = &lq; in[0].d[2] = &width;
  in[1].nbDims = 3; in[1].d[0] = &batch; in[1].d[1] = &lk; in[1].d[2] = &width;
  in[2].nbDims = 3; in[2].d[0] = &batch; in[2].d[1] = &lk; in[2].d[2] = &width;
  in[3].nbDims = 2; in[3].d[0] = &batch; in[3].d[1] = &lk;
  in[4].nbDims = 4; in[4].d[0] = &one; in[4].d[1] = &one; in[4].d[2] = &one; in[4].d[3] = &one;
  DimsExprs outExprs[1] = {};
  check(build->getOutputShapes(in, 5, nullptr, 0, outExprs, 1, eb) == 0 && outExprs[0].nbDims == 3 &&
            outExprs[0].d[0] == &batch && outExprs[0].d[1] == &lq && outExprs[0].d[2] == &width,
        "output [B, Lq, H*Dv] reuses the input expressions (dynamic batch and lengths)");
  {
    auto threeHeads = parser_fields(&three, &scale, nullptr, nullptr, nullptr);
    std::unique_ptr<IPluginV3> bad(create(creator, threeHeads, TensorRTPhase::kBUILD));
    auto* badBuild = static_cast<IPluginV3OneBuild*>(bad->getCapabilityInterface(PluginCapabilityType::kBUILD));
    check(badBuild->getOutputShapes(in, 5, nullptr, 0, outExprs, 1, eb) != 0 &&
              logger.saw("num_heads=3 must divide the last dimension of query"),
          "a width H does not divide fails at build time: " + logger.last());
    // Grouped-query: one key/value head (width 32) for both query heads (width 64).
    Dim half(true, 32);
    DimsExprs gqa[5] = {in[0], in[1], in[2], in[3], in[4]};
    gqa[1].d[2] = &half;
    gqa[2].d[2] = &half;
    std::unique_ptr<IPluginV3> grouped(
        create(creator, parser_fields(&heads, &scale, &on, &off, &off, nullptr, &on, &on), TensorRTPhase::kBUILD));
    auto* groupedBuild = static_cast<IPluginV3OneBuild*>(grouped->getCapabilityInterface(PluginCapabilityType::kBUILD));
    check(groupedBuild->getOutputShapes(gqa, 5, nullptr, 0, outExprs, 1, eb) == 0 && outExprs[0].d[2] != &half &&
              !outExprs[0].d[2]->isConstant(),
          "grouped-query output width H*Dv is value's width times H / Hkv");
    check(groupedBuild->getOutputShapes(in, 5, nullptr, 0, outExprs, 1, eb) != 0 &&
              logger.saw("key must be as wide as query times kv_num_heads / num_heads"),
          "a key with every query head fails for kv_num_heads=1: " + logger.last());
  }

  // ---- configurePlugin / workspace with an optimization profile.
  auto profile = [&](int64_t maxBatch) {
    std::vector<DynamicPluginTensorDesc> v = {
        dyn(desc({-1, -1, 64}, DataType::kHALF), dims({1, 1, 64}), dims({2, 16, 64}), dims({maxBatch, 128, 64})),
        dyn(desc({-1, -1, 64}, DataType::kHALF), dims({1, 1, 64}), dims({2, 16, 64}), dims({maxBatch, 96, 64})),
        dyn(desc({-1, -1, 64}, DataType::kHALF), dims({1, 1, 64}), dims({2, 16, 64}), dims({maxBatch, 96, 64})),
        dyn(desc({-1, -1}, DataType::kFLOAT), dims({1, 1}), dims({2, 16}), dims({maxBatch, 96})),
        dyn(desc({1, 1, 1, 1}, DataType::kFLOAT), dims({1, 1, 1, 1}), dims({1, 1, 1, 1}), dims({1, 1, 1, 1})),
        dyn(desc({-1, -1, 64}, DataType::kHALF), dims({1, 1, 64}), dims({2, 16, 64}), dims({maxBatch, 128, 64}))};
    return v;
  };
  auto ok = profile(8);
  check(build->configurePlugin(ok.data(), 5, ok.data() + 5, 1) == 0, "configurePlugin with a dynamic profile");
  check(build->getWorkspaceSize(ok.data(), 5, ok.data() + 5, 1) == 8 * 2 * 128 * 4,
        "workspace = max batch * H * max Lq float32");
  auto huge = profile(70000);
  check(build->configurePlugin(huge.data(), 5, huge.data() + 5, 1) != 0 && logger.saw("at most 65535"),
        "a profile beyond the kernels' grid limit fails the build with a reason: " + logger.last());
  check(build->getMetadataString() != nullptr &&
            std::string(build->getMetadataString()) ==
                "num_heads=2 scale=0.125 is_causal=0 has_key_padding_mask=1 has_attn_mask=0 softcap=30 "
                "causal_alignment=0 kv_num_heads=0 window=0 has_past=0",
        "metadata string names the fields");

  // ---- serialization round trip (engine build -> engine load).
  const PluginFieldCollection* serialized = runtime->getFieldsToSerialize();
  check(serialized != nullptr && serialized->nbFields == kFieldCount, "every field serialized");
  std::vector<PluginField> copy(serialized->fields, serialized->fields + serialized->nbFields);
  for (int32_t i = 0; i < static_cast<int32_t>(copy.size()) && i < kFieldCount; ++i) {
    // alibi_slopes: a list, empty without slopes (this plugin has none).
    const int32_t length = std::strcmp(names[i], spec::kAttrAlibiSlopes) == 0 ? 0 : 1;
    check(std::strcmp(copy[i].name, names[i]) == 0 && copy[i].type == types[i] && copy[i].length == length,
          std::string("serialized field ") + names[i]);
  }
  std::unique_ptr<IPluginV3> reloaded(create(creator, copy, TensorRTPhase::kRUNTIME));
  check(reloaded != nullptr, "createPlugin(kRUNTIME) from the serialized fields");
  auto* reloadedBuild = static_cast<IPluginV3OneBuild*>(reloaded->getCapabilityInterface(PluginCapabilityType::kBUILD));
  check(std::string(reloadedBuild->getMetadataString()) == build->getMetadataString(), "the reloaded plugin is the same");
  std::unique_ptr<IPluginV3> attached(runtime->attachToContext(nullptr));
  std::unique_ptr<IPluginV3> cloned(plugin->clone());
  check(attached != nullptr && cloned != nullptr, "clone and attachToContext");

  // ---- ALiBi slopes: a kFLOAT32 field of length num_heads, serialized back as given.
  const std::vector<float> slopes = {0.5F, 0.25F};
  std::unique_ptr<IPluginV3> alibi(
      create(creator, parser_fields(&heads, &scale, &off, &on, &off, &softcap, nullptr, nullptr, &slopes),
             TensorRTPhase::kBUILD));
  check(alibi != nullptr, "createPlugin with alibi_slopes");
  if (alibi) {
    auto* alibiRuntime =
        static_cast<IPluginV3OneRuntime*>(alibi->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    const PluginFieldCollection* written = alibiRuntime->getFieldsToSerialize();
    const PluginField& last = written->fields[kFieldCount - 1];
    check(std::strcmp(last.name, spec::kAttrAlibiSlopes) == 0 && last.type == PluginFieldType::kFLOAT32 &&
              last.length == 2 && static_cast<const float*>(last.data)[0] == 0.5F &&
              static_cast<const float*>(last.data)[1] == 0.25F,
          "alibi_slopes serialized as kFLOAT32 of length num_heads");
    auto* alibiBuild = static_cast<IPluginV3OneBuild*>(alibi->getCapabilityInterface(PluginCapabilityType::kBUILD));
    check(std::string(alibiBuild->getMetadataString()).find(" alibi_slopes=[0.5,0.25]") != std::string::npos,
          "metadata string names the slopes");
    std::unique_ptr<IPluginV3> alibiClone(alibi->clone());  // its own device buffer: freed once each
    check(alibiClone != nullptr, "clone with slopes");
  }

  cache_form(creator, logger);

  // ---- runtime shape checks and enqueue.
  PluginTensorDesc badKpm[5] = {desc({2, 3, 64}, DataType::kHALF), desc({2, 5, 64}, DataType::kHALF),
                                desc({2, 5, 64}, DataType::kHALF), desc({3, 5}, DataType::kFLOAT),
                                desc({1, 1, 1, 1}, DataType::kFLOAT)};
  PluginTensorDesc outDesc[1] = {desc({2, 3, 64}, DataType::kHALF)};
  check(runtime->onShapeChange(badKpm, 5, outDesc, 1) != 0 &&
            logger.saw("key_padding_mask must be [B or 1, Lk or 1]; got [3, 5]"),
        "onShapeChange refuses a mask that does not broadcast: " + logger.last());

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    PluginTensorDesc good[5] = {desc({2, 3, 64}, DataType::kHALF), desc({2, 5, 64}, DataType::kHALF),
                                desc({2, 5, 64}, DataType::kHALF), desc({2, 5}, DataType::kFLOAT),
                                desc({1, 1, 1, 1}, DataType::kFLOAT)};
    char buffer[4096] = {};
    const void* ptrs[5] = {buffer, buffer, buffer, buffer, buffer};
    void* outs[1] = {buffer};
    const size_t before = logger.messages.size();
    const int32_t status = runtime->enqueue(good, outDesc, ptrs, outs, buffer, nullptr);
    check(status != 0 && logger.messages.size() > before, "without a GPU, enqueue fails cleanly with a reason: " + logger.last());
    std::printf("host_check: no CUDA device; enqueue returned %d and logged: %s\n", status, logger.last().c_str());
  } else {
    gpu_numerics(creator, DataType::kFLOAT);
    gpu_numerics(creator, DataType::kHALF);
  }

  plugin.reset();
  reloaded.reset();
  attached.reset();
  cloned.reset();
  if (gFailures) {
    std::fprintf(stderr, "host_check: %d of %d checks failed\n", gFailures, gChecks);
    return 1;
  }
  std::printf("host_check: %d checks passed\n", gChecks);
  return 0;
}
