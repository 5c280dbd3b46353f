#include "meshrt/call_site.hpp"

#include "common/site.hpp"

namespace meshrt {

std::string to_string(const CallSite& where) {
  return detail::describe(where);
}

}  // namespace meshrt
