"""meshrt: drive a whole MPI job from one Python program (docs/python.md).

Every rank runs the same script under ``mpiexec`` or ``srun`` and calls
``meshrt.run(main)``: rank 0 runs ``main(ctl)``, every rank runs a worker.
"""

import atexit as _atexit
import os as _os
import sys as _sys

# threading must first be imported on the main thread: the module that first imports it
# makes the importing thread its "main thread", and a worker thread importing it (numpy
# does, when a kernel first makes an array) leaves the interpreter's exit waiting for a
# thread that never ends.
import threading as _threading  # noqa: E402,F401

# Open MPI loads its components as plugins that resolve symbols of libmpi: libmpi (loaded
# with the extension module) must be global, as mpi4py makes it.
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | _os.RTLD_GLOBAL)
try:
    from . import _core
finally:
    _sys.setdlopenflags(_flags)

from ._core import *  # noqa: E402,F401,F403
from ._core import __version__  # noqa: E402,F401
from ._functions import function  # noqa: E402,F401
from ._futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, as_completed, wait  # noqa: E402,F401

_atexit.register(_core._shutdown)
