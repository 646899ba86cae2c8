#include "fusedAttentionPlugin.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/attention_cuda.h"

using TrtType = nvinfer1::DataType;
using nvinfer1::PluginFieldType;

namespace attn_export::trt_plugin {

// FieldType mirrors nvinfer1::PluginFieldType so that the TensorRT-free core can be tested alone.
static_assert(static_cast<int32_t>(PluginFieldType::kFLOAT32) == static_cast<int32_t>(FieldType::kFloat32));
static_assert(static_cast<int32_t>(PluginFieldType::kINT32) == static_cast<int32_t>(FieldType::kInt32));
static_assert(static_cast<int32_t>(PluginFieldType::kCHAR) == static_cast<int32_t>(FieldType::kChar));
static_assert(spec::kNumOutputs == 1 && spec::kOutputOutput == 0);
static_assert(spec::kOutputPresentKey == 1 && spec::kOutputPresentValue == 2 && spec::kNumPastOutputs == 3);

namespace {

constexpr int32_t kSuccess = 0;
constexpr int32_t kFailure = 1;

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

// One line through TensorRT's logger (stderr when the library was loaded without one).
void log(nvinfer1::ILogger::Severity severity, const std::string& message) noexcept {
  nvinfer1::ILogger* logger = nullptr;
  try {
    if (nvinfer1::ILoggerFinder* finder = gLoggerFinder.load()) {
      logger = finder->findLogger();
    }
  } catch (...) {
    logger = nullptr;
  }
  if (logger != nullptr) {
    logger->log(severity, message.c_str());
  } else if (severity <= nvinfer1::ILogger::Severity::kWARNING) {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
}

std::string prefix(const std::string& layer) {
  return std::string(spec::kPluginName) + (layer.empty() ? "" : "[" + layer + "]") + ": ";
}

void log_error(const std::string& layer, const std::string& what) noexcept {
  try {
    log(nvinfer1::ILogger::Severity::kERROR, prefix(layer) + what);
  } catch (...) {
    // Out of memory while formatting an error: nothing more can be said.
  }
}

// The ONNX element type (spec::kType*) of a TensorRT type the spec names; 0 for the others.
int onnx_type(TrtType t) {
  switch (t) {
    case TrtType::kFLOAT: return spec::kTypeFloat32;
    case TrtType::kHALF: return spec::kTypeFloat16;
    case TrtType::kBF16: return spec::kTypeBFloat16;
    default: return 0;
  }
}

// T: query, key, value and the output (spec::kTensorTypes).
bool supported_type(TrtType t) {
  for (int type : spec::kTensorTypes) {
    if (onnx_type(t) == type) {
      return true;
    }
  }
  return false;
}

// M: the masks, always additive (spec::kMaskType).
bool mask_type(TrtType t) { return onnx_type(t) == spec::kMaskType; }

const char* type_name(TrtType t) {
  for (int i = 0; i < spec::kNumTensorTypes; ++i) {
    if (onnx_type(t) == spec::kTensorTypes[i]) {
      return spec::kTensorTypeNames[i];
    }
  }
  switch (t) {
    case TrtType::kINT32: return "int32";
    case TrtType::kINT64: return "int64";
    case TrtType::kBOOL: return "bool";
    default: return "an unsupported type";
  }
}

// "float32, float16, bfloat16"
std::string supported_type_names() {
  std::string names;
  for (const char* name : spec::kTensorTypeNames) {
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  return names;
}

std::string mask_type_name() {
  for (int i = 0; i < spec::kNumTensorTypes; ++i) {
    if (spec::kTensorTypes[i] == spec::kMaskType) {
      return spec::kTensorTypeNames[i];
    }
  }
  return "?";
}

attn_export::DataType kernel_type(TrtType t) {
  return t == TrtType::kHALF ? attn_export::DataType::kFloat16
      : t == TrtType::kBF16  ? attn_export::DataType::kBFloat16
                              : attn_export::DataType::kFloat32;
}

Shape to_shape(const nvinfer1::Dims& dims) {
  Shape s;
  s.rank = dims.nbDims;
  for (int32_t i = 0; i < dims.nbDims && i < 4; ++i) {
    s.d[i] = dims.d[i];  // -1 for a dimension not known at build time
  }
  return s;
}

// Known dims of symbolic shapes: the constant ones, -1 for the others.
Shape to_shape(const nvinfer1::DimsExprs& dims) {
  Shape s;
  s.rank = dims.nbDims;
  for (int32_t i = 0; i < dims.nbDims && i < 4; ++i) {
    s.d[i] = dims.d[i] != nullptr && dims.d[i]->isConstant() ? dims.d[i]->getConstantValue() : -1;
  }
  return s;
}

size_t element_bytes(TrtType t) { return t == TrtType::kFLOAT ? 4 : 2; }

// "expected 7 inputs and 3 outputs (has_past=1); got 5 and 1"
std::string count_error(const Config& c, int32_t nbInputs, int32_t nbOutputs) {
  return "expected " + std::to_string(c.num_inputs()) + " inputs and " + std::to_string(c.num_outputs()) +
      " output(s) (" + spec::kAttrHasPast + "=" + std::to_string(c.has_past) + "); got " + std::to_string(nbInputs) +
      " and " + std::to_string(nbOutputs);
}

// present = [past | new] (present_copies), on `stream` before the attention reads it.
cudaError_t write_presents(const Config& c, const Shape* shapes, size_t element, const void* const* inputs,
                           void* const* outputs, cudaStream_t stream) {
  for (int32_t which = 0; which < 2; ++which) {
    auto* present = static_cast<unsigned char*>(outputs[which == 0 ? spec::kOutputPresentKey : spec::kOutputPresentValue]);
    for (const Copy2D& copy : present_copies(c, shapes, which, static_cast<int64_t>(element))) {
      const cudaError_t err = cudaMemcpy2DAsync(
          present + copy.dst_offset, static_cast<size_t>(copy.dst_pitch),
          static_cast<const unsigned char*>(inputs[copy.src]) + copy.src_offset, static_cast<size_t>(copy.src_pitch),
          static_cast<size_t>(copy.width), static_cast<size_t>(copy.height), cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) {
        return err;
      }
    }
  }
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// FusedAttentionPlugin
// ---------------------------------------------------------------------------------------------

FusedAttentionPlugin::FusedAttentionPlugin(const Config& config, std::string layerName)
    : mConfig(config), mLayerName(std::move(layerName)), mDescription(describe(config)) {}

FusedAttentionPlugin::FusedAttentionPlugin(const FusedAttentionPlugin& other)
    : mConfig(other.mConfig), mLayerName(other.mLayerName), mDescription(other.mDescription) {}

FusedAttentionPlugin::~FusedAttentionPlugin() {
  if (mDeviceSlopes != nullptr) {
    cudaFree(mDeviceSlopes);  // the error of a destructor has nowhere to go
  }
}

int32_t FusedAttentionPlugin::upload_slopes() noexcept {
  if (mConfig.alibi_slopes.empty() || mDeviceSlopes != nullptr) {
    return kSuccess;
  }
  const size_t bytes = mConfig.alibi_slopes.size() * sizeof(float);
  void* buffer = nullptr;
  cudaError_t err = cudaMalloc(&buffer, bytes);
  if (err == cudaSuccess) {
    err = cudaMemcpy(buffer, mConfig.alibi_slopes.data(), bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
      cudaFree(buffer);
    }
  }
  if (err != cudaSuccess) {
    return fail(std::string("copying the ") + spec::kAttrAlibiSlopes + " to the device failed: " +
                cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
  mDeviceSlopes = static_cast<float*>(buffer);
  return kSuccess;
}

int32_t FusedAttentionPlugin::fail(const std::string& what) const noexcept {
  log_error(mLayerName, what);
  return kFailure;
}

nvinfer1::IPluginCapability* FusedAttentionPlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

nvinfer1::IPluginV3* FusedAttentionPlugin::clone() noexcept {
  try {
    return new FusedAttentionPlugin(*this);
  } catch (const std::exception& e) {
    fail(std::string("clone failed: ") + e.what());
  } catch (...) {
    fail("clone failed");
  }
  return nullptr;
}

const char* FusedAttentionPlugin::getPluginName() const noexcept { return spec::kPluginName; }
const char* FusedAttentionPlugin::getPluginVersion() const noexcept { return spec::kPluginVersion; }
const char* FusedAttentionPlugin::getPluginNamespace() const noexcept { return spec::kPluginNamespace; }

// The cache form (has_past) has the presents as outputs 1 and 2: TensorRT asks before it shows
// the plugin its inputs, so the count comes from the field.
int32_t FusedAttentionPlugin::getNbOutputs() const noexcept { return mConfig.num_outputs(); }

bool FusedAttentionPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut,
                                                     int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (inOut == nullptr || nbInputs != mConfig.num_inputs() || nbOutputs != mConfig.num_outputs() || pos < 0 ||
      pos >= nbInputs + nbOutputs) {
    return false;
  }
  const nvinfer1::PluginTensorDesc& desc = inOut[pos].desc;
  if (desc.format != nvinfer1::TensorFormat::kLINEAR) {
    return false;
  }
  if (pos == spec::kInputKeyPaddingMask || pos == spec::kInputAttnMask) {
    return mask_type(desc.type);  // the masks are always additive float32
  }
  if (pos == spec::kInputQuery) {
    return supported_type(desc.type);
  }
  // key, value, the past, the output and the presents follow query
  return desc.type == inOut[spec::kInputQuery].desc.type;
}

int32_t FusedAttentionPlugin::getOutputDataTypes(TrtType* outputTypes, int32_t nbOutputs,
                                                 const TrtType* inputTypes, int32_t nbInputs) const noexcept {
  try {
    if (outputTypes == nullptr || inputTypes == nullptr || nbInputs != mConfig.num_inputs() ||
        nbOutputs != mConfig.num_outputs()) {
      return fail(count_error(mConfig, nbInputs, nbOutputs));
    }
    const TrtType t = inputTypes[spec::kInputQuery];
    if (!supported_type(t) || inputTypes[spec::kInputKey] != t || inputTypes[spec::kInputValue] != t) {
      return fail("query, key and value must share one type among " + supported_type_names() + "; got " +
                  type_name(t) + ", " + type_name(inputTypes[spec::kInputKey]) + ", " +
                  type_name(inputTypes[spec::kInputValue]));
    }
    for (int32_t i = spec::kNumInputs; i < nbInputs; ++i) {
      if (inputTypes[i] != t) {
        return fail(std::string(spec::kPastInputNames[i - spec::kNumInputs]) + " must have query's type " +
                    type_name(t) + "; got " + type_name(inputTypes[i]));
      }
    }
    for (int32_t i : {spec::kInputKeyPaddingMask, spec::kInputAttnMask}) {
      if (!mask_type(inputTypes[i])) {
        return fail(std::string(spec::kInputNames[i]) + " must be " + mask_type_name() + " (an additive mask); got " +
                    type_name(inputTypes[i]));
      }
    }
    for (int32_t i = 0; i < nbOutputs; ++i) {
      outputTypes[i] = t;  // the output and the presents
    }
    return kSuccess;
  } catch (...) {
    return fail("getOutputDataTypes failed");
  }
}

int32_t FusedAttentionPlugin::getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs,
                                              const nvinfer1::DimsExprs* /*shapeInputs*/, int32_t nbShapeInputs,
                                              nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                                              nvinfer1::IExprBuilder& exprBuilder) noexcept {
  try {
    if (inputs == nullptr || outputs == nullptr || nbInputs != mConfig.num_inputs() || nbShapeInputs != 0 ||
        nbOutputs != mConfig.num_outputs()) {
      return fail(count_error(mConfig, nbInputs, nbOutputs) + ", and no shape input");
    }
    // Build-time check of what is already known (static widths, heads, mask ranks); the
    // symbolic dimensions are checked again in onShapeChange() with their runtime values.
    Shape shapes[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
      shapes[i] = to_shape(inputs[i]);
    }
    const std::string why = check_shapes(mConfig, shapes, nbInputs);
    if (!why.empty()) {
      return fail(why);
    }
    // [B, Lq, H*Dv]: the output reuses the input expressions, so it is as dynamic as they are
    // (any batch and sequence lengths the optimization profile allows). Grouped-query: value
    // holds Hkv*Dv, the output H*Dv.
    nvinfer1::DimsExprs& out = outputs[spec::kOutputOutput];
    out.nbDims = spec::kOutputRank;
    out.d[0] = inputs[spec::kInputQuery].d[0];
    out.d[1] = inputs[spec::kInputQuery].d[1];
    const int32_t group = mConfig.num_heads / mConfig.kv_heads();
    out.d[2] = group == 1 ? inputs[spec::kInputValue].d[2]
                          : exprBuilder.operation(nvinfer1::DimensionOperation::kPROD, *inputs[spec::kInputValue].d[2],
                                                  *exprBuilder.constant(group));
    if (mConfig.has_past != 0) {
      // present [B, Hkv, P+S, D]: the past's dims with P + S (the new keys' length) on axis 2.
      for (int32_t which = 0; which < 2; ++which) {
        const nvinfer1::DimsExprs& past = inputs[which == 0 ? spec::kInputPastKey : spec::kInputPastValue];
        const nvinfer1::DimsExprs& fresh = inputs[which == 0 ? spec::kInputKey : spec::kInputValue];
        nvinfer1::DimsExprs& present = outputs[which == 0 ? spec::kOutputPresentKey : spec::kOutputPresentValue];
        present = past;
        present.d[2] = exprBuilder.operation(nvinfer1::DimensionOperation::kSUM, *past.d[2], *fresh.d[1]);
      }
    }
    return kSuccess;
  } catch (...) {
    return fail("getOutputShapes failed");
  }
}

int32_t FusedAttentionPlugin::configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                                              const nvinfer1::DynamicPluginTensorDesc* out,
                                              int32_t nbOutputs) noexcept {
  try {
    if (in == nullptr || out == nullptr || nbInputs != mConfig.num_inputs() || nbOutputs != mConfig.num_outputs()) {
      return fail("configurePlugin: " + count_error(mConfig, nbInputs, nbOutputs));
    }
    Shape shapes[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
      shapes[i] = to_shape(in[i].desc.dims);
    }
    std::string why = check_shapes(mConfig, shapes, nbInputs);
    if (!why.empty()) {
      return fail(why);
    }
    // The kernels' limits, checked against the profile's largest shapes so that the engine
    // build fails with a reason instead of an enqueue() failing later.
    Shape largest[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
      largest[i] = to_shape(in[i].max);
    }
    why = check_shapes(mConfig, largest, nbInputs);
    if (!why.empty()) {
      return fail("at the profile's largest shapes: " + why);
    }
    const void* const none[kMaxInputs] = {};
    const AttentionParams p = make_params(mConfig, largest, kernel_type(in[0].desc.type), none, nullptr, nullptr);
    if (const char* limit = cuda::attention_params_error(p)) {
      return fail(std::string("at the profile's largest shapes: ") + limit);
    }
    return kSuccess;
  } catch (...) {
    return fail("configurePlugin failed");
  }
}

size_t FusedAttentionPlugin::getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                                              const nvinfer1::DynamicPluginTensorDesc* /*outputs*/,
                                              int32_t /*nbOutputs*/) const noexcept {
  if (inputs == nullptr || nbInputs != mConfig.num_inputs()) {
    return 0;
  }
  try {
    // [the kernels' lse][the forward's own workspace: split-KV partials, bounded for every shape
    // of the profile up to its largest, whether or not the preview switch is on at run time].
    Shape largest[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
      largest[i] = to_shape(inputs[i].max);
    }
    const void* const none[kMaxInputs] = {};
    const AttentionParams p = make_params(mConfig, largest, kernel_type(inputs[0].desc.type), none, nullptr, nullptr);
    const nvinfer1::Dims& q = inputs[spec::kInputQuery].max;
    return workspace_bytes(mConfig, q.d[0], q.d[1]) + cuda::attention_forward_workspace_bound(p);
  } catch (...) {
    return 0;
  }
}

const char* FusedAttentionPlugin::getTimingCacheID() noexcept { return mDescription.c_str(); }

const char* FusedAttentionPlugin::getMetadataString() noexcept { return mDescription.c_str(); }

int32_t FusedAttentionPlugin::onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs,
                                            const nvinfer1::PluginTensorDesc* out, int32_t nbOutputs) noexcept {
  try {
    if (in == nullptr || out == nullptr || nbInputs != mConfig.num_inputs() || nbOutputs != mConfig.num_outputs()) {
      return fail("onShapeChange: " + count_error(mConfig, nbInputs, nbOutputs));
    }
    Shape shapes[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
      shapes[i] = to_shape(in[i].dims);
    }
    const std::string why = check_shapes(mConfig, shapes, nbInputs);
    return why.empty() ? upload_slopes() : fail(why);
  } catch (...) {
    return fail("onShapeChange failed");
  }
}

int32_t FusedAttentionPlugin::enqueue(const nvinfer1::PluginTensorDesc* inputDesc,
                                      const nvinfer1::PluginTensorDesc* outputDesc, const void* const* inputs,
                                      void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  try {
    if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr) {
      return fail("enqueue: missing tensor descriptions or pointers");
    }
    // The shapes were checked by onShapeChange(), which TensorRT calls whenever they change.
    Shape shapes[kMaxInputs];
    for (int32_t i = 0; i < mConfig.num_inputs(); ++i) {
      shapes[i] = to_shape(inputDesc[i].dims);
    }
    const int64_t batch = shapes[spec::kInputQuery].d[0], seqlen_q = shapes[spec::kInputQuery].d[1];
    if (workspace == nullptr && workspace_bytes(mConfig, batch, seqlen_q) > 0) {
      return fail("enqueue: no workspace (getWorkspaceSize asked for one)");
    }
    if (!mConfig.alibi_slopes.empty() && mDeviceSlopes == nullptr) {  // never run without the bias
      return fail(std::string("enqueue: the ") + spec::kAttrAlibiSlopes + " are not on the device (onShapeChange " +
                  "uploads them)");
    }
    const TrtType type = inputDesc[spec::kInputQuery].type;
    const bool past = mConfig.has_past != 0;
    const AttentionParams params =
        make_params(mConfig, shapes, kernel_type(type), inputs, outputs[spec::kOutputOutput], workspace,
                    past ? outputs[spec::kOutputPresentKey] : nullptr, past ? outputs[spec::kOutputPresentValue] : nullptr,
                    mDeviceSlopes);
    if (const char* why = cuda::attention_params_error(params)) {
      return fail(why);
    }
    // After the lse, what getWorkspaceSize reserved for the forward: at least the bound at these
    // (smaller or equal) shapes, the bound being monotone in batch and seqlen_q.
    const size_t lse_bytes = workspace_bytes(mConfig, batch, seqlen_q);
    void* forward_workspace = workspace == nullptr ? nullptr : static_cast<unsigned char*>(workspace) + lse_bytes;
    const size_t forward_bytes = workspace == nullptr ? 0 : cuda::attention_forward_workspace_bound(params);
    if (past) {  // the cache form: present = [past | new] first, on the same stream
      const cudaError_t err = write_presents(mConfig, shapes, element_bytes(type), inputs, outputs, stream);
      if (err != cudaSuccess) {
        return fail(std::string("writing the presents failed: ") + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
      }
    }
    const cudaError_t err = cuda::run_attention_forward(params, forward_workspace, forward_bytes, stream);
    if (err != cudaSuccess) {
      return fail(std::string("the attention kernel failed: ") + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")");
    }
    return kSuccess;
  } catch (...) {
    return fail("enqueue failed");
  }
}

nvinfer1::IPluginV3* FusedAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
  return clone();  // its own copy of the slopes' device buffer, uploaded by its onShapeChange()
}

const nvinfer1::PluginFieldCollection* FusedAttentionPlugin::getFieldsToSerialize() noexcept {
  Field fields[kNumFields];
  fields_to_serialize(mConfig, fields);
  for (int32_t i = 0; i < kNumFields; ++i) {
    mSerialized[i] = nvinfer1::PluginField(fields[i].name, fields[i].data,
                                           static_cast<PluginFieldType>(fields[i].type), fields[i].length);
  }
  mSerializedCollection.nbFields = kNumFields;
  mSerializedCollection.fields = mSerialized;
  return &mSerializedCollection;
}

// ---------------------------------------------------------------------------------------------
// FusedAttentionPluginCreator
// ---------------------------------------------------------------------------------------------

FusedAttentionPluginCreator::FusedAttentionPluginCreator() {
  for (int32_t i = 0; i < kNumFields; ++i) {
    mFieldNames[i] = nvinfer1::PluginField(kFields[i].name, nullptr, static_cast<PluginFieldType>(kFields[i].type), 1);
  }
  mFieldCollection.nbFields = kNumFields;
  mFieldCollection.fields = mFieldNames;
}

const char* FusedAttentionPluginCreator::getPluginName() const noexcept { return spec::kPluginName; }
const char* FusedAttentionPluginCreator::getPluginVersion() const noexcept { return spec::kPluginVersion; }
const char* FusedAttentionPluginCreator::getPluginNamespace() const noexcept { return spec::kPluginNamespace; }

const nvinfer1::PluginFieldCollection* FusedAttentionPluginCreator::getFieldNames() noexcept {
  return &mFieldCollection;
}

nvinfer1::IPluginV3* FusedAttentionPluginCreator::createPlugin(const char* name,
                                                               const nvinfer1::PluginFieldCollection* fc,
                                                               nvinfer1::TensorRTPhase /*phase*/) noexcept {
  const std::string layer = name != nullptr ? name : "";
  try {
    if (fc == nullptr) {
      log_error(layer, "createPlugin: no field collection");
      return nullptr;
    }
    std::vector<Field> fields;
    fields.reserve(fc->nbFields > 0 ? fc->nbFields : 0);
    for (int32_t i = 0; i < fc->nbFields && fc->fields != nullptr; ++i) {
      const nvinfer1::PluginField& f = fc->fields[i];
      fields.push_back(Field{f.name, f.data, static_cast<int32_t>(f.type), f.length});
    }
    Config config;
    const std::string why = parse_fields(fields.data(), static_cast<int32_t>(fields.size()), config);
    if (!why.empty()) {
      log_error(layer, "cannot create the plugin: " + why);
      return nullptr;
    }
    return new FusedAttentionPlugin(config, layer);
  } catch (const std::exception& e) {
    log_error(layer, std::string("cannot create the plugin: ") + e.what());
  } catch (...) {
    log_error(layer, "cannot create the plugin");
  }
  return nullptr;
}

}  // namespace attn_export::trt_plugin

// ---------------------------------------------------------------------------------------------
// Library entry points
// ---------------------------------------------------------------------------------------------

nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static attn_export::trt_plugin::FusedAttentionPluginCreator sCreator;
  static nvinfer1::IPluginCreatorInterface* const sCreators[] = {&sCreator};
  nbCreators = 1;
  return sCreators;
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  attn_export::trt_plugin::gLoggerFinder.store(finder);
}
