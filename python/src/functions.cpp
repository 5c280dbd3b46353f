// Python remote functions (DESIGN section 11): the registration behind meshrt.function,
// CallContext and Signature. A Python function is an entry of the C++ registry whose
// kernel and shape function call the Python callables with the GIL taken for that call
// only: the shape function at the controller's call site (and again on each worker, which
// checks the kernel's outputs against it), the kernel on the worker thread, or, on an
// emulated accelerator, as a host task on the call's device stream.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "convert.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"

namespace meshrt::python {

// A Python exception raised by a kernel: the worker reports its text (the Python type,
// message and last frames) as the call's failure.
class PythonError : public Error {
 public:
  using Error::Error;
};

namespace {

// A registered Python function. The registry's kernel and shape function point at it.
struct PyFunction {
  std::string name;
  py::object kernel;
  py::object shape;
  bool torch = false;  // tensor arguments as torch tensors, not numpy arrays
};

// Every PyFunction registered, never destroyed: the C++ registry outlives the interpreter,
// and a Python object released after Python finalised would crash the exit. Their
// callables are dropped at exit instead (release_functions, an atexit hook, with the GIL),
// after which they refuse to run. The vector is guarded by the GIL.
std::vector<PyFunction*>& registered() {
  static auto* all = new std::vector<PyFunction*>();
  return *all;
}
std::atomic<bool> g_released{false};

// torch.from_numpy and torch.bfloat16, looked up when the first torch=True function is
// registered (with the GIL); never released, like the functions.
struct Torch {
  PyObject* from_numpy = nullptr;
  PyObject* bfloat16 = nullptr;
};
Torch g_torch;

// The GIL for this thread. A thread keeps its Python thread state between calls (made on
// its first call) rather than making and deleting one per kernel: the worker thread and
// an emulated stream's thread come back for every Python call.
class Gil {
 public:
  Gil() {
    thread_local bool kept = false;
    if (!kept) {
      acquire_.inc_ref();
      kept = true;
    }
  }

