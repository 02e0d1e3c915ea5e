// shardtensor_bench: domain-parallel training / inference benchmarks, each
// against plain single-process libtorch on the same global input in the same
// job. Launch under mpirun; see `shardtensor_bench help` and bench/run.sh.
//
//   mpirun -np 2 shardtensor_bench run --workload unet2d --mode train --shape 256,256
//   mpirun -np 4 shardtensor_bench maxsize --workload unet2d --cap-mib 1024
//
// Measurements (rank 0 prints a table and appends JSON records to --out):
//  - step time: every timed step starts after a barrier; a step's time is the
//    slowest rank's; the median over --steps after --warmup steps is reported.
//  - peak tensor memory: shardtensor::memory_stats() (the library's tracking
//    CPU allocator), reset after the model, optimizer and inputs exist, so it
//    covers parameters, inputs, activations, gradients and optimizer state;
//    the max over ranks.
//  - traffic: comm_stats().bytes_sent per timed step, the max over ranks.
//  - comm_fraction: comm_stats().comm_seconds (time inside the transport's MPI
//    calls, waiting included) over the step time, averaged over ranks.
//  - baseline: rank 0 alone runs the same workload on plain tensors with a
//    given thread count while the other ranks sleep in a non-blocking barrier
//    (so they do not spin on the cores the baseline uses).
#include <mpi.h>
#include <shardtensor/shardtensor.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "json.h"

namespace st = shardtensor;

