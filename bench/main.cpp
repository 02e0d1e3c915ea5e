// shardtensor_bench: domain-parallel training / inference benchmarks, each
// against plain single-process libtorch on the same global input in the same
// job. Launch under mpirun; see `shardtensor_bench help` and bench/run.sh.
//
//   mpirun -np 2 shardtensor_bench run --workload unet2d --mode train --shape 256,256
//   mpirun -np 4 shardtensor_bench maxsize --workload unet2d --cap-mib 1024
//   mpirun -np 2 shardtensor_bench profile --workload unet2d --shape 512,512
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
//    (so they do not spin on the cores the baseline uses), on the union of the
//    ranks' CPUs, before and after the sharded run (Note [baseline honesty]).
//  - every record: each rank's CPU affinity, the mpirun flags, the thread
//    settings, the load, and per rank and step: messages, bytes, CPU seconds,
//    host seconds outside MPI, the dispatcher's counters (Note [scale counters]).
//  - profile: per-op times of the sharded and the plain run (Note [bench profile]).
#include <ATen/Context.h>
#include <ATen/Version.h>
#include <mpi.h>
#include <sched.h>
#include <shardtensor/dispatch/stats.h>
#include <shardtensor/shardtensor.h>
#include <torch/version.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bench.h"
#include "ops/registry.h"
#include "results.h"

namespace st = shardtensor;

