// Conversions between Python objects and meshrt's C++ values, shared by every part of
// the extension module. Tensors cross without a copy wherever the two sides allow it.
#pragma once

#include <pybind11/pybind11.h>

#include <string_view>

#include "meshrt/tensor.hpp"

namespace meshrt::python {

namespace py = pybind11;

// A meshrt.Tensor object holding `t` (a handle: it shares t's storage).
py::object wrap_tensor(Tensor t);
// The meshrt Tensor an object holds or views: a meshrt.Tensor (its handle), or anything
// that speaks DLPack or the buffer protocol (numpy arrays, torch tensors, bytearray,
// array.array), without a copy; read-only memory (bytes, a read-only array) is copied,
// since kernels may write a tensor. The view keeps the producer alive and releases it with
// the GIL, from whichever thread drops the last handle. `what` names the object in errors
// ("argument 2 of example.scale"). Throws UsageError (non-contiguous memory, a dtype meshrt
// lacks, a failing __dlpack__).
Tensor to_tensor(py::handle obj, std::string_view what);
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

}  // namespace meshrt::python
