// run(), Controller, Mesh, DTensor, Stream, Future, MeshPermutation, Reduction and
// DeviceKind in Python: the C++ API of meshrt/controller.hpp and meshrt/runtime.hpp with
// Python spelling (DESIGN section 11, docs/python.md).
//
// Three rules hold every binding here:
//   - Arguments are converted with the GIL held; the C++ call then runs with the GIL
//     released and the controller lock held (released()). The controller is not
//     thread-safe; the lock is what serialises Python threads now that the GIL does not.
//   - Every call site the C++ controller records is the Python line (site.hpp), and a
//     UsageError of a call that records none is given that line here (at_site()).
//   - A blocking wait checks for signals every detail::kWaitCheckInterval (check_signals
//     through detail::set_wait_check, or the loops below), so Ctrl-C is a KeyboardInterrupt
//     and not a hang.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <pybind11/stl.h>

#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "convert.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/internal/controller.hpp"
#include "meshrt/runtime.hpp"
#include "meshrt/version.hpp"
#include "site.hpp"

namespace meshrt::python {
namespace {

// ------------------------------------------------------------------ the controller lock

// Held around every C++ controller call. Recursive: a Python signal handler that the wait
// check runs may itself drop a handle or call the controller, on the thread that holds it.
std::recursive_mutex& controller_mutex() {
  static auto* m = new std::recursive_mutex();  // never destroyed: handles die after exit's statics
  return *m;
}

// Handles whose Python object died while another thread held the controller lock. They
// are destroyed by the next call that takes it: waiting for the lock could deadlock (the
// holder may wait for worker 0, whose Python kernel is the thread that dropped the handle),
// and destroying a handle only queues a delete for the next command anyway.
struct Grave {
  void* handle;
  void (*destroy)(void*);
};
std::mutex& graveyard_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<Grave>& graveyard() {
  static auto* g = new std::vector<Grave>();
  return *g;
}

// The caller holds the controller lock.
void empty_graveyard() {
  std::vector<Grave> graves;
  {
    std::lock_guard lock(graveyard_mutex());
    if (graveyard().empty()) return;
    graves.swap(graveyard());
  }
  for (const Grave& g : graves) g.destroy(g.handle);
}

// The holder's deleter of every handle type (DTensor, Mesh, Stream, Future).
template <class T>
struct HandleDelete {
  void operator()(T* handle) const noexcept {
    std::unique_lock lock(controller_mutex(), std::try_to_lock);
    if (lock.owns_lock()) {
      delete handle;
      return;
    }
    std::lock_guard g(graveyard_mutex());
    graveyard().push_back(Grave{handle, [](void* p) { delete static_cast<T*>(p); }});
  }
};
template <class T>
using Holder = std::unique_ptr<T, HandleDelete<T>>;

// Runs f (a C++ controller call) with the GIL released and the controller lock held.
template <class F>
auto released(F&& f) -> decltype(f()) {
  py::gil_scoped_release release;
  std::lock_guard lock(controller_mutex());
  empty_graveyard();
  return f();
}

// The wait check (meshrt/internal/controller.hpp): a pending signal's Python handler runs
// here, and its exception (KeyboardInterrupt) ends the wait.
void check_signals() {
  py::gil_scoped_acquire acquire;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// ------------------------------------------------------------------ call sites

// A UsageError of a C++ call that records no site of its own, given the Python line.
template <class F>
auto at_site(const std::source_location& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UsageError& e) {
    const std::string site = describe(where);
    const std::string what = e.what();
    if (what.find("(at " + site + ")") != std::string::npos) throw;
    throw UsageError(fmt::format("{} (at {})", what, site));
  }
}

[[noreturn]] void usage(const std::source_location& where, const std::string& what) {
  throw UsageError(fmt::format("{} (at {})", what, describe(where)));
}

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__qualname__"));
}

// "list [1, 'a']", shortened: what was found, for an error.
std::string found(py::handle obj) {
  std::string r = py::repr(obj);
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return fmt::format("{} {}", type_name(obj), r);
}

// ------------------------------------------------------------------ conversions

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::int64_t to_int(py::handle obj, const std::string& what, const std::source_location& where) {
  if (py::isinstance<py::bool_>(obj) || !PyIndex_Check(obj.ptr()))
    usage(where, what + ": expected an int, found " + found(obj));
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) usage(where, what + ": expected an int that fits in 64 bits, found " + found(obj));
  return v;
}

std::string to_name(py::handle obj, const std::string& what, const std::source_location& where) {
  if (!py::isinstance<py::str>(obj)) usage(where, what + ": expected a str, found " + found(obj));
  return obj.cast<std::string>();
}

