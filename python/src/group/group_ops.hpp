// The Python group's operations over the C++ group (include/meshrt/group.hpp).
//
//
// A Python call is one C++ operation for the object's structure (codec.hpp; small arrays
// and bytes inside it), then one C++ operation per large array or bytes, received straight
// into the new object's memory. The structure's operation is typed ("Python codec"), so
// a C++ member that sends another type is refused as in C++. The collectives exchange
// every member's part in that first operation: the root's object, and each member's
// allow_pickle, out= and any error it met encoding. So every member sees the same facts
// and raises the same error (an object the codec refuses, pickle without consent, an out=
// whose type or size differs from the root's array) before any array moves, and the group
// stays usable. A failure once the arrays are moving makes the group unusable.
//
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "group/obj_codec.hpp"
#include "meshrt/error.hpp"
#include "meshrt/group.hpp"

namespace meshrt::python {

namespace py = pybind11;

namespace group_ops {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// A timeout of this many seconds or more is no limit, as the C++ group reads it.
constexpr double kNoLimitFrom = 1e9;

// One deadline for a whole Python call (its C++ operations share it). The first operation
// gets the call's timeout itself, so its error names the number the caller passed.
class Deadline {
 public:
  Deadline(std::optional<double> timeout, const StatelessGroup& g, const char* op) {
    if (timeout && !(*timeout >= 0)) {
      throw UsageError(
          fmt::format("{}: timeout: expected seconds >= 0 (None: the group's default, math.inf: no "
                      "limit), found {}",
                      op, *timeout));
    }
    first_ = timeout ? *timeout : g.default_timeout().count();
    unlimited_ = !(first_ < kNoLimitFrom);
    if (!unlimited_) at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(first_));
  }
  Timeout first() const { return Seconds(unlimited_ ? kNoLimit : first_); }
  Timeout next() const {
    if (unlimited_) return Seconds(kNoLimit);
    return std::max(Seconds(0), std::chrono::duration_cast<Seconds>(at_ - Clock::now()));
  }

 private:
  static constexpr double kNoLimit = 1e10;  // what the C++ group reads as no limit
  double first_ = 0;
  bool unlimited_ = false;
  Clock::time_point at_{};
};

struct PyGroup {
  std::optional<StatelessGroup> g;
  std::string broken;  // why the Python protocol broke (the C++ group may not know)
  bool busy = false;
  // Reused across calls.
  codec::Encoded enc;
  std::string mine;
  std::vector<std::string> parts;
  std::string inbox;
  std::vector<char> scratch;

  StatelessGroup& group(const char* op) {
    if (!g || g->comm() == MPI_COMM_NULL) throw UsageError(fmt::format("{}: the group has been closed", op));
    if (!broken.empty()) {
      throw UsageError(fmt::format("{} on {}: the group is unusable after {}; create a new group", op, me(), broken));
    }
    return *g;
  }
  std::string peer(int r) const { return fmt::format("group rank {} (parent rank {})", r, g->parent_rank(r)); }
  std::string me() const { return fmt::format("{} of {}", peer(g->rank()), g->world_size()); }
  std::string peers(const std::vector<int>& rs) const {
    std::vector<int> parents;
    for (int r : rs) parents.push_back(g->parent_rank(r));
    if (rs.size() == 1) return peer(rs[0]);
    return fmt::format("group ranks [{}] (parent ranks [{}])", fmt::join(rs, ", "), fmt::join(parents, ", "));
  }
};

}  // namespace group_ops

using group_ops::PyGroup;

py::object send_obj(PyGroup& pg, py::handle obj, int dst, std::optional<double> timeout, bool allow_pickle);
py::object recv_obj(PyGroup& pg, int src, std::optional<double> timeout, bool allow_pickle, py::handle out);
py::object broadcast_obj(PyGroup& pg, py::handle obj, int src, std::optional<double> timeout, bool allow_pickle,
                         py::handle out);
py::list all_gather_obj(PyGroup& pg, py::handle obj, std::optional<double> timeout, bool allow_pickle);
// A list of every member's object on dst, None on the others.
py::object gather_obj(PyGroup& pg, py::handle obj, int dst, std::optional<double> timeout, bool allow_pickle);
// objs[i] on group rank i, from src (objs is not used on the others).
py::object scatter_obj(PyGroup& pg, py::handle objs, int src, std::optional<double> timeout, bool allow_pickle);
void barrier(PyGroup& pg, std::optional<double> timeout);

}  // namespace meshrt::python
