"""meshrt: drive a whole MPI job from one Python program (DESIGN section 11)."""

import builtins
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import numpy
import numpy.typing

_T = TypeVar("_T")
_Kernel = TypeVar("_Kernel", bound=Callable[..., Any])

class _SupportsDLPack(Protocol):
    """Anything that speaks DLPack: a torch tensor, a numpy array, a meshrt.Tensor, ..."""

    def __dlpack__(self) -> object: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

# A tensor the controller or Tensor() takes: DLPack producers, numpy arrays, writable buffers.
_TensorLike = Tensor | _SupportsDLPack | numpy.ndarray[Any, Any] | bytearray | memoryview
# meshrt.float32, "float32", numpy.float32, numpy.dtype("float32"), torch.float32, ...
# (torch dtypes have no common type to name here, hence Any).
_DTypeLike = DType | str | numpy.dtype[Any] | type | Any
_DeviceLike = Device | str
_ShapeLike = int | Sequence[int]
# {"dp": 2, "tp": 2} or [("dp", 2), ("tp", 2)].
_Dims = Mapping[str, int] | Sequence[tuple[str, int]]

__version__: str

# ------------------------------------------------------------------ errors

class Error(Exception):
    """Every meshrt error."""

class UsageError(Error):
    """A bad call at the controller, in a shape function or in a group."""

class RemoteError(Error):
    """A function failed on a worker, or a value depends on one that did."""

    ident: int
    function: str
    ranks: list[int]
    worker_message: str
    issued_at: str

class TimeoutError(Error, builtins.TimeoutError):
    """A blocking operation did not complete in time (also a builtin TimeoutError)."""

    missing_ranks: list[int]
    group_unusable: bool

class SystemError(Error):
    """A call into MPI, CUDA or NCCL failed."""

class InternalError(Error):
    """A bug in meshrt."""

    file: str
    line: int

class ProtocolError(Error):
    """A message that does not decode."""

# ------------------------------------------------------------------ tensors

class DType:
    """A tensor's element type; also meshrt.float32, meshrt.int64, ..."""

    __members__: ClassVar[dict[str, DType]]
    bool_: ClassVar[DType]
    uint8: ClassVar[DType]
    int32: ClassVar[DType]
    int64: ClassVar[DType]
    float16: ClassVar[DType]
    bfloat16: ClassVar[DType]
    float32: ClassVar[DType]
    float64: ClassVar[DType]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...
    @property
    def itemsize(self) -> int:
        """Bytes per element."""
    @property
    def is_floating_point(self) -> bool: ...

bool_: DType
uint8: DType
int32: DType
int64: DType
float16: DType
bfloat16: DType
float32: DType
float64: DType

