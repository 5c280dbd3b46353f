"""meshrt.run called on rank 0 only (an 'if' on the rank around it): rank 0 must not wait
for ever at start. With MESHRT_START_TIMEOUT set short, rank 0 names rank 1 and ends the
job; rank 1 meanwhile waits in its own code, as a program that forgot it would."""
import time

import meshrt

if meshrt.rank() == 0:
    meshrt.run(lambda ctl: None)
else:
    time.sleep(60)
