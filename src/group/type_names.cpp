// The objects' side of the group: the readable names and hashes of their types
// (detail::TypeTag) and the codec's errors.
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "common/hash.hpp"
#include "meshrt/group.hpp"

namespace meshrt::detail {

std::string readable_type_name(std::string name) {
  const auto replace_all = [&](std::string_view from, std::string_view to) {
    for (auto at = name.find(from); at != std::string::npos; at = name.find(from, at + to.size()))
      name.replace(at, from.size(), to);
  };
  replace_all("std::__cxx11::", "std::");
  // Drop ", std::allocator<...>" and the other defaults, with their nested brackets.
  for (const std::string_view arg : {", std::allocator<", ", std::char_traits<", ", std::less<", ", std::hash<",
                                     ", std::equal_to<", ", std::default_delete<"}) {
    for (auto at = name.find(arg); at != std::string::npos; at = name.find(arg, at)) {
      std::size_t end = at + arg.size();
      for (int depth = 1; end < name.size() && depth > 0; ++end) {
        if (name[end] == '<') ++depth;
        if (name[end] == '>') --depth;
      }
      name.erase(at, end - at);
    }
  }
  replace_all(" >", ">");
  replace_all("std::basic_string<char>", "std::string");
  replace_all("std::basic_string_view<char>", "std::string_view");
  return name;
}

std::uint64_t fnv1a(std::string_view text) {
  return fnv1a_64(text);
}

void serialize_failed(const TypeTag& tag, const char* what) {
  throw UsageError(fmt::format("cannot serialize an object of type {}: {}", tag.name, what));
}

void deserialize_failed(const TypeTag& tag, std::size_t size, const char* what, const std::string& where) {
  throw ProtocolError(
      fmt::format("{}: the {}-byte payload does not decode as {} (tag matched): {}", where, size, tag.name, what));
}

}  // namespace meshrt::detail
