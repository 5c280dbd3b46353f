#include "api/python_functions.hpp"

#include <fmt/format.h>
#include <pybind11/numpy.h>

#include <atomic>
#include <string>

#include "bindings.hpp"
#include "support/gil.hpp"
#include "support/tracebacks.hpp"

namespace meshrt::python {
namespace {

// Every PyFunction registered, never destroyed: the C++ registry outlives the interpreter,
// and a Python object released after Python finalised would crash the exit. Their
// callables are dropped at exit instead (release_functions, an atexit hook, with the GIL),
// after which they refuse to run. The vector is guarded by the GIL.
std::vector<PyFunction*>& registered() {
  static auto* all = new std::vector<PyFunction*>();
  return *all;
}
std::atomic<bool> g_released{false};

// Looked up when the first torch=True function is registered (with the GIL); never
// released, like the functions.
TorchHooks g_torch;

py::object call(const py::object& fn, const py::tuple& args) {
  PyObject* result = PyObject_Call(fn.ptr(), args.ptr(), nullptr);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

}  // namespace

// A shape function's argument: tensors as their TensorMeta, lists as tuples.
py::object meta_arg(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None:
      return py::none();
    case Value::Kind::Bool:
      return py::bool_(v.as_bool());
    case Value::Kind::Int:
      return py::int_(v.as_int());
    case Value::Kind::Double:
      return py::float_(v.as_number());
    case Value::Kind::String:
      return py::str(v.as_string());
    case Value::Kind::Meta:
      return py::cast(v.as_meta());
    case Value::Kind::Tensor:
      return py::cast(v.as_tensor().meta());
    case Value::Kind::List: {
      py::tuple out(v.as_list().size());
      for (std::size_t i = 0; i < v.as_list().size(); ++i) out[i] = meta_arg(v.as_list()[i]);
      return out;
    }
    case Value::Kind::Dict: {
      py::dict out;
      for (const auto& [k, e] : v.as_dict()) out[py::str(k)] = meta_arg(e);
      return out;
    }
    case Value::Kind::Object:
      return py::none();  // shape functions see None for a worker object, as on the controller
    case Value::Kind::Ref:
      break;
  }
  throw UsageError(fmt::format("expected an argument value, found the unresolved reference {}", v.to_string()));
}

const TorchHooks& torch_hooks() {
  return g_torch;
}

bool functions_released() noexcept {
  return g_released.load();
}

PyObjectBox::~PyObjectBox() {
  if (g_released.load() || !Py_IsInitialized()) {
    (void)object.release();  // the interpreter is exiting: its objects go with it
    return;
  }
  KeptGil gil;
  object = py::object();
}

void require_live(const PyFunction& f) {
  if (g_released.load()) {
    throw UsageError(
        fmt::format("{}: expected a live Python interpreter, found it exiting (its Python functions are "
                    "released at exit); call Python functions inside meshrt.run",
                    f.name));
  }
}

Signature signature_of(const PyFunction& f, py::handle r) {
  if (r.is_none()) return {};
  if (py::isinstance<Signature>(r)) return r.cast<Signature>();
  if (py::isinstance<TensorMeta>(r)) return {.outputs = {r.cast<TensorMeta>()}, .mutates = {}};
  if (py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r)) {
    Signature s;
    std::size_t i = 0;
    for (py::handle item : r) {
      if (!py::isinstance<TensorMeta>(item)) {
        throw UsageError(
            fmt::format("{}: its shape function returned a sequence whose item {} is a {}; expected "
                        "meshrt.TensorMeta items",
                        f.name, i, qualified_name(py::type::handle_of(item))));
      }
      s.outputs.push_back(item.cast<TensorMeta>());
      ++i;
    }
    return s;
  }
  throw UsageError(
      fmt::format("{}: its shape function returned a {}; expected a meshrt.TensorMeta, a list of them, "
                  "None (no outputs) or a meshrt.Signature",
                  f.name, qualified_name(py::type::handle_of(r))));
}

void require_torch_cuda(const PyFunction& f, const Device& device) {
  static std::atomic<bool> available{false};
  if (available.load()) return;
  std::string version = "(its version unknown)";
  std::string answer;
  try {
    py::module_ torch = py::module_::import("torch");
    version = py::str(torch.attr("__version__"));
    if (torch.attr("cuda").attr("is_available")().cast<bool>()) {
      available.store(true);
      return;
    }
    const py::object cuda = torch.attr("version").attr("cuda");
    answer = cuda.is_none() ? "False, and torch.version.cuda is None: a build of torch without CUDA"
                            : fmt::format("False (a build for CUDA {} that finds no usable GPU or driver here)",
                                          std::string(py::str(cuda)));
  } catch (const py::error_already_set& e) {
    answer = fmt::format("not known: asking raised {}", exception_line(e));
  }
  throw UsageError(fmt::format(
      "{} on {}: a torch kernel on a CUDA mesh needs torch with CUDA, found torch {} whose "
      "torch.cuda.is_available() is {}; install a CUDA build of torch, or place the mesh on the cpu or the emulated "
      "accelerator (kind=\"emulated\" with MESHRT_ACCELERATOR=emulated)",
      f.name, device.to_string(), version, answer));
}