namespace bench {

std::map<std::string, Workload>& registry() {
  static std::map<std::string, Workload> r;
  return r;
}

namespace {

/// NaN (no value) is written as null.
Json num_or_null(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

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
  int top = 40;  // profile: table rows
  std::string baseline_order = "sandwich";
};

const char* kCommands = R"(Commands:
  run       time one configuration (sharded on all ranks, then the baseline on rank 0)
  maxsize   largest trainable global resolution under a per-rank tensor-memory cap
            (bisection over the resolution; the cap is checked against measured peaks)
  profile   per-op forward and backward time and bytes of the sharded run and of the
            plain run of the same workload in the same job, sorted by the difference,
            and the host time spent at the dispatcher boundary (rule lookup)
  list      list the workloads
  help      this text
)";

/// "512,512", "512x512" -> {512, 512}.
std::vector<int64_t> int_list(const std::string& s) {
  std::vector<int64_t> out;
  std::string cur;
  for (const char c : s + ",") {
    if (c == ',' || c == 'x') {
      if (!cur.empty()) out.push_back(std::stoll(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

std::vector<std::string> comma_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

/// The command line, parsed by CLI11 (flag names are the bench's public
/// interface: bench/run.sh, tests/bench_smoke.cmake and docs call them).
struct Cli {
  CLI::App app{
      "shardtensor_bench: domain-parallel benchmarks against plain libtorch "
      "(launch under mpirun; rank 0 reports)",
      "shardtensor_bench"};
  Options o;
  std::string shape, mesh, baseline_threads = "1", name;
  double cap_mib = 1024;

  Cli() {
    app.footer(kCommands);
    app.add_option("command", o.command, "run | maxsize | profile | list | help")->required();
    std::string names;
    for (const auto& [name, w] : registry()) names += (names.empty() ? "" : " | ") + name;
    app.add_option("--workload", o.workload, names + " (`list` describes them)")
        ->capture_default_str();
    app.add_option("--mode", o.mode,
                   "train: forward + backward + SGD step, loss = mean(out^2); "
                   "infer: forward under NoGradGuard")
        ->check(CLI::IsMember({"train", "infer"}))
        ->capture_default_str();
    app.add_option("--shape", shape,
                   "global spatial shape A,B[,C] (attention: S) [workload default]");
    auto& p = o.problem;
    app.add_option("--batch", p.batch)->capture_default_str();
    app.add_option("--in-channels", p.in_channels)->capture_default_str();
    app.add_option("--out-channels", p.out_channels)->capture_default_str();
    app.add_option("--base-channels", p.base_channels)->capture_default_str();
    app.add_option("--depth", p.depth)->capture_default_str();
    app.add_option("--layers", p.layers, "conv_stack layers")->capture_default_str();
    app.add_option("--heads", p.heads, "attention heads")->capture_default_str();
    app.add_option("--head-dim", p.head_dim, "attention head dim")->capture_default_str();
    app.add_flag("--causal", p.causal, "attention: causal mask");
    app.add_option("--norm", p.norm, "U-Net normalization")
        ->check(CLI::IsMember({"none", "group", "batch"}))
        ->capture_default_str();
    app.add_option("--mesh", mesh, "device mesh shape AxB; mesh dim i shards spatial dim i [P]");
    app.add_option("--threads", o.threads, "intra-op threads per rank")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--baseline-threads", baseline_threads,
                   "comma list of thread counts for the single-process baseline; "
                   "'match' = min(P * threads, cores)")
        ->capture_default_str();
    app.add_flag_function(
        "--no-baseline", [this](int64_t) { o.baseline = false; }, "skip the baseline");
    app.add_option("--warmup", o.warmup, "warm-up steps")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    app.add_option("--steps", o.steps, "timed steps")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--out", o.out, "append JSON records to this JSON array file");
    app.add_option("--name", name, "same as --out <source tree>/bench/results/NAME.json");
    app.add_option("--scenario", o.scenario, "label stored in the records")->capture_default_str();
    app.add_option("--cap-mib", cap_mib, "maxsize: per-rank tensor-memory cap in MiB")
        ->capture_default_str();
    app.add_option("--start-size", o.start_size, "maxsize: first resolution probed [auto]");
    app.add_option("--max-size", o.max_size, "maxsize: never probe beyond this resolution")
        ->capture_default_str();
    app.add_option("--baseline-order", o.baseline_order,
                   "sandwich: each baseline before and after the sharded run (reverse "
                   "order), after: all baselines after it (the old behaviour)")
        ->check(CLI::IsMember({"sandwich", "after"}))
        ->capture_default_str();
    app.add_option("--top", o.top, "profile: rows of the per-op table")->capture_default_str();
    app.add_option("--seed", o.seed)->capture_default_str();
    app.add_option("--lr", o.lr)->capture_default_str();
  }

  /// Returns false when only help was asked for (printed by rank 0).
  bool parse(int argc, char** argv) {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      if (st::world_rank() == 0) std::cout << app.help();
      return false;
    } catch (const CLI::ParseError& e) {
      TORCH_CHECK(false, "shardtensor_bench: ", e.what(), "; try 'shardtensor_bench help'");
    }
    if (o.command == "help") {
      if (st::world_rank() == 0) std::cout << app.help();
      return false;
    }
    if (!shape.empty()) o.problem.shape = int_list(shape);
    if (!mesh.empty()) o.mesh = int_list(mesh);
    o.baseline_threads = comma_list(baseline_threads);
    if (!name.empty()) o.out = std::string(SHARDTENSOR_BENCH_RESULTS_DIR) + "/" + name + ".json";
    o.cap_bytes = cap_mib * 1024.0 * 1024.0;
    if (o.command == "run" || o.command == "maxsize" || o.command == "profile") {
      auto it = registry().find(o.workload);
      TORCH_CHECK(it != registry().end(), "unknown workload '", o.workload,
                  "'; 'shardtensor_bench list' shows the built ones");
      if (shape.empty()) o.problem.shape = it->second.default_shape;
    }
    return true;
  }
};

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
  // Per timed step, this rank (Note [scale counters]): messages, bytes sent,
  // thread CPU seconds, seconds in the transport, and the dispatcher's
  // counters (DispatchStats).
  double cpu_s_per_step = 0, comm_s_per_step = 0;
  double dispatch_calls_per_step = 0, boundary_s_per_step = 0, handler_s_per_step = 0;
  double lookup_s_per_step = 0;
  std::vector<int64_t> rank_messages, rank_bytes;  // per rank, per step (sharded only)
  std::vector<double> rank_cpu_s, rank_boundary_s, rank_comm_s;
};

// ---- per-op profile ---------------------------------------------------------------

// Note [bench profile]: a global RecordFunction callback (libtorch's
// observer hook, the one its autograd profiler uses) times every top-level op
// on each thread: the aten ops the workload calls in forward (aten::conv2d, ...),
// and the autograd nodes the engine runs in backward ("X (bwd)"). Nested ops
// (a rule's local kernels, a decomposition's pieces, a backward node's aten
// calls) are inside their parent's time. Per op it also takes the deltas of
// comm_stats() (bytes, messages, transport seconds) and dispatch_stats()
// (interception overhead) across the call: ops run one at a time per rank,
// so the deltas belong to that op. The sharded and the plain run get the same
// callback, so the rows line up by name.
//
// Kernel time: a nested op during which the dispatcher intercepted nothing
// (dispatch_stats().calls unchanged) ran on plain tensors only: a libtorch
// kernel. The outermost such ops under a top-level op add up to its kernel
// time; host = time - kernel - comm is what the op spent in shardtensor's
// own host code (dispatch, rules, spec and plan construction, packing is
// kernel). A top-level op that nothing intercepted (a plain op, or a rule's
// backward Function) is kernel time except its communication.
struct OpStat {
  int64_t calls = 0;
  double seconds = 0, kernel_seconds = 0, comm_seconds = 0, boundary_seconds = 0;
  int64_t bytes_sent = 0, messages = 0;
};

struct Profiler {
  std::mutex mu;
  std::map<std::string, OpStat> ops;
  std::atomic<bool> on{false};
};
Profiler& profiler() {
  static Profiler p;
  return p;
}

struct Frame {
  double t0 = 0;
  int64_t calls0 = 0;
  double child_kernel = 0;  // kernel seconds of the outermost pure ops below
  st::CommStats comm;       // top level only
  st::DispatchStats dispatch;
};
thread_local std::vector<Frame> frames;

struct OpContext : at::ObserverContext {};

double now_s();

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (!profiler().on.load(std::memory_order_relaxed)) return nullptr;
  Frame f;
  f.dispatch = st::dispatch_stats();
  f.calls0 = f.dispatch.calls;
  if (frames.empty()) f.comm = st::comm_stats();
  f.t0 = now_s();
  frames.push_back(f);
  return std::make_unique<OpContext>();
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* c) {
  if (c == nullptr || frames.empty()) return;
  const double t1 = now_s();
  const Frame f = frames.back();
  frames.pop_back();
  const double dt = t1 - f.t0;
  const st::DispatchStats ds = st::dispatch_stats();
  const bool pure = ds.calls == f.calls0;
  const double kernel = pure ? dt : f.child_kernel;
  if (!frames.empty()) {
    frames.back().child_kernel += kernel;
    return;
  }
  const st::CommStats cs = st::comm_stats();
  // A top-level op nothing intercepted (e.g. a rule's backward Function, which
  // works on plain tensors) is kernel time except its communication.
  const double top_kernel =
      pure ? std::max(0.0, dt - (cs.comm_seconds - f.comm.comm_seconds)) : kernel;
  std::string name = fn.name();
  // "autograd::engine::evaluate_function: torch::autograd::CppNode<ns::Fn>" -> "Fn (bwd)".
  const std::string engine = "autograd::engine::evaluate_function: ";
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION || name.rfind(engine, 0) == 0) {
    if (name.rfind(engine, 0) == 0) name = name.substr(engine.size());
    const std::string node = "torch::autograd::CppNode<";
    if (name.rfind(node, 0) == 0 && name.back() == '>') {
      name = name.substr(node.size(), name.size() - node.size() - 1);
      const auto ns = name.rfind("::");
      if (ns != std::string::npos) name = name.substr(ns + 2);
    }
    name += " (bwd)";
  }
  auto& p = profiler();
  std::lock_guard<std::mutex> lock(p.mu);
  OpStat& o = p.ops[name];
  o.calls += 1;
  o.seconds += dt;
  o.kernel_seconds += top_kernel;
  o.comm_seconds += cs.comm_seconds - f.comm.comm_seconds;
  o.bytes_sent += cs.bytes_sent - f.comm.bytes_sent;
  o.messages += cs.messages - f.comm.messages;
  o.boundary_seconds += ds.boundary_seconds - f.dispatch.boundary_seconds;
}

/// Installs the callback once; measure() switches it on for the timed steps
/// when `profile_timed_steps` is set.
bool profile_timed_steps = false;
void install_profiler() {
  static const at::CallbackHandle handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_op_start, &on_op_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  (void)handle;
}

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

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
  st::reset_dispatch_stats();
  if (profile_timed_steps) {
    std::lock_guard<std::mutex> lock(profiler().mu);
    profiler().ops.clear();
    profiler().on = true;
  }
  const double cpu0 = thread_cpu_s();
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
  profiler().on = false;
  const double cpu = thread_cpu_s() - cpu0;
  const st::CommStats cs = st::comm_stats();
  const st::DispatchStats ds = st::dispatch_stats();
  const st::MemoryStats ms = st::memory_stats();
  m.cpu_s_per_step = cpu / steps;
  m.comm_s_per_step = cs.comm_seconds / steps;
  m.dispatch_calls_per_step = static_cast<double>(ds.calls) / steps;
  m.boundary_s_per_step = ds.boundary_seconds / steps;
  m.lookup_s_per_step = ds.lookup_seconds / steps;
  m.handler_s_per_step = ds.handler_seconds / steps;
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
    // Note [scale counters]: every rank's per-step counters, for the scale
    // scenario (what grows with P): messages and bytes (deterministic), the
    // thread's CPU seconds (oversubscribed ranks share cores, so CPU time, not
    // wall time), the transport's wall seconds, and the dispatcher boundary's
    // seconds. The host time outside kernels comes from `profile` (Note
    // [bench profile]).
    m.rank_messages.assign(size, 0);
    m.rank_bytes.assign(size, 0);
    m.rank_cpu_s.assign(size, 0);
    m.rank_boundary_s.assign(size, 0);
    m.rank_comm_s.assign(size, 0);
    const int64_t mine[2] = {cs.messages / steps, cs.bytes_sent / steps};
    std::vector<int64_t> ints(2 * size);
    MPI_Allgather(mine, 2, MPI_INT64_T, ints.data(), 2, MPI_INT64_T, world);
    const double mined[3] = {m.cpu_s_per_step, m.boundary_s_per_step, m.comm_s_per_step};
    std::vector<double> dbl(3 * size);
    MPI_Allgather(mined, 3, MPI_DOUBLE, dbl.data(), 3, MPI_DOUBLE, world);
    for (int r = 0; r < size; ++r) {
      m.rank_messages[r] = ints[2 * r];
      m.rank_bytes[r] = ints[2 * r + 1];
      m.rank_cpu_s[r] = dbl[3 * r];
      m.rank_boundary_s[r] = dbl[3 * r + 1];
      m.rank_comm_s[r] = dbl[3 * r + 2];
    }
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

/// The machine's 1-minute load average (NaN if unreadable).
double load_1min() {
  double load = std::nan("");
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = std::nan("");
    std::fclose(f);
  }
  return load;
}

