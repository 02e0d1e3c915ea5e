#pragma once
/// \file The MPI types held by the transport seam's in-flight objects
/// (transport.h). A c10d-only build (Note [c10d-only build] in
/// shardtensor/core/comm.h) makes no MPI request, so there they are inert
/// placeholders that stay null or empty.

#include <shardtensor/core/comm.h>

#include <cstddef>

namespace shardtensor::comm::transport {

#if SHARDTENSOR_WITH_MPI
using MpiRequest = MPI_Request;
using MpiStatus = MPI_Status;
using MpiDatatype = MPI_Datatype;
using MpiAint = MPI_Aint;
inline MpiRequest null_request() { return MPI_REQUEST_NULL; }
#else
struct MpiRequestObject;
using MpiRequest = MpiRequestObject*;
struct MpiStatus {};
using MpiDatatype = void*;
using MpiAint = std::ptrdiff_t;
inline MpiRequest null_request() { return nullptr; }
#endif

}  // namespace shardtensor::comm::transport
