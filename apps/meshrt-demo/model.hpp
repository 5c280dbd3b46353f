// The demo's model: a two-layer MLP, y = relu(x W1 + b1) W2 + b2, trained with plain SGD
// on a mean squared error against a fixed random "teacher" function.
//
// Everything numeric lives here, on raw row-major float arrays, so that the distributed
// kernels (functions.cpp) and the one-process reference (reference.cpp) run the very
// same code: data and initial weights are bitwise equal, and the only differences left
// at the end are the summation orders of the partitioned matmuls and reductions.
//
// Randomness is a counter-based hash of (seed, stream, i, j), not a stateful generator:
// a rank can make element (i, j) of any matrix or batch without making the others, so a
// tensor-parallel shard is exactly a slice of the full matrix, and a data-parallel shard
// of the batch is exactly a block of rows of the full batch.
#pragma once

#include <cstdint>

namespace demo {

struct Sizes {
  std::int64_t in = 64;       // input features
  std::int64_t hidden = 256;  // hidden units (split over tp)
  std::int64_t out = 16;      // outputs
};

// A uniform float in [-1, 1) from (seed, stream, i, j).
float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t i, std::uint64_t j);

// Rows [row0, row0 + rows) of step `step`'s global batch: inputs x [rows, in] and
// targets t [rows, out], t = sin(x A) for the teacher matrix A [in, out] of `seed`.
void make_batch(std::uint64_t seed, std::int64_t step, std::int64_t row0, std::int64_t rows, const Sizes& s, float* x,
                float* t);

// Columns [col0, col0 + cols) of W1 [in, hidden] and of b1 [hidden]; rows
// [col0, col0 + cols) of W2 [hidden, out]; and b2 [out]. He-uniform weights, zero biases.
void init_params(std::uint64_t seed, const Sizes& s, std::int64_t col0, std::int64_t cols, float* w1, float* b1,
                 float* w2, float* b2);

// The first layer and the second layer's partial product for `cols` hidden units:
// z = x w1 + b1 [rows, cols] (kept for the backward pass), y_part = relu(z) w2 [rows, out].
void forward(std::int64_t rows, std::int64_t in, std::int64_t cols, std::int64_t out, const float* x, const float* w1,
             const float* b1, const float* w2, float* z, float* y_part);

// e = y + b2 - t over `rows` samples; returns the mean of e^2 over rows * out elements
// and writes its gradient with respect to y, dy = 2 e / (rows * out).
double loss_grad(std::int64_t rows, std::int64_t out, const float* y, const float* b2, const float* t, float* dy);

// The gradients of one hidden block, packed in one flat buffer (one all_reduce per step
// instead of four, as DDP's gradient buckets do): [dW1 (in x cols) | db1 (cols) |
// dW2 (cols x out) | db2 (out)].
std::int64_t grad_size(std::int64_t in, std::int64_t cols, std::int64_t out);
void backward(std::int64_t rows, std::int64_t in, std::int64_t cols, std::int64_t out, const float* x, const float* z,
              const float* w2, const float* dy, float* grads);

// w -= lr * g, over the four parameters in the packed layout above.
void sgd_step(std::int64_t in, std::int64_t cols, std::int64_t out, float lr, const float* grads, float* w1, float* b1,
              float* w2, float* b2);

}  // namespace demo