/// CPU list of a mask: "0-1", "0,2-3".
std::string cpu_list(const cpu_set_t& set) {
  std::string out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    int e = c;
    while (e + 1 < CPU_SETSIZE && CPU_ISSET(e + 1, &set)) ++e;
    out += (out.empty() ? "" : ",") + std::to_string(c) + (e > c ? "-" + std::to_string(e) : "");
    c = e;
  }
  return out;
}

cpu_set_t my_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) CPU_SET(0, &set);
  return set;
}

/// Every rank's affinity mask (collective over MPI_COMM_WORLD).
std::vector<cpu_set_t> all_affinities() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const cpu_set_t mine = my_affinity();
  std::vector<cpu_set_t> all(size);
  MPI_Allgather(&mine, sizeof(cpu_set_t), MPI_BYTE, all.data(), sizeof(cpu_set_t), MPI_BYTE,
                MPI_COMM_WORLD);
  return all;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

/// The BLAS and LAPACK libraries mapped into this process (/proc/self/maps):
/// Debian's libtorch 1.13 called whatever libblas.so.3 the alternatives system
/// pointed to (Note [blas]); PyPI's torch 2.x links MKL statically, so there the
/// list is usually empty and `torch_blas` / `torch_lapack` below say what runs.
/// For the MKL-backed builds the list would contain libmkl_* only if loaded dynamically.
std::vector<std::string> blas_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string name = path.substr(path.rfind('/') + 1);
    if ((name.find("blas") != std::string::npos || name.find("lapack") != std::string::npos) &&
        std::find(out.begin(), out.end(), path) == out.end()) {
      out.push_back(path);
    }
  }
  return out;
}

