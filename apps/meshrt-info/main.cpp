// meshrt-info: what this build of meshrt is, what it runs on, and where every rank is.
//
//   mpirun -n 4 meshrt-info          a table for people
//   mpirun -n 4 meshrt-info --json   one JSON document for scripts
#include <fmt/format.h>
#include <mpi.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "meshrt/log.hpp"
#include "meshrt/settings.hpp"
#include "meshrt/version.hpp"

namespace {

struct RankInfo {
  int rank;
  std::string host;
  int local_rank;
  int local_size;
};

// Gathers (host, local rank) of every rank to rank 0.
std::vector<RankInfo> gather_ranks(int rank, int size) {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);

  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  std::vector<char> hosts(static_cast<std::size_t>(size) * MPI_MAX_PROCESSOR_NAME);
  MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0, MPI_COMM_WORLD);
  int mine[2] = {local_rank, local_size};
  std::vector<int> locals(static_cast<std::size_t>(size) * 2);
  MPI_Gather(mine, 2, MPI_INT, locals.data(), 2, MPI_INT, 0, MPI_COMM_WORLD);

  std::vector<RankInfo> out;
  if (rank == 0) {
    for (int r = 0; r < size; ++r) {
      const auto i = static_cast<std::size_t>(r);
      out.push_back({r, std::string(&hosts[i * MPI_MAX_PROCESSOR_NAME]), locals[2 * i], locals[2 * i + 1]});
    }
  }
  return out;
}

std::string truncate(std::string s, std::size_t n) {
  if (s.size() > n) s = s.substr(0, n - 3) + "...";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshrt-info: meshrt's version, build options, libraries, settings and the ranks of this job"};
  bool json = false;
  app.add_flag("--json", json, "Print one JSON document instead of tables");
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = rank == 0 ? app.exit(e) : (e.get_exit_code());
    MPI_Finalize();
    return rc;
  }
  meshrt::log::init(rank);

  const meshrt::BuildInfo info = meshrt::build_info();
  const std::vector<RankInfo> ranks = gather_ranks(rank, size);
  if (rank == 0) {
    if (json) {
      nlohmann::json j;
      j["meshrt"] = {{"version", info.meshrt_version},
                     {"build_type", info.build_type},
                     {"compiler", info.compiler},
                     {"sanitize", info.sanitize},
                     {"cuda", info.cuda},
                     {"nccl", info.nccl}};
      j["mpi"] = {{"library", info.mpi_library},
                  {"standard", info.mpi_standard},
                  {"thread_level", meshrt::thread_level_name(provided)}};
      j["boost"] = info.boost_version;
      j["cuda"] = {{"runtime", info.cuda_runtime},
                   {"driver", info.cuda_driver},
                   {"devices", info.cuda_devices},
                   {"status", info.cuda_status}};
      j["nccl"] = info.nccl_version;
      for (const auto& s : meshrt::settings::all()) {
        const auto env = meshrt::settings::text_from_environment(s);
        j["settings"].push_back({{"name", s.name},
                                 {"value", env.value_or(std::string(s.default_value))},
                                 {"default", s.default_value},
                                 {"from_environment", env.has_value()},
                                 {"takes", meshrt::settings::takes(s)},
                                 {"description", s.description}});
      }
      j["world_size"] = size;
      for (const auto& r : ranks) {
        j["ranks"].push_back(
            {{"rank", r.rank}, {"host", r.host}, {"local_rank", r.local_rank}, {"local_size", r.local_size}});
      }
      std::puts(j.dump(2).c_str());
    } else {
      fmt::print("meshrt {}  ({}, {}{}{})\n", info.meshrt_version, info.build_type, info.compiler,
                 info.sanitize.empty() ? "" : ", sanitize=", info.sanitize);
      fmt::print("  {:<22} {}\n", "CUDA side built", info.cuda ? "yes" : "no");
      fmt::print("  {:<22} {}\n", "MPI library", info.mpi_library);
      fmt::print("  {:<22} {} (thread level provided: {})\n", "MPI standard", info.mpi_standard,
                 meshrt::thread_level_name(provided));
      fmt::print("  {:<22} {}\n", "Boost", info.boost_version);
      fmt::print("  {:<22} runtime {}, driver {}; {}\n", "CUDA", info.cuda_runtime, info.cuda_driver, info.cuda_status);
      fmt::print("  {:<22} {}\n\n", "NCCL", info.nccl_version);

      fmt::print("{:<26} {:<12} {:<12} {}\n", "setting", "value", "default", "meaning");
      for (const auto& s : meshrt::settings::all()) {
        const auto env = meshrt::settings::text_from_environment(s);
        fmt::print("{:<26} {:<12} {:<12} {} (takes {})\n", s.name,
                   truncate(env ? *env : std::string(s.default_value), 12),
                   s.default_value.empty() ? "(unset)" : s.default_value, s.description, meshrt::settings::takes(s));
      }
      fmt::print("\nworld size {}\n{:>6}  {:<32} {:>10} {:>10}\n", size, "rank", "host", "local rank", "local size");
      for (const auto& r : ranks)
        fmt::print("{:>6}  {:<32} {:>10} {:>10}\n", r.rank, r.host, r.local_rank, r.local_size);
    }
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