// {"dp": 2, "tp": 2} or [("dp", 2), ("tp", 2)].
std::vector<std::pair<std::string, std::int64_t>> to_dims(py::handle obj, const std::string& what,
                                                          const std::source_location& where) {
  std::vector<std::pair<std::string, std::int64_t>> dims;
  if (py::isinstance<py::dict>(obj)) {
    for (auto [k, v] : obj.cast<py::dict>()) {
      const std::string name = to_name(k, what + ": a dimension name", where);
      dims.emplace_back(name, to_int(v, fmt::format("{}: the size of '{}'", what, name), where));
    }
    return dims;
  }
  if (!py::isinstance<py::list>(obj) && !py::isinstance<py::tuple>(obj)) {
    usage(where, what + ": expected a dict {name: size} or a list of (name, size) pairs, found " + found(obj));
  }
  for (py::handle item : obj) {
    if (!(py::isinstance<py::tuple>(item) || py::isinstance<py::list>(item)) || py::len(item) != 2) {
      usage(where, what + ": expected (name, size) pairs, found " + found(item));
    }
    const std::string name = to_name(item[py::int_(0)], what + ": a dimension name", where);
    dims.emplace_back(name, to_int(item[py::int_(1)], fmt::format("{}: the size of '{}'", what, name), where));
  }
  return dims;
}

Reduction to_reduction(py::handle obj, const std::source_location& where) {
  if (py::isinstance<Reduction>(obj)) return obj.cast<Reduction>();
  if (py::isinstance<py::str>(obj))
    return at_site(where, [&] { return parse_reduction(lower(obj.cast<std::string>())); });
  usage(where, "reduce: expected a meshrt.Reduction or its name (\"sum\"), found " + found(obj));
}

DeviceKind to_kind(py::handle obj, const std::source_location& where) {
  if (py::isinstance<DeviceKind>(obj)) return obj.cast<DeviceKind>();
  if (py::isinstance<py::str>(obj)) {
    const std::string text = lower(obj.cast<std::string>());
    for (DeviceKind k : {DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Emulated}) {
      if (text == name(k)) return k;
    }
  }
  usage(where, "world_mesh: expected kind \"cpu\", \"cuda\", \"emulated\" or a meshrt.DeviceKind, found " + found(obj));
}

// A numpy scalar (numpy.float32(1.5), numpy.int64(3)): taken as the Python number it holds.
bool is_numpy_scalar(py::handle obj) {
  PyObject* numpy = PyImport_GetModule(py::str("numpy").ptr());  // only if already imported
  if (numpy == nullptr) {
    PyErr_Clear();
    return false;
  }
  py::object np = py::reinterpret_steal<py::object>(numpy);
  return py::isinstance(obj, np.attr("generic"));
}

// One argument of a remote call; `position` is "2" or "2[0]" for an item of a list.
// An argument's position for error messages ("2", "0[1]"), formatted only when one is
// raised: a call converts its arguments on every call, and fails rarely.
struct Position {
  const Position* parent = nullptr;
  std::size_t index = 0;
  std::string text() const { return parent ? fmt::format("{}[{}]", parent->text(), index) : std::to_string(index); }
};

Arg to_arg(py::handle obj, const std::string& fn, const Position& position, const std::source_location& where) {
  // The exact builtin types and meshrt's own first, by type pointer: no pybind11 lookups.
  PyObject* p = obj.ptr();
  static PyTypeObject* const dtensor_type = reinterpret_cast<PyTypeObject*>(py::type::of<DTensor>().ptr());
  static PyTypeObject* const dtype_type = reinterpret_cast<PyTypeObject*>(py::type::of<DType>().ptr());
  if (Py_TYPE(p) == dtensor_type) return Arg(obj.cast<const DTensor&>());
  if (PyFloat_CheckExact(p)) return Arg(PyFloat_AS_DOUBLE(p));
  if (PyLong_CheckExact(p)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(p, &overflow);
    if (overflow == 0) return Arg(v);
  }
  if (PyUnicode_CheckExact(p)) {
    Py_ssize_t n = 0;
    if (const char* text = PyUnicode_AsUTF8AndSize(p, &n)) return Arg(std::string(text, static_cast<std::size_t>(n)));
    PyErr_Clear();
  }
  if (Py_TYPE(p) == dtype_type) return Arg(obj.cast<DType>());
  if (py::isinstance<DTensor>(obj)) return Arg(obj.cast<const DTensor&>());
  if (py::isinstance<py::bool_>(obj)) return Arg(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj))
    return Arg(to_int(obj, fmt::format("{}: argument {}", fn, position.text()), where));
  if (py::isinstance<py::float_>(obj)) return Arg(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return Arg(obj.cast<std::string>());
  if (obj.is_none()) return Arg(Value());
  if (is_dtype_like(obj)) {
    try {
      return Arg(to_dtype(obj));
    } catch (const UsageError& e) {
      usage(where, fmt::format("{}: argument {}: {}", fn, position.text(), e.what()));
    }
  }
  if (is_numpy_scalar(obj)) return to_arg(obj.attr("item")(), fn, position, where);
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    std::vector<Arg> items;
    items.reserve(py::len(obj));
    std::size_t i = 0;
    for (py::handle item : obj) items.push_back(to_arg(item, fn, Position{&position, i++}, where));
    return Arg::list(std::move(items));
  }
  if (is_tensor_like(obj)) {
    try {
      return Arg(to_tensor(obj, fmt::format("{}: argument {}", fn, position.text())));
    } catch (const UsageError& e) {
      usage(where, e.what());
    }
  }
  usage(where, fmt::format("{}: argument {}: expected a DTensor, a number, bool, str, None, a dtype, a tuple or "
                           "list of these, or a tensor (numpy array, torch tensor, meshrt.Tensor); found {}",
                           fn, position.text(), found(obj)));
}

