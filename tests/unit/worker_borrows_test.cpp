// The worker's borrows (src/worker/borrows.hpp) on CPU streams: a borrow shares the
// origin's value or its failure marker, and its first use and drop need its record only.
#include <gtest/gtest.h>

#include <variant>

#include "meshrt/error.hpp"
#include "worker/borrows.hpp"
#include "worker/env.hpp"

namespace meshrt::detail {
namespace {

using namespace protocol;

TEST(WorkerBorrows, ABorrowSharesTheValueOrItsMarker) {
  Env env(0);
  env.define(Ref{1}, StreamValue{1, true, make_stream(true, 1)});
  env.define(Ref{2}, StreamValue{2, false, make_stream(false, 2)});
  env.define(Ref{10}, Tensor::zeros(TensorMeta({2}, DType::Float32)));
  env.define(Ref{11}, DependentOnError{4});
  Borrows borrows;
  borrows.create(BorrowCreate{.result = Ref{20}, .tensor = Ref{10}, .from_stream = Ref{1}, .to_stream = Ref{2}}, env);
  borrows.create(BorrowCreate{.result = Ref{21}, .tensor = Ref{11}, .from_stream = Ref{1}, .to_stream = Ref{2}}, env);
  EXPECT_TRUE(std::holds_alternative<Tensor>(env.input(Ref{20})));
  EXPECT_EQ(std::get<DependentOnError>(env.input(Ref{21})).ident, 4u);
  borrows.first_use(BorrowFirstUse{.borrow = Ref{20}}, env);
  borrows.drop(BorrowDrop{.borrow = Ref{20}}, env);
  borrows.drop(BorrowDrop{.borrow = Ref{20}}, env);           // already dropped: ignored
  borrows.first_use(BorrowFirstUse{.borrow = Ref{99}}, env);  // unknown: ignored
  EXPECT_THROW(borrows.create(
                   BorrowCreate{.result = Ref{22}, .tensor = Ref{12}, .from_stream = Ref{1}, .to_stream = Ref{2}}, env),
               ProtocolError);
}

}  // namespace
}  // namespace meshrt::detail
