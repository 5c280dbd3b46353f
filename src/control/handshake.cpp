#include "meshrt/internal/control.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <span>
#include <string>
#include <utility>
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

// Every rank's `data` (n bytes), on rank 0 in rank order; empty elsewhere. Collective.
std::vector<std::string> gather_to_root(MPI_Comm comm, const void* data, int n) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  std::vector<int> lens(static_cast<std::size_t>(size));
  MESHRT_MPI_CHECK(MPI_Gather(&n, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm));
  std::vector<int> displs(static_cast<std::size_t>(size), 0);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    displs[static_cast<std::size_t>(r)] = total;
    total += lens[static_cast<std::size_t>(r)];
  }
  std::string all(static_cast<std::size_t>(std::max(total, 1)), '\0');
  MESHRT_MPI_CHECK(MPI_Gatherv(data, n, MPI_BYTE, all.data(), lens.data(), displs.data(), MPI_BYTE, 0, comm));
  std::vector<std::string> parts;
  if (rank == 0) {
    for (int r = 0; r < size; ++r) {
      parts.push_back(all.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]),
                                 static_cast<std::size_t>(lens[static_cast<std::size_t>(r)])));
    }
  }
  return parts;
}

// The non-empty messages of `per_rank`, each once with the ranks that sent it, in the
// order of the first rank of each.
std::vector<std::pair<std::string, std::vector<int>>> by_message(const std::vector<std::string>& per_rank) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    if (per_rank[r].empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == per_rank[r]; });
    if (it == groups.end()) it = groups.insert(groups.end(), {per_rank[r], {}});
    it->second.push_back(static_cast<int>(r));
  }
  return groups;
}

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", "));
}

// Printed once per job, by rank 0, before the others hear of it (a launcher that ends
// the job when the first rank exits must not lose the only copy); then every rank
// throws the same StartupError. Collective.
void fail_together(MPI_Comm comm, std::string verdict) {
  int rank = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  if (rank == 0 && !verdict.empty()) {
    std::fprintf(stderr, "%s\n", verdict.c_str());
    std::fflush(stderr);
  }
  int n = static_cast<int>(verdict.size());
  MESHRT_MPI_CHECK(MPI_Bcast(&n, 1, MPI_INT, 0, comm));
  verdict.resize(static_cast<std::size_t>(n));
  MESHRT_MPI_CHECK(MPI_Bcast(verdict.data(), n, MPI_CHAR, 0, comm));
  if (!verdict.empty()) throw StartupError(verdict);
}

}  // namespace

void agree_on_start(MPI_Comm comm, const std::string& local_error) {
  int size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  const auto groups = by_message(gather_to_root(comm, local_error.data(), static_cast<int>(local_error.size())));
  std::string verdict;
  if (groups.size() == 1 && groups[0].second.size() == static_cast<std::size_t>(size)) {
    verdict = fmt::format("meshrt start-up failed{}: {}", size == 1 ? "" : " on every rank", groups[0].first);
  } else if (groups.size() == 1) {
    verdict = fmt::format("meshrt start-up failed on {}: {}", rank_list(groups[0].second), groups[0].first);
  } else if (!groups.empty()) {
    verdict = "meshrt start-up failed:";
    for (const auto& [message, ranks] : groups) verdict += fmt::format("\n  {}: {}", rank_list(ranks), message);
  }
  fail_together(comm, std::move(verdict));
}

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
  const auto handshakes = gather_to_root(control, bytes.data(), static_cast<int>(bytes.size()));
  auto decoded = [&](int r) {
    return protocol::decode_handshake(std::as_bytes(std::span(handshakes[static_cast<std::size_t>(r)])));
  };
  const auto errors = by_message(gather_to_root(control, local_error.data(), static_cast<int>(local_error.size())));
  // Function tables that differ are named function by function: only then (rank 0 says so)
  // does every rank send its names, one per line.
  int tables_differ = 0;
  if (rank == 0) {
    for (int r = 1; r < size; ++r) {
      try {
        const protocol::Handshake h = decoded(r);
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
    for (const std::string& text : gather_to_root(control, listed.data(), static_cast<int>(listed.size()))) {
      std::vector<std::string> names;
      for (std::size_t at = 0, end; at < text.size(); at = end + 1) {
        end = text.find('\n', at);
        names.push_back(text.substr(at, end - at));
      }
      tables.push_back(std::move(names));
    }
  }
  std::string verdict;
  if (rank == 0) {
    for (const auto& [message, ranks] : errors) verdict += fmt::format("\n  {}: {}", rank_list(ranks), message);
    for (int r = 1; r < size; ++r) {
      try {
        const protocol::Handshake h = decoded(r);
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
  fail_together(control, verdict.empty() ? verdict : "meshrt start-up failed: the ranks disagree:" + verdict);
}

}  // namespace meshrt::control
