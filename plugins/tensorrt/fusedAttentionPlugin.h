// The FusedAttention TensorRT plugin (IPluginV3): the attn_export.FusedAttention ONNX node
// (docs/onnx_node.md), run by the same CUDA kernels as the PyTorch operator
// (csrc/kernels/cuda/attention_cuda.h). This class only handles shapes, formats, types and
// fields; the rules themselves live in fusedAttentionCore.h (TensorRT-free, unit-tested) and the
// names in csrc/attention_spec.h (the one spec of the node).
//
// Every override is noexcept and catches internally: no exception crosses the library boundary.
// Problems are reported through the logger TensorRT hands the library (setLoggerFinder), as
// "FusedAttention[<layer>]: <what is wrong>", and a non-zero status / nullptr.
#pragma once

#include <NvInferRuntime.h>

#include <string>

#include "fusedAttentionCore.h"

namespace attn_export::trt_plugin {

class FusedAttentionPlugin final : public nvinfer1::IPluginV3,
                                   public nvinfer1::IPluginV3OneCore,
                                   public nvinfer1::IPluginV3OneBuild,
                                   public nvinfer1::IPluginV3OneRuntime {
 public:
  FusedAttentionPlugin(const Config& config, std::string layerName);
  // A copy (clone(), attachToContext()) shares no device memory: it uploads its own slopes.
  FusedAttentionPlugin(const FusedAttentionPlugin& other);
  FusedAttentionPlugin& operator=(const FusedAttentionPlugin&) = delete;
  ~FusedAttentionPlugin() override;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  const char* getPluginName() const noexcept override;
  const char* getPluginVersion() const noexcept override;
  const char* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuild
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             const nvinfer1::DataType* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs,
                          const nvinfer1::DimsExprs* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t getNbOutputs() const noexcept override;
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nbOutputs) const noexcept override;
  const char* getTimingCacheID() noexcept override;
  const char* getMetadataString() noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override;

 private:
  int32_t fail(const std::string& what) const noexcept;
  // The config's ALiBi slopes copied into mDeviceSlopes (once; nothing without slopes). Called from
  // onShapeChange(), which TensorRT calls in the build phase and at run time before any enqueue()
  // (so an engine build without a GPU is not asked to allocate); kSuccess or a logged failure.
  int32_t upload_slopes() noexcept;

  Config mConfig;
  std::string mLayerName;
  std::string mDescription;  // describe(mConfig): metadata string and timing-cache ID
  float* mDeviceSlopes = nullptr;  // [num_heads] float32 on the device, owned (cudaFree in the destructor)
  nvinfer1::PluginField mSerialized[kNumFields];
  nvinfer1::PluginFieldCollection mSerializedCollection{};
};

class FusedAttentionPluginCreator final : public nvinfer1::IPluginCreatorV3One {
 public:
  FusedAttentionPluginCreator();
  ~FusedAttentionPluginCreator() override = default;

  const char* getPluginName() const noexcept override;
  const char* getPluginVersion() const noexcept override;
  const char* getPluginNamespace() const noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override;
  nvinfer1::IPluginV3* createPlugin(const char* name, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;

 private:
  nvinfer1::PluginField mFieldNames[kNumFields];
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

}  // namespace attn_export::trt_plugin

// The entry points IPluginRegistry::loadLibrary() and `trtexec --dynamicPlugins` look for: the
// only symbols the library exports (it is built with -fvisibility=hidden; TensorRT's own
// TENSORRTAPI is empty outside TensorRT's build).
#define ATTN_EXPORT_TRT_PLUGIN_API extern "C" __attribute__((visibility("default")))

ATTN_EXPORT_TRT_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
ATTN_EXPORT_TRT_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
