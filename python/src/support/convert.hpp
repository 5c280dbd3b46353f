// Conversions between Python objects and meshrt's C++ values, shared by every part of
// the extension module. Tensors cross without a copy wherever the two sides allow it.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <string_view>

#include "meshrt/tensor.hpp"

namespace meshrt::python {

namespace py = pybind11;

// A meshrt.Tensor object holding `t` (a handle: it shares t's storage).
py::object wrap_tensor(Tensor t);
// How to_tensor takes memory (the array API's from_dlpack(x, device=, copy=)).
struct ImportOptions {
  // None: a view where meshrt can view the memory, else a copy; True: always a copy;
  // False: never one (BufferError where one is needed).
  std::optional<bool> copy;
  // Where the tensor must be: a copy there when the producer's memory is elsewhere.
  std::optional<Device> device;
};

// The meshrt Tensor an object holds or views: a meshrt.Tensor (its handle), or anything
// that speaks DLPack or the buffer protocol (numpy arrays, torch tensors, bytearray,
// array.array), without a copy where meshrt can view the memory: contiguous, row-major
// and writable. Other memory (strided, read-only: a kernel may write a tensor) is copied,
// unless how.copy is False (BufferError). The view keeps the producer alive and releases
// it with the GIL, from whichever thread drops the last handle. `what` names the object in
// errors ("argument 2 of example.scale"). Throws UsageError (a dtype meshrt lacks, a
// failing __dlpack__).
Tensor to_tensor(py::handle obj, std::string_view what, const ImportOptions& how = {});
// `t` moved to the device `how` asks for (a copy), or as it is when it is there or none is
// asked; a copy that copy=False forbids is a BufferError naming `what` and `source`.
Tensor on_requested_device(Tensor t, const ImportOptions& how, std::string_view what, py::handle source);
// Whether to_tensor takes `obj` (a meshrt.Tensor, or an object with __dlpack__ or
// __array_interface__ or the buffer protocol; not str, bytes, numbers or lists).
bool is_tensor_like(py::handle obj);
// A numpy array viewing a host tensor's memory, no copy (its base, a meshrt.Tensor, keeps
// the storage alive); bool stays bool. Emulated device memory only inside a task on its
// stream (DeviceMemoryAccess, where a Python kernel runs on an emulated mesh); UsageError
// for CUDA memory, emulated memory elsewhere, and bfloat16 (numpy has none).
py::object to_numpy(const Tensor& t);
// A DType from meshrt.DType, a numpy dtype (or type), a torch dtype or a name such as
// "float32"; throws UsageError naming what was found.
DType to_dtype(py::handle obj);
// Whether `obj` is one of the forms to_dtype takes other than a string.
bool is_dtype_like(py::handle obj);
// Whether Python objects may still be touched: a tensor's last handle can go on a worker
// thread after the interpreter has finished, where taking the GIL would crash.
bool python_alive();

}  // namespace meshrt::python
