#include "meshrt/internal/control.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "common/checks.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/version.hpp"

namespace meshrt::control {
namespace {

// "functions on rank 2 only: my.extra; functions on rank 0 only: my.other" (sorted names).
std::string table_difference(const std::vector<std::string>& rank0, const std::vector<std::string>& other, int r) {
  std::vector<std::string> only_other, only_rank0;
  std::set_difference(other.begin(), other.end(), rank0.begin(), rank0.end(), std::back_inserter(only_other));
  std::set_difference(rank0.begin(), rank0.end(), other.begin(), other.end(), std::back_inserter(only_rank0));
  std::vector<std::string> parts;
  if (!only_other.empty())
    parts.push_back(fmt::format("functions on rank {} only: {}", r, fmt::join(only_other, ", ")));
  if (!only_rank0.empty()) parts.push_back(fmt::format("functions on rank 0 only: {}", fmt::join(only_rank0, ", ")));
  if (parts.empty()) parts.emplace_back("the same function names, hashed differently");
  return fmt::format("{} (register them on every rank: the same program and load_library calls)",
                     fmt::join(parts, "; "));
}

}  // namespace

void handshake(MPI_Comm control, int provided, bool dedicated_controller) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(control, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(control, &size));
  std::string local_error;
  protocol::Handshake mine;
  mine.meshrt_version = MESHRT_VERSION_STRING;
  mine.thread_level = provided;
  mine.rank = rank;
  mine.host = detail::processor_name();
  try {
    mine.function_table_hash = functions::table_hash();
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  if (provided < MPI_THREAD_MULTIPLE && !(dedicated_controller && rank != 0)) {
    local_error += fmt::format(
        "{}MPI provides thread level {}; meshrt needs multiple (rank 0 runs the controller "
        "and worker 0 on two threads)",
        local_error.empty() ? "" : "; ", thread_level_name(provided));
  }
  const auto bytes = protocol::encode(mine);
  auto gather = [&](const void* data, int n) {
    std::vector<int> lens(static_cast<std::size_t>(size));
    MESHRT_MPI_CHECK(MPI_Gather(&n, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, control));
    std::vector<int> displs(static_cast<std::size_t>(size), 0);
    int total = 0;
    for (int r = 0; r < size; ++r) {
      displs[static_cast<std::size_t>(r)] = total;
      total += lens[static_cast<std::size_t>(r)];
    }
    std::vector<std::byte> all(static_cast<std::size_t>(std::max(total, 1)));
    MESHRT_MPI_CHECK(MPI_Gatherv(data, n, MPI_BYTE, all.data(), lens.data(), displs.data(), MPI_BYTE, 0, control));
    std::vector<std::vector<std::byte>> parts;
    if (rank == 0) {
      for (int r = 0; r < size; ++r) {
        auto b = all.begin() + displs[static_cast<std::size_t>(r)];
        parts.emplace_back(b, b + lens[static_cast<std::size_t>(r)]);
      }
    }
    return parts;
  };
  const auto handshakes = gather(bytes.data(), static_cast<int>(bytes.size()));
  const auto errors = gather(local_error.data(), static_cast<int>(local_error.size()));
  // Function tables that differ are named function by function: only then (rank 0 says so)
  // does every rank send its names, one per line.
  int tables_differ = 0;
  if (rank == 0) {
    for (int r = 1; r < size; ++r) {
      try {
        const protocol::Handshake h = protocol::decode_handshake(handshakes[static_cast<std::size_t>(r)]);
        if (h.function_table_hash != mine.function_table_hash) tables_differ = 1;
      } catch (const std::exception&) {
        // Reported below as a handshake that does not decode.
      }
    }
  }
  MESHRT_MPI_CHECK(MPI_Bcast(&tables_differ, 1, MPI_INT, 0, control));
  std::vector<std::vector<std::string>> tables;
  if (tables_differ != 0) {
    std::string listed;
    try {
      for (const std::string& n : functions::names()) listed += n + "\n";
    } catch (const std::exception&) {
      // A broken table is already this rank's local error.
    }
    for (const auto& part : gather(listed.data(), static_cast<int>(listed.size()))) {
      std::vector<std::string> names;
      std::string text(reinterpret_cast<const char*>(part.data()), part.size());
      for (std::size_t at = 0, end; at < text.size(); at = end + 1) {
        end = text.find('\n', at);
        names.push_back(text.substr(at, end - at));
      }
      tables.push_back(std::move(names));
    }
  }
  std::string verdict;
  if (rank == 0) {
    for (int r = 0; r < size; ++r) {
      const auto& err = errors[static_cast<std::size_t>(r)];
      if (!err.empty()) {
        verdict +=
            fmt::format("\n  rank {}: {}", r, std::string(reinterpret_cast<const char*>(err.data()), err.size()));
      }
      if (r == 0) continue;
      try {
        const protocol::Handshake h = protocol::decode_handshake(handshakes[static_cast<std::size_t>(r)]);
        std::vector<std::string> diffs;
        if (h.meshrt_version != mine.meshrt_version) {
          diffs.push_back(fmt::format("meshrt {} (rank 0: {})", h.meshrt_version, mine.meshrt_version));
        }
        if (h.protocol_version != mine.protocol_version) {
          diffs.push_back(fmt::format("protocol {} (rank 0: {})", h.protocol_version, mine.protocol_version));
        }
        if (h.function_table_hash != mine.function_table_hash) {
          diffs.push_back(fmt::format("function table {:016x} (rank 0: {:016x}): {}", h.function_table_hash,
                                      mine.function_table_hash,
                                      table_difference(tables.at(0), tables.at(static_cast<std::size_t>(r)), r)));
        }
        if (!diffs.empty()) {
          verdict += fmt::format("\n  rank {} (host {}) differs from rank 0: {}", r, h.host, fmt::join(diffs, "; "));
        }
      } catch (const std::exception& e) {
        verdict += fmt::format("\n  rank {}: its handshake does not decode ({}): a different meshrt", r, e.what());
      }
    }
  }
  // Printed once per job, by rank 0, before the others hear of it: a launcher that ends
  // the job when the first rank exits must not lose the only copy.
  const std::string message = "meshrt start-up failed: the ranks disagree:";
  if (!verdict.empty()) {
    std::fprintf(stderr, "%s%s\n", message.c_str(), verdict.c_str());
    std::fflush(stderr);
  }
  int n = static_cast<int>(verdict.size());
  MESHRT_MPI_CHECK(MPI_Bcast(&n, 1, MPI_INT, 0, control));
  verdict.resize(static_cast<std::size_t>(n));
  MESHRT_MPI_CHECK(MPI_Bcast(verdict.data(), n, MPI_CHAR, 0, control));
  if (!verdict.empty()) throw StartupError(message + verdict);
}

}  // namespace meshrt::control
