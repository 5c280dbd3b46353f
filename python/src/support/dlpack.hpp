// DLPack in Python (docs/python.md, "DLPack"): meshrt.Tensor.__dlpack__ as the Python array
// API defines it (unversioned and DLPack 1.0 versioned capsules, dl_device, copy, the CUDA
// stream hand-off) and the import of another library's tensor through its __dlpack__, the
// first way into to_tensor (convert.hpp).
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string_view>

#include "meshrt/device.hpp"
#include "meshrt/tensor.hpp"
#include "support/convert.hpp"

namespace meshrt::python {

namespace py = pybind11;

// meshrt.Tensor.__dlpack__(stream, max_version, dl_device, copy): a "dltensor" capsule, or a
// "dltensor_versioned" one (DLPack 1.0) when max_version's major is 1 or more; a copy when
// copy is True, or on dl_device when it differs and copy is not False. BufferError where a
// request cannot be served, ValueError or TypeError for a malformed argument.
py::object export_dlpack(const Tensor& t, py::handle stream, py::handle max_version, py::handle dl_device,
                         py::handle copy);
// An unversioned "dltensor" capsule viewing t, with no stream hand-off: what a torch kernel
// on a CUDA mesh gets its arguments from (torch reads them on the kernel's own stream).
py::object unversioned_capsule(const Tensor& t);
// meshrt.Tensor.__dlpack_device__: (kDLCPU, 0), (kDLCUDA, N) or (kDLExtDev, N).
py::tuple dlpack_device(const Tensor& t);
// The tensor obj.__dlpack__ describes, viewed or copied as `how` says (to_tensor's rules).
// nullopt when __dlpack__ itself fails and `buffer_fallback` is set (numpy 1.24 exports no
// read-only or bool array through DLPack; its buffer protocol takes both); otherwise a
// failing __dlpack__ is a UsageError naming `what`.
std::optional<Tensor> import_dlpack(py::handle obj, std::string_view what, const ImportOptions& how,
                                    bool buffer_fallback);

// While a Python kernel runs on a CUDA stream (python_kernels.cpp): on this thread, an
// export's consumer stream waits for that stream's work (meshrt.Tensor.__dlpack__(stream=)),
// and an import hands that stream to the producer (obj.__dlpack__(stream=)). Outside a
// kernel meshrt has no device work pending on a tensor Python holds, and hands off nothing.
class KernelStreamScope {
 public:
  explicit KernelStreamScope(device::Stream stream);
  ~KernelStreamScope();
  KernelStreamScope(const KernelStreamScope&) = delete;
  KernelStreamScope& operator=(const KernelStreamScope&) = delete;
  // The stream of the kernel this thread runs, or null.
  static const device::Stream* current() noexcept;

 private:
  device::Stream stream_;
  const device::Stream* previous_;
};

}  // namespace meshrt::python
