"""Data- and tensor-parallel training of a two-layer MLP from one Python controller.

    mpiexec -n 4 python3 apps/examples/python/train.py --mesh 2x2 --steps 100
    MESHRT_ACCELERATOR=emulated mpiexec -n 4 python3 apps/examples/python/train.py --kind cpu,emulated
    mpiexec -n 1 python3 apps/examples/python/train.py --kind cuda --mesh 1x1     (one GPU per rank)

The Python twin of apps/meshrt-demo: y = relu(x W1 + b1) W2 + b2, trained with SGD on
a mean squared error against a fixed "teacher" t = sin(x A). Tensor parallelism over
"tp" (Megatron-style): each tp rank holds W1[:, block], b1[block] and W2[block, :], and
the partial outputs are summed with an all_reduce over "tp". Data parallelism over
"dp": each dp rank makes its own rows of the global batch, and the gradients are
averaged with an all_reduce over "dp". The kernels are torch functions registered with
@meshrt.function(..., torch=True), and the same kernels run on every kind of mesh:
--kind cpu, emulated (MESHRT_ACCELERATOR=emulated: the GPU code path on the host) or
cuda (torch CUDA tensors over meshrt's device memory, on the call's stream), or several
of them one after the other; the default is the job's accelerator (ctl.accelerator). At
the end the trained weights are fetched and checked against the same training run in one
process, in numpy.
"""

import argparse
import sys

import numpy as np

import meshrt

try:
    import torch
except ImportError:
    raise SystemExit("train.py: its kernels are torch functions: expected torch to import, found none "
                     "(Debian: apt install python3-torch; or pip install torch)")

IN, HIDDEN, OUT = 32, 64, 8


def teacher(seed):
    return np.random.default_rng([seed, 1]).uniform(-1, 1, (IN, OUT)).astype(np.float32)


def batch(seed, step, rows):
    """The global batch of `step`: inputs [rows, IN] and targets [rows, OUT]."""
    x = np.random.default_rng([seed, 2, step]).uniform(-1, 1, (rows, IN)).astype(np.float32)
    return x, np.sin(x @ teacher(seed)).astype(np.float32)


def init_params(seed):
    """The full W1 [IN, HIDDEN], b1 [HIDDEN], W2 [HIDDEN, OUT], b2 [OUT]."""
    rng = np.random.default_rng([seed, 3])
    w1 = rng.uniform(-1, 1, (IN, HIDDEN)).astype(np.float32) * np.float32(np.sqrt(6 / IN))
    w2 = rng.uniform(-1, 1, (HIDDEN, OUT)).astype(np.float32) * np.float32(np.sqrt(6 / HIDDEN))
    return w1, np.zeros(HIDDEN, np.float32), w2, np.zeros(OUT, np.float32)


def pack(*arrays):
    return np.concatenate([a.ravel() for a in arrays])


def unpack(flat, cols):
    sizes = [IN * cols, cols, cols * OUT, OUT]
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    return parts[0].reshape(IN, cols), parts[1], parts[2].reshape(cols, OUT), parts[3]


def grad_size(cols):
    return IN * cols + cols + cols * OUT + OUT


def block_grads(x, t_rows, params, y_partial_sum, scale):
    """Gradients of one hidden block: the packed [dW1 | db1 | dW2 | db2]."""
    w1, b1, w2, b2 = params
    z = x @ w1 + b1
    e = y_partial_sum + b2 - t_rows
    dy = (2 * e * scale).astype(np.float32)
    h = np.maximum(z, 0)
    dh = (dy @ w2.T) * (z > 0)
    return pack(x.T @ dh, dh.sum(0), h.T @ dy, dy.sum(0)).astype(np.float32)


# --- remote functions: torch kernels on every rank, shape functions on the controller ---
# Their tensors are on the mesh's device as torch names it (ctx.torch_device: cuda:N on a
# CUDA mesh, cpu on cpu and emulated meshes); data made on the host moves there.


def f32(*shape):
    return meshrt.TensorMeta(shape, meshrt.float32)


def on(ctx, array):
    return torch.from_numpy(array).to(ctx.torch_device)


def unpack_t(flat, cols):
    w1, b1, w2, b2 = torch.split(flat, [IN * cols, cols, cols * OUT, OUT])
    return w1.reshape(IN, cols), b1, w2.reshape(cols, OUT), b2