namespace bench {

std::map<std::string, Workload>& registry() {
  static std::map<std::string, Workload> r;
  return r;
}

namespace {

// ---- options ----------------------------------------------------------------

struct Options {
  std::string command;
  std::string workload = "unet2d";
  std::string mode = "train";
  Problem problem;
  std::vector<int64_t> mesh;  // empty: {world size}
  int threads = 1;
  std::vector<std::string> baseline_threads = {"1"};
  bool baseline = true;
  int warmup = 2;
  int steps = 5;
  std::string out;
  std::string scenario = "custom";
  double cap_bytes = 1024.0 * 1024 * 1024;
  int64_t start_size = 0;
  int64_t max_size = 1 << 16;
  int64_t seed = 0;
  double lr = 1e-3;
};

const char* kHelp = R"(shardtensor_bench COMMAND [flags]   (launch under mpirun; rank 0 reports)

Commands:
  run       time one configuration (sharded on all ranks, then the baseline on rank 0)
  maxsize   largest trainable global resolution under a per-rank tensor-memory cap
            (bisection over the resolution; the cap is checked against measured peaks)
  list      list the workloads
  help      this text

Flags (defaults in brackets):
  --workload NAME          conv_stack | unet2d | unet3d | attention (if built) [unet2d]
  --mode train|infer       train: forward + backward + SGD step, loss = mean(out^2);
                           infer: forward under NoGradGuard [train]
  --shape A,B[,C]          global spatial shape (attention: S) [workload default]
  --batch N  --in-channels N  --out-channels N  --base-channels N  --depth N
  --layers N (conv_stack)  --heads N  --head-dim N  --causal (attention)
  --norm none|group|batch  U-Net normalization [group]
  --mesh AxB               device mesh shape; mesh dim i shards spatial dim i [P]
  --threads N              intra-op threads per rank [1]
  --baseline-threads LIST  comma list of thread counts for the single-process
                           baseline; 'match' = min(P * threads, cores) [1]
  --no-baseline            skip the baseline
  --warmup N  --steps N    warm-up and timed steps [2, 5]
  --out FILE               append JSON records to this JSON array file
  --name NAME              same as --out <source tree>/bench/results/NAME.json
  --scenario LABEL         label stored in the records [custom]
  --cap-mib X              maxsize: per-rank tensor-memory cap in MiB [1024]
  --start-size N           maxsize: first resolution probed [auto]
  --max-size N             maxsize: never probe beyond this resolution [65536]
  --seed N  --lr X
)";

std::vector<std::string> split(const std::string& s, const std::string& seps) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (seps.find(c) != std::string::npos) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::vector<int64_t> int_list(const std::string& s) {
  std::vector<int64_t> out;
  for (const auto& p : split(s, ",x")) out.push_back(std::stoll(p));
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  TORCH_CHECK(argc >= 2, "usage: shardtensor_bench COMMAND [flags]; try 'help'");
  o.command = argv[1];
  bool shape_given = false;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    auto val = [&]() -> std::string {
      TORCH_CHECK(i + 1 < argc, "flag ", f, " needs a value");
      return argv[++i];
    };
    if (f == "--workload")
      o.workload = val();
    else if (f == "--mode")
      o.mode = val();
    else if (f == "--shape")
      o.problem.shape = int_list(val()), shape_given = true;
    else if (f == "--batch")
      o.problem.batch = std::stoll(val());
    else if (f == "--in-channels")
      o.problem.in_channels = std::stoll(val());
    else if (f == "--out-channels")
      o.problem.out_channels = std::stoll(val());
    else if (f == "--base-channels")
      o.problem.base_channels = std::stoll(val());
    else if (f == "--depth")
      o.problem.depth = std::stoll(val());
    else if (f == "--layers")
      o.problem.layers = std::stoll(val());
    else if (f == "--heads")
      o.problem.heads = std::stoll(val());
    else if (f == "--head-dim")
      o.problem.head_dim = std::stoll(val());
    else if (f == "--causal")
      o.problem.causal = true;
    else if (f == "--norm")
      o.problem.norm = val();
    else if (f == "--mesh")
      o.mesh = int_list(val());
    else if (f == "--threads")
      o.threads = std::stoi(val());
    else if (f == "--baseline-threads")
      o.baseline_threads = split(val(), ",");
    else if (f == "--no-baseline")
      o.baseline = false;
    else if (f == "--warmup")
      o.warmup = std::stoi(val());
    else if (f == "--steps")
      o.steps = std::stoi(val());
    else if (f == "--out")
      o.out = val();
    else if (f == "--name")
      o.out = std::string(SHARDTENSOR_BENCH_RESULTS_DIR) + "/" + val() + ".json";
    else if (f == "--scenario")
      o.scenario = val();
    else if (f == "--cap-mib")
      o.cap_bytes = std::stod(val()) * 1024.0 * 1024.0;
    else if (f == "--start-size")
      o.start_size = std::stoll(val());
    else if (f == "--max-size")
      o.max_size = std::stoll(val());
    else if (f == "--seed")
      o.seed = std::stoll(val());
    else if (f == "--lr")
      o.lr = std::stod(val());
    else
      TORCH_CHECK(false, "unknown flag ", f, "; try 'shardtensor_bench help'");
  }
  TORCH_CHECK(o.mode == "train" || o.mode == "infer", "--mode must be train or infer");
  TORCH_CHECK(o.steps >= 1 && o.warmup >= 0 && o.threads >= 1, "bad --steps/--warmup/--threads");
  if (o.command == "run" || o.command == "maxsize") {
    auto it = registry().find(o.workload);
    TORCH_CHECK(it != registry().end(), "unknown workload '", o.workload,
                "'; 'shardtensor_bench list' shows the built ones");
    if (!shape_given) o.problem.shape = it->second.default_shape;
  }
  return o;
}

// ---- inputs -------------------------------------------------------------------

/// This rank's piece of a deterministic global tensor: element at global
/// coordinates g is sin(sum_d c_d * g_d) with fixed c_d (salted per input), in
/// float32. Every element is computed by the same float operations in the
/// same order whatever the piece, so pieces and the full tensor agree bit for bit.
at::Tensor make_piece(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                      int salt) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor acc = at::zeros(sizes, opts);
  const int64_t nd = static_cast<int64_t>(sizes.size());
  for (int64_t d = 0; d < nd; ++d) {
    const double c = 0.0137 + 0.7071 * (d + 1) / (nd + 1) + 0.1234 * salt;
    std::vector<int64_t> view(nd, 1);
    view[d] = sizes[d];
    at::Tensor g = at::arange(offsets[d], offsets[d] + sizes[d], opts).mul_(c).view(view);
    acc.add_(g);
  }
  return acc.sin_();
}

