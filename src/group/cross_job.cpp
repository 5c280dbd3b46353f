// Across jobs: accept() and connect() join two MPI jobs into one group through an MPI
// port, named in a file or an environment variable (docs/ARCHITECTURE.md section 5).
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/checks.hpp"
#include "group/impl.hpp"

namespace meshrt {

using namespace group_internal;

namespace {

// Writes `text` to `path` so that a reader never sees a partial file: tmp, then rename.
void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text << '\n';
    out.flush();
    if (!out) throw UsageError(fmt::format("StatelessGroup::accept: cannot write the port file {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw UsageError(fmt::format("StatelessGroup::accept: cannot rename {} to {}: {}", tmp, path, ec.message()));
}

// The port name from "env:NAME" or from a file, waiting for the file up to `timeout`.
std::string read_port(const std::string& where, Seconds timeout) {
  if (where.rfind("env:", 0) == 0) {
    const char* v = std::getenv(where.substr(4).c_str());
    if (v == nullptr || *v == '\0') {
      throw UsageError(
          fmt::format("StatelessGroup::connect: expected an MPI port name in environment variable {}, "
                      "found it unset or empty",
                      where.substr(4)));
    }
    return v;
  }
  const auto dl = deadline_after(timeout);
  for (;;) {
    std::ifstream in(where);
    std::string line;
    if (in && std::getline(in, line) && !line.empty()) return line;
    if (Clock::now() >= dl) {
      throw TimeoutError(
          fmt::format("StatelessGroup::connect: the port file {} did not appear within {} s (is the "
                      "accepting job running, and started with the same --ompi-server?)",
                      where, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

StatelessGroup StatelessGroup::accept(const std::string& port_file, MPI_Comm local, const GroupOptions& options) {
  return join(true, port_file, local, options);
}

StatelessGroup StatelessGroup::connect(const std::string& where, MPI_Comm local, const GroupOptions& options) {
  return join(false, where, local, options);
}

StatelessGroup StatelessGroup::join(bool accepting, const std::string& where, MPI_Comm local,
                                    const GroupOptions& options) {
  const char* op = accepting ? "StatelessGroup::accept" : "StatelessGroup::connect";
  require_mpi(accepting ? "accept" : "connect");
  MPI_Comm ldup = MPI_COMM_NULL;  // the caller's communicator is never used directly
  MESHRT_MPI_CHECK(MPI_Comm_dup(local, &ldup));
  detail::set_error_policy(ldup);
  struct FreeDup {
    MPI_Comm& c;
    ~FreeDup() { MESHRT_MPI_IGNORE(MPI_Comm_free(&c)); }
  } free_dup{ldup};
  int lrank = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(ldup, &lrank));

  // Local rank 0 gets the port; it tells the others whether that worked, so a failure
  // raises on every rank instead of leaving them in MPI_Comm_accept/connect.
  std::array<char, MPI_MAX_PORT_NAME + 1> port{};
  std::string error;
  std::exception_ptr own_error;
  if (lrank == 0) {
    try {
      if (accepting) {
        MESHRT_MPI_CHECK(MPI_Open_port(MPI_INFO_NULL, port.data()));
        write_atomically(where, port.data());
      } else {
        const std::string name = read_port(where, option_timeout(options));
        if (name.size() > MPI_MAX_PORT_NAME) throw UsageError(fmt::format("{}: port name in {} too long", op, where));
        std::memcpy(port.data(), name.data(), name.size());
      }
    } catch (const std::exception& e) {
      error = e.what();
      own_error = std::current_exception();
    }
  }
  int failed = error.empty() ? 0 : 1;
  MESHRT_MPI_CHECK(MPI_Bcast(&failed, 1, MPI_INT, 0, ldup));
  if (failed) {
    if (own_error) std::rethrow_exception(own_error);
    throw UsageError(fmt::format("{}: local rank 0 failed to get the port: {}", op, error));
  }
  MPI_Comm inter = MPI_COMM_NULL;
  if (accepting) {
    // MPI_Comm_accept has no timeout: it waits until the other job connects.
    MESHRT_MPI_CHECK(MPI_Comm_accept(port.data(), MPI_INFO_NULL, 0, ldup, &inter));
    if (lrank == 0) {
      MESHRT_MPI_IGNORE(MPI_Close_port(port.data()));  // connected already; the port is not used again
      std::remove(where.c_str());                      // a later connect must not find a closed port
    }
  } else {
    MESHRT_MPI_CHECK(MPI_Comm_connect(port.data(), MPI_INFO_NULL, 0, ldup, &inter));
  }
  MPI_Comm merged = MPI_COMM_NULL;
  // The accepting job's ranks come first (high = 0).
  const int rc = MPI_Intercomm_merge(inter, accepting ? 0 : 1, &merged);
  if (rc != MPI_SUCCESS) MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));  // rc is reported
  MESHRT_MPI_CHECK(rc);
  // parent_rank(i): member i's rank in its own job's `local` communicator.
  int msize = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(merged, &msize));
  std::vector<int> parents(static_cast<std::size_t>(msize));
  const int rc2 = MPI_Allgather(&lrank, 1, MPI_INT, parents.data(), 1, MPI_INT, merged);
  if (rc2 != MPI_SUCCESS) {
    MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&merged));  // rc2 is reported
    MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));
  }
  MESHRT_MPI_CHECK(rc2);
  auto impl = make_impl(merged, std::move(parents), options);
  impl->inter = inter;
  return StatelessGroup(std::move(impl));
}

}  // namespace meshrt
