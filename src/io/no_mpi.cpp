// The io/ functions of a c10d-only build (Note [c10d-only build] in
// shardtensor/core/comm.h): parallel HDF5 reads and writes through MPI-IO,
// so without MPI each of them raises one clear error on every rank that calls
// it (the check is local and the same everywhere, so no rank is left in a
// collective). Compiled instead of hdf5.cpp and checkpoint.cpp when
// SHARDTENSOR_WITH_MPI is OFF.
#include <shardtensor/io/checkpoint.h>
#include <shardtensor/io/hdf5.h>

#include <string>

namespace shardtensor::io {

namespace {

[[noreturn]] void unavailable(const char* fn, const std::string& what) {
  TORCH_CHECK(false, "shardtensor::io::", fn, "(", what,
              "): this shardtensor was built without MPI (SHARDTENSOR_WITH_MPI=OFF, a c10d-only "
              "build), and its HDF5 reader and writer need parallel HDF5, which runs on MPI-IO. "
              "Rebuild with SHARDTENSOR_WITH_MPI=ON and a parallel HDF5 (Debian: "
              "libhdf5-openmpi-dev) to read or write HDF5 files and checkpoints");
}

}  // namespace

at::Tensor read_hdf5(const std::string& path, const std::string& dataset, const DeviceMesh&,
                     Placements, const ReadOptions&) {
  unavailable("read_hdf5", path + ", " + dataset);
}

HaloRead read_hdf5_with_halo(const std::string& path, const std::string& dataset, const DeviceMesh&,
                             Placements, const ReadOptions&) {
  unavailable("read_hdf5_with_halo", path + ", " + dataset);
}

void write_hdf5(const std::string& path, const std::string& dataset, const at::Tensor&,
                const WriteOptions&) {
  unavailable("write_hdf5", path + ", " + dataset);
}

DatasetInfo read_hdf5_info(const std::string& path, const std::string& dataset, const DeviceMesh&) {
  unavailable("read_hdf5_info", path + ", " + dataset);
}

void save_checkpoint(const std::string& dir, const DeviceMesh&, const CheckpointState&) {
  unavailable("save_checkpoint", dir);
}

LoadedCheckpoint load_checkpoint(const std::string& dir, const DeviceMesh&, const LoadOptions&) {
  unavailable("load_checkpoint", dir);
}

NamedTensors fully_shard_tensors(torch::nn::Module&, const DeviceMesh&, torch::optim::Optimizer*) {
  unavailable("fully_shard_tensors", "a module");
}

TensorLayouts fully_shard_layouts(torch::nn::Module&, const DeviceMesh&, torch::optim::Optimizer*) {
  unavailable("fully_shard_layouts", "a module");
}

void load_fully_shard_tensors(const LoadedCheckpoint&, torch::nn::Module&,
                              torch::optim::Optimizer*) {
  unavailable("load_fully_shard_tensors", "a checkpoint");
}

bool checkpoint_exists(const std::string& dir) { unavailable("checkpoint_exists", dir); }

}  // namespace shardtensor::io
