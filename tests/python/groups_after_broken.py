"""A group broken by a timeout, then smaller groups over the same ranks: what the broken
group left unreceived (its "broke the group" notices) must never reach the new groups.

Rank 0 leaves a broadcast it roots; the others time out in it and break the group. Then
every rank makes a pair group and gathers in it. Open MPI crashed in the new groups'
creation when the broken group's communicator was freed (its id reused); MPICH let the
notice break the new group at once."""
import sys

import meshrt

me, n = meshrt.rank(), meshrt.world_size()
try:
    with meshrt.StatelessGroup.create(list(range(n)), timeout=1) as world:
        world.all_gather_obj(me)
        if me != 0:
            world.broadcast_obj(None, 0)
except meshrt.TimeoutError:
    pass
base = me - me % 2
with meshrt.StatelessGroup.create([base, base + 1], timeout=10) as pair:
    got = pair.all_gather_obj(me)
if got != [base, base + 1]:
    sys.exit(f"rank {me}: the pair group gathered {got}, expected {[base, base + 1]}")
print(f"rank {me}: pair {got}", flush=True)
