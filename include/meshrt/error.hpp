// meshrt's exceptions. Every error derives from meshrt::Error and says what was expected,
// what was found and where (rank, command, mesh dimension). Their types say whose fault
// it is (docs/ARCHITECTURE.md section 3.5): UsageError the caller's, InternalError
// meshrt's own, SystemError the environment's (MPI, CUDA, NCCL), ProtocolError a frame's.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace meshrt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad call at the controller or in a group: wrong dimension, shape, type or stream.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A bug in meshrt: one of its own invariants does not hold (raised by MESHRT_ASSERT and
// MESHRT_INTERNAL in src/common/assert.hpp). Nothing the caller did can cause it, so it
// is never a UsageError; the text and file()/line() name meshrt's source line to report.
class InternalError : public Error {
 public:
  InternalError(const std::string& what, std::string file, int line)
      : Error(what), file_(std::move(file)), line_(line) {}
  // The source file ("src/comm/data_plane.cpp") and the line that detected it.
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string file_;
  int line_;
};

// A blocking operation did not complete in time. `missing_ranks` names the ranks that
// did not arrive, where the operation can know them.
class TimeoutError : public Error {
 public:
  TimeoutError(const std::string& what, std::vector<int> missing_ranks = {}, bool group_unusable = false)
      : Error(what), missing_ranks_(std::move(missing_ranks)), group_unusable_(group_unusable) {}
  const std::vector<int>& missing_ranks() const noexcept { return missing_ranks_; }
  bool group_unusable() const noexcept { return group_unusable_; }

 private:
  std::vector<int> missing_ranks_;
  bool group_unusable_;
};

// A message that does not decode: unknown tag, bad enum, length past the buffer.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// A call into MPI, CUDA or NCCL failed; the text names the call, file and line.
class SystemError : public Error {
 public:
  using Error::Error;
};

}  // namespace meshrt
