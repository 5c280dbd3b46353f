// A Python kernel's run on a worker: its tensor arguments as views of the rank's local
// tensors (numpy arrays, or torch tensors over them: torch CUDA tensors on a CUDA mesh), its
// results as the call's outputs.
#include <fmt/format.h>
#include <pybind11/numpy.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "api/python_functions.hpp"
#include "meshrt/device.hpp"
#include "support/convert.hpp"
#include "support/dlpack.hpp"
#include "support/gil.hpp"
#include "support/tracebacks.hpp"

namespace meshrt::python {
namespace {

constexpr int kTracebackFrames = 5;

std::string kernel_failure(const PyFunction& f, int rank, const py::error_already_set& e) {
  return fmt::format("{} on rank {} raised {}\n{}", f.name, rank, exception_line(e), last_frames(e, kTracebackFrames));
}

py::object call(const py::object& fn, const py::tuple& args) {
  PyObject* result = PyObject_Call(fn.ptr(), args.ptr(), nullptr);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// numpy's type number for `dtype`. bfloat16 travels as its bits (int16) and becomes a
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
      return api::NPY_INT16_;  // its bits; torch.from_numpy takes int16 (not uint16), then views it
    case DType::Float32:
      return api::NPY_FLOAT_;
    case DType::Float64:
      return api::NPY_DOUBLE_;
  }
  return api::NPY_UINT8_;
}

// A kernel's Python arguments: tensors as views of the rank's local tensors (numpy arrays,
// or torch tensors over them), read-only unless the shape function declares them mutated
// (or outputs views of them).
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
        // A declared view of the argument is returned as a view of its array.
        for (const View& v : signature->views) writable = writable || v.input == i;
      }
      out[i + 1] = convert(values[i], i, writable);
    }
    return out;
  }

  // The views made, with the argument each belongs to.
  const std::vector<std::pair<std::size_t, py::object>>& views() const noexcept { return views_; }

  // torch has no read-only tensors: a torch view of an input not declared mutated is
  // writable, and every in-place op moves its _version. A moved one fails the call. Once
  // checked, the list lets its views go: only views() counts the kernel's references then.
  void check_read_only(const std::vector<Value>& values) {
    const auto checked = std::move(read_only_torch_);
    read_only_torch_.clear();
    for (const auto& [index, view] : checked) {
      if (view.attr("_version").cast<long long>() == 0) continue;
      throw UsageError(fmt::format(
          "{} on rank {}: its kernel wrote argument {} ({}) in place, which its shape function does not declare "
          "mutated; declare it (meshrt.Signature(outputs, mutates=[{}])) or write to a copy (x.clone()); that "
          "argument's value on this rank now holds what the kernel wrote",
          f_.name, rank_, index, values[index].is_tensor() ? values[index].as_tensor().meta().to_string() : "a list",
          index));
    }
  }

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
      case Value::Kind::Object: {
        if (const auto* box = v.as_object().get<PyObjectBox>()) return box->object;
        throw UsageError(
            fmt::format("{} on rank {}: argument {} is a {}, which Python cannot see: pass Python "
                        "kernels objects made by Python constructors",
                        f_.name, rank_, index, v.to_string()));
      }
      default:
        return meta_arg(v);
    }
  }

  py::object view(const Tensor& t, std::size_t index, bool writable) {
    if (t.device().is_cuda()) return cuda_view(t, index, writable);
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
      out = py::reinterpret_steal<py::object>(PyObject_CallOneArg(torch_hooks().from_numpy, out.ptr()));
      if (!out) throw py::error_already_set();
      if (t.dtype() == DType::BFloat16) out = out.attr("view")(py::handle(torch_hooks().bfloat16));
    }
    views_.emplace_back(index, out);
    if (f_.torch && !writable) read_only_torch_.emplace_back(index, out);
    return out;
  }

  // A torch CUDA tensor over the device memory, through DLPack (no copy): it holds a handle
  // of the storage, so meshrt's pool keeps the memory while torch uses it. bool crosses as
  // uint8 (torch 1.13 takes no kDLBool) and is viewed back as bool.
  py::object cuda_view(const Tensor& t, std::size_t index, bool writable) {
    const py::object capsule = unversioned_capsule(t);
    py::object out = py::reinterpret_steal<py::object>(PyObject_CallOneArg(torch_hooks().from_dlpack, capsule.ptr()));
    if (!out) throw py::error_already_set();
    if (t.dtype() == DType::Bool) out = out.attr("view")(py::handle(torch_hooks().bool_));
    views_.emplace_back(index, out);
    if (!writable) read_only_torch_.emplace_back(index, out);
    return out;
  }

  const PyFunction& f_;
  int rank_;
  std::vector<std::pair<std::size_t, py::object>> views_;
  std::vector<std::pair<std::size_t, py::object>> read_only_torch_;
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
    metas.push_back(v.map([](const Value& leaf) {
      if (leaf.is_object()) return Value();  // shape functions see None for a worker object
      return leaf.is_tensor() ? Value(leaf.as_tensor().meta()) : leaf;
    }));
  }
  return run_shape(f, ArgMetas(f.name, std::move(metas), ctx.device()));
}

