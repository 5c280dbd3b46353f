// Words: an immutable description ("reduce sum over 'x'", a function's name) that the
// dependency graph's node and the completion tracker both keep for error messages. Copies
// share one string (a reference count, no allocation), and a mesh caches the words of its
// reductions, so issuing a collective formats and allocates none of it (instead of a
// string built per call and copied into the tracker and the node).
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace meshrt::detail {

class Words {
 public:
  Words() = default;
  Words(std::string s) : text_(std::make_shared<const std::string>(std::move(s))) {}  // NOLINT: implicit
  Words(const char* s) : Words(std::string(s)) {}                                     // NOLINT: implicit
  const std::string& str() const noexcept { return text_ ? *text_ : empty_string(); }
  operator std::string_view() const noexcept { return str(); }  // NOLINT: implicit
  bool empty() const noexcept { return !text_ || text_->empty(); }

 private:
  static const std::string& empty_string() noexcept {
    static const std::string empty;
    return empty;
  }
  std::shared_ptr<const std::string> text_;
};

}  // namespace meshrt::detail
