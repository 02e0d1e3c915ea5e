#pragma once
/// \file The wait board: a key-value store beside MPI on which ranks post their
/// long waits, so that a watchdog that expires in an MPI collective can name
/// the ranks that never joined it (Note [flight recorder] in
/// comm/flight_recorder.h). Private to the library: started by init(), read
/// and written only by comm/flight_recorder.cpp.

namespace c10d {
class Store;
}

namespace shardtensor::detail::board {

/// Collective over MPI_COMM_WORLD (init() calls it under the MPI transport,
/// before any user collective; a no-op in a c10d-only build and on a second
/// call). World rank 0 serves a c10d TCPStore on a port the system picks, and
/// MPI_Bcast's its host (the processor name; 127.0.0.1 for ranks on the same
/// host) and port; every rank connects (5 s bound) and posts an empty wait
/// under "wait/<world rank>". An MPI_Allreduce agrees on the outcome: either
/// every rank has the board or none has (then store() is null and the
/// watchdog keeps its old wording). SHARDTENSOR_WAIT_BOARD=0 disables it (set
/// it alike on every rank). Never throws.
void start() noexcept;

/// Local. The board (store operations bounded by 2 s), or nullptr when it is
/// not up. Valid for the rest of the process (never torn down).
::c10d::Store* store() noexcept;

}  // namespace shardtensor::detail::board
