#include "worker/borrows.hpp"

#include "worker/env.hpp"

namespace meshrt::detail {

void Borrows::create(const protocol::BorrowCreate& c, Env& env) {
  env.define(c.result, env.get(c.tensor, "borrowed tensor"));
  const StreamHandle* from = env.stream_handle(c.from_stream);
  records_[c.result.id] = Record{c.from_stream, c.to_stream, from ? borrow_create(*from) : BorrowEvents{}};
}

void Borrows::first_use(const protocol::BorrowFirstUse& c, const Env& env) {
  auto it = records_.find(c.borrow.id);
  if (it == records_.end()) return;
  if (const StreamHandle* to = env.stream_handle(it->second.to)) borrow_first_use(it->second.events, *to);
}

void Borrows::drop(const protocol::BorrowDrop& c, const Env& env) {
  auto it = records_.find(c.borrow.id);
  if (it == records_.end()) return;
  const StreamHandle* from = env.stream_handle(it->second.from);
  const StreamHandle* to = env.stream_handle(it->second.to);
  if (from && to) borrow_drop(it->second.events, *from, *to);
  records_.erase(it);
}

}  // namespace meshrt::detail
