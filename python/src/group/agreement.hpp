// The members' agreement inside a Python group operation: each member's part (its
// allow_pickle, out= and any error it met), exchanged in the operation's first C++
// collective, so every member raises the same error before any array moves.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "group/group_ops.hpp"

namespace meshrt::python::group_ops {

// Exactly `size` bytes into memory allocated beforehand (an array's).
class FixedSink final : public detail::PayloadSink {
 public:
  FixedSink(char* data, std::size_t size) : data_(data), size_(size) {}
  char* prepare(std::size_t size) override;

 private:
  char* data_;
  std::size_t size_;
};

// Anything, into a scratch buffer that is thrown away.
class DiscardSink final : public detail::PayloadSink {
 public:
  explicit DiscardSink(std::vector<char>& scratch) : scratch_(scratch) {}
  char* prepare(std::size_t size) override {
    scratch_.resize(std::max<std::size_t>(size, 1));
    return scratch_.data();
  }

 private:
  std::vector<char>& scratch_;
};

// The wire tags of the Python group's messages.
const detail::TypeTag& object_tag();
const detail::TypeTag& buffer_tag();
const detail::TypeTag& all_gather_tag();
const detail::TypeTag& broadcast_tag(int root);
const detail::TypeTag& gather_tag(int root);
const detail::TypeTag& scatter_tag(int root);

enum PartFlags : std::uint8_t { kAllowPickle = 1, kHasOut = 2, kHasObject = 4, kHasError = 8 };

struct Part {
  std::uint8_t flags = 0;
  codec::ArraySpec out;  // kHasOut
  std::string error;     // kHasError
  std::string_view object;
};
void write_part(std::string& s, std::uint8_t flags, const codec::ArraySpec* out, const std::string& error,
                const std::string* object);
Part read_part(std::string_view b, const codec::Where& where);

// Where an operation runs, and from whom, for error messages: formatted only when one is
// raised (a message costs more than a small object's whole transfer).
struct Site {
  const PyGroup* pg;
  const char* op;
  int from;
  std::string here() const { return fmt::format("{} on {}", op, pg->me()); }
  codec::Where where() const {
    return [this] { return here(); };
  }
  codec::Where where_from() const {
    return [this] { return fmt::format("{} from {}", here(), pg->peer(from)); };
  }
  codec::Where peer() const {
    return [this] { return pg->peer(from); };
  }
};

// One operation at a time per group: a second thread (or code that runs while an object
// is encoded, such as a __reduce__) gets a UsageError instead of corrupting the protocol.
class Busy {
 public:
  Busy(PyGroup& pg, const char* op) : pg_(pg) {
    if (pg.busy) {
      throw UsageError(
          fmt::format("{}: another operation is running on this group (a group runs one operation at "
                      "a time; use one group per thread)",
                      op));
    }
    pg.busy = true;
  }
  ~Busy() { pg_.busy = false; }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;

 private:
  PyGroup& pg_;
};

// A C++ error of the first operation of broadcast_obj names the C++ collective it runs on
// (all_gather_obj); the caller called broadcast_obj.
template <class F>
void renamed(const char* op, F&& f) {
  auto rename = [&](const char* what) {
    std::string s = what;
    const std::string from = "all_gather_obj";
    if (s.rfind(from, 0) == 0) s = op + s.substr(from.size());
    return s;
  };
  try {
    f();
  } catch (const TimeoutError& e) {
    throw TimeoutError(rename(e.what()), e.missing_ranks(), e.group_unusable());
  } catch (const UsageError& e) {
    throw UsageError(rename(e.what()));
  }
}

// The collective's first operation: every member's part, by group rank.
std::vector<Part> exchange_parts(PyGroup& pg, StatelessGroup& g, const char* op, const detail::TypeTag& tag,
                                 const Deadline& dl);

// An error a member meets before a collective (encoding its object, checking its out=):
// it still takes part in the collective's first operation, so that every member learns
// of it and raises instead of waiting. A UsageError is raised alike on every member; any
// other exception (a Python one from an object's own code) is re-raised on this member
// as it was, the others raise a UsageError quoting it.
struct LocalError {
  std::string text;
  std::exception_ptr other;
  explicit operator bool() const { return !text.empty(); }
  void rethrow() const {
    if (other) std::rethrow_exception(other);
  }
};

template <class F>
LocalError before_collective(F&& f) {
  LocalError e;
  try {
    f();
  } catch (const UsageError& u) {
    e.text = u.what();
  } catch (py::error_already_set& p) {
    e.text = p.what();
    e.other = std::current_exception();
  } catch (const std::exception& x) {
    e.text = x.what();
    e.other = std::current_exception();
  }
  return e;
}

// Raises on every member alike if any member met an error before the collective.
void raise_member_errors(PyGroup& pg, const char* op, const std::vector<Part>& parts, int root);
// Pickled parts need the consent of every member that decodes one it did not pickle
// itself: of `decoders` (every member when empty). Raises on every member alike.
void check_pickle_consent(PyGroup& pg, const char* op, const std::vector<Part>& parts,
                          const std::vector<int>& pickled_by, const std::vector<int>& decoders = {});

}  // namespace meshrt::python::group_ops