std::vector<Arg> to_args(const py::args& args, std::size_t first, const std::string& fn,
                         const std::source_location& where) {
  std::vector<Arg> out;
  out.reserve(args.size() - first);
  for (std::size_t i = first; i < args.size(); ++i)
    out.push_back(to_arg(args[i], fn, Position{nullptr, i - first}, where));
  return out;
}

std::string function_name(py::handle fn, const std::source_location& where) {
  if (!py::isinstance<py::str>(fn))
    usage(where, "call: expected a registered function's name (a str), found " + found(fn));
  return fn.cast<std::string>();
}

Tensor host_tensor(py::handle obj, const std::string& what, const std::source_location& where) {
  try {
    return to_tensor(obj, what);
  } catch (const UsageError& e) {
    usage(where, e.what());
  }
}

py::object one_or_none(DTensor t) {
  if (!t.defined()) return py::none();
  return py::cast(std::move(t));
}

py::list to_list(std::vector<DTensor> ts) {
  py::list out;
  for (DTensor& t : ts) out.append(py::cast(std::move(t)));
  return out;
}

// A recording and the form its function returned: one DTensor, None, or a tuple of them
// (a list returns as a tuple); each replay returns the same form.
struct PyRecording {
  Recording recording;
  enum class Form { One, None, Tuple } form = Form::Tuple;
};

std::vector<DTensor> to_tensors(py::handle obj, const char* what, const std::source_location& where) {
  std::vector<DTensor> out;
  auto one = [&](py::handle item) {
    if (!py::isinstance<DTensor>(item)) usage(where, fmt::format("{}: expected DTensors, found {}", what, found(item)));
    out.push_back(item.cast<DTensor>());
  };
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    for (py::handle item : obj) one(item);
  } else if (!obj.is_none()) {
    one(obj);
  }
  return out;
}

py::object in_form(std::vector<DTensor> out, PyRecording::Form form) {
  if (form == PyRecording::Form::None) return py::none();
  if (form == PyRecording::Form::One) return py::cast(std::move(out.front()));
  py::tuple t(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) t[i] = py::cast(std::move(out[i]));
  return t;
}

py::list ranks_of(const NDSlice& s) {
  py::list out;
  for (auto r : s) out.append(static_cast<std::int64_t>(r));
  return out;
}

// The Python exception object `e` would raise, translated as a call would translate it.
py::object exception_object(const std::exception_ptr& e) {
  py::cpp_function raiser([e] { std::rethrow_exception(e); });
  try {
    raiser();
  } catch (py::error_already_set& err) {
    return err.value();
  }
  return py::none();
}

std::optional<std::chrono::duration<double>> seconds(std::optional<double> s) {
  if (!s) return std::nullopt;
  return std::chrono::duration<double>(*s);
}

std::string mesh_repr(const Mesh& m) {
  std::vector<std::string> dims;
  const auto sizes = m.sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i) dims.push_back(fmt::format("'{}': {}", m.names()[i], sizes[i]));
  std::vector<std::int64_t> ranks;
  for (auto r : m.ranks()) ranks.push_back(static_cast<std::int64_t>(r));
  return fmt::format("meshrt.Mesh({{{}}}, ranks [{}])", fmt::join(dims, ", "), fmt::join(ranks, ", "));
}

// ------------------------------------------------------------------ the controller handle

// What main(ctl) receives: the session's Controller while the session runs.
struct ControllerHandle {
  Controller* ctl = nullptr;
  Controller& get() const {
    if (ctl == nullptr) {
      throw UsageError(
          "this Controller's session has ended (meshrt.run returned); use the one the next meshrt.run passes to "
          "main");
    }
    return *ctl;
  }
};

// ------------------------------------------------------------------ the runtime

// The process's Runtime: made by the first run(), kept for later sessions (MPI can be
// initialised once per process), ended at interpreter exit (_shutdown).
struct Process {
  std::unique_ptr<Runtime> runtime;
  RuntimeOptions options;
  bool initialized_mpi = false;  // by rank()/world_size() before the Runtime
  std::string start_error;       // the first start's failure: MPI cannot start twice
  bool in_session = false;
};
Process& process() {
  static auto* p = new Process();
  return *p;
}

std::string level_name(int level) {
  std::string s = thread_level_name(level);
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return "MPI_THREAD_" + s;
}

// MPI initialised before meshrt (by mpi4py) is accepted at MPI_THREAD_MULTIPLE only. Every
// rank takes part and refuses together (the lowest level any rank needs and lacks).
void check_thread_level(bool dedicated_controller) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    throw UsageError(
        "meshrt.run: MPI was already finalised (MPI.Finalize() from mpi4py?); meshrt needs it running: "
        "finalise it at exit only (mpi4py does so by itself)");
  }
  if (!initialized || process().initialized_mpi) return;
  int provided = MPI_THREAD_SINGLE, rank = 0;
  MPI_Query_thread(&provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // With a dedicated controller the workers of ranks 1.. run on one thread each
  // (control::handshake's rule).
  const bool needs_multiple = !(dedicated_controller && rank != 0);
  int mine = needs_multiple ? provided : MPI_THREAD_MULTIPLE;
  int lowest = mine;
  MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (lowest >= MPI_THREAD_MULTIPLE) return;
  throw UsageError(fmt::format(
      "meshrt.run: MPI was initialised before meshrt (by mpi4py?) with thread level {} (this rank: {}); meshrt "
      "needs MPI_THREAD_MULTIPLE (rank 0 runs the controller and worker 0 on two threads). Fix: leave "
      "mpi4py.rc.thread_level at \"multiple\" (its default) or set it so before `from mpi4py import MPI`, or "
      "import mpi4py's MPI only after meshrt.run has started MPI",
      level_name(lowest), level_name(provided)));
}

