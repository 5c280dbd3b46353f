// The same training run in one process: full matrices, the whole batch, no meshrt. The
// demo checks its distributed result against this.
#pragma once

#include <cstdint>
#include <vector>

#include "model.hpp"

namespace demo {

struct Params {
  std::vector<float> w1;  // [in, hidden]
  std::vector<float> b1;  // [hidden]
  std::vector<float> w2;  // [hidden, out]
  std::vector<float> b2;  // [out]
};

struct TrainOptions {
  Sizes sizes;
  std::int64_t batch = 256;  // global batch
  std::int64_t steps = 300;
  float lr = 0.1f;
  std::uint64_t seed = 1;
};

struct ReferenceRun {
  Params params;             // after the last step
  std::vector<double> loss;  // loss[s]: the loss of step s's batch before its update
};

ReferenceRun train_reference(const TrainOptions& o);

}  // namespace demo
