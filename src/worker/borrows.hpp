// A worker's borrows (docs/ARCHITECTURE.md section 3.7): a borrowed tensor shares the
// origin's value, and its streams are ordered through the events of worker/streams.hpp.
// The controller enforces the borrow rules; the worker only orders the device streams.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "meshrt/internal/protocol.hpp"
#include "worker/streams.hpp"

namespace meshrt::detail {

class Env;

class Borrows {
 public:
  // Defines the borrow as the borrowed value (or its failure marker) and records the
  // origin stream's point.
  void create(const protocol::BorrowCreate& c, Env& env);
  // The borrower's stream waits for the origin's point (once).
  void first_use(const protocol::BorrowFirstUse& c, const Env& env);
  // The origin's stream waits for the borrower's work; the record goes.
  void drop(const protocol::BorrowDrop& c, const Env& env);

 private:
  struct Record {
    Ref from, to;  // the origin's and the borrower's stream
    BorrowEvents events;
  };
  std::unordered_map<std::uint64_t, Record> records_;
};

}  // namespace meshrt::detail
