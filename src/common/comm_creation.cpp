#include "common/comm_creation.hpp"

namespace meshrt::detail {

std::timed_mutex& comm_creation_mutex() {
  static std::timed_mutex m;
  return m;
}

}  // namespace meshrt::detail