// On the worker thread: the kernel's results are the call's outputs (the worker checks
// them against the shape function).
std::vector<Tensor> run_on_host(const PyFunction& f, CallContext& ctx, Args& args) {
  KeptGil gil;
  PythonKernelRunning running;
  require_live(f);
  try {
    KernelArgs kernel_args(f, ctx.rank());
    py::tuple call_args = kernel_args.build(ctx, args.values(), ctx.signature());
    py::object result = call(f.kernel, call_args);
    kernel_args.check_read_only(args.values());
    return outputs_of(f, result, ctx.rank());
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
  KeptGil gil;
  PythonKernelRunning running;
  try {
    KernelArgs kernel_args(f, ctx.rank());
    std::vector<Tensor> results;
    {
      py::tuple call_args = kernel_args.build(ctx, values, &signature);
      py::object result = call(f.kernel, call_args);
      kernel_args.check_read_only(values);
      results = outputs_of(f, result, ctx.rank());
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

// torch's current stream and device, while it lives, are the call's CUDA stream (as a
// torch.cuda.ExternalStream) and the rank's GPU: the kernel's torch work is enqueued in
// the call's order, after the work that made its inputs and before the work that reads
// its outputs, as a C++ kernel's launches on ctx.native_stream() are.
class TorchOnCallStream {
 public:
  explicit TorchOnCallStream(const CallContext& ctx)
      : context_(py::reinterpret_borrow<py::object>(torch_hooks().cuda_stream)(
            py::int_(reinterpret_cast<std::intptr_t>(ctx.native_stream())), ctx.device().index())) {
    context_.attr("__enter__")();
  }
  ~TorchOnCallStream() {
    try {
      context_.attr("__exit__")(py::none(), py::none(), py::none());
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("meshrt: restoring torch's stream after a kernel");
    }
  }
  TorchOnCallStream(const TorchOnCallStream&) = delete;
  TorchOnCallStream& operator=(const TorchOnCallStream&) = delete;

 private:
  py::object context_;
};

// On the worker thread, a torch kernel on a CUDA mesh (run_shape refuses numpy kernels
// there): its tensor arguments are torch CUDA tensors viewing meshrt's device memory, its
// torch work runs on the call's stream, and the CUDA tensors it returns become the call's
// outputs without a copy (meshrt's tensor holds torch's, so torch's caching allocator
// keeps that memory until meshrt lets it go, and then reuses it in the call stream's order).
std::vector<Tensor> run_on_cuda(const PyFunction& f, CallContext& ctx, Args& args) {
  KeptGil gil;
  PythonKernelRunning running;
  require_live(f);
  try {
    const KernelStreamScope scope(device::stream_for(ctx.stream_id(), ctx.device()));
    const TorchOnCallStream on_stream(ctx);
    KernelArgs kernel_args(f, ctx.rank());
    py::tuple call_args = kernel_args.build(ctx, args.values(), ctx.signature());
    py::object result = call(f.kernel, call_args);
    kernel_args.check_read_only(args.values());
    std::vector<Tensor> outputs = outputs_of(f, result, ctx.rank());
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].device().is_cuda()) {
        throw UsageError(fmt::format(
            "{} returned on rank {} as output {} {}: expected a tensor on the rank's GPU {}, where the outputs of a "
            "kernel on a CUDA mesh live; make it there (torch.zeros(..., device=ctx.torch_device), "
            "x.new_zeros(...), t.to(x.device))",
            f.name, ctx.rank(), i, outputs[i].meta().to_string(), ctx.device().to_string()));
      }
    }
    return outputs;
  } catch (const py::error_already_set& e) {
    throw PythonError(kernel_failure(f, ctx.rank(), e));
  }
}

}  // namespace

// On the worker thread on every mesh: its tensor arguments read-only views (on the cpu: the
// controller refuses tensor arguments to a constructor on an accelerator mesh, whose memory
// a view outside the stream's tasks could not read).
WorkerObject run_object(const PyFunction& f, CallContext& ctx, Args& args) {
  KeptGil gil;
  PythonKernelRunning running;
  require_live(f);
  try {
    KernelArgs kernel_args(f, ctx.rank());
    const Signature none;  // nothing declared mutated: the views are read-only
    py::tuple call_args = kernel_args.build(ctx, args.values(), &none);
    py::object result = call(f.kernel, call_args);
    kernel_args.check_read_only(args.values());
    return WorkerObject(std::make_shared<PyObjectBox>(std::move(result)));
  } catch (const py::error_already_set& e) {
    throw PythonError(kernel_failure(f, ctx.rank(), e));
  }
}

std::vector<Tensor> run_kernel(const PyFunction& f, CallContext& ctx, Args& args) {
  if (ctx.device().is_emulated()) return run_on_emulated(f, ctx, args);
  if (ctx.device().is_cuda()) return run_on_cuda(f, ctx, args);
  return run_on_host(f, ctx, args);
}

}  // namespace meshrt::python