@meshrt.function("train.init", shape=lambda seed, tp: f32(grad_size(HIDDEN // tp)), torch=True)
def init_kernel(ctx, seed, tp):
    cols = HIDDEN // tp
    block = slice(ctx.coordinate("tp") * cols, (ctx.coordinate("tp") + 1) * cols)
    w1, b1, w2, b2 = init_params(seed)
    return on(ctx, pack(w1[:, block], b1[block], w2[block], b2))


@meshrt.function("train.forward", shape=lambda p, seed, step, rows, tp: f32(rows, OUT), torch=True)
def forward_kernel(ctx, params, seed, step, rows, tp):
    """This rank's rows of the batch through its hidden block: the partial output."""
    w1, b1, w2, _ = unpack_t(params, HIDDEN // tp)
    x, _ = local_rows(ctx, seed, step, rows)
    return torch.relu(on(ctx, x) @ w1 + b1) @ w2


@meshrt.function("train.backward", shape=lambda p, y, seed, step, rows, tp: p, torch=True)
def backward_kernel(ctx, params, y, seed, step, rows, tp):
    x, t = local_rows(ctx, seed, step, rows)
    # Scaled for the global batch, so that a sum over dp is the mean over all its rows. b2's
    # gradient needs no sum over tp: every tp rank holds the same y, so the same db2.
    w1, b1, w2, b2 = unpack_t(params, HIDDEN // tp)
    x, t = on(ctx, x), on(ctx, t)
    z = x @ w1 + b1
    dy = 2 * (y + b2 - t) / (rows * ctx.size("dp") * OUT)
    h = torch.relu(z)
    dh = (dy @ w2.T) * (z > 0)
    return torch.cat([(x.T @ dh).ravel(), dh.sum(0), (h.T @ dy).ravel(), dy.sum(0)])


@meshrt.function("train.sgd", shape=lambda p, g, lr, tp: p, torch=True)
def sgd_kernel(ctx, params, grads, lr, tp):
    return params - lr * grads


def local_rows(ctx, seed, step, rows):
    """Rows [dp * rows, (dp + 1) * rows) of the global batch of size rows * size("dp")."""
    x, t = batch(seed, step, rows * ctx.size("dp"))
    r = slice(ctx.coordinate("dp") * rows, (ctx.coordinate("dp") + 1) * rows)
    return x[r], t[r]


def reference(seed, steps, rows, lr):
    """The same training in one process."""
    w1, b1, w2, b2 = init_params(seed)
    for step in range(steps):
        x, t = batch(seed, step, rows)
        z = x @ w1 + b1
        y = np.maximum(z, 0) @ w2
        g = unpack(block_grads(x, t, (w1, b1, w2, b2), y, 1.0 / (rows * OUT)), HIDDEN)
        w1, b1, w2, b2 = (p - np.float32(lr) * d for p, d in zip((w1, b1, w2, b2), g))
    return w1, b1, w2, b2


def train(ctl, args, kind):
    """Trains on a mesh placed on `kind` and checks the weights against the reference."""
    dp, tp = (int(v) for v in args.mesh.split("x"))
    mesh = ctl.world_mesh({"dp": dp, "tp": tp}, kind=kind)
    rows = args.batch // dp
    params = mesh.call("train.init", args.seed, tp)
    for step in range(args.steps):
        y = mesh.call("train.forward", params, args.seed, step, rows, tp).reduce("tp", "sum")
        grads = mesh.call("train.backward", params, y, args.seed, step, rows, tp)
        grads = grads.reduce("dp", "sum")
        params = mesh.call("train.sgd", params, grads, args.lr, tp)
    ctl.synchronize(timeout=120)

    # Gather the shards on the controller and compare with the one-process run.
    cols = HIDDEN // tp
    full = [np.zeros((IN, HIDDEN), np.float32), np.zeros(HIDDEN, np.float32),
            np.zeros((HIDDEN, OUT), np.float32), None]
    for k in range(tp):
        w1, b1, w2, b2 = unpack(np.asarray(ctl.fetch_shard(params, dp=0, tp=k).result(timeout=60)), cols)
        block = slice(k * cols, (k + 1) * cols)
        full[0][:, block], full[1][block], full[2][block] = w1, b1, w2
        full[3] = b2 if full[3] is None else full[3]
    want = reference(args.seed, args.steps, args.batch, args.lr)
    scale = max(float(np.abs(w).max()) for w in want)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(full, want)) / scale
    first, last = loss(init_params(args.seed), args.seed, 0, args.batch), loss(full, args.seed, 0, args.batch)
    print(f"trained {args.steps} steps on a {dp}x{tp} mesh on {kind}; "
          f"max |distributed - reference| / max |w| = {diff:.2e}")
    if diff > args.rtol:
        raise SystemExit(f"FAILED on {kind}: the distributed weights differ from the reference by {diff:.2e} > "
                         f"{args.rtol}")
    print(f"verification passed on {kind}; loss on batch 0: {first:.4f} before training, {last:.4f} after")
    return diff


def main(ctl, args):
    kinds = [str(ctl.accelerator) if k == "auto" else k for k in args.kind.split(",")]
    return [train(ctl, args, kind) for kind in kinds]


def loss(params, seed, step, rows):
    w1, b1, w2, b2 = params
    x, t = batch(seed, step, rows)
    return float(np.mean((np.maximum(x @ w1 + b1, 0) @ w2 + b2 - t) ** 2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="2x2", help="DPxTP (their product is the number of ranks)")
    parser.add_argument("--kind", default="auto",
                        help="where the mesh is placed: cpu, emulated, cuda or auto (the job's accelerator, "
                        "MESHRT_ACCELERATOR), or several, comma-separated, trained one after the other")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by dp)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    for k in args.kind.split(","):
        if k not in ("auto", "cpu", "emulated", "cuda"):
            parser.error(f"--kind: expected cpu, emulated, cuda or auto (comma-separated), found '{k}'")
    meshrt.run(lambda ctl: main(ctl, args))
    sys.exit(0)