Runtime& start_runtime(const RuntimeOptions& options) {
  Process& p = process();
  if (p.runtime) {
    if (p.options.dedicated_controller != options.dedicated_controller) {
      throw UsageError(fmt::format(
          "meshrt.run: expected dedicated_controller={} as in this process's first meshrt.run (one runtime per "
          "process: MPI starts once), found dedicated_controller={}",
          p.options.dedicated_controller ? "True" : "False", options.dedicated_controller ? "True" : "False"));
    }
    return *p.runtime;
  }
  if (!p.start_error.empty()) {
    throw Error("meshrt.run: meshrt failed to start earlier in this process, and MPI cannot start twice: " +
                p.start_error);
  }
  check_thread_level(options.dedicated_controller);
  int argc = 1;
  static char program[] = "python";
  static char* args[] = {program, nullptr};
  char** argv = args;
  try {
    py::gil_scoped_release release;
    p.runtime = std::make_unique<Runtime>(argc, argv, options);
  } catch (const std::exception& e) {
    p.start_error = e.what();
    throw;
  }
  p.options = options;
  return *p.runtime;
}

// MPI for rank()/world_size() before any run(): initialised here (finalised by _shutdown)
// unless meshrt's runtime or mpi4py has done it.
void ensure_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = MPI_THREAD_SINGLE;
  py::gil_scoped_release release;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    throw SystemError("meshrt.rank: MPI_Init_thread failed");
  }
  process().initialized_mpi = true;
}

// Rank 0: the session runs main(ctl) on this thread; its result or exception comes back
// after the workers have shut down. The exception is main's own Python exception object.
py::object run_controller(Runtime& rt, const py::function& main) {
  auto handle = std::make_shared<ControllerHandle>();
  py::object ctl_object = py::cast(handle);
  py::object result;
  std::unique_lock shutdown_lock(controller_mutex(), std::defer_lock);
  {
    py::gil_scoped_release release;
    rt.session([&](Controller& ctl) {
      // The session's shutdown follows main on this thread, under the controller lock
      // (taken after the GIL is given back, also when main raises).
      struct LockForShutdown {
        std::unique_lock<std::recursive_mutex>& lock;
        ~LockForShutdown() {
          lock.lock();
          empty_graveyard();
        }
      } lock_for_shutdown{shutdown_lock};
      py::gil_scoped_acquire acquire;
      struct Invalidate {
        ControllerHandle& h;
        ~Invalidate() { h.ctl = nullptr; }
      } invalidate{*handle};
      handle->ctl = &ctl;
      result = main(ctl_object);
    });
  }
  return result ? result : py::none();
}

// Other ranks: the worker serves on a thread of its own while this one waits for the
// session to end and lets signals through. The first Ctrl-C is held until the controller
// ends the session (rank 0 has most likely been interrupted too), then raised; a second
// one ends the job.
void run_worker(Runtime& rt) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::optional<py::error_already_set> interrupt;
  {
    py::gil_scoped_release release;
    std::thread serve([&] {
      try {
        rt.session([](Controller&) {});
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(m);
      done = true;
      cv.notify_all();
    });
    for (;;) {
      {
        std::unique_lock lock(m);
        if (cv.wait_for(lock, detail::kWaitCheckInterval, [&] { return done; })) break;
      }
      py::gil_scoped_acquire acquire;
      if (PyErr_CheckSignals() == 0) continue;
      if (!interrupt) {
        interrupt.emplace();
        std::fprintf(stderr,
                     "meshrt: rank %d interrupted; its worker serves until the controller (rank 0) ends the "
                     "session; interrupt again to end the job\n",
                     rt.rank());
        std::fflush(stderr);
        continue;
      }
      PyErr_Clear();
      std::fprintf(stderr, "meshrt: rank %d interrupted twice while serving; aborting the job\n", rt.rank());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 130);
    }
    serve.join();
  }
  if (error) std::rethrow_exception(error);
  if (interrupt) throw *interrupt;
}

py::object run(const py::function& main, bool dedicated_controller, double shutdown_timeout) {
  Process& p = process();
  if (p.in_session) {
    throw UsageError("meshrt.run: called inside a session's main; a process runs one session at a time");
  }
  RuntimeOptions options;
  options.dedicated_controller = dedicated_controller;
  options.shutdown_timeout_seconds = shutdown_timeout;
  Runtime& rt = start_runtime(options);
  p.in_session = true;
  struct Leave {
    ~Leave() { process().in_session = false; }
  } leave;
  if (rt.is_controller()) return run_controller(rt, main);
  run_worker(rt);
  return py::none();
}

