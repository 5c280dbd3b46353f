#include "model.hpp"

#include <cblas.h>

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace demo {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Streams of uniform(): one per kind of random number.
constexpr std::uint64_t kInput = 1, kTeacher = 2, kW1 = 3, kW2 = 4;

// C = op(A) op(B), row-major, through CBLAS.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
          const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  // One BLAS thread per process: the ranks already fill the cores, and OpenBLAS's own
  // pool would oversubscribe them (as meshrt.matmul does, unless the user set
  // OPENBLAS_NUM_THREADS or OMP_NUM_THREADS).
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr && std::getenv("OMP_NUM_THREADS") == nullptr) {
      openblas_set_num_threads(1);
    }
  });
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), 0.0f, c, static_cast<int>(ldc));
}

// Column sums of a [rows, cols] matrix, accumulated in double so that the result does
// not depend on how many rows a data-parallel shard has beyond float32 rounding.
void column_sums(std::int64_t rows, std::int64_t cols, const float* a, float* out) {
  for (std::int64_t j = 0; j < cols; ++j) {
    double acc = 0;
    for (std::int64_t i = 0; i < rows; ++i) acc += a[i * cols + j];
    out[j] = static_cast<float>(acc);
  }
}

// The kernels run on worker threads and the reference on the controller thread: each
// thread keeps its own scratch buffers, which are reused from step to step.
std::vector<float>& scratch(std::size_t n) {
  thread_local std::vector<float> buf;
  buf.resize(n);
  return buf;
}

}  // namespace

float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t i, std::uint64_t j) {
  std::uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ stream);
  h = splitmix64(h ^ i);
  h = splitmix64(h ^ j);
  // The top 24 bits: exactly representable in float.
  return static_cast<float>(h >> 40) * 0x1.0p-23f - 1.0f;
}

void make_batch(std::uint64_t seed, std::int64_t step, std::int64_t row0, std::int64_t rows, const Sizes& s, float* x,
                float* t) {
  // Each input feature is U(-1, 1) (variance 1/3); teacher entries U(-a, a) with
  // a = 3 / sqrt(in) make x A of unit variance, so that sin(x A) is far from linear.
  const float a = 3.0f / std::sqrt(static_cast<float>(s.in));
  std::vector<float> teacher(static_cast<std::size_t>(s.in * s.out));
  for (std::int64_t k = 0; k < s.in; ++k) {
    for (std::int64_t o = 0; o < s.out; ++o) {
      teacher[static_cast<std::size_t>(k * s.out + o)] =
          a * uniform(seed, kTeacher, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(o));
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    // The sample's global index keys its numbers: a shard of the batch equals the same
    // rows of the full batch, whatever the data-parallel degree.
    const auto sample = static_cast<std::uint64_t>(step) * 0x100000000ULL + static_cast<std::uint64_t>(row0 + r);
    float* xr = x + r * s.in;
    for (std::int64_t k = 0; k < s.in; ++k) xr[k] = uniform(seed, kInput, sample, static_cast<std::uint64_t>(k));
    for (std::int64_t o = 0; o < s.out; ++o) {
      double acc = 0;
      for (std::int64_t k = 0; k < s.in; ++k)
        acc += static_cast<double>(xr[k]) * teacher[static_cast<std::size_t>(k * s.out + o)];
      t[r * s.out + o] = static_cast<float>(std::sin(acc));
    }
  }
}

void init_params(std::uint64_t seed, const Sizes& s, std::int64_t col0, std::int64_t cols, float* w1, float* b1,
                 float* w2, float* b2) {
  // He-uniform: U(-sqrt(6 / fan_in), sqrt(6 / fan_in)) keeps the relu layer's output
  // variance near its input's.
  const float bound1 = std::sqrt(6.0f / static_cast<float>(s.in));
  const float bound2 = std::sqrt(6.0f / static_cast<float>(s.hidden));
  for (std::int64_t k = 0; k < s.in; ++k) {
    for (std::int64_t j = 0; j < cols; ++j) {
      w1[k * cols + j] =
          bound1 * uniform(seed, kW1, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(col0 + j));
    }
  }
  for (std::int64_t j = 0; j < cols; ++j) {
    b1[j] = 0.0f;
    for (std::int64_t o = 0; o < s.out; ++o) {
      w2[j * s.out + o] =
          bound2 * uniform(seed, kW2, static_cast<std::uint64_t>(col0 + j), static_cast<std::uint64_t>(o));
    }
  }
  for (std::int64_t o = 0; o < s.out; ++o) b2[o] = 0.0f;
}

void forward(std::int64_t rows, std::int64_t in, std::int64_t cols, std::int64_t out, const float* x, const float* w1,
             const float* b1, const float* w2, float* z, float* y_part) {
  gemm(false, false, rows, cols, in, x, in, w1, cols, z, cols);
  std::vector<float>& h = scratch(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      float& zij = z[i * cols + j];
      zij += b1[j];
      h[static_cast<std::size_t>(i * cols + j)] = zij > 0.0f ? zij : 0.0f;
    }
  }
  gemm(false, false, rows, out, cols, h.data(), cols, w2, out, y_part, out);
}

