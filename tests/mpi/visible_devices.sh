#!/usr/bin/env bash
# Runs "$@" as a rank that sees one emulated device, the layout slurm/meshrt.sbatch gives
# GPUs with GPU_PER_RANK=1 (CUDA_VISIBLE_DEVICES=<one GPU> per rank): with "own" the node's
# device <local rank>, with "shared" the node's device 1 on every rank. Either way each
# rank's device index is 0.
#   visible_devices.sh own|shared PROGRAM [ARGS...]   (under mpiexec or srun)
set -euo pipefail
mode=$1
shift
case "$mode" in
  own)
    # Open MPI's mpiexec, MPICH's (Hydra) or srun says which local rank this is.
    local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-}}}
    if [ -z "$local_rank" ]; then
      echo "visible_devices.sh: expected a local rank from the launcher, found none of OMPI_COMM_WORLD_LOCAL_RANK," \
        "MPI_LOCALRANKID, SLURM_LOCALID set" >&2
      exit 2
    fi
    export MESHRT_EMULATED_VISIBLE_DEVICES="$local_rank"
    ;;
  shared) export MESHRT_EMULATED_VISIBLE_DEVICES=1 ;;
  *)
    echo "visible_devices.sh: expected own or shared, found '$mode'" >&2
    exit 2
    ;;
esac
exec "$@"