/// Note [baseline honesty]: what the job actually ran on. The affinity masks
/// are read back from the kernel (sched_getaffinity), not inferred from the
/// launcher's flags, which are recorded next to them as given.
Json environment_fields(const std::vector<cpu_set_t>& affinity) {
  Json r;
  std::vector<std::string> masks;
  for (const auto& a : affinity) masks.push_back(cpu_list(a));
  r["rank_affinity"] = masks;
  r["mpirun_flags"] = env_or("BENCH_MPIRUN_FLAGS", "unknown");
  // The transport (Note [c10d handles]): MPI unless SHARDTENSOR_BACKEND chose gloo.
  r["transport"] = env_or("SHARDTENSOR_BACKEND", "mpi");
  r["mpi_binding_policy"] = env_or("OMPI_MCA_hwloc_base_binding_policy", "default");
  r["omp_num_threads_env"] = env_or("OMP_NUM_THREADS", "unset");
  r["intra_op_threads"] = at::get_num_threads();
  r["blas_libraries"] = blas_libraries();
  // Note [torch backends in records]: torch 2.x brings its own BLAS (MKL on PyPI's x86
  // CPU build) and oneDNN; record what this libtorch was built with and what is on.
  r["torch_version"] = TORCH_VERSION;
  const std::string cfg = at::show_config();
  auto field = [&](const std::string& key) {
    const auto at_key = cfg.find(key + "=");
    if (at_key == std::string::npos) return std::string("unknown");
    const auto start = at_key + key.size() + 1;
    return cfg.substr(start, cfg.find_first_of(", \n", start) - start);
  };
  r["torch_blas"] = field("BLAS_INFO");
  r["torch_lapack"] = field("LAPACK_INFO");
  r["torch_use_mkldnn"] = field("USE_MKLDNN");
  r["mkldnn_enabled"] = at::globalContext().userEnabledMkldnn();
  {
    const auto v = cfg.find("MKL-DNN v");
    r["onednn_version"] = v == std::string::npos ? std::string("none")
                                                 : cfg.substr(v + 9, cfg.find(' ', v + 9) - v - 9);
  }
  r["cpu_capability"] = at::get_cpu_capability();
  return r;
}

