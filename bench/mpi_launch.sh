# Sourced by bench/run.sh and bench/run_io.sh (needs MPIRUN, run from the repo root).
# This Open MPI's flags and variables (4.1 or 5.0), from cmake/MpiLaunch.cmake (Note [Open MPI
# 4.1 and 5.0 spellings]); MPIRUN_FLAGS and variables already set win. Without cmake: 4.1's
# (5.0's mpirun accepts them too). Sets MPIRUN_FLAGS and the array MPIRUN_ARGS.
mpi_version="" mpi_flags=() mpi_env=()
for w in $(cmake -DMPIEXEC_EXECUTABLE="$MPIRUN" -DSHARDTENSOR_MPI_PRINT=words \
  -P cmake/MpiLaunch.cmake 2>/dev/null); do
  case $w in
    version=*) mpi_version=${w#version=} ;;
    flag=*) mpi_flags+=("${w#flag=}") ;;
    env=*) mpi_env+=("${w#env=}") ;;
  esac
done
if [ -z "$mpi_version" ]; then
  mpi_flags=(--oversubscribe --bind-to none) mpi_env=(OMPI_MCA_btl_vader_single_copy_mechanism=none)
fi
for kv in "${mpi_env[@]}"; do  # single copy off (containers), in this version's spelling
  name=${kv%%=*}
  [ -n "${!name:-}" ] || export "$kv"
done
MPIRUN_FLAGS=${MPIRUN_FLAGS-${mpi_flags[*]}}
read -r -a MPIRUN_ARGS <<<"$MPIRUN_FLAGS"