std::vector<at::Tensor> make_inputs(const Instance& inst, const st::DeviceMesh* mesh) {
  std::vector<at::Tensor> xs;
  int salt = 0;
  for (const auto& in : inst.inputs) {
    at::Tensor x;
    if (mesh == nullptr) {
      x = make_piece(std::vector<int64_t>(in.global_shape.size(), 0), in.global_shape, salt);
      if (in.requires_grad) x.requires_grad_(true);
    } else {
      st::Placements pl;
      for (int64_t m = 0; m < mesh->ndim(); ++m) {
        TORCH_CHECK(m < static_cast<int64_t>(in.shard_dims.size()),
                    "the mesh has more dims than the workload has shardable dims");
        pl.push_back(st::Shard{in.shard_dims[m]});
      }
      auto spec = std::make_shared<const st::ShardSpec>(*mesh, pl, in.global_shape);
      at::Tensor local = make_piece(spec->local_offsets(), spec->local_shape(), salt);
      if (in.requires_grad) local.requires_grad_(true);
      x = st::ShardTensor::from_local_unchecked(local, spec);
    }
    xs.push_back(x);
    ++salt;
  }
  return xs;
}

// ---- one measurement -------------------------------------------------------------

struct Measurement {
  std::vector<double> step_s;       // per timed step (sharded: the slowest rank's)
  int64_t peak_bytes = 0;           // sharded: max over ranks
  int64_t peak_bytes_min = 0;       // sharded: min over ranks
  int64_t bytes_sent_per_step = 0;  // max over ranks
  int64_t messages_per_step = 0;    // max over ranks
  double comm_fraction = 0;         // mean over ranks
  double comm_fraction_max = 0;
  double loss = std::nan("");  // mean(out^2) at the first step, before any update
};

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs warm-up and timed steps. `mesh` null: plain libtorch on this process only.
Measurement measure(const Options& o, const Problem& problem, const st::DeviceMesh* mesh,
                    int warmup, int steps) {
  const Workload& wl = registry().at(o.workload);
  const bool train = o.mode == "train";
  Measurement m;
  torch::manual_seed(o.seed);
  Instance inst = wl.make(problem);
  if (mesh != nullptr && inst.module) st::distribute_module(*inst.module, *mesh);
  if (inst.module) inst.module->train(train);
  std::vector<at::Tensor> xs = make_inputs(inst, mesh);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (train) {
    std::vector<at::Tensor> params;
    if (inst.module) params = inst.module->parameters();
    for (size_t i = 0; i < xs.size(); ++i) {
      if (inst.inputs[i].requires_grad) {
        params.push_back(mesh ? st::ShardTensor(xs[i]).local() : xs[i]);
      }
    }
    TORCH_CHECK(!params.empty(), "workload ", o.workload, " has nothing to train");
    opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(0.9));
  }

  auto step = [&](bool want_loss) -> double {
    if (train) {
      opt->zero_grad();
      at::Tensor out = inst.forward(xs);
      at::Tensor loss = out.pow(2).mean();  // a global mean: plain and replicated when sharded
      loss.backward();
      opt->step();
      return want_loss ? loss.item<double>() : 0.0;
    }
    torch::NoGradGuard no_grad;
    at::Tensor out = inst.forward(xs);
    return want_loss ? out.pow(2).mean().item<double>() : 0.0;
  };

  MPI_Comm world = MPI_COMM_WORLD;
  st::reset_peak_memory_stats();
  for (int i = 0; i < warmup; ++i) {
    const double l = step(i == 0);
    if (i == 0) m.loss = l;
  }
  st::reset_comm_stats();
  std::vector<double> local(steps);
  double local_total = 0;
  for (int i = 0; i < steps; ++i) {
    if (mesh) MPI_Barrier(world);
    const double t0 = now_s();
    const double l = step(warmup == 0 && i == 0);
    local[i] = now_s() - t0;
    local_total += local[i];
    if (warmup == 0 && i == 0) m.loss = l;
  }
  const st::CommStats cs = st::comm_stats();
  const st::MemoryStats ms = st::memory_stats();
  m.step_s = local;
  m.peak_bytes = m.peak_bytes_min = ms.peak_bytes;
  m.bytes_sent_per_step = cs.bytes_sent / steps;
  m.messages_per_step = cs.messages / steps;
  const double frac = local_total > 0 ? cs.comm_seconds / local_total : 0.0;
  m.comm_fraction = m.comm_fraction_max = frac;
  if (mesh) {
    MPI_Allreduce(MPI_IN_PLACE, m.step_s.data(), steps, MPI_DOUBLE, MPI_MAX, world);
    int64_t v[3] = {m.peak_bytes, m.bytes_sent_per_step, m.messages_per_step};
    MPI_Allreduce(MPI_IN_PLACE, v, 3, MPI_INT64_T, MPI_MAX, world);
    m.peak_bytes = v[0];
    m.bytes_sent_per_step = v[1];
    m.messages_per_step = v[2];
    MPI_Allreduce(MPI_IN_PLACE, &m.peak_bytes_min, 1, MPI_INT64_T, MPI_MIN, world);
    double f[2] = {frac, frac};
    MPI_Allreduce(MPI_IN_PLACE, &f[0], 1, MPI_DOUBLE, MPI_SUM, world);
    MPI_Allreduce(MPI_IN_PLACE, &f[1], 1, MPI_DOUBLE, MPI_MAX, world);
    int size = 1;
    MPI_Comm_size(world, &size);
    m.comm_fraction = f[0] / size;
    m.comm_fraction_max = f[1];
  }
  return m;
}