double loss_grad(std::int64_t rows, std::int64_t out, const float* y, const float* b2, const float* t, float* dy) {
  const std::int64_t n = rows * out;
  const float scale = 2.0f / static_cast<float>(n);
  double sum = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t o = 0; o < out; ++o) {
      const float e = y[i * out + o] + b2[o] - t[i * out + o];
      sum += static_cast<double>(e) * e;
      dy[i * out + o] = scale * e;
    }
  }
  return sum / static_cast<double>(n);
}

std::int64_t grad_size(std::int64_t in, std::int64_t cols, std::int64_t out) {
  return in * cols + cols + cols * out + out;
}

void backward(std::int64_t rows, std::int64_t in, std::int64_t cols, std::int64_t out, const float* x, const float* z,
              const float* w2, const float* dy, float* grads) {
  float* dw1 = grads;
  float* db1 = dw1 + in * cols;
  float* dw2 = db1 + cols;
  float* db2 = dw2 + cols * out;
  const auto n = static_cast<std::size_t>(rows * cols);
  std::vector<float>& buf = scratch(2 * n);
  float* h = buf.data();
  float* dz = buf.data() + n;
  for (std::size_t i = 0; i < n; ++i) h[i] = z[i] > 0.0f ? z[i] : 0.0f;
  // The second layer: y = sum over tp of h w2 (+ b2). The backward of that sum is the
  // identity on each partial, so dy (replicated over tp) is every partial's gradient.
  gemm(true, false, cols, out, rows, h, cols, dy, out, dw2, out);          // dW2 = h^T dy
  column_sums(rows, out, dy, db2);                                         // db2 (equal on every tp rank)
  gemm(false, true, rows, cols, out, dy, out, w2, out, dz, cols);          // dh = dy W2^T
  for (std::size_t i = 0; i < n; ++i) dz[i] = z[i] > 0.0f ? dz[i] : 0.0f;  // relu'
  gemm(true, false, in, cols, rows, x, in, dz, cols, dw1, cols);           // dW1 = x^T dz
  column_sums(rows, cols, dz, db1);
}

void sgd_step(std::int64_t in, std::int64_t cols, std::int64_t out, float lr, const float* grads, float* w1, float* b1,
              float* w2, float* b2) {
  const auto update = [lr](float* w, const float* g, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) w[i] -= lr * g[i];
  };
  update(w1, grads, in * cols);
  update(b1, grads + in * cols, cols);
  update(w2, grads + in * cols + cols, cols * out);
  update(b2, grads + in * cols + cols + cols * out, out);
}

}  // namespace demo
