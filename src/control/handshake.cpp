#include "meshrt/internal/control.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/checks.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/version.hpp"

namespace meshrt::control {

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
          diffs.push_back(fmt::format("function table {:016x} (rank 0: {:016x}): a different program or library set",
                                      h.function_table_hash, mine.function_table_hash));
        }
        if (!diffs.empty()) {
          verdict +=
              fmt::format("\n  rank {} (host {}) runs a different binary: {}", r, h.host, fmt::join(diffs, "; "));
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
