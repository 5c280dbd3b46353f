// Python remote functions (docs/python.md, "Remote functions in Python"): an entry of the
// C++ registry whose kernel and shape function call Python callables with the GIL taken
// for that call only: the shape function at the controller's call site (and again on each
// worker, which checks the kernel's outputs against it), the kernel on the worker thread
// (on a CUDA mesh, a torch kernel on the call's CUDA stream) or, on an emulated
// accelerator, as a host task on the call's device stream (python_kernels.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "meshrt/error.hpp"
#include "meshrt/functions.hpp"

namespace meshrt::python {

namespace py = pybind11;

// A Python exception raised by a kernel: the worker reports its text (the Python type,
// message and last frames) as the call's failure.
class PythonError : public Error {
 public:
  using Error::Error;
};

// A registered Python function. The registry's kernel and shape function point at it.
struct PyFunction {
  std::string name;
  py::object kernel;
  py::object shape;
  bool torch = false;          // tensor arguments as torch tensors, not numpy arrays
  bool shape_missing = false;  // registered without shape=: an object constructor only
};

// meshrt.function's registration (before meshrt.run; UsageError after it).
void register_python_function(const std::string& name, const py::object& kernel, const py::object& shape, bool torch,
                              const std::string& file, int line,
                              const std::vector<std::pair<std::string, std::string>>& params,
                              const std::string& returns, const std::string& doc);
// Drops every Python function's callables (at exit, with the GIL): afterwards they refuse
// to run.
void release_functions();

// What a shape function returned, as a Signature (UsageError naming f otherwise).
Signature signature_of(const PyFunction& f, py::handle r);
// Runs f's shape function (GIL taken here).
Signature run_shape(const PyFunction& f, const ArgMetas& args);
// A shape function's argument: tensors as their TensorMeta, lists as tuples.
py::object meta_arg(const Value& v);
// UsageError once the functions are released.
void require_live(const PyFunction& f);
// The function's kernel on this rank (python_kernels.cpp).
std::vector<Tensor> run_kernel(const PyFunction& f, CallContext& ctx, Args& args);
// The function as an object constructor on this rank (mesh.call_object): what it returns,
// kept as a worker object.
WorkerObject run_object(const PyFunction& f, CallContext& ctx, Args& args);
// A Python object a worker keeps: released with the GIL taken, or left to the exit once
// the functions are released (the interpreter is going; no Python code may run then).
struct PyObjectBox {
  explicit PyObjectBox(py::object o) : object(std::move(o)) {}
  ~PyObjectBox();
  PyObjectBox(const PyObjectBox&) = delete;
  PyObjectBox& operator=(const PyObjectBox&) = delete;
  py::object object;
};
// Whether release_functions has run.
bool functions_released() noexcept;
// What torch=True kernels call, looked up at the first torch=True registration (null
// before): torch.from_numpy, torch.bfloat16 and torch.bool, torch.utils.dlpack.from_dlpack
// (CUDA arguments), and meshrt._functions._cuda_stream (the kernel's stream as torch's).
struct TorchHooks {
  PyObject* from_numpy = nullptr;
  PyObject* bfloat16 = nullptr;
  PyObject* bool_ = nullptr;
  PyObject* from_dlpack = nullptr;
  PyObject* cuda_stream = nullptr;
};
const TorchHooks& torch_hooks();
// A torch kernel on a CUDA mesh needs torch with CUDA: UsageError naming f, `device`, the
// torch version and what torch.cuda.is_available() says, where it has none. Asked once
// per process while the answer is yes.
void require_torch_cuda(const PyFunction& f, const Device& device);

}  // namespace meshrt::python