Signature run_shape(const PyFunction& f, const ArgMetas& args) {
  if (f.shape_missing) {
    throw UsageError(fmt::format(
        "{}: it was registered without shape= and returns no tensors: call it with mesh.call_object (its return value "
        "stays on every rank as a worker object), or register it with a shape function to call it with mesh.call",
        f.name));
  }
  if (args.device().is_cuda() && !f.torch) {
    throw UsageError(fmt::format(
        "{}: expected a mesh on the cpu or the emulated accelerator for a numpy kernel, found one on {}: a numpy "
        "kernel runs on the host, which cannot read CUDA memory; register it with torch=True "
        "(@meshrt.function(..., torch=True)): its tensors are then torch CUDA tensors over the device memory, and "
        "its torch work runs on the call's stream",
        f.name, args.device().to_string()));
  }
  KeptGil gil;
  require_live(f);
  if (args.device().is_cuda()) require_torch_cuda(f, args.device());
  Signature s;
  try {
    py::tuple call_args(args.size());
    for (std::size_t i = 0; i < args.size(); ++i) call_args[i] = meta_arg(args.value(i));
    s = signature_of(f, call(f.shape, call_args));
  } catch (const py::error_already_set& e) {
    throw UsageError(fmt::format("{}: its shape function raised {} (at {})", f.name, exception_line(e), innermost(e)));
  }
  // On the emulated accelerator a Python kernel runs in a task after the call has made its
  // outputs, so its results are copies: none can be a view of an argument.
  if (args.device().is_emulated() && !s.views.empty()) {
    throw UsageError(fmt::format(
        "{}: its shape function declares views, which a Python kernel on {} cannot return (it runs in a task on "
        "the stream, and its outputs are copies made there); call it on a cpu or cuda mesh, or write the view as a "
        "C++ kernel (docs/guide.md \"Declared views\")",
        f.name, args.device().to_string()));
  }
  // A Python kernel's outputs live where its mesh is placed: on an accelerator mesh a cpu
  // meta (meshrt.TensorMeta's default) means the rank's device.
  if (args.device().is_accelerator()) {
    for (TensorMeta& m : s.outputs) {
      if (m.device().is_cpu()) m = m.with_device(args.device());
    }
  }
  return s;
}

// ------------------------------------------------------------------ registration

void register_python_function(const std::string& name, const py::object& kernel, const py::object& shape, bool torch,
                              const std::string& file, int line,
                              const std::vector<std::pair<std::string, std::string>>& params,
                              const std::string& returns, const std::string& doc) {
  const std::string where = fmt::format("meshrt.function('{}') at {}:{}", name, file, line);
  if (runtime_started()) {
    throw UsageError(fmt::format(
        "{}: expected registration before meshrt.run, found the runtime started: the start-up handshake has "
        "compared the ranks' function tables, and a function registered now would exist on this rank only; "
        "register functions at import, on every rank",
        where));
  }
  if (!PyCallable_Check(kernel.ptr())) {
    throw UsageError(
        fmt::format("{}: expected a callable kernel, found {}", where, qualified_name(py::type::handle_of(kernel))));
  }
  if (!shape.is_none() && !PyCallable_Check(shape.ptr())) {
    throw UsageError(fmt::format("{}: expected a callable shape function (shape=...), found {}", where,
                                 qualified_name(py::type::handle_of(shape))));
  }
  // numpy's C API (pybind11 loads it at the first array) is loaded here, on the
  // registering thread, rather than by the first kernel on a worker thread: an import there
  // runs module code off the main thread (see python/meshrt/__init__.py for what that did).
  try {
    (void)py::detail::npy_api::get();
  } catch (const py::error_already_set& e) {
    throw UsageError(
        fmt::format("{}: a Python kernel needs numpy, which does not import: {}", where, exception_line(e)));
  }
  if (torch && g_torch.from_numpy == nullptr) {
    try {
      py::module_ t = py::module_::import("torch");
      py::module_ dlpack = py::module_::import("torch.utils.dlpack");
      py::module_ functions = py::module_::import("meshrt._functions");
      g_torch.from_numpy = py::object(t.attr("from_numpy")).release().ptr();
      g_torch.bfloat16 = py::object(t.attr("bfloat16")).release().ptr();
      g_torch.bool_ = py::object(t.attr("bool")).release().ptr();
      g_torch.from_dlpack = py::object(dlpack.attr("from_dlpack")).release().ptr();
      g_torch.cuda_stream = py::object(functions.attr("_cuda_stream")).release().ptr();
    } catch (const py::error_already_set& e) {
      throw UsageError(fmt::format("{}: torch=True needs torch, which does not import: {}", where, exception_line(e)));
    }
  }
  auto* f = new PyFunction{name, kernel, shape, torch, shape.is_none()};
  functions::Description description;
  for (const auto& [n, kind] : params) description.params.push_back({n, kind});
  description.returns = returns;
  description.doc = doc;
  try {
    functions::register_function(
        name, [f](CallContext& ctx, Args& args) { return run_kernel(*f, ctx, args); },
        [f](const ArgMetas& args) { return run_shape(*f, args); }, file.c_str(), line, std::move(description),
        [f](CallContext& ctx, Args& args) { return run_object(*f, ctx, args); });
  } catch (...) {
    delete f;
    throw;
  }
  registered().push_back(f);
}

void release_functions() {
  g_released.store(true);
  for (PyFunction* f : registered()) {
    f->kernel = py::object();
    f->shape = py::object();
  }
}

}  // namespace meshrt::python
