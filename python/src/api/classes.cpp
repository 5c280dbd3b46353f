#include "api/classes.hpp"

namespace meshrt::python {

void declare_api_classes(py::module_& m) {
  FutureClass(m, "Future", "A tensor that will come back from the workers, or a completion (mesh.barrier()).");
  StreamClass(m, "Stream", "A stream of work on the workers (ctl.stream(name)).");
  DTensorClass(m, "DTensor", "A distributed tensor: one local tensor per rank of its mesh.");
  MeshClass(m, "Mesh", "A device mesh: named dimensions over a set of ranks.");
  WorkerObjectClass(m, "WorkerObject",
                    "A handle to the Python object each rank of a mesh keeps (mesh.call_object); pass it to calls on "
                    "that mesh.");
  RecordingClass(m, "Recording", "A recorded step (ctl.record): call it with tensors like the examples to replay it.");
  ControllerClass(m, "Controller",
                  "The program on rank 0 drives every worker through it (main's argument in meshrt.run).");
}

}  // namespace meshrt::python