 private:
  py::gil_scoped_acquire acquire_;
};

void require_live(const PyFunction& f) {
  if (g_released.load()) {
    throw UsageError(
        fmt::format("{}: expected a live Python interpreter, found it exiting (its Python functions are "
                    "released at exit); call Python functions inside meshrt.run",
                    f.name));
  }
}

std::string qualified_name(py::handle type) {
  const std::string module = py::str(type.attr("__module__"));
  const std::string name = py::str(type.attr("__qualname__"));
  return module == "builtins" ? name : module + "." + name;
}

// "ValueError: bad input"
std::string exception_line(const py::error_already_set& e) {
  const std::string message = py::str(e.value());
  const std::string type = qualified_name(e.type());
  return message.empty() ? type : type + ": " + message;
}

// The traceback's last `limit` frames, as Python prints them.
std::string last_frames(const py::error_already_set& e, int limit) {
  if (!e.trace()) return "";
  int frames = 0;
  for (py::handle tb = e.trace(); !tb.is_none(); tb = tb.attr("tb_next")) ++frames;
  py::list lines = py::module_::import("traceback").attr("format_tb")(e.trace(), py::arg("limit") = -limit);
  std::string out = frames > limit ? fmt::format("Traceback (the last {} of {} frames):\n", limit, frames)
                                   : std::string("Traceback (most recent call last):\n");
  for (py::handle line : lines) out += py::str(line).cast<std::string>();
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// "file.py:12 in scale_shape": where the innermost frame raised.
std::string innermost(const py::error_already_set& e) {
  if (!e.trace()) return "";
  py::handle tb = e.trace();
  while (!tb.attr("tb_next").is_none()) tb = tb.attr("tb_next");
  py::handle code = tb.attr("tb_frame").attr("f_code");
  return fmt::format("{}:{} in {}", py::str(code.attr("co_filename")).cast<std::string>(),
                     tb.attr("tb_lineno").cast<int>(), py::str(code.attr("co_name")).cast<std::string>());
}

constexpr int kTracebackFrames = 5;

std::string kernel_failure(const PyFunction& f, int rank, const py::error_already_set& e) {
  return fmt::format("{} on rank {} raised {}\n{}", f.name, rank, exception_line(e), last_frames(e, kTracebackFrames));
}

py::object call(const py::object& fn, const py::tuple& args) {
  PyObject* result = PyObject_Call(fn.ptr(), args.ptr(), nullptr);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// ------------------------------------------------------------------ shape functions

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
    case Value::Kind::Ref:
      break;
  }
  throw UsageError(fmt::format("expected an argument value, found the unresolved reference {}", v.to_string()));
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

Signature run_shape(const PyFunction& f, const ArgMetas& args) {
  if (args.device().is_cuda()) {
    throw UsageError(
        fmt::format("{}: expected a mesh on the cpu or the emulated accelerator, found one on {}: a "
                    "Python kernel runs on the host, which cannot read CUDA memory",
                    f.name, args.device().to_string()));
  }
  Gil gil;
  require_live(f);
  Signature s;
  try {
    py::tuple call_args(args.size());
    for (std::size_t i = 0; i < args.size(); ++i) call_args[i] = meta_arg(args.value(i));
    s = signature_of(f, call(f.shape, call_args));
  } catch (const py::error_already_set& e) {
    throw UsageError(fmt::format("{}: its shape function raised {} (at {})", f.name, exception_line(e), innermost(e)));
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

// ------------------------------------------------------------------ kernels

// numpy's type number for `dtype`. bfloat16 travels as its bits (uint16) and becomes a
// torch.bfloat16 tensor for torch=True functions.
int numpy_type(DType dtype) {
  using api = py::detail::npy_api;
  switch (dtype) {
    case DType::Bool:
      return api::NPY_BOOL_;
    case DType::UInt8:
      return api::NPY_UINT8_;
    case DType::Int32:
      return api::NPY_INT32_;
    case DType::Int64:
      return api::NPY_INT64_;
    case DType::Float16:
      return 23;  // NPY_HALF
    case DType::BFloat16:
      return api::NPY_UINT16_;
    case DType::Float32:
      return api::NPY_FLOAT_;
    case DType::Float64:
      return api::NPY_DOUBLE_;
  }
  return api::NPY_UINT8_;
}

// A kernel's Python arguments: tensors as views of the rank's local tensors (numpy arrays,
// or torch tensors over them), read-only unless the shape function declares them mutated.
class KernelArgs {
 public:
  KernelArgs(const PyFunction& f, int rank) : f_(f), rank_(rank) {}

  py::tuple build(const CallContext& ctx, const std::vector<Value>& values, const Signature* signature) {
    py::tuple out(values.size() + 1);
    CallContext copy = ctx;
    copy.set_signature(nullptr);  // the Python object may outlive the call
    out[0] = py::cast(std::move(copy));
    for (std::size_t i = 0; i < values.size(); ++i) {
      bool writable = signature == nullptr;
      if (signature != nullptr) {
        for (std::size_t m : signature->mutates) writable = writable || m == i;
      }
      out[i + 1] = convert(values[i], i, writable);
    }
    return out;
  }

  // The views made, with the argument each belongs to.
  const std::vector<std::pair<std::size_t, py::object>>& views() const noexcept { return views_; }

 private:
  py::object convert(const Value& v, std::size_t index, bool writable) {
    switch (v.kind()) {
      case Value::Kind::Tensor:
        return view(v.as_tensor(), index, writable);
      case Value::Kind::List: {
        py::tuple out(v.as_list().size());
        for (std::size_t i = 0; i < v.as_list().size(); ++i) out[i] = convert(v.as_list()[i], index, writable);
        return out;
      }
      case Value::Kind::Dict: {
        py::dict out;
        for (const auto& [k, e] : v.as_dict()) out[py::str(k)] = convert(e, index, writable);
        return out;
      }
      default:
        return meta_arg(v);
    }
  }

  py::object view(const Tensor& t, std::size_t index, bool writable) {
    if (t.dtype() == DType::BFloat16 && !f_.torch) {
      throw UsageError(
          fmt::format("{} on rank {}: argument {} is a {} tensor, and numpy has no bfloat16; register "
                      "the function with torch=True to receive torch tensors",
                      f_.name, rank_, index, t.meta().to_string()));
    }
    auto* owner = new Tensor(t);
    py::capsule base(owner, [](void* p) { delete static_cast<Tensor*>(p); });
    std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
    py::array array(py::dtype(numpy_type(t.dtype())), std::move(shape), {}, owner->raw_data(), base);
    // torch refuses read-only arrays (and numpy's DLPack export does too): torch views
    // are writable.
    if (!writable && !f_.torch) {
      py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    }
    py::object out = std::move(array);
    if (f_.torch) {
      out = py::reinterpret_steal<py::object>(PyObject_CallOneArg(g_torch.from_numpy, out.ptr()));
      if (!out) throw py::error_already_set();
      if (t.dtype() == DType::BFloat16) out = out.attr("view")(py::handle(g_torch.bfloat16));
    }
    views_.emplace_back(index, out);
    return out;
  }

  const PyFunction& f_;
  int rank_;
  std::vector<std::pair<std::size_t, py::object>> views_;
};

// A kernel's return value as tensors: None (no outputs), one tensor-like object, or a
// tuple or list of them.
std::vector<Tensor> outputs_of(const PyFunction& f, py::handle result, int rank) {
  std::vector<Tensor> out;
  if (result.is_none()) return out;
  auto what = [&](std::size_t i) { return fmt::format("{} on rank {}: its kernel's output {}", f.name, rank, i); };
  if (py::isinstance<py::tuple>(result) || py::isinstance<py::list>(result)) {
    for (py::handle item : result) out.push_back(to_tensor(item, what(out.size())));
  } else {
    out.push_back(to_tensor(result, what(0)));
  }
  return out;
}

// The signature the worker computed for this call, or (a fetch's preprocess function) the
// shape function's answer now.
Signature declared(const PyFunction& f, const CallContext& ctx, const Args& args) {
  if (ctx.signature() != nullptr) return *ctx.signature();
  std::vector<Value> metas;
  for (const Value& v : args.values()) {
    metas.push_back(v.map([](const Value& leaf) { return leaf.is_tensor() ? Value(leaf.as_tensor().meta()) : leaf; }));
  }
  return run_shape(f, ArgMetas(f.name, std::move(metas), ctx.device()));
}

// On the worker thread: the kernel's results are the call's outputs (the worker checks
// them against the shape function).
std::vector<Tensor> run_on_host(const PyFunction& f, CallContext& ctx, Args& args) {
  Gil gil;
  require_live(f);
  try {
    KernelArgs kernel_args(f, ctx.rank());
    py::tuple call_args = kernel_args.build(ctx, args.values(), ctx.signature());
    return outputs_of(f, call(f.kernel, call_args), ctx.rank());
  } catch (const py::error_already_set& e) {
    throw PythonError(kernel_failure(f, ctx.rank(), e));
  }
}

// On an emulated stream's thread, inside the task (where its device memory is readable):
// the kernel's results are copied into the call's outputs, which the worker made on the
// stream. A view that outlives the task would read device memory outside any task, so
// keeping one fails the call.
// "float32[2] on emulated:1", or the kind of a non-tensor argument (a list of tensors).
std::string meta_of(const Value& v) {
  return v.is_tensor() ? v.as_tensor().meta().to_string() : std::string(Value::kind_name(v.kind()));
}

void run_task(const PyFunction& f, const CallContext& ctx, const std::vector<Value>& values, const Signature& signature,
              std::vector<Tensor>& outputs) {
  require_live(f);
  Gil gil;
  try {
    KernelArgs kernel_args(f, ctx.rank());
    std::vector<Tensor> results;
    {
      py::tuple call_args = kernel_args.build(ctx, values, &signature);
      results = outputs_of(f, call(f.kernel, call_args), ctx.rank());
    }
    if (results.size() != outputs.size()) {
      throw UsageError(fmt::format("{} returned {} tensors on rank {}; its shape function declared {}", f.name,
                                   results.size(), ctx.rank(), outputs.size()));
    }
    for (std::size_t i = 0; i < results.size(); ++i) {
      const TensorMeta& want = outputs[i].meta();
      if (results[i].shape() != want.shape() || results[i].dtype() != want.dtype()) {
        throw UsageError(fmt::format("{} returned on rank {} as output {}: expected {} (its shape function), found {}",
                                     f.name, ctx.rank(), i, want.to_string(), results[i].meta().to_string()));
      }
      std::memcpy(outputs[i].raw_data(), results[i].raw_data(), want.nbytes());
    }
    results.clear();
    for (const auto& [index, view] : kernel_args.views()) {
      if (view.ref_count() > 1) {
        throw UsageError(
            fmt::format("{} on rank {}: the kernel kept its view of argument {} ({}), which is emulated "
                        "device memory, readable only during the kernel's task; keep a copy "
                        "(np.array(x)) instead",
                        f.name, ctx.rank(), index, meta_of(values[index])));
      }
    }
  } catch (const py::error_already_set& e) {
    throw PythonError(kernel_failure(f, ctx.rank(), e));
  }
}

std::vector<Tensor> run_on_emulated(const PyFunction& f, CallContext& ctx, Args& args) {
  Signature signature = declared(f, ctx, args);
  std::vector<Tensor> outputs;
  for (const TensorMeta& m : signature.outputs) outputs.push_back(device::empty_on(ctx.stream_id(), m));
  CallContext task_ctx = ctx;
  task_ctx.set_signature(nullptr);
  device::host_task(ctx.stream_id(), ctx.device(),
                    [&f, task_ctx, values = args.values(), signature = std::move(signature), outputs]() mutable {
                      run_task(f, task_ctx, values, signature, outputs);
                    });
  return outputs;
}

std::vector<Tensor> run_kernel(const PyFunction& f, CallContext& ctx, Args& args) {
  if (ctx.device().is_emulated()) return run_on_emulated(f, ctx, args);
  if (ctx.device().is_cuda()) {
    throw UsageError(
        fmt::format("{} on rank {}: expected a cpu or emulated device, found {}: a Python kernel runs on "
                    "the host, which cannot read CUDA memory",
                    f.name, ctx.rank(), ctx.device().to_string()));
  }
  return run_on_host(f, ctx, args);
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
  if (!PyCallable_Check(shape.ptr())) {
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
      g_torch.from_numpy = py::object(t.attr("from_numpy")).release().ptr();
      g_torch.bfloat16 = py::object(t.attr("bfloat16")).release().ptr();
    } catch (const py::error_already_set& e) {
      throw UsageError(fmt::format("{}: torch=True needs torch, which does not import: {}", where, exception_line(e)));
    }
  }
  auto* f = new PyFunction{name, kernel, shape, torch};
  functions::Description description;
  for (const auto& [n, kind] : params) description.params.push_back({n, kind});
  description.returns = returns;
  description.doc = doc;
  try {
    functions::register_function(
        name, [f](CallContext& ctx, Args& args) { return run_kernel(*f, ctx, args); },
        [f](const ArgMetas& args) { return run_shape(*f, args); }, file.c_str(), line, std::move(description));
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

// ------------------------------------------------------------------ benchmark support

Arg plain_arg(py::handle obj) {
  if (py::isinstance<DTensor>(obj)) return Arg(obj.cast<DTensor>());
  if (py::isinstance<py::bool_>(obj)) return Arg(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj)) return Arg(obj.cast<long long>());
  if (py::isinstance<py::float_>(obj)) return Arg(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return Arg(obj.cast<std::string>());
  if (obj.is_none()) return Arg(Value());
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    Value::List items;
    for (py::handle item : obj) items.push_back(plain_arg(item).value());
    return Arg(Value(std::move(items)));
  }
  return Arg(to_dtype(obj));
}

}  // namespace

void bind_functions(py::module_& m) {
  py::class_<CallContext>(m, "CallContext", "Where and on what a kernel runs: the first argument of a Python kernel.")
      .def_property_readonly("rank", &CallContext::rank)
      .def_property_readonly("dim_names", [](const CallContext& c) { return py::tuple(py::cast(c.dim_names())); })
      .def_property_readonly("coordinates", [](const CallContext& c) { return py::tuple(py::cast(c.coordinates())); })
      .def_property_readonly("sizes", [](const CallContext& c) { return py::tuple(py::cast(c.sizes())); })
      .def_property_readonly("device", [](const CallContext& c) { return c.device(); })
      .def_property_readonly("stream_id", &CallContext::stream_id)
      .def("coordinate", &CallContext::coordinate, py::arg("dim"), "This rank's coordinate along mesh dimension dim.")
      .def("size", &CallContext::size, py::arg("dim"), "The mesh's size along dimension dim.")
      .def("__repr__", [](const CallContext& c) {
        std::vector<std::string> dims;
        for (std::size_t i = 0; i < c.dim_names().size(); ++i) {
          dims.push_back(fmt::format("{}={}/{}", c.dim_names()[i], c.coordinates()[i], c.sizes()[i]));
        }
        return fmt::format("meshrt.CallContext(rank={}, {}, device={}, stream_id={})", c.rank(), fmt::join(dims, ", "),
                           c.device().to_string(), c.stream_id());
      });

  py::class_<Signature>(m, "Signature",
                        "What a call produces, returned by a shape function: its outputs' metas, and the positions "
                        "of the tensor arguments its kernel writes in place.")
      .def(py::init([](py::handle outputs, std::vector<std::size_t> mutates) {
             PyFunction anonymous{"meshrt.Signature", {}, {}, false};
             Signature s = signature_of(anonymous, outputs);
             s.mutates = std::move(mutates);
             return s;
           }),
           py::arg("outputs") = py::tuple(), py::arg("mutates") = std::vector<std::size_t>{})
      .def_property_readonly("outputs", [](const Signature& s) { return py::tuple(py::cast(s.outputs)); })
      .def_property_readonly("mutates", [](const Signature& s) { return py::tuple(py::cast(s.mutates)); })
      .def("__repr__", [](const Signature& s) {
        std::vector<std::string> outputs;
        for (const TensorMeta& o : s.outputs) outputs.push_back(o.to_string());
        return fmt::format("meshrt.Signature(outputs=[{}], mutates={})", fmt::join(outputs, ", "), s.mutates);
      });

  m.def("_register_function", &register_python_function, py::arg("name"), py::arg("kernel"), py::arg("shape"),
        py::arg("torch"), py::arg("file"), py::arg("line"), py::arg("params"), py::arg("returns"), py::arg("doc"),
        "Registers a Python kernel and shape function (meshrt.function is the way to call it).");
  m.def("_release_functions", &release_functions,
        "Drops the Python functions' callables (at exit, before Python finalises).");
  // Last out, after _shutdown (registered later, by the package) has stopped the runtime.
  py::module_::import("atexit").attr("register")(m.attr("_release_functions"));

  m.def(
      "_call_loop",
      [](const Mesh& mesh, const std::string& fn, const py::tuple& args, std::int64_t n) {
        std::vector<Arg> converted;
        for (py::handle a : args) converted.push_back(plain_arg(a));
        py::gil_scoped_release release;
        for (std::int64_t i = 0; i < n; ++i) (void)mesh.call_n(fn, converted);
      },
      py::arg("mesh"), py::arg("fn"), py::arg("args"), py::arg("n"),
      "Calls fn(*args) on mesh n times from C++ (the benchmark's C++ controller loop).");
}

}  // namespace meshrt::python