/// Every rank but 0 sleeps in a non-blocking barrier while rank 0 runs `fn`.
template <typename Fn>
void on_root_others_sleep(Fn fn) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::exception_ptr error;
  if (rank == 0) {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  }
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  int done = 0;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (error) std::rethrow_exception(error);
}

int hardware_cores() {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string mib(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << bytes / (1024.0 * 1024.0);
  return s.str();
}

std::string fixed(double v, int prec) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream s;
  s << std::fixed << std::setprecision(prec) << v;
  return s.str();
}

std::string join(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

JsonRecord common_fields(const Options& o, const Problem& p, const Instance& shape_of,
                         const std::vector<int64_t>& mesh_shape, int ranks) {
  JsonRecord r;
  r.str("scenario", o.scenario)
      .str("workload", o.workload)
      .str("mode", o.mode)
      .num("ranks", ranks)
      .num("threads_per_rank", o.threads)
      .array("mesh", mesh_shape)
      .array("global_shape", shape_of.inputs.at(0).global_shape)
      .array("spatial_shape", p.shape);
  if (o.workload.rfind("unet", 0) == 0) r.str("norm", p.norm).num("depth", p.depth);
  if (o.workload != "attention") r.num("base_channels", p.base_channels);
  r.num("warmup", o.warmup).num("steps", o.steps).num("cores", hardware_cores());
  // The machine's 1-minute load average when the record is written: timings
  // taken while others use the cores are noisy, and this says so.
  double load = std::nan("");
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = std::nan("");
    std::fclose(f);
  }
  r.num("loadavg_1min", load);
  return r;
}

std::vector<int64_t> mesh_shape_of(const Options& o, int world) {
  return o.mesh.empty() ? std::vector<int64_t>{world} : o.mesh;
}

void write(const Options& o, const std::vector<JsonRecord>& recs) {
  if (o.out.empty()) return;
  append_records(o.out, recs);
  std::cout << "appended " << recs.size() << " record(s) to " << o.out << std::endl;
}

// ---- run ---------------------------------------------------------------------------

