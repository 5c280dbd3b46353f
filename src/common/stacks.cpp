#include "meshrt/internal/stacks.hpp"

#include <fmt/format.h>
#include <pthread.h>

#include <mutex>
#include <utility>

namespace meshrt::detail {
namespace {

struct Registered {
  std::mutex mutex;
  const char* language = nullptr;
  StackProvider provider = nullptr;
};

Registered& registered() {
  static Registered r;
  return r;
}

}  // namespace

void set_stack_provider(const char* language, StackProvider provider) noexcept {
  Registered& r = registered();
  std::lock_guard lock(r.mutex);
  r.language = provider != nullptr ? language : nullptr;
  r.provider = provider;
}

std::string language_stack(const StackOf& of, std::size_t indent) {
  const char* language = nullptr;
  StackProvider provider = nullptr;
  {
    // Copied out, so that a slow provider holds no lock another report needs.
    Registered& r = registered();
    std::lock_guard lock(r.mutex);
    language = r.language;
    provider = r.provider;
  }
  if (provider == nullptr) return {};
  std::string text;
  try {
    text = provider(of);
  } catch (const std::exception& e) {
    text = fmt::format("(the stack provider failed: {})", e.what());
  } catch (...) {
    text = "(the stack provider failed)";
  }
  if (text.empty()) return {};
  try {
    const std::string pad(indent, ' ');
    std::string out = fmt::format("{}{} stack of the {}:\n", pad, language ? language : "language",
                                  of.owner == StackOwner::Kernel ? "kernel" : "controller");
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t end = text.find('\n', at);
      const std::string_view line = std::string_view(text).substr(at, end == std::string::npos ? end : end - at);
      out.append(pad).append("  ").append(line).append("\n");
      if (end == std::string::npos) break;
      at = end + 1;
    }
    return out;
  } catch (...) {
    return {};
  }
}

std::uint64_t this_thread_id() noexcept {
  return static_cast<std::uint64_t>(pthread_self());
}

}  // namespace meshrt::detail
