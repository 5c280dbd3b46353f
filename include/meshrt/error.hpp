// meshrt's exceptions. Every error a caller can act on derives from meshrt::Error and
// says what was expected, what was found and where (rank, command, mesh dimension).
#pragma once

#include <stdexcept>
#include <string>
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