int cmd_run(const Options& o) {
  const int rank = st::world_rank(), world = st::world_size();
  const auto mesh_shape = mesh_shape_of(o, world);
  auto mesh = st::DeviceMesh::create(mesh_shape);
  at::set_num_threads(o.threads);
  const Workload& wl = registry().at(o.workload);
  for (int64_t s : o.problem.shape) {
    TORCH_CHECK(s % wl.size_multiple(o.problem) == 0, o.workload, ": every spatial size must be a",
                " multiple of ", wl.size_multiple(o.problem));
  }

  const Measurement sh = measure(o, o.problem, &mesh, o.warmup, o.steps);

  struct Base {
    int threads;
    std::string rule;
    Measurement m;
  };
  std::vector<Base> bases;
  if (o.baseline) {
    for (const auto& b : o.baseline_threads) {
      const int n = b == "match" ? std::min(world * o.threads, hardware_cores()) : std::stoi(b);
      // 'match' at P x threads = 1 (or equal to a listed count) would repeat a baseline.
      bool dup = false;
      for (const auto& e : bases) dup = dup || e.threads == n;
      if (!dup) bases.push_back({n, b == "match" ? "match" : "fixed", {}});
    }
    on_root_others_sleep([&] {
      for (auto& b : bases) {
        at::set_num_threads(b.threads);
        b.m = measure(o, o.problem, nullptr, o.warmup, o.steps);
      }
      at::set_num_threads(o.threads);
    });
  }
  if (rank != 0) return 0;

  torch::manual_seed(o.seed);
  const Instance shape_of = wl.make(o.problem);
  const double step = median(sh.step_s);
  std::vector<JsonRecord> recs;
  auto base_record = [&](const Base* b) {
    JsonRecord r = common_fields(o, o.problem, shape_of, mesh_shape, world);
    r.num("peak_bytes_per_rank", sh.peak_bytes)
        .num("peak_bytes_per_rank_min", sh.peak_bytes_min)
        .num("step_s_median", step)
        .num("step_s_min", *std::min_element(sh.step_s.begin(), sh.step_s.end()))
        .num("bytes_sent_per_rank", sh.bytes_sent_per_step)
        .num("messages_per_rank", sh.messages_per_step)
        .num("comm_fraction", sh.comm_fraction)
        .num("comm_fraction_max", sh.comm_fraction_max)
        .num("loss", sh.loss);
    if (b) {
      const double bstep = median(b->m.step_s);
      const double speedup = bstep / step;
      r.num("baseline_peak_bytes", b->m.peak_bytes)
          .num("memory_ratio",
               static_cast<double>(sh.peak_bytes) / (static_cast<double>(b->m.peak_bytes) / world))
          .num("baseline_step_s_median", bstep)
          .num("baseline_threads", b->threads)
          .str("baseline_threads_rule", b->rule)
          .num("speedup", speedup)
          .num("efficiency", speedup * b->threads / (world * o.threads))
          .num("baseline_loss", b->m.loss)
          .num("loss_rel_diff",
               std::abs(sh.loss - b->m.loss) / std::max(std::abs(b->m.loss), 1e-30));
    } else {
      r.raw("baseline_peak_bytes", "null")
          .raw("memory_ratio", "null")
          .raw("baseline_step_s_median", "null")
          .raw("baseline_threads", "null")
          .raw("speedup", "null");
    }
    r.str("date", utc_now());
    recs.push_back(r);
  };
  if (bases.empty()) base_record(nullptr);
  for (const auto& b : bases) base_record(&b);

  std::cout << "\n"
            << o.workload << " " << o.mode << " shape [" << join(o.problem.shape, "x") << "] on "
            << world << " rank(s) x " << o.threads << " thread(s), mesh [" << join(mesh_shape, "x")
            << "], median of " << o.steps << " after " << o.warmup << " warm-up (scenario "
            << o.scenario << ")\n";
  std::cout << std::left << std::setw(22) << "" << std::right << std::setw(12) << "step s"
            << std::setw(14) << "peak MiB/rk" << std::setw(12) << "sent MiB" << std::setw(8)
            << "comm%" << std::setw(14) << "loss" << std::setw(9) << "speedup" << std::setw(10)
            << "mem ratio"
            << "\n";
  std::cout << std::left << std::setw(22) << ("shardtensor P=" + std::to_string(world))
            << std::right << std::setw(12) << fixed(step, 4) << std::setw(14) << mib(sh.peak_bytes)
            << std::setw(12) << mib(sh.bytes_sent_per_step) << std::setw(8)
            << fixed(100 * sh.comm_fraction, 1) << std::setw(14) << fixed(sh.loss, 6) << "\n";
  for (const auto& b : bases) {
    const double bstep = median(b.m.step_s);
    std::cout << std::left << std::setw(22) << ("libtorch " + std::to_string(b.threads) + " thr")
              << std::right << std::setw(12) << fixed(bstep, 4) << std::setw(14)
              << mib(b.m.peak_bytes) << std::setw(12) << "-" << std::setw(8) << "-" << std::setw(14)
              << fixed(b.m.loss, 6) << std::setw(9) << fixed(bstep / step, 2) << std::setw(10)
              << fixed(static_cast<double>(sh.peak_bytes) / (b.m.peak_bytes / double(world)), 2)
              << "\n";
  }
  std::cout.flush();
  write(o, recs);
  return 0;
}

