// What a worker checks around a kernel call: the signature its shape function declares for
// the call's argument metas, and that the kernel's outputs match it (the controller planned
// every later command, and peers join collectives, with those metas).
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

#include "meshrt/functions.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::detail {

class KernelCall {
 public:
  explicit KernelCall(int rank) : rank_(rank) {}

  // The signature `fn`'s shape function gives for `args` on `device`, computed before the
  // kernel runs (a mutating kernel may change its inputs). The last few answers per
  // function are kept with the metas they were given: loops call a function with the same
  // metas (a step calls one with a few scalars), and shape functions are pure, so a hit is
  // the same answer.
  const Signature& expected(const functions::Function& fn, const Args& args, const Device& device);
  // Throws UsageError naming the function, the rank and the output unless `outputs` match
  // `expected`: the same count, and each output the declared shape, dtype and device kind,
  // an accelerator output on this rank's own device, and new memory: none overlaps a tensor
  // of `inputs` (the call's arguments, mutated ones too) or another output.
  void check(const std::string& function, const Signature& expected, const std::vector<Tensor>& outputs,
             const Args& inputs) const;

  // Whether `v` (an argument, tensors in it) has the metas `meta`, without building them.
  static bool same_meta(const Value& meta, const Value& v);

 private:
  struct Inferred {
    ArgMetas args;
    Signature signature;
  };
  static constexpr std::size_t kPerFunction = 4;
  struct Answers {
    std::vector<Inferred> kept;  // at most kPerFunction
    std::size_t next = 0;        // the one a new answer replaces once full
  };
  int rank_;
  std::unordered_map<const functions::Function*, Answers> inferred_;
  // The last function's answers (a map's elements stay where they are): a loop calls one
  // function in turn, without a hash lookup each time.
  const functions::Function* last_ = nullptr;
  Answers* last_answers_ = nullptr;
};

}  // namespace meshrt::detail
