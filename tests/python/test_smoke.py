"""The package imports, and a call, a reduction and a fetch work through it (4 ranks)."""
import numpy as np

import meshrt


def test_full_reduce_fetch():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        x = mesh.call("meshrt.full", (3, 4), meshrt.float32, 1.0)
        y = x.reduce("tp", "sum")
        a = ctl.fetch_shard(y, dp=0, tp=1).result(timeout=30)
        np.testing.assert_array_equal(a.numpy(), np.full((3, 4), 2, np.float32))
        return "done"

    result = meshrt.run(main)
    assert result in ("done", None)


def test_errors_are_classes():
    assert issubclass(meshrt.UsageError, meshrt.Error)
    assert issubclass(meshrt.TimeoutError, TimeoutError)
    assert issubclass(meshrt.TimeoutError, meshrt.Error)
