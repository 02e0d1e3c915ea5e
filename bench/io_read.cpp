// shardtensor_bench_io: read throughput of a sharded HDF5 field.
//
//   mpirun -np P shardtensor_bench_io --shape 4096,4096 [--repeats 5] [--file PATH] [--out F.json]
//
// 1. The field (float32, the given 2-D or 3-D shape) is written once,
//    collectively, by the P ranks (io::write_hdf5 of a Shard(0) tensor).
// 2. Baseline, same run: mesh rank 0 alone reads the whole dataset
//    sequentially (a one-rank mesh over MPI_COMM_SELF, one H5Dread).
// 3. Sharded: every rank reads its Shard(0) hyperslab (io::read_hdf5,
//    collective MPI-IO, and independent), between barriers.
// Prints, and appends one record to the JSON array in --out: median seconds,
// bytes per rank (io_stats), per-rank and aggregate GB/s.
// The file is in the page cache after the write (the machine's disk is not
// measured, only HDF5 + MPI-IO + memory); the load average is recorded.
#include <ATen/ATen.h>
#include <mpi.h>
#include <shardtensor/shardtensor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "results.h"
#include "tool.h"

namespace st = shardtensor;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double max_all(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

/// Median over `repeats` of the slowest rank's time for `fn` (between barriers).
double time_it(int repeats, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = std::chrono::steady_clock::now();
    fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.push_back(max_all(s));
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  std::string shape_arg = "4096,4096";
  int repeats = 5;
  std::string file = "/tmp/shardtensor_bench_io.h5", out;
  CLI::App app{"shardtensor_bench_io: read throughput of a sharded HDF5 field",
               "shardtensor_bench_io"};
  app.add_option("--shape", shape_arg, "global shape, 2-D or 3-D, comma separated")
      ->capture_default_str();
  app.add_option("--repeats", repeats, "timed reads of each kind")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--file", file, "scratch HDF5 file (removed at the end)")->capture_default_str();
  app.add_option("--out", out, "append one JSON record to this JSON array file");
  if (auto rc = bench::parse_command_line(app, argc, argv, "shardtensor_bench_io")) return *rc;
  std::vector<int64_t> shape;
  {
    std::stringstream ss(shape_arg);
    std::string x;
    while (std::getline(ss, x, ',')) shape.push_back(std::stoll(x));
  }
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const int P = static_cast<int>(mesh.size());
  const bool root = mesh.rank() == 0;
  int64_t numel = 1;
  for (auto s : shape) numel *= s;
  const double total_bytes = 4.0 * static_cast<double>(numel);

  {  // Write the field collectively: every rank makes only its own rows.
    st::ShardSpec spec(mesh, {st::Shard{0}}, shape);
    auto local = at::rand(spec.local_shape(), at::TensorOptions().dtype(at::kFloat));
    auto t = st::ShardTensor::from_local(local, mesh, {st::Shard{0}});
    st::io::write_hdf5(file, "field", t, st::io::WriteOptions().truncate(true));
  }
  const std::string load_before = bench::load_average();

  // Baseline: rank 0 alone reads the whole dataset.
  double seq_s = 0;
  {
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      if (root) {
        auto self = st::DeviceMesh::create({1}, {}, MPI_COMM_SELF);
        auto t0 = std::chrono::steady_clock::now();
        auto whole = st::io::read_hdf5(file, "field", self, {st::Replicate{}});
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    if (root) seq_s = median(t);
  }

  auto sharded = [&](st::io::Transfer mode) {
    st::reset_io_stats();
    const double s = time_it(repeats, [&] {
      auto x = st::io::read_hdf5(file, "field", mesh, {st::Shard{0}},
                                 st::io::ReadOptions().transfer(mode));
    });
    const double bytes = static_cast<double>(st::io_stats().bytes_read) / repeats;
    return std::make_pair(s, bytes);
  };
  auto [coll_s, coll_bytes] = sharded(st::io::Transfer::Collective);
  auto [ind_s, ind_bytes] = sharded(st::io::Transfer::Independent);
  const double coll_bytes_max = max_all(coll_bytes);
  const std::string load_after = bench::load_average();

  if (root) {
    std::string sh;
    for (size_t i = 0; i < shape.size(); ++i) sh += (i ? "x" : "") + std::to_string(shape[i]);
    std::printf(
        "io read %s float32 (%.1f MB), P=%d: sequential whole-file read on rank 0 %.4f s "
        "(%.2f GB/s); sharded collective %.4f s (%.2f GB/s aggregate, %.2f GB/s per rank, "
        "%.1f MB max per rank); sharded independent %.4f s (%.2f GB/s aggregate); "
        "load %s -> %s\n",
        sh.c_str(), total_bytes / 1e6, P, seq_s, total_bytes / seq_s / 1e9, coll_s,
        total_bytes / coll_s / 1e9, coll_bytes_max / coll_s / 1e9, coll_bytes_max / 1e6, ind_s,
        total_bytes / ind_s / 1e9, load_before.c_str(), load_after.c_str());
    if (!out.empty()) {
      bench::Json r;
      r["scenario"] = "io";
      r["shape"] = sh;
      r["np"] = P;
      r["bytes"] = total_bytes;
      r["sequential_s"] = seq_s;
      r["collective_s"] = coll_s;
      r["independent_s"] = ind_s;
      r["bytes_per_rank_max"] = coll_bytes_max;
      r["load_before"] = load_before;
      r["load_after"] = load_after;
      bench::append_records(out, {r});
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (root) std::remove(file.c_str());
  return 0;
}
