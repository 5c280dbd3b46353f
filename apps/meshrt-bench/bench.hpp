// meshrt-bench: benchmarks of meshrt measured side by side with the raw MPI call in the
// same run, reported as ratios. Every suite registers Google Benchmark benchmarks; MPI
// suites register *pairs* (meshrt and raw MPI) with fixed iteration counts so every rank
// runs the same loop, and time each iteration as the slowest rank's time.
//
//   mpiexec -n 4 meshrt-bench collectives [--json out.jsonl] [--benchmark_filter=...]
#pragma once

#include <mpi.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace meshrt::bench {

struct Context {
  int rank = 0;
  int size = 1;
  MPI_Comm comm = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD
  bool quick = false;             // --quick: fewer sizes and iterations (CI smoke runs)
};

// How nccl-tests turn time into bus bandwidth (docs/ARCHITECTURE.md section 6).
enum class BusFactor {
  one,          // send/recv, broadcast
  all_reduce,   // 2(n-1)/n
  gather_like,  // (n-1)/n: all_gather, reduce_scatter, all_to_all
};
double bus_factor(BusFactor f, int ranks);

struct Pair {
  std::string suite;  // "collectives"
  std::string op;     // "all_reduce"
  std::size_t bytes;  // the whole array, as nccl-tests count it
  BusFactor bus = BusFactor::one;
  int inner = 10;                // operations per timed iteration
  int iterations = 20;           // timed iterations (all ranks run the same number)
  std::function<void()> meshrt;  // one operation through meshrt
  std::function<void()> mpi;     // the same operation with raw MPI calls
};

// Registers "<suite>/<op>/<bytes>/meshrt" and ".../mpi". Call from a suite's register
// function, on every rank, in the same order.
void add_pair(const Context& ctx, Pair pair);

// Message sizes 8 B, 64 B, ... up to `max_bytes` (x8 steps, plus 1 MiB).
std::vector<std::size_t> sizes_up_to(std::size_t max_bytes, bool quick);

// "--name=value" from a suite's arguments: the value, or "" when it is not given.
std::string flag(int argc, char** argv, const std::string& name);

struct Suite {
  const char* name;
  const char* description;
  void (*register_benchmarks)(Context&);
  // A suite that drives its own run (e.g. inside a meshrt session) sets this instead; it
  // gets Google Benchmark's arguments and the --json path ("" when none).
  int (*run)(Context&, int argc, char** argv, const std::string& json_path) = nullptr;
};

// Prints the side-by-side table and JSON lines for rows a custom run measured itself.
struct Row {
  std::string suite, op;
  std::size_t bytes;
  double meshrt_seconds;
  double mpi_seconds;
  std::string unit_note;  // what one operation is, e.g. "per command"
};
void print_rows(const std::vector<Row>& rows, int ranks, const std::string& json_path);

// The same for collectives, with nccl-tests' algbw and busbw beside the times (the
// format of the Google Benchmark pair suites). One block per (suite, op).
struct CollectiveRow {
  std::string suite, op;
  std::size_t bytes;
  BusFactor bus;
  double meshrt_seconds;
  double mpi_seconds;
};
void print_collective_rows(const std::vector<CollectiveRow>& rows, int ranks, const std::string& json_path);

struct SuiteRegistrar {
  explicit SuiteRegistrar(Suite suite);
};

}  // namespace meshrt::bench

#define MESHRT_BENCH_SUITE(name, description, fn) \
  static const ::meshrt::bench::SuiteRegistrar meshrt_bench_suite_##fn({name, description, &fn})
#define MESHRT_BENCH_SUITE_RUN(name, description, fn) \
  static const ::meshrt::bench::SuiteRegistrar meshrt_bench_suite_##fn({name, description, nullptr, &fn})
