// DLPack imports that copy: what the Python binding's from_dlpack needs beyond
// Tensor::from_dlpack (meshrt/tensor.hpp), which views memory as it is. Not installed.
#pragma once

#include "meshrt/tensor.hpp"

struct DLManagedTensor;

namespace meshrt {

// Whether Tensor::from_dlpack can view `managed`'s memory as it is laid out: null strides,
// or the row-major ones on every dimension longer than 1 (an empty tensor always).
bool is_compact_dlpack(const DLManagedTensor& managed);
// A new tensor on `managed`'s device holding a copy of its elements in row-major order,
// whatever its strides: host memory (kDLCPU, kDLCUDAHost) with any strides (negative
// too), device memory compact only (the device copies it). `managed` is only read: the
// caller still owns it (and calls its deleter). Throws UsageError as from_dlpack does.
Tensor copy_from_dlpack(const DLManagedTensor& managed);

}  // namespace meshrt
