// Words: an immutable description ("reduce sum over 'x'", a function's name) that the
// dependency graph's node and the completion tracker both keep for error messages. Copies
// share one string (a reference count, no allocation), and a mesh caches the words of its
// reductions, so issuing a collective formats and allocates none of it (instead of a
// string built per call and copied into the tracker and the node).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/trace.hpp"

namespace meshrt::detail {

class Words {
 public:
  Words() = default;
  Words(std::string s) : text_(std::make_shared<const Text>(std::move(s))) {}  // NOLINT: implicit
  Words(const char* s) : Words(std::string(s)) {}                              // NOLINT: implicit
  const std::string& str() const noexcept { return text_ ? text_->text : empty_string(); }
  operator std::string_view() const noexcept { return str(); }  // NOLINT: implicit
  bool empty() const noexcept { return !text_ || text_->text.empty(); }
  // The words' number in the timeline's table of names (trace::intern), looked up once
  // for all the copies: a traced call costs no hash of its name.
  std::uint64_t trace_name() const {
    if (!text_) return trace::intern({});
    std::uint64_t n = text_->trace_name.load(std::memory_order_relaxed);
    if (n == kNoName) {
      n = trace::intern(text_->text);
      text_->trace_name.store(n, std::memory_order_relaxed);
    }
    return n;
  }

 private:
  static constexpr std::uint64_t kNoName = ~std::uint64_t{0};
  struct Text {
    explicit Text(std::string s) : text(std::move(s)) {}
    std::string text;
    mutable std::atomic<std::uint64_t> trace_name{kNoName};
  };
  static const std::string& empty_string() noexcept {
    static const std::string empty;
    return empty;
  }
  std::shared_ptr<const Text> text_;
};

// What a wait or a future is about, for its errors and its trace span: `head`, and
// " (invocation N)" after it when `ident` is set. Made into text only when something is
// reported, so a fetch that succeeds formats nothing.
struct Subject {
  Subject(std::string_view h, std::uint64_t i = 0) : head(h), ident(i) {}  // NOLINT: implicit
  Subject(const char* h) : head(h) {}                                      // NOLINT: implicit
  Subject(const std::string& h) : head(h) {}                               // NOLINT: implicit
  std::string_view head;
  std::uint64_t ident = 0;
  std::string str() const {
    std::string s(head);
    if (ident != 0) s.append(" (invocation ").append(std::to_string(ident)).append(")");
    return s;
  }
};

}  // namespace meshrt::detail
