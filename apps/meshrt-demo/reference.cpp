#include "reference.hpp"

namespace demo {

ReferenceRun train_reference(const TrainOptions& o) {
  const Sizes& s = o.sizes;
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  ReferenceRun run;
  Params& p = run.params;
  p.w1.resize(n(s.in * s.hidden));
  p.b1.resize(n(s.hidden));
  p.w2.resize(n(s.hidden * s.out));
  p.b2.resize(n(s.out));
  // The whole hidden layer is one "block" starting at column 0.
  init_params(o.seed, s, 0, s.hidden, p.w1.data(), p.b1.data(), p.w2.data(), p.b2.data());

  std::vector<float> x(n(o.batch * s.in)), t(n(o.batch * s.out)), z(n(o.batch * s.hidden)), y(n(o.batch * s.out));
  std::vector<float> dy(y.size()), grads(n(grad_size(s.in, s.hidden, s.out)));
  for (std::int64_t step = 0; step < o.steps; ++step) {
    make_batch(o.seed, step, 0, o.batch, s, x.data(), t.data());
    forward(o.batch, s.in, s.hidden, s.out, x.data(), p.w1.data(), p.b1.data(), p.w2.data(), z.data(), y.data());
    run.loss.push_back(loss_grad(o.batch, s.out, y.data(), p.b2.data(), t.data(), dy.data()));
    backward(o.batch, s.in, s.hidden, s.out, x.data(), z.data(), p.w2.data(), dy.data(), grads.data());
    sgd_step(s.in, s.hidden, s.out, o.lr, grads.data(), p.w1.data(), p.b1.data(), p.w2.data(), p.b2.data());
  }
  return run;
}

}  // namespace demo