Json common_fields(const Options& o, const Problem& p, const Instance& shape_of,
                   const std::vector<int64_t>& mesh_shape, int ranks) {
  Json r;
  r["scenario"] = o.scenario;
  r["workload"] = o.workload;
  r["mode"] = o.mode;
  r["ranks"] = ranks;
  r["threads_per_rank"] = o.threads;
  r["mesh"] = mesh_shape;
  r["global_shape"] = shape_of.inputs.at(0).global_shape;
  r["spatial_shape"] = p.shape;
  if (o.workload.rfind("unet", 0) == 0) {
    r["norm"] = p.norm;
    r["depth"] = p.depth;
  }
  if (o.workload != "attention") r["base_channels"] = p.base_channels;
  r["warmup"] = o.warmup;
  r["steps"] = o.steps;
  r["cores"] = hardware_cores();
  // The machine's 1-minute load average when the record is written: timings
  // taken while others use the cores are noisy, and this says so.
  r["loadavg_1min"] = num_or_null(load_1min());
  return r;
}

std::vector<int64_t> mesh_shape_of(const Options& o, int world) {
  return o.mesh.empty() ? std::vector<int64_t>{world} : o.mesh;
}

void write(const Options& o, const std::vector<Json>& recs) {
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

  const auto affinity = all_affinities();
  const Json env = environment_fields(affinity);

  struct Base {
    int threads;
    std::string rule;
    Measurement m;
    std::vector<double> position_medians;  // median step per run position
  };
  std::vector<Base> bases;
  if (o.baseline) {
    for (const auto& b : o.baseline_threads) {
      const int n = b == "match" ? std::min(world * o.threads, hardware_cores()) : std::stoi(b);
      // 'match' at P x threads = 1 (or equal to a listed count) would repeat a baseline.
      bool dup = false;
      for (const auto& e : bases) dup = dup || e.threads == n;
      if (!dup) bases.push_back({n, b == "match" ? "match" : "fixed", {}, {}});
    }
  }
  // Note [baseline honesty]: the baseline process runs on the union of the
  // CPUs the sharded ranks ran on (so "1 process x 2 threads" and "2 ranks x
  // 1 thread" get the same cores, however mpirun bound the ranks), and in
  // 'sandwich' order each baseline runs once before the sharded run and once
  // after it, in reverse order, so that no configuration always runs first
  // (cold caches, allocator growth) or last; the record keeps both positions'
  // medians and the median over all steps of both.
  cpu_set_t all_cpus;
  CPU_ZERO(&all_cpus);
  for (const auto& a : affinity) CPU_OR(&all_cpus, &all_cpus, &a);
  auto run_bases = [&](bool forward) {
    if (bases.empty()) return;
    on_root_others_sleep([&] {
      const cpu_set_t own = my_affinity();
      sched_setaffinity(0, sizeof(all_cpus), &all_cpus);
      for (size_t k = 0; k < bases.size(); ++k) {
        Base& b = bases[forward ? k : bases.size() - 1 - k];
        at::set_num_threads(b.threads);
        Measurement m = measure(o, o.problem, nullptr, o.warmup, o.steps);
        b.position_medians.push_back(median(m.step_s));
        if (b.m.step_s.empty()) {
          b.m = m;
        } else {
          b.m.step_s.insert(b.m.step_s.end(), m.step_s.begin(), m.step_s.end());
          b.m.peak_bytes = std::max(b.m.peak_bytes, m.peak_bytes);
        }
      }
      sched_setaffinity(0, sizeof(own), &own);
      at::set_num_threads(o.threads);
    });
  };
  const bool sandwich = o.baseline_order == "sandwich";
  if (sandwich) run_bases(true);
  const Measurement sh = measure(o, o.problem, &mesh, o.warmup, o.steps);
  run_bases(!sandwich);
  if (rank != 0) return 0;

  torch::manual_seed(o.seed);
  const Instance shape_of = wl.make(o.problem);
  const double step = median(sh.step_s);
  std::vector<Json> recs;
  auto base_record = [&](const Base* b) {
    Json r = common_fields(o, o.problem, shape_of, mesh_shape, world);
    r["peak_bytes_per_rank"] = sh.peak_bytes;
    r["peak_bytes_per_rank_min"] = sh.peak_bytes_min;
    r["step_s_median"] = num_or_null(step);
    r["step_s_min"] = *std::min_element(sh.step_s.begin(), sh.step_s.end());
    r["bytes_sent_per_rank"] = sh.bytes_sent_per_step;
    r["messages_per_rank"] = sh.messages_per_step;
    r["comm_fraction"] = num_or_null(sh.comm_fraction);
    r["comm_fraction_max"] = num_or_null(sh.comm_fraction_max);
    r["loss"] = num_or_null(sh.loss);
    r.update(env);
    r["cpu_s_per_step"] = sh.cpu_s_per_step;
    r["comm_s_per_step"] = sh.comm_s_per_step;
    r["dispatch_calls_per_step"] = sh.dispatch_calls_per_step;
    r["dispatch_lookup_s_per_step"] = sh.lookup_s_per_step;
    r["dispatch_boundary_s_per_step"] = sh.boundary_s_per_step;
    r["dispatch_handler_s_per_step"] = sh.handler_s_per_step;
    r["rank_messages_per_step"] = sh.rank_messages;
    r["rank_bytes_sent_per_step"] = sh.rank_bytes;
    r["rank_cpu_s_per_step"] = sh.rank_cpu_s;
    r["rank_comm_s_per_step"] = sh.rank_comm_s;
    r["rank_dispatch_boundary_s_per_step"] = sh.rank_boundary_s;
    if (b) {
      const double bstep = median(b->m.step_s);
      const double speedup = bstep / step;
      r["baseline_peak_bytes"] = b->m.peak_bytes;
      r["memory_ratio"] = num_or_null(static_cast<double>(sh.peak_bytes) /
                                      (static_cast<double>(b->m.peak_bytes) / world));
      r["baseline_step_s_median"] = num_or_null(bstep);
      r["baseline_threads"] = b->threads;
      r["baseline_threads_rule"] = b->rule;
      r["baseline_order"] = o.baseline_order;
      r["baseline_step_s_by_position"] = b->position_medians;
      r["baseline_affinity"] = cpu_list(all_cpus);
      r["baseline_cpus"] = CPU_COUNT(&all_cpus);
      r["speedup"] = num_or_null(speedup);
      r["efficiency"] = num_or_null(speedup * b->threads / (world * o.threads));
      r["baseline_loss"] = num_or_null(b->m.loss);
      r["loss_rel_diff"] =
          num_or_null(std::abs(sh.loss - b->m.loss) / std::max(std::abs(b->m.loss), 1e-30));
    } else {
      for (const char* k : {"baseline_peak_bytes", "memory_ratio", "baseline_step_s_median",
                            "baseline_threads", "speedup"})
        r[k] = nullptr;
    }
    r["date"] = utc_now();
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
  Json r = common_fields(probe_options, p, shape_of, mesh_shape, world);
  Json probe_json = Json::array();
  for (const auto& pr : probes) probe_json.push_back({pr.size, pr.peak});
  int64_t points = 1;
  for (int d = 0; d < D; ++d) points *= lo;
  r["cap_bytes"] = static_cast<int64_t>(cap);
  r["max_size"] = lo;
  r["max_points"] = lo > 0 ? points : int64_t{0};
  r["size_quantum"] = q;
  r["failing_size"] = hi;
  r["peak_bytes_per_rank"] = best ? best->peak : int64_t{0};
  r["step_s_median"] = best ? Json(best->step_s) : Json(nullptr);
  r["probes"] = probe_json;
  r["date"] = utc_now();
  std::cout << "largest trainable: " << lo << "^" << D << " (" << points
            << " points) at P = " << world << "; " << hi << "^" << D
            << (hi ? " exceeds the cap" : " not reached") << std::endl;
  write(o, {r});
  return 0;
}

// ---- profile -----------------------------------------------------------------------

Json ops_to_json(const std::map<std::string, OpStat>& ops, int steps) {
  Json j = Json::object();
  for (const auto& [name, st] : ops) {
    j[name] = {{"calls", st.calls / steps},
               {"s", st.seconds / steps},
               {"kernel_s", st.kernel_seconds / steps},
               {"comm_s", st.comm_seconds / steps},
               {"boundary_s", st.boundary_seconds / steps},
               {"bytes_sent", st.bytes_sent / steps},
               {"messages", st.messages / steps}};
  }
  return j;
}

/// Every rank's per-op map, on rank 0 (collective over MPI_COMM_WORLD).
std::vector<Json> gather_json(const Json& mine) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string text = mine.dump();
  int len = static_cast<int>(text.size());
  std::vector<int> lens(size), displs(size);
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < size; ++r) displs[r] = total, total += lens[r];
  std::string all(rank == 0 ? total : 0, '\0');
  MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  std::vector<Json> out;
  if (rank == 0)
    for (int r = 0; r < size; ++r) out.push_back(Json::parse(all.substr(displs[r], lens[r])));
  return out;
}