// ---- maxsize -----------------------------------------------------------------------

int64_t round_down(double v, int64_t q) {
  return std::max<int64_t>(q, static_cast<int64_t>(std::floor(v / q)) * q);
}

int cmd_maxsize(const Options& o) {
  TORCH_CHECK(o.mode == "train", "maxsize measures training (--mode train)");
  const int rank = st::world_rank(), world = st::world_size();
  const auto mesh_shape = mesh_shape_of(o, world);
  auto mesh = st::DeviceMesh::create(mesh_shape);
  at::set_num_threads(o.threads);
  const Workload& wl = registry().at(o.workload);
  int64_t parts = 1;
  for (int64_t e : mesh_shape) parts *= e;
  // Resolutions are multiples of q: divisible by the workload's multiple on every piece.
  const int64_t q = wl.size_multiple(o.problem) * parts;
  const int D = static_cast<int>(o.problem.shape.size());
  const double cap = o.cap_bytes;

  struct Probe {
    int64_t size;
    int64_t peak;
    double step_s;
  };
  std::vector<Probe> probes;
  auto probe = [&](int64_t s) {
    Problem p = o.problem;
    p.shape.assign(D, s);
    // One warm-up step (creates the optimizer state) and one measured step.
    const Measurement m = measure(o, p, &mesh, 1, 1);
    probes.push_back({s, m.peak_bytes, m.step_s[0]});
    if (rank == 0) {
      std::cout << "  probe " << s << "^" << D << ": peak " << mib(m.peak_bytes)
                << " MiB/rank, step " << fixed(m.step_s[0], 3) << " s ("
                << (m.peak_bytes <= cap ? "fits" : "over the cap") << ")" << std::endl;
    }
    return m.peak_bytes;
  };
  if (rank == 0) {
    std::cout << o.workload << " train: largest " << D << "-d resolution (multiple of " << q
              << ") with peak tensor memory <= " << mib(cap) << " MiB per rank, P = " << world
              << std::endl;
  }

  // Peak ~ a + b * s^D. Extrapolate from the measurements below the cap (two
  // points: fit a and b; one point: a = 0, which underestimates s, so probes
  // stay below the cap), grow at most 2x per probe, and bisect once bracketed.
  int64_t lo = 0, hi = 0;  // largest fitting / smallest failing size (0 = none yet)
  int64_t s =
      o.start_size > 0 ? round_down(o.start_size, q) : round_down(std::max<int64_t>(q, 64), q);
  for (int iter = 0; iter < 40; ++iter) {
    const int64_t peak = probe(s);
    if (peak <= cap)
      lo = std::max(lo, s);
    else
      hi = hi == 0 ? s : std::min(hi, s);
    if (hi != 0 && hi - lo <= q) break;
    if (lo >= o.max_size) break;
    int64_t next;
    if (hi == 0) {
      // Fit on the two largest fitting probes.
      std::vector<Probe> fit;
      for (const auto& pr : probes)
        if (pr.peak <= cap) fit.push_back(pr);
      std::sort(fit.begin(), fit.end(), [](auto& a, auto& b) { return a.size < b.size; });
      double est;
      const Probe& p1 = fit.back();
      if (fit.size() >= 2) {
        const Probe& p0 = fit[fit.size() - 2];
        const double b = (p1.peak - p0.peak) / (std::pow(p1.size, D) - std::pow(p0.size, D));
        const double a = p1.peak - b * std::pow(p1.size, D);
        est = b > 0 ? std::pow((cap - a) / b, 1.0 / D) : 2.0 * p1.size;
      } else {
        est = p1.size * std::pow(cap / std::max<double>(p1.peak, 1), 1.0 / D);
      }
      next = std::min(round_down(est, q), 2 * lo);
      if (next <= lo) next = lo + q;
      next = std::min(next, round_down(o.max_size, q));
      if (next <= lo) break;
    } else if (lo == 0) {
      next = round_down(s * std::pow(cap / static_cast<double>(peak), 1.0 / D) * 0.97, q);
      if (next >= hi) next = hi - q;
      if (next < q) break;
    } else {
      next = lo + round_down((hi - lo) / 2.0, q);
      if (next <= lo || next >= hi) break;
    }
    s = next;
  }
  if (rank != 0) return 0;
  const Probe* best = nullptr;
  for (const auto& pr : probes)
    if (pr.size == lo) best = &pr;
  Problem p = o.problem;
  p.shape.assign(D, std::max<int64_t>(lo, q));
  torch::manual_seed(o.seed);
  const Instance shape_of = wl.make(p);
  Options probe_options = o;  // every probe: one warm-up step and one measured step
  probe_options.warmup = 1;
  probe_options.steps = 1;
  JsonRecord r = common_fields(probe_options, p, shape_of, mesh_shape, world);
  std::string probe_json = "[";
  for (size_t i = 0; i < probes.size(); ++i) {
    probe_json += (i ? "," : "") + std::string("[") + std::to_string(probes[i].size) + "," +
                  std::to_string(probes[i].peak) + "]";
  }
  probe_json += "]";
  int64_t points = 1;
  for (int d = 0; d < D; ++d) points *= lo;
  r.num("cap_bytes", static_cast<int64_t>(cap))
      .num("max_size", lo)
      .num("max_points", lo > 0 ? points : int64_t{0})
      .num("size_quantum", q)
      .num("failing_size", hi)
      .num("peak_bytes_per_rank", best ? best->peak : int64_t{0})
      .num("step_s_median", best ? std::optional<double>(best->step_s) : std::nullopt)
      .raw("probes", probe_json)
      .str("date", utc_now());
  std::cout << "largest trainable: " << lo << "^" << D << " (" << points
            << " points) at P = " << world << "; " << hi << "^" << D
            << (hi ? " exceeds the cap" : " not reached") << std::endl;
  write(o, {r});
  return 0;
}

int cmd_list() {
  if (st::world_rank() == 0) {
    for (const auto& [name, w] : registry()) {
      std::cout << std::left << std::setw(12) << name << " " << w.description << " (default shape "
                << join(w.default_shape, "x") << ")\n";
    }
  }
  return 0;
}

}  // namespace
}  // namespace bench

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  try {
    const bench::Options o = bench::parse(argc, argv);
    if (o.command == "run") return bench::cmd_run(o);
    if (o.command == "maxsize") return bench::cmd_maxsize(o);
    if (o.command == "list") return bench::cmd_list();
    if (o.command == "help" || o.command == "--help") {
      if (st::world_rank() == 0) std::cout << bench::kHelp;
      return 0;
    }
    TORCH_CHECK(false, "unknown command '", o.command, "'; try 'shardtensor_bench help'");
  } catch (const std::exception& e) {
    std::cerr << "[rank " << st::world_rank() << "] shardtensor_bench: " << e.what() << std::endl;
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