class Device:
    """Where a tensor lives: cpu, cuda:N or emulated:N."""

    def __init__(self, name: str) -> None: ...
    @property
    def type(self) -> str:
        """"cpu", "cuda" or "emulated"."""
    @property
    def index(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class TensorMeta:
    """Shape, dtype and device: what the controller knows of a tensor."""

    def __init__(self, shape: _ShapeLike, dtype: _DTypeLike, device: _DeviceLike | None = None) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def device(self) -> Device: ...
    @property
    def ndim(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def with_shape(self, shape: _ShapeLike, /) -> TensorMeta: ...
    def with_device(self, device: _DeviceLike, /) -> TensorMeta: ...
    def with_dtype(self, dtype: _DTypeLike, /) -> TensorMeta: ...
    def empty(self) -> Tensor:
        """A new tensor of this meta, uninitialised."""
    def zeros(self) -> Tensor:
        """A new tensor of this meta, zeroed."""
    def __eq__(self, other: object) -> bool: ...

class Tensor:
    """A local tensor: contiguous, row-major, on one device; shares memory through DLPack."""

    def __init__(self, obj: _TensorLike) -> None:
        """A view of a numpy array, torch tensor or writable buffer (read-only memory is copied)."""
    @staticmethod
    def from_dlpack(obj: _TensorLike) -> Tensor:
        """A view of anything with __dlpack__ (or the buffer protocol): no copy."""
    def __dlpack__(self, stream: int | None = None) -> Any:
        """A DLPack capsule viewing this tensor."""
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def numpy(self) -> numpy.typing.NDArray[Any]:
        """A numpy array viewing this host tensor's memory."""
    def __array__(self, dtype: numpy.typing.DTypeLike | None = None) -> numpy.typing.NDArray[Any]: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def device(self) -> Device: ...
    @property
    def meta(self) -> TensorMeta: ...
    @property
    def ndim(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_ptr(self) -> int:
        """The address of the first element (host or device memory, per device)."""
    def __len__(self) -> int: ...
    def item(self) -> bool | int | float:
        """The one element of a tensor of one element."""
    def clone(self) -> Tensor:
        """A copy on the same device."""
    def to(self, device: _DeviceLike) -> Tensor:
        """This tensor on `device` (itself when already there; otherwise a copy)."""
    def reshape(self, shape: _ShapeLike) -> Tensor:
        """A view of the same memory with another shape of the same number of elements."""
    def equals(self, other: Tensor) -> bool:
        """Same shape, dtype, device and bytes."""
    def same_storage(self, other: Tensor) -> bool:
        """Whether both share one storage."""

def from_dlpack(obj: _TensorLike) -> Tensor:
    """A meshrt.Tensor viewing a numpy array, torch tensor or DLPack producer: no copy."""

# ------------------------------------------------------------------ the controller

class Reduction:
    """How reduce() combines a mesh dimension; or its name, "sum"."""

    __members__: ClassVar[dict[str, Reduction]]
    STACK: ClassVar[Reduction]
    SUM: ClassVar[Reduction]
    AVG: ClassVar[Reduction]
    PRODUCT: ClassVar[Reduction]
    MIN: ClassVar[Reduction]
    MAX: ClassVar[Reduction]
    BAND: ClassVar[Reduction]
    BOR: ClassVar[Reduction]
    BXOR: ClassVar[Reduction]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class DeviceKind:
    """What a mesh is placed on; or its name: "cpu", "cuda", "emulated"."""

    __members__: ClassVar[dict[str, DeviceKind]]
    CPU: ClassVar[DeviceKind]
    CUDA: ClassVar[DeviceKind]
    EMULATED: ClassVar[DeviceKind]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class MeshPermutation:
    """A rank order for DTensor.to_mesh: rotate(dim, shift), transpose(a, b), mapping(to)."""

    @staticmethod
    def rotate(dim: str, shift: int) -> MeshPermutation:
        """Along dim, coordinate i goes to (i + shift) mod size(dim)."""
    @staticmethod
    def transpose(dim_a: str, dim_b: str) -> MeshPermutation:
        """The coordinates along dim_a and dim_b (of equal sizes) trade places."""
    @staticmethod
    def mapping(to: Sequence[int]) -> MeshPermutation:
        """Source position k (row-major) goes to target position to[k]."""
    def resolve(self, names: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """The target position of every source position for a mesh with these dimensions."""

class Future:
    """A tensor that will come back from the workers."""

    def result(self, timeout: float | None = None) -> Tensor:
        """Waits and returns the tensor; RemoteError on a failure, TimeoutError after `timeout` s."""
    def done(self) -> bool:
        """True once result() would return or raise without waiting."""
    def exception(self) -> BaseException | None:
        """Waits; the exception result() would raise, or None."""

class Stream:
    """A stream of work on the workers (ctl.stream(name))."""

    @property
    def name(self) -> str: ...
    def borrow(self, t: DTensor, mutable: bool = False) -> DTensor:
        """A handle to t usable on this stream; end it with drop()."""
    def __eq__(self, other: object) -> bool: ...

class DTensor:
    """A distributed tensor: one local tensor per rank of its mesh."""

    @property
    def meta(self) -> TensorMeta: ...
    @property
    def mesh(self) -> Mesh: ...
    @property
    def stream(self) -> Stream: ...
    def reduce(self, dim: str, reduction: Reduction | str, scatter: bool = False) -> DTensor:
        """The reduction over mesh dimension dim: meshrt.Reduction.SUM or "sum", ..."""
    def reduce_(self, dim: str, reduction: Reduction | str, scatter: bool = False) -> DTensor:
        """In place: this tensor's value changes (and every handle's that shares it); returns self."""
    def to_mesh(self, target: Mesh, permutation: MeshPermutation | None = None) -> DTensor:
        """The same values sent to target (a mesh of the same sizes)."""
    def rotate(self, dim: str, shift: int) -> DTensor:
        """Each rank's tensor moves shift coordinates along dim (a ring)."""
    def slice_mesh(self, dim: str, index: int) -> DTensor:
        """The part of this tensor on the sub-mesh where dim == index."""
    def drop(self) -> None:
        """Ends a borrow: the origin stream may use the tensor again."""

class Mesh:
    """A device mesh: named dimensions over a set of ranks."""

    @property
    def names(self) -> list[str]: ...
    @property
    def sizes(self) -> list[int]: ...
    @property
    def ranks(self) -> list[int]:
        """The world ranks."""
    def size(self, dim: str) -> int: ...
    def slice(self, dim: str, index: int, end: int | None = None, step: int = 1) -> Mesh:
        """slice(dim, index): dim dropped; slice(dim, begin, end, step=1): dim kept."""
    def rename(self, dim: str, name: str) -> Mesh: ...
    def split(self, dim: str, parts: _Dims) -> Mesh:
        """Splits dim into dimensions of the given sizes."""
    def flatten(self, name: str) -> Mesh:
        """One dimension over all ranks, in row-major order."""
    def rank(self, dim: str) -> DTensor:
        """Each rank's coordinate along dim, as an int64 0-d DTensor."""
    def call(self, fn: str, /, *args: Any) -> DTensor | None:
        """Runs a registered function on every rank; its one output (None if it only mutates)."""
    def call_n(self, fn: str, /, *args: Any) -> list[DTensor]:
        """As call, returning the list of every output."""
    def call_on(self, stream: Stream, fn: str, /, *args: Any) -> list[DTensor]:
        """As call_n, on an explicit stream."""
    def from_host(self, array: _TensorLike) -> DTensor:
        """The controller's array copied to every rank of the mesh."""
    def scatter(self, dim: str, array: _TensorLike) -> DTensor:
        """The array split along its first axis: coordinate i along dim holds shard i."""
    def __eq__(self, other: object) -> bool: ...

class Recording:
    """A recorded step (Controller.record): call it with tensors like the examples to replay it."""

    def __call__(self, *inputs: DTensor) -> Any:
        """Replays the step; returns fresh results in the form the recorded function returned them
        (a DTensor, None, or a tuple)."""
    @property
    def num_inputs(self) -> int: ...
    @property
    def num_outputs(self) -> int: ...
    @property
    def num_commands(self) -> int: ...

class Controller:
    """The program on rank 0 drives every worker through it (main's argument in meshrt.run)."""

    def world_mesh(self, dims: _Dims, kind: DeviceKind | str = "cpu") -> Mesh:
        """The mesh of every worker rank."""
    @property
    def accelerator(self) -> DeviceKind:
        """The job's accelerator (MESHRT_ACCELERATOR), DeviceKind.CPU when there is none."""
    def stream(self, name: str) -> Stream:
        """The stream name (created on first use)."""
    @property
    def default_stream(self) -> Stream: ...
    def fetch_shard(self, t: DTensor, /, preprocess: str | None = None, **coordinates: int) -> Future:
        """fetch_shard(t, dp=0, tp=1): a Future of t's local tensor at those coordinates."""
    def record(self, examples: Sequence[DTensor], body: Callable[..., Any]) -> Recording:
        """record([x], lambda x: ...): runs body once on formal tensors like the examples and keeps the
        commands it issues; the Recording replays them with one command. Fetches and synchronize
        inside are refused; tensors from outside are captured."""
    def synchronize(self, timeout: float | None = None) -> None:
        """Waits for all issued work; raises one RemoteError for the failures no Future reported."""
    def restart_workers(self) -> None:
        """Fresh worker loops: every mesh, tensor and stream made before is gone."""
    def release_cached_memory(self) -> int:
        """Frees the memory the workers keep cached; returns the bytes freed on all of them."""
    def dump_flight_recorder(self) -> str:
        """Every worker's last commands (also written to its log), rank by rank."""
    def write_trace(self, path: str | os.PathLike[str]) -> int:
        """Writes every rank's timeline recorded so far to `path` (Chrome-trace JSON, for
        Perfetto's UI or chrome://tracing); returns the events written. Does not wait for
        issued work."""
    def start_trace(self) -> None:
        """Waits for the work issued so far, then every rank starts recording its timeline
        (MESHRT_TRACE records the whole run)."""
    def stop_trace(self) -> None:
        """Waits for the work issued so far, then every rank stops recording its timeline."""
    def abort(self, reason: str) -> None:
        """Ends the whole job now (MPI_Abort), after telling the workers why."""
    @property
    def world_size(self) -> int: ...
    @property
    def worker_ranks(self) -> list[int]: ...
    def live_values(self, rank: int) -> int:
        """How many values rank's worker holds, as of its latest status."""
    def control_traffic(self) -> dict[str, dict[str, dict[str, int]]]:
        """The control messages and bytes sent and received so far, by kind."""

def run(
    main: Callable[[Controller], _T], *, dedicated_controller: bool = False, shutdown_timeout: float = 60.0
) -> _T | None:
    """Every rank calls it: rank 0 runs main(ctl) and returns its result, the others None."""

def rank() -> int:
    """This process's rank in the job (starts MPI if nothing has)."""

def world_size() -> int:
    """The number of ranks in the job (starts MPI if nothing has)."""

def world_rank() -> int:
    """This process's rank in MPI_COMM_WORLD (starts MPI if nothing has)."""

# ------------------------------------------------------------------ remote functions

class CallContext:
    """Where and on what a kernel runs: the first argument of a Python kernel."""

    @property
    def rank(self) -> int: ...
    @property
    def dim_names(self) -> tuple[str, ...]: ...
    @property
    def coordinates(self) -> tuple[int, ...]: ...
    @property
    def sizes(self) -> tuple[int, ...]: ...
    @property
    def device(self) -> Device: ...
    @property
    def stream_id(self) -> int: ...
    def coordinate(self, dim: str) -> int:
        """This rank's coordinate along mesh dimension dim."""
    def size(self, dim: str) -> int:
        """The mesh's size along dimension dim."""

class Signature:
    """What a call produces: its outputs' metas, and the tensor arguments it writes in place."""

    def __init__(
        self, outputs: TensorMeta | Sequence[TensorMeta] | None = (), mutates: Sequence[int] = ()
    ) -> None: ...
    @property
    def outputs(self) -> tuple[TensorMeta, ...]: ...
    @property
    def mutates(self) -> tuple[int, ...]: ...

def function(name: str, *, shape: Callable[..., Any], torch: bool = False) -> Callable[[_Kernel], _Kernel]:
    """Registers the decorated kernel as the remote function ``name``; returns it unchanged."""

# ------------------------------------------------------------------ groups

class StatelessGroup:
    """A group of ranks exchanging Python objects, without the controller."""

    @staticmethod
    def create(members: Sequence[int], timeout: float | None = None) -> StatelessGroup: ...
    @staticmethod
    def from_mpi4py(comm: Any, timeout: float | None = None) -> StatelessGroup:
        """The group of an mpi4py communicator's ranks."""
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def world_size(self) -> int:
        """The group's size (vLLM's name)."""
    @property
    def members(self) -> list[int]: ...
    @property
    def usable(self) -> bool:
        """False once a timeout or a failure mid-transfer has left messages in flight."""
    @property
    def timeout(self) -> float:
        """Every call's default timeout in seconds."""
    def send_obj(self, obj: Any, dst: int, timeout: float | None = None, *, allow_pickle: bool = False) -> None: ...
    def recv_obj(
        self, src: int, timeout: float | None = None, *, allow_pickle: bool = False, out: Any | None = None
    ) -> Any: ...
    def broadcast_obj(
        self, obj: Any, src: int, timeout: float | None = None, *, allow_pickle: bool = False, out: Any | None = None
    ) -> Any: ...
    def all_gather_obj(self, obj: Any, timeout: float | None = None, *, allow_pickle: bool = False) -> list[Any]: ...
    def barrier(self, timeout: float | None = None) -> None: ...
    def close(self) -> None:
        """Frees the group's communicator now (later calls raise)."""
    def __enter__(self) -> StatelessGroup: ...
    def __exit__(self, *args: Any) -> None: ...