/// Nanoseconds per call of the registry's lookup (ops::find_rule: a mutex and
/// a string concatenation of name and overload), which the dispatcher calls
/// once per op since Note [rule cache], for the profile's summary.
double find_rule_ns() {
  const c10::OperatorName names[] = {{"aten::convolution", ""},
                                     {"aten::add", "Tensor"},
                                     {"aten::native_group_norm", ""},
                                     {"aten::upsample_bilinear2d", "vec"}};
  const int n = 20000;
  const double t0 = now_s();
  int64_t found = 0;
  for (int i = 0; i < n; ++i)
    for (const auto& name : names) found += shardtensor::ops::find_rule(name) != nullptr;
  const double dt = now_s() - t0;
  return found >= 0 ? 1e9 * dt / (n * 4) : 0.0;
}

int cmd_profile(const Options& o) {
  const int rank = st::world_rank(), world = st::world_size();
  const auto mesh_shape = mesh_shape_of(o, world);
  auto mesh = st::DeviceMesh::create(mesh_shape);
  at::set_num_threads(o.threads);
  const Workload& wl = registry().at(o.workload);
  for (int64_t s : o.problem.shape) {
    TORCH_CHECK(s % wl.size_multiple(o.problem) == 0, o.workload, ": every spatial size must be a",
                " multiple of ", wl.size_multiple(o.problem));
  }
  const auto affinity = all_affinities();
  const Json env = environment_fields(affinity);
  install_profiler();
  profile_timed_steps = true;
  const Measurement sh = measure(o, o.problem, &mesh, o.warmup, o.steps);
  const std::vector<Json> sharded = gather_json(ops_to_json(profiler().ops, o.steps));
  Json plain = Json::object();
  Measurement pl;
  if (o.baseline) {
    // Plain libtorch with the threads of one rank, on rank 0: per op, the
    // sharded time should be plain / P.
    on_root_others_sleep([&] {
      pl = measure(o, o.problem, nullptr, o.warmup, o.steps);
      plain = ops_to_json(profiler().ops, o.steps);
    });
  }
  profile_timed_steps = false;
  const double lookup_ns = rank == 0 ? find_rule_ns() : 0.0;
  if (rank != 0) return 0;

  struct Row {
    std::string name;
    int64_t calls = 0;
    double sharded_s = 0, sharded_mean_s = 0, plain_s = 0, comm_s = 0, boundary_s = 0;
    double kernel_s = 0, host_s = 0;
    int64_t bytes = 0, messages = 0;
    double excess() const { return sharded_s - plain_s; }
  };
  std::map<std::string, Row> rows;
  std::vector<double> rank_host, rank_kernel;
  for (const Json& rk : sharded) {
    double host = 0, kernel = 0;
    for (const auto& [name, v] : rk.items()) {
      const double h = std::max(
          0.0, v["s"].get<double>() - v["kernel_s"].get<double>() - v["comm_s"].get<double>());
      host += h;
      kernel += v["kernel_s"].get<double>();
      Row& r = rows[name];
      r.host_s = std::max(r.host_s, h);
      r.kernel_s = std::max(r.kernel_s, v["kernel_s"].get<double>());
      r.name = name;
      r.calls = std::max<int64_t>(r.calls, v["calls"].get<int64_t>());
      r.sharded_s = std::max(r.sharded_s, v["s"].get<double>());
      r.sharded_mean_s += v["s"].get<double>() / world;
      r.comm_s = std::max(r.comm_s, v["comm_s"].get<double>());
      r.boundary_s = std::max(r.boundary_s, v["boundary_s"].get<double>());
      r.bytes = std::max(r.bytes, v["bytes_sent"].get<int64_t>());
      r.messages = std::max(r.messages, v["messages"].get<int64_t>());
    }
    rank_host.push_back(host);
    rank_kernel.push_back(kernel);
  }
  for (const auto& [name, v] : plain.items()) {
    Row& r = rows[name];
    r.name = name;
    r.plain_s = v["s"].get<double>() / world;  // the ideal share of one rank
    if (r.calls == 0) r.calls = v["calls"].get<int64_t>();
  }
  std::vector<Row> sorted;
  for (auto& [k, r] : rows) sorted.push_back(r);
  std::sort(sorted.begin(), sorted.end(),
            [](const Row& a, const Row& b) { return a.excess() > b.excess(); });

  const double step = median(sh.step_s);
  const double pstep = o.baseline ? median(pl.step_s) : std::nan("");
  std::cout << "\n"
            << o.workload << " " << o.mode << " shape [" << join(o.problem.shape, "x")
            << "], P = " << world << " x " << o.threads << " thread(s), per step (median of "
            << o.steps << "; load " << fixed(load_1min(), 2) << ")\n"
            << "step: sharded " << fixed(step, 4) << " s, plain " << fixed(pstep, 4)
            << " s (plain/P " << fixed(pstep / world, 4) << " s)\n"
            << "dispatcher: " << fixed(sh.dispatch_calls_per_step, 0) << " intercepted calls, "
            << "lookup " << fixed(1e6 * sh.lookup_s_per_step, 1) << " us, boundary "
            << fixed(1e3 * sh.boundary_s_per_step, 3) << " ms, in handlers "
            << fixed(sh.handler_s_per_step, 4) << " s; uncached find_rule " << fixed(lookup_ns, 0)
            << " ns/call\n"
            << "ms per step; sharded = slowest rank; ideal = plain / P; rows sorted by excess = "
               "sharded - ideal\n";
  std::cout << std::left << std::setw(48) << "op" << std::right << std::setw(7) << "calls"
            << std::setw(11) << "sharded" << std::setw(10) << "ideal" << std::setw(10) << "excess"
            << std::setw(10) << "kernel" << std::setw(10) << "host" << std::setw(10) << "comm"
            << std::setw(10) << "dispatch" << std::setw(11) << "sent KiB" << std::setw(7) << "msgs"
            << "\n";
  Row total;
  int shown = 0;
  for (const auto& r : sorted) {
    total.sharded_s += r.sharded_s;
    total.plain_s += r.plain_s;
    total.comm_s += r.comm_s;
    total.kernel_s += r.kernel_s;
    total.host_s += r.host_s;
    total.boundary_s += r.boundary_s;
    total.bytes += r.bytes;
    total.messages += r.messages;
    if (shown++ >= o.top) continue;
    std::cout << std::left << std::setw(48) << r.name.substr(0, 47) << std::right << std::setw(7)
              << r.calls << std::setw(11) << fixed(1e3 * r.sharded_s, 3) << std::setw(10)
              << fixed(1e3 * r.plain_s, 3) << std::setw(10) << fixed(1e3 * r.excess(), 3)
              << std::setw(10) << fixed(1e3 * r.kernel_s, 3) << std::setw(10)
              << fixed(1e3 * r.host_s, 3) << std::setw(10) << fixed(1e3 * r.comm_s, 3)
              << std::setw(10) << fixed(1e3 * r.boundary_s, 3) << std::setw(11)
              << fixed(r.bytes / 1024.0, 1) << std::setw(7) << r.messages << "\n";
  }
  std::cout << std::left << std::setw(48) << "total (all rows)" << std::right << std::setw(7) << ""
            << std::setw(11) << fixed(1e3 * total.sharded_s, 3) << std::setw(10)
            << fixed(1e3 * total.plain_s, 3) << std::setw(10) << fixed(1e3 * total.excess(), 3)
            << std::setw(10) << fixed(1e3 * total.kernel_s, 3) << std::setw(10)
            << fixed(1e3 * total.host_s, 3) << std::setw(10) << fixed(1e3 * total.comm_s, 3)
            << std::setw(10) << fixed(1e3 * total.boundary_s, 3) << std::setw(11)
            << fixed(total.bytes / 1024.0, 1) << std::setw(7) << total.messages << "\n";
  std::cout.flush();

  torch::manual_seed(o.seed);
  const Instance shape_of = wl.make(o.problem);
  Json r = common_fields(o, o.problem, shape_of, mesh_shape, world);
  r.update(env);
  r["kind"] = "profile";
  r["step_s_median"] = num_or_null(step);
  r["baseline_step_s_median"] = num_or_null(pstep);
  r["dispatch_calls_per_step"] = sh.dispatch_calls_per_step;
  r["dispatch_lookup_s_per_step"] = sh.lookup_s_per_step;
  r["dispatch_boundary_s_per_step"] = sh.boundary_s_per_step;
  r["dispatch_handler_s_per_step"] = sh.handler_s_per_step;
  r["find_rule_ns_uncached"] = lookup_ns;
  r["cpu_s_per_step"] = sh.cpu_s_per_step;
  r["comm_s_per_step"] = sh.comm_s_per_step;
  r["rank_messages_per_step"] = sh.rank_messages;
  r["rank_bytes_sent_per_step"] = sh.rank_bytes;
  r["rank_cpu_s_per_step"] = sh.rank_cpu_s;
  r["rank_comm_s_per_step"] = sh.rank_comm_s;
  r["rank_dispatch_boundary_s_per_step"] = sh.rank_boundary_s;
  r["rank_host_s_per_step"] = rank_host;
  r["rank_kernel_s_per_step"] = rank_kernel;
  Json ops = Json::array();
  for (const auto& row : sorted) {
    ops.push_back({{"op", row.name},
                   {"calls", row.calls},
                   {"sharded_s", row.sharded_s},
                   {"sharded_mean_s", row.sharded_mean_s},
                   {"ideal_s", row.plain_s},
                   {"kernel_s", row.kernel_s},
                   {"host_s", row.host_s},
                   {"comm_s", row.comm_s},
                   {"dispatch_s", row.boundary_s},
                   {"bytes_sent", row.bytes},
                   {"messages", row.messages}});
  }
  r["ops"] = ops;
  r["date"] = utc_now();
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
    bench::Cli cli;
    if (!cli.parse(argc, argv)) return 0;
    const bench::Options& o = cli.o;
    if (o.command == "run") return bench::cmd_run(o);
    if (o.command == "maxsize") return bench::cmd_maxsize(o);
    if (o.command == "profile") return bench::cmd_profile(o);
    if (o.command == "list") return bench::cmd_list();
    TORCH_CHECK(false, "unknown command '", o.command, "'; try 'shardtensor_bench help'");
  } catch (const std::exception& e) {
    std::cerr << "[rank " << st::world_rank() << "] shardtensor_bench: " << e.what() << std::endl;
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
