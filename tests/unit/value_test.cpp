#include "meshrt/value.hpp"
#include "../support/expect_error.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace meshrt {
namespace {

using test::expect_contains;
using test::usage_error;

TEST(Value, KindsAndAccessors) {
  EXPECT_TRUE(Value().is_none());
  EXPECT_TRUE(Value(nullptr).is_none());
  EXPECT_EQ(Value(true).as_bool(), true);
  EXPECT_EQ(Value(7).as_int(), 7);
  EXPECT_EQ(Value(std::uint8_t{200}).as_int(), 200);
  EXPECT_EQ(Value(7).as_number(), 7.0);
  EXPECT_EQ(Value(2.5).as_number(), 2.5);
  EXPECT_EQ(Value("hi").as_string(), "hi");
  EXPECT_EQ(Value(Ref{9}).as_ref(), Ref{9});
  EXPECT_TRUE(Value(TensorMeta()).is_meta());
  EXPECT_TRUE(Value(Tensor::zeros(TensorMeta())).is_tensor());
  const Value l{1, "a", 2.0};
  ASSERT_TRUE(l.is_list());
  EXPECT_EQ(l.as_list().size(), 3u);
  EXPECT_EQ(l.at(1).as_string(), "a");
  EXPECT_EQ(Value(std::vector<std::int64_t>{3, 4}), (Value{3, 4}));
  EXPECT_EQ(usage_error([] { (void)Value("x").as_int(); }), "expected int, found string 'x'");
  EXPECT_EQ(usage_error([] { (void)Value(true).as_number(); }), "expected a number (int or double), found bool true");
  EXPECT_EQ(usage_error([] { (void)Value(std::uint64_t{1} << 63); }),
            "Value: expected an integer <= 9223372036854775807, found 9223372036854775808");
  EXPECT_EQ(usage_error([&] { (void)l.at(5); }), "list: expected an index < 3, found 5");
}

TEST(Value, DictKeepsOrderAndNamesMissingKeys) {
  const Value d = Value::dict({{"z", Value(1)}, {"a", Value(Ref{2})}});
  EXPECT_EQ(d.as_dict().front().first, "z");
  EXPECT_EQ(d.at("a").as_ref().id, 2u);
  EXPECT_EQ(usage_error([&] { (void)d.at("q"); }), "dict: expected a key 'q', found keys ['z', 'a']");
  EXPECT_EQ(d.to_string(), "{'z': 1, 'a': ref(2)}");
}

TEST(Value, FlattenAndMapFollowTreeOrder) {
  const Value tree =
      Value::list({Value(Ref{1}), Value::dict({{"b", Value(Ref{2})}, {"a", Value{Value(Ref{3}), Value(4)}}}),
                   Value("s"), Value(Ref{4})});
  EXPECT_EQ(tree.refs(), (std::vector<Ref>{{1}, {2}, {3}, {4}}));
  const auto ints = tree.flatten([](const Value& v) { return v.is_int(); });
  ASSERT_EQ(ints.size(), 1u);
  EXPECT_EQ(ints[0]->as_int(), 4);

  // Replace refs by tensors, as a worker's lookup does.
  const Value looked_up = tree.map([](const Value& v) -> Value {
    if (!v.is_ref()) return v;
    return Value(Tensor::from<std::int64_t>({}, {static_cast<std::int64_t>(v.as_ref().id) * 10}));
  });
  EXPECT_TRUE(looked_up.refs().empty());
  const auto tensors = looked_up.flatten([](const Value& v) { return v.is_tensor(); });
  ASSERT_EQ(tensors.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(tensors[i]->as_tensor().item(), 10.0 * static_cast<double>(i + 1));
  EXPECT_EQ(looked_up.at(1).at("a").at(1).as_int(), 4);  // the shape of the tree is kept

  Value mutable_tree = tree;
  for (Value* v : mutable_tree.flatten([](const Value& x) { return x.is_ref(); })) *v = Value(0);
  EXPECT_TRUE(mutable_tree.refs().empty());
  EXPECT_FALSE(tree.refs().empty());  // the copy was deep
}

TEST(Value, Equality) {
  EXPECT_EQ(Value(std::nan("")), Value(std::nan("")));  // bitwise for doubles
  EXPECT_NE(Value(0.0), Value(-0.0));
  EXPECT_NE(Value(1), Value(1.0));
  const Tensor t = Tensor::from<float>({2}, {1, 2});
  EXPECT_EQ(Value(t), Value(t.clone()));
  EXPECT_NE(Value(t), Value(Tensor::from<float>({2}, {1, 3})));
  EXPECT_NE(Value::list({Value(1)}), Value::list({Value(1), Value(2)}));
  EXPECT_NE(Value::dict({{"a", Value(1)}}), Value::dict({{"b", Value(1)}}));
}

}  // namespace
}  // namespace meshrt