void shutdown() {
  Process& p = process();
  detail::set_wait_check(nullptr);
  py::gil_scoped_release release;
  {
    std::lock_guard lock(controller_mutex());
    empty_graveyard();
  }
  p.runtime.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (p.initialized_mpi && !finalized) MPI_Finalize();
  p.initialized_mpi = false;
}

}  // namespace

bool runtime_started() {
  return process().runtime != nullptr;
}

void bind_controller(py::module_& m) {
  bind_site(m);
  check_site_layout();
  detail::set_wait_check(&check_signals);

  py::enum_<Reduction> reduction(m, "Reduction", "How reduce() combines a mesh dimension; or its name, \"sum\".");
  for (int i = 0; i < kNumReductions; ++i) {
    const auto r = static_cast<Reduction>(i);
    std::string n(name(r));
    for (auto& c : n) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    reduction.value(n.c_str(), r);
  }
  // str() is the name ("sum", "emulated"); a def() would chain behind pybind11's own __str__.
  reduction.attr("__str__") =
      py::cpp_function([](Reduction r) { return std::string(name(r)); }, py::name("__str__"), py::is_method(reduction));

  py::enum_<DeviceKind> kinds(m, "DeviceKind",
                              "What a mesh is placed on; or its name: \"cpu\", \"cuda\", \"emulated\".");
  kinds.value("CPU", DeviceKind::Cpu).value("CUDA", DeviceKind::Cuda).value("EMULATED", DeviceKind::Emulated);
  kinds.attr("__str__") =
      py::cpp_function([](DeviceKind k) { return std::string(name(k)); }, py::name("__str__"), py::is_method(kinds));

  py::class_<MeshPermutation>(m, "MeshPermutation",
                              "A rank order for DTensor.to_mesh: rotate(dim, shift), transpose(a, b), mapping(to).")
      .def_static("rotate", &MeshPermutation::rotate, py::arg("dim"), py::arg("shift"),
                  "Along dim, coordinate i goes to (i + shift) mod size(dim).")
      .def_static("transpose", &MeshPermutation::transpose, py::arg("dim_a"), py::arg("dim_b"),
                  "The coordinates along dim_a and dim_b (of equal sizes) trade places.")
      .def_static("mapping", &MeshPermutation::mapping, py::arg("to"),
                  "Source position k (row-major) goes to target position to[k].")
      .def("resolve", &MeshPermutation::resolve, py::arg("names"), py::arg("sizes"),
           "The target position of every source position for a mesh with these dimensions.")
      .def("__str__", &MeshPermutation::to_string)
      .def("__repr__", [](const MeshPermutation& p) { return "meshrt.MeshPermutation(" + p.to_string() + ")"; });

  py::class_<PyRecording, Holder<PyRecording>>(
      m, "Recording", "A recorded step (ctl.record): call it with tensors like the examples to replay it.")
      .def(
          "__call__",
          [](const PyRecording& r, py::args inputs) {
            const auto where = caller_site();
            std::vector<DTensor> in = to_tensors(inputs, "replay", where);
            std::vector<DTensor> out = released([&] { return r.recording(in, where); });
            return in_form(std::move(out), r.form);
          },
          "Replays the step on tensors of the same metas, meshes and streams as the examples; returns fresh "
          "results in the form the recorded function returned them.")
      .def_property_readonly("num_inputs", [](const PyRecording& r) { return r.recording.num_inputs(); })
      .def_property_readonly("num_outputs", [](const PyRecording& r) { return r.recording.num_outputs(); })
      .def_property_readonly("num_commands", [](const PyRecording& r) { return r.recording.num_commands(); });

  py::class_<Future<Tensor>, Holder<Future<Tensor>>>(m, "Future", "A tensor that will come back from the workers.")
      .def(
          "result",
          [](Future<Tensor>& f, std::optional<double> timeout) {
            Tensor t = released([&] { return timeout ? f.get(*seconds(timeout)) : f.get(); });
            return wrap_tensor(std::move(t));
          },
          py::arg("timeout") = py::none(),
          "Waits (Ctrl-C interrupts) and returns the meshrt.Tensor; RemoteError if it depends on a failure, "
          "meshrt.TimeoutError after `timeout` seconds.")
      .def(
          "done", [](Future<Tensor>& f) { return released([&] { return f.done(); }); },
          "True once result() would return or raise without waiting.")
      .def(
          "exception",
          [](Future<Tensor>& f) -> py::object {
            std::exception_ptr e = released([&] { return f.exception(); });
            if (!e) return py::none();
            return exception_object(e);
          },
          "Waits; the exception result() would raise, or None.");

  py::class_<Stream, Holder<Stream>>(m, "Stream", "A stream of work on the workers (ctl.stream(name)).")
      .def_property_readonly("name", &Stream::name)
      .def(
          "borrow",
          [](const Stream& s, const DTensor& t, bool mutable_borrow) {
            const auto where = caller_site();
            return released([&] { return s.borrow(t, mutable_borrow, where); });
          },
          py::arg("t"), py::arg("mutable") = false,
          "A handle to t usable on this stream; end it with drop(). A mutable borrow needs no other active borrow.")
      .def("__eq__", [](const Stream& a, const Stream& b) { return a == b; })
      .def("__repr__", [](const Stream& s) { return "meshrt.Stream('" + s.name() + "')"; });

  py::class_<DTensor, Holder<DTensor>>(m, "DTensor", "A distributed tensor: one local tensor per rank of its mesh.")
      .def_property_readonly("meta", [](const DTensor& t) { return t.meta(); })
      .def_property_readonly("mesh", &DTensor::mesh)
      .def_property_readonly("stream", &DTensor::stream)
      .def(
          "reduce",
          [](const DTensor& t, const std::string& dim, py::handle r, bool scatter) {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            return released([&] { return t.reduce(dim, red, scatter, where); });
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false,
          "The reduction over mesh dimension dim: meshrt.Reduction.SUM or \"sum\", ...; stack gathers.")
      .def(
          "reduce_",
          [](py::object self, const std::string& dim, py::handle r, bool scatter) {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            DTensor& t = self.cast<DTensor&>();
            released([&] { t.reduce_(dim, red, scatter, where); });
            return self;
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false,
          "In place: this tensor's value changes (and every handle's that shares it); returns self.")
      .def(
          "to_mesh",
          [](const DTensor& t, const Mesh& target, std::optional<MeshPermutation> permutation) {
            const auto where = caller_site();
            return released(
                [&] { return permutation ? t.to_mesh(target, *permutation, where) : t.to_mesh(target, where); });
          },
          py::arg("target"), py::arg("permutation") = py::none(),
          "The same values sent to target (a mesh of the same sizes), positionally or in permutation's order.")
      .def(
          "rotate",
          [](const DTensor& t, const std::string& dim, std::int64_t shift) {
            const auto where = caller_site();
            return released([&] { return t.rotate(dim, shift, where); });
          },
          py::arg("dim"), py::arg("shift"), "Each rank's tensor moves shift coordinates along dim (a ring).")
      .def(
          "slice_mesh",
          [](const DTensor& t, const std::string& dim, std::int64_t index) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return t.slice_mesh(dim, index); }); });
          },
          py::arg("dim"), py::arg("index"), "The part of this tensor on the sub-mesh where dim == index.")
      .def(
          "drop",
          [](DTensor& t) {
            const auto where = caller_site();
            released([&] { t.drop(where); });
          },
          "Ends a borrow: the origin stream may use the tensor again.")
      .def("__repr__", [](const DTensor& t) {
        return fmt::format("meshrt.DTensor({} on {}, stream '{}')", t.meta().to_string(), mesh_repr(t.mesh()),
                           t.stream().name());
      });

  py::class_<Mesh, Holder<Mesh>>(m, "Mesh", "A device mesh: named dimensions over a set of ranks.")
      .def_property_readonly("names", &Mesh::names)
      .def_property_readonly("sizes", &Mesh::sizes)
      .def_property_readonly(
          "ranks", [](const Mesh& mesh) { return ranks_of(mesh.ranks()); }, "The world ranks.")
      .def(
          "size",
          [](const Mesh& mesh, const std::string& dim) {
            const auto where = caller_site();
            return at_site(where, [&] { return mesh.size(dim); });
          },
          py::arg("dim"))
      .def(
          "slice",
          [](const Mesh& mesh, const std::string& dim, std::int64_t begin, std::optional<std::int64_t> end,
             std::int64_t step) {
            const auto where = caller_site();
            return released([&] {
              return at_site(where, [&] { return end ? mesh.slice(dim, begin, *end, step) : mesh.slice(dim, begin); });
            });
          },
          py::arg("dim"), py::arg("index"), py::arg("end") = py::none(), py::arg("step") = 1,
          "slice(dim, index): the sub-mesh where dim == index (dim dropped); slice(dim, begin, end, step=1): "
          "indices begin, begin+step, ... < end (dim kept).")
      .def(
          "rename",
          [](const Mesh& mesh, const std::string& from, std::string to) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.rename(from, std::move(to)); }); });
          },
          py::arg("dim"), py::arg("name"))
      .def(
          "split",
          [](const Mesh& mesh, const std::string& dim, py::handle parts) {
            const auto where = caller_site();
            auto p = to_dims(parts, fmt::format("split of '{}'", dim), where);
            return released([&] { return at_site(where, [&] { return mesh.split(dim, std::move(p)); }); });
          },
          py::arg("dim"), py::arg("parts"),
          "Splits dim into dimensions of the given sizes: {\"a\": 2, \"b\": 2} or [(\"a\", 2), (\"b\", 2)].")
      .def(
          "flatten",
          [](const Mesh& mesh, std::string name) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.flatten(std::move(name)); }); });
          },
          py::arg("name"), "One dimension over all ranks, in row-major order.")
      .def(
          "rank",
          [](const Mesh& mesh, const std::string& dim) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.rank(dim, where); }); });
          },
          py::arg("dim"), "Each rank's coordinate along dim, as an int64 0-d DTensor.")
      .def(
          "call",
          [](const Mesh& mesh, py::args args) -> py::object {
            const auto where = caller_site();
            if (args.size() == 0) usage(where, "call: expected a function name and its arguments, found none");
            const std::string fn = function_name(args[0], where);
            std::vector<Arg> a = to_args(args, 1, fn, where);
            DTensor out = released([&] {
              std::vector<DTensor> outs = mesh.call_n(FunctionName(fn, where), std::move(a));
              if (outs.size() > 1) {
                usage(where,
                      fmt::format("call: {} returns {} tensors; use call_n to get all of them", fn, outs.size()));
              }
              return outs.empty() ? DTensor() : std::move(outs.front());
            });
            return one_or_none(std::move(out));
          },
          "call(fn, *args): runs a registered function on every rank; its one output (None for a function that "
          "only mutates).")
      .def(
          "call_n",
          [](const Mesh& mesh, py::args args) {
            const auto where = caller_site();
            if (args.size() == 0) usage(where, "call_n: expected a function name and its arguments, found none");
            const std::string fn = function_name(args[0], where);
            std::vector<Arg> a = to_args(args, 1, fn, where);
            return to_list(released([&] { return mesh.call_n(FunctionName(fn, where), std::move(a)); }));
          },
          "call_n(fn, *args): as call, returning the list of every output.")
      .def(
          "call_on",
          [](const Mesh& mesh, py::args args) {
            const auto where = caller_site();
            if (args.size() < 2 || !py::isinstance<Stream>(args[0])) {
              usage(where, "call_on: expected a Stream, a function name and its arguments, found " +
                               (args.size() == 0 ? std::string("none") : found(args[0])));
            }
            const Stream stream = args[0].cast<const Stream&>();
            const std::string fn = function_name(args[1], where);
            std::vector<Arg> a = to_args(args, 2, fn, where);
            return to_list(released([&] { return mesh.call_on(stream, FunctionName(fn, where), std::move(a)); }));
          },
          "call_on(stream, fn, *args): as call_n, on an explicit stream.")
      .def(
          "from_host",
          [](const Mesh& mesh, py::handle array) {
            const auto where = caller_site();
            const Tensor t = host_tensor(array, "from_host", where);
            return released([&] { return mesh.from_host(t, where); });
          },
          py::arg("array"), "The controller's array (numpy, torch, meshrt.Tensor) copied to every rank of the mesh.")
      .def(
          "scatter",
          [](const Mesh& mesh, const std::string& dim, py::handle array) {
            const auto where = caller_site();
            const Tensor t = host_tensor(array, "scatter", where);
            return released([&] { return mesh.scatter(dim, t, where); });
          },
          py::arg("dim"), py::arg("array"),
          "The array split along its first axis into size(dim) shards: coordinate i along dim holds shard i.")
      .def("__eq__", [](const Mesh& a, const Mesh& b) { return a == b; })
      .def("__repr__", &mesh_repr);

  py::class_<ControllerHandle, std::shared_ptr<ControllerHandle>>(
      m, "Controller", "The program on rank 0 drives every worker through it (main's argument in meshrt.run).")
      .def(
          "world_mesh",
          [](const ControllerHandle& h, py::handle dims, py::handle kind) {
            const auto where = caller_site();
            auto d = to_dims(dims, "world_mesh", where);
            const DeviceKind k = to_kind(kind, where);
            Controller& ctl = h.get();
            return released([&] { return at_site(where, [&] { return ctl.world_mesh(std::move(d), k, where); }); });
          },
          py::arg("dims"), py::arg("kind") = "cpu",
          "The mesh of every worker rank: dims {\"dp\": 2, \"tp\": 2} or [(\"dp\", 2), (\"tp\", 2)]; kind \"cpu\", "
          "\"emulated\", \"cuda\" or ctl.accelerator.")
      .def_property_readonly(
          "accelerator", [](const ControllerHandle& h) { return h.get().accelerator(); },
          "The job's accelerator (MESHRT_ACCELERATOR), DeviceKind.CPU when there is none.")
      .def(
          "stream",
          [](const ControllerHandle& h, const std::string& name) {
            Controller& ctl = h.get();
            return released([&] { return ctl.stream(name); });
          },
          py::arg("name"), "The stream name (created on first use).")
      .def_property_readonly("default_stream",
                             [](const ControllerHandle& h) {
                               Controller& ctl = h.get();
                               return released([&] { return ctl.default_stream(); });
                             })
      .def(
          "fetch_shard",
          [](const ControllerHandle& h, const DTensor& t, std::optional<std::string> preprocess, py::kwargs coords) {
            const auto where = caller_site();
            std::vector<std::pair<std::string, std::int64_t>> c;
            for (auto [k, v] : coords) {
              const std::string dim = py::str(k);
              c.emplace_back(dim, to_int(v, fmt::format("fetch_shard: coordinate {}", dim), where));
            }
            Controller& ctl = h.get();
            return released([&] { return ctl.fetch_shard(t, std::move(c), std::move(preprocess), where); });
          },
          py::arg("t"), py::pos_only(), py::arg("preprocess") = py::none(),
          "fetch_shard(t, dp=0, tp=1): a Future of t's local tensor at those coordinates, optionally through a "
          "registered function on the worker.")
      .def(
          "record",
          [](const ControllerHandle& h, py::handle examples, const py::function& body) {
            const auto where = caller_site();
            const std::vector<DTensor> ex = to_tensors(examples, "record: examples", where);
            Controller& ctl = h.get();
            auto r = Holder<PyRecording>(new PyRecording());
            // With the GIL held and without the controller lock: the body's calls take it
            // one by one, as outside a recording.
            r->recording = at_site(where, [&] {
              return ctl.record(
                  ex,
                  [&](const std::vector<DTensor>& formals) {
                    py::tuple args(formals.size());
                    for (std::size_t i = 0; i < formals.size(); ++i) args[i] = py::cast(formals[i]);
                    const py::object out = body(*args);
                    r->form = out.is_none()                  ? PyRecording::Form::None
                              : py::isinstance<DTensor>(out) ? PyRecording::Form::One
                                                             : PyRecording::Form::Tuple;
                    return to_tensors(out, "record: the function's result", where);
                  },
                  where);
            });
            return r;
          },
          py::arg("examples"), py::arg("body"),
          "record([x], lambda x: ...): runs body once on formal tensors like the examples and keeps the commands "
          "it issues; the Recording returned replays them with one command. Fetches and synchronize inside are "
          "refused; tensors from outside are captured.")
      .def(
          "synchronize",
          [](const ControllerHandle& h, std::optional<double> timeout) {
            Controller& ctl = h.get();
            released([&] { timeout ? ctl.synchronize(*seconds(timeout)) : ctl.synchronize(); });
          },
          py::arg("timeout") = py::none(),
          "Waits for all issued work (Ctrl-C interrupts); raises one RemoteError for the failures no Future "
          "reported.")
      .def(
          "restart_workers",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            released([&] { ctl.restart_workers(); });
          },
          "Fresh worker loops: every mesh, tensor and stream made before is gone (using one raises UsageError).")
      .def(
          "release_cached_memory",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            return released([&] { return ctl.release_cached_memory(); });
          },
          "Frees the memory the workers keep cached; returns the bytes freed on all of them together.")
      .def(
          "dump_flight_recorder",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            return released([&] { return ctl.dump_flight_recorder(); });
          },
          "Every worker's last commands (also written to its log), rank by rank.")
      .def(
          "write_trace",
          [](const ControllerHandle& h, const py::object& path) {
            Controller& ctl = h.get();
            const std::string file = py::str(py::module_::import("os").attr("fspath")(path));
            return released([&] { return ctl.write_trace(file); });
          },
          py::arg("path"),
          "Writes every rank's timeline recorded so far to `path` (Chrome-trace JSON, for Perfetto's UI or "
          "chrome://tracing); returns the events written. Does not wait for issued work.")
      .def(
          "start_trace",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            released([&] { ctl.start_trace(); });
          },
          "Waits for the work issued so far, then every rank starts recording its timeline (MESHRT_TRACE "
          "records the whole run).")
      .def(
          "stop_trace",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            released([&] { ctl.stop_trace(); });
          },
          "Waits for the work issued so far, then every rank stops recording its timeline.")
      .def(
          "abort",
          [](const ControllerHandle& h, const std::string& reason) {
            Controller& ctl = h.get();
            released([&] { ctl.abort(reason); });
          },
          py::arg("reason"), "Ends the whole job now (MPI_Abort), after telling the workers why.")
      .def_property_readonly("world_size", [](const ControllerHandle& h) { return h.get().world_size(); })
      .def_property_readonly("worker_ranks", [](const ControllerHandle& h) { return ranks_of(h.get().worker_ranks()); })
      .def(
          "live_values",
          [](const ControllerHandle& h, int rank) {
            Controller& ctl = h.get();
            return released([&] { return ctl.live_values(rank); });
          },
          py::arg("rank"), "How many values rank's worker holds, as of its latest status (synchronize first).")
      .def(
          "control_traffic",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            const std::string json = released([&] { return ctl.control_traffic().to_json(); });
            return py::module_::import("json").attr("loads")(json);
          },
          "The control messages and bytes sent and received so far, by kind: {\"sent\": {\"Command\": "
          "{\"messages\": n, \"bytes\": b}, ...}, \"received\": {...}}.");

  m.def("run", &run, py::arg("main"), py::kw_only(), py::arg("dedicated_controller") = false,
        py::arg("shutdown_timeout") = 60.0,
        "Every rank calls it: rank 0 runs main(ctl) and returns its result (main's exception is raised after the "
        "workers shut down), every rank runs a worker and returns None. The first call starts MPI and meshrt; "
        "later calls reuse them.");
  m.def(
      "rank",
      [] {
        if (process().runtime) return process().runtime->rank();
        ensure_mpi();
        int r = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
        return r;
      },
      "This process's rank in the job (starts MPI if nothing has).");
  m.def(
      "world_size",
      [] {
        if (process().runtime) return process().runtime->world_size();
        ensure_mpi();
        int n = 0;
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        return n;
      },
      "The number of ranks in the job (starts MPI if nothing has).");
  m.def("_shutdown", &shutdown, "Ends meshrt (and MPI, if meshrt started it); registered with atexit.");
}

}  // namespace meshrt::python
