// The main job: a U-Net learns to emulate a physical solver, trained
// domain-parallel (and data-parallel) with shardtensor.
//
//   mpirun --oversubscribe -np 4 build/examples/unet_train [flags]     (make demo)
//
// Task. u_t = div(kappa(x) grad u) on the unit square with zero-flux walls.
// Input: [u0, log kappa] (2 channels); target: u after k explicit
// finite-difference steps (flux form, face-averaged kappa) with a fixed time
// step, stable for every sample: dt = 0.2 h^2 / kappa_max. Every sample is generated on the fly
// by a domain-parallel solver: each rank evaluates the random smooth fields
// (a sum of plane waves for u0, a few Fourier modes for log kappa, with
// parameters drawn from a per-sample seed) only at the global coordinates of
// its own subdomain, and exchanges one-row halos per step with
// shardtensor::halo_exchange.
//
// Mesh {"data", "domain"} (--mesh DATAxDOMAIN): the batch is split over
// "data" (Shard 0) and the rows over "domain" (Shard 2). The model is the
// plain-libtorch models::UNet2d; its parameters' gradients are summed over
// the mesh in buckets (shardtensor::distribute_module).
//
// Data pipeline (parallel HDF5, shardtensor::io): every step the solver's
// batch is written collectively to one HDF5 file (--data, datasets
// train/<step>/input and train/<step>/target; each rank writes only its
// subdomain), and training reads it back with io::read_hdf5, each rank only
// its own subdomain (never a whole sample on one rank); the bytes each rank
// read per sample are printed next to the sample's size (io_stats). At the
// end the job saves a sharded checkpoint (--checkpoint DIR: model, Adam state,
// step); --resume continues from it for --steps more steps.
//
// At the end: one sharded training step on a 64x64 grid is compared with a
// single-process step (loss and every parameter after one Adam step);
// prints MATCH or MISMATCH, and the exit code says so. A PNG (--png) shows
// input, prediction, target and error of one validation sample, each panel
// titled and with a colour bar (Note [validation picture] in
// examples/models/diffusion.h: drawn by examples/plot_panels.py).
#include <mpi.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "models/check.h"
#include "models/diffusion.h"
#include "models/fsdp.h"
#include "models/unet.h"

namespace st = shardtensor;

namespace {

struct Config {
  int64_t size = 1024;
  int64_t steps = 20;
  int64_t solver_steps = 100;
  double lr = 3e-3;
  int64_t data = 1, domain = -1;  // --mesh DATAxDOMAIN; domain -1: the rest
  int64_t batch = -1;             // global; -1: one sample per data coordinate
  int64_t base_channels = 8;
  int64_t depth = 3;
  std::string norm = "group";
  std::string checkpoint = "unet_checkpoint";
  std::string data_file = "unet_train_data.h5";
  bool resume = false;
  bool fully_shard = false;  // parameters, gradients, Adam state sharded over "data"
  std::string png = "unet_train.png";
  int64_t log_every = 1;
};

[[noreturn]] void usage(const std::string& why) {
  if (st::world_rank() == 0) {
    std::cerr << "unet_train: " << why << " (unet_train --help lists the flags)\n";
  }
  throw std::invalid_argument(why);
}

/// The command line (CLI11). Returns false when only --help was asked for.
bool parse(int argc, char** argv, Config& c) {
  CLI::App app{
      "unet_train: the main job (a GroupNorm U-Net learns a diffusion solver on a "
      "data x domain mesh)",
      "unet_train"};
  app.add_option("--size", c.size, "global image size N (N x N)")->capture_default_str();
  app.add_option("--steps", c.steps, "training steps")->capture_default_str();
  app.add_option("--solver-steps", c.solver_steps, "explicit solver steps per sample")
      ->capture_default_str();
  app.add_option("--lr", c.lr, "Adam learning rate")->capture_default_str();
  std::string mesh;
  app.add_option("--mesh", mesh, "DATAxDOMAIN, e.g. 2x2 [1 x P]");
  app.add_option("--batch", c.batch, "global batch [one sample per data coordinate]");
  app.add_option("--base-channels", c.base_channels)->capture_default_str();
  app.add_option("--depth", c.depth)->capture_default_str();
  app.add_option("--norm", c.norm)
      ->check(CLI::IsMember({"group", "batch", "none"}))
      ->capture_default_str();
  app.add_option("--checkpoint", c.checkpoint, "checkpoint directory (\"\" = none)")
      ->capture_default_str();
  app.add_flag("--resume", c.resume, "continue from the checkpoint in --checkpoint");
  app.add_flag("--fully-shard", c.fully_shard,
               "shard parameters, gradients and Adam state over the data dim (fully_shard, "
               "one unit per U-Net block) instead of replicating them");
  app.add_option("--data", c.data_file, "HDF5 file of the training batch")->capture_default_str();
  app.add_option("--png", c.png, "output image (\"\" = none)")->capture_default_str();
  app.add_option("--log-every", c.log_every, "print the loss every N steps")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    if (st::world_rank() == 0) std::cout << app.help();
    return false;
  } catch (const CLI::ParseError& e) {
    usage(e.what());
  }
  if (!mesh.empty()) {
    const auto x = mesh.find('x');
    if (x == std::string::npos) usage("--mesh wants DATAxDOMAIN, e.g. 2x2");
    try {
      c.data = std::stoll(mesh.substr(0, x));
      c.domain = std::stoll(mesh.substr(x + 1));
    } catch (const std::exception&) {
      usage("--mesh wants DATAxDOMAIN, e.g. 2x2");
    }
  }
  c.log_every = std::max<int64_t>(1, c.log_every);
  return true;
}

models::Norm norm_of(const std::string& n) {
  if (n == "group") return models::Norm::Group;
  if (n == "batch") return models::Norm::Batch;
  if (n == "none") return models::Norm::None;
  usage("--norm wants group, batch or none");
}

// The solver (draw, fields, make_batch) and the picture (draw_panels) live in
// examples/models/diffusion.h, shared with fno_train so both train on the same data.
using diffusion::Batch;
using diffusion::make_batch;

// ---- training -------------------------------------------------------------------------

using check::max_over_ranks;

/// The emulator predicts the change: u_k = u0 + U-Net([u0, log kappa]).
at::Tensor predict(models::UNet2d& net, const at::Tensor& input) {
  return input.narrow(1, 0, 1) + net->forward(input);
}

models::UNetOptions model_options(const Config& c) {
  return models::UNetOptions(2, 1)
      .base_channels(c.base_channels)
      .depth(c.depth)
      .norm(norm_of(c.norm))
      .groups(4)
      .up(models::Up::Interpolate);
}

/// One sharded Adam step on a small grid against a single-process step: the
/// same model, the same samples (gathered), the same optimizer.
/// distribute_module, or fully_shard per block (--fully-shard); returns the units.
std::vector<models::NamedUnit> distribute(torch::nn::Module& net, const st::DeviceMesh& mesh,
                                          const Config& c) {
  if (!c.fully_shard) {
    st::distribute_module(net, mesh);
    return {};
  }
  return models::fully_shard_blocks(net, mesh, "data", st::FullyShardOptions(), {"enc", "dec"});
}

/// What the optimizer steps: the parameters, or fully_shard's shards.
std::vector<at::Tensor> trained_parameters(torch::nn::Module& net, const Config& c) {
  return c.fully_shard ? st::fully_shard_parameters(net) : net.parameters();
}

/// Collective over the data dim: every parameter's full value, by its name in the model.
std::vector<std::pair<std::string, at::Tensor>> full_parameters(
    const std::vector<models::NamedUnit>& units) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& u : units) {
    for (auto& [n, v] : u.unit.full_state_dict()) out.emplace_back(u.prefix + n, v);
  }
  return out;
}

bool verify_small(const Config& c, const st::DeviceMesh& mesh, bool root) {
  const int64_t n = 64, batch = std::max<int64_t>(2, mesh.size(0));
  // In float64: Adam's first step is lr * g / (|g| + eps), so gradient entries
  // near eps = 1e-8 (GroupNorm makes some conv-weight gradients cancel to
  // that level) would turn float32 summation-order noise into parameter
  // differences of a good fraction of lr. In float64 that noise is ~1e-17,
  // and the comparison can be tight: rtol 1e-8, atol 1e-10 (the worst
  // measured ratio is ~1e-4 of that at 3 and 4 ranks and 2x2; a wrong halo or
  // a missing gradient sum gives ratios far above 1).
  auto data = make_batch(mesh, batch, n, 20, 424242);
  auto to_double = [](const at::Tensor& t) {
    st::ShardTensor s(t);
    return at::Tensor(
        st::ShardTensor::from_local_unchecked(s.local().to(at::kDouble), s.spec_ptr()));
  };
  data.input = to_double(data.input);
  data.target = to_double(data.target);
  auto x = st::ShardTensor(data.input).full_tensor();
  auto y = st::ShardTensor(data.target).full_tensor();
  torch::manual_seed(99);
  models::UNet2d ref(model_options(c));
  ref->to(at::kDouble);
  torch::manual_seed(99);
  models::UNet2d net(model_options(c));
  net->to(at::kDouble);
  auto units = distribute(*net, mesh, c);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(c.lr));
  torch::optim::Adam opt(trained_parameters(*net, c), torch::optim::AdamOptions(c.lr));
  auto ref_loss = (predict(ref, x) - y).pow(2).mean();
  ref_loss.backward();
  ref_opt.step();
  auto loss = (predict(net, data.input) - data.target).pow(2).mean();
  loss.backward();
  opt.step();
  const double rtol = 1e-8, atol = 1e-10;
  const check::StepError err =
      c.fully_shard ? check::compare_step(full_parameters(units), *ref, loss, ref_loss, rtol, atol)
                    : check::compare_step(*net, *ref, loss, ref_loss, rtol, atol);
  const double worst = err.worst;
  const std::string& worst_name = err.where;
  const bool ok = err.ok();
  if (root) {
    std::printf(
        "check: one sharded%s Adam step on %lldx%lld (batch %lld, float64) vs single-process: loss "
        "%.12f vs %.12f; worst |diff|/(atol+rtol|ref|) = %.3g (%s; rtol %.0e, atol %.0e) -> %s\n",
        c.fully_shard ? " (fully_shard)" : "", static_cast<long long>(n), static_cast<long long>(n),
        static_cast<long long>(batch), loss.item<double>(), ref_loss.item<double>(), worst,
        worst_name.c_str(), rtol, atol, ok ? "MATCH" : "MISMATCH");
  }
  return ok;
}

int run(int argc, char** argv) {
  Config c;
  if (!parse(argc, argv, c)) return 0;
  const int P = st::world_size();
  if (c.domain < 0) c.domain = P / c.data;
  if (c.data * c.domain != P) usage("--mesh DATAxDOMAIN must multiply to the number of ranks");
  if (c.batch < 0) c.batch = c.data;
  if (c.batch < c.data) usage("--batch must be at least DATA");
  if (c.size % (int64_t{1} << c.depth) != 0) usage("--size must be divisible by 2^depth");
  auto mesh = st::DeviceMesh::create({c.data, c.domain}, {"data", "domain"});
  const bool root = mesh.rank() == 0;
  if (root) {
    std::printf(
        "unet_train: %lldx%lld grid, mesh %lld (data) x %lld (domain), batch %lld, U-Net base %lld "
        "depth %lld norm %s, %lld solver steps, %lld training steps, Adam lr %g\n",
        (long long)c.size, (long long)c.size, (long long)c.data, (long long)c.domain,
        (long long)c.batch, (long long)c.base_channels, (long long)c.depth, c.norm.c_str(),
        (long long)c.solver_steps, (long long)c.steps, c.lr);
    std::fflush(stdout);
  }
  torch::manual_seed(1);
  models::UNet2d net(model_options(c));
  auto units = distribute(*net, mesh, c);
  torch::optim::Adam opt(trained_parameters(*net, c), torch::optim::AdamOptions(c.lr));

  int64_t first_step = 0;
  if (c.resume) {
    if (c.checkpoint.empty() || !st::io::checkpoint_exists(c.checkpoint)) {
      usage("--resume needs a checkpoint in --checkpoint DIR (" + c.checkpoint + ")");
    }
    auto loaded =
        c.fully_shard
            ? st::io::load_checkpoint(
                  c.checkpoint, mesh,
                  st::io::LoadOptions().layouts(st::io::fully_shard_layouts(*net, mesh, &opt)))
            : st::io::load_checkpoint(c.checkpoint, mesh,
                                      st::io::LoadOptions().module(net.get()).optimizer(&opt));
    if (c.fully_shard) st::io::load_fully_shard_tensors(loaded, *net, &opt);
    first_step = loaded.step;
    if (root) {
      std::printf("resumed from %s at step %lld\n", c.checkpoint.c_str(), (long long)first_step);
    }
  }

  using clock = std::chrono::steady_clock;
  const st::Placements layout{st::Shard{0}, st::Shard{2}};
  const double sample_bytes = 3.0 * c.size * c.size * sizeof(float);  // input (2 ch) + target
  double first_loss = 0, last_loss = 0;
  for (int64_t step = first_step; step < first_step + c.steps; ++step) {
    auto t0 = clock::now();
    // Solver -> file: every rank writes its subdomain of the batch (collective).
    {
      auto gen =
          make_batch(mesh, c.batch, c.size, c.solver_steps, static_cast<uint64_t>(step * c.batch));
      const std::string group = "train/" + std::to_string(step);
      st::io::write_hdf5(c.data_file, group + "/input", gen.input,
                         st::io::WriteOptions().truncate(step == first_step));
      st::io::write_hdf5(c.data_file, group + "/target", gen.target);
    }
    // File -> training: every rank reads only its own subdomain.
    st::reset_io_stats();
    Batch data;
    data.input =
        st::io::read_hdf5(c.data_file, "train/" + std::to_string(step) + "/input", mesh, layout);
    data.target =
        st::io::read_hdf5(c.data_file, "train/" + std::to_string(step) + "/target", mesh, layout);
    const double read_bytes = static_cast<double>(st::io_stats().bytes_read);
    const double read_max = max_over_ranks(read_bytes), read_min = -max_over_ranks(-read_bytes);
    auto t1 = clock::now();
    const int64_t base = st::memory_stats().current_bytes;
    st::reset_peak_memory_stats();
    opt.zero_grad();
    auto loss = (predict(net, data.input) - data.target).pow(2).mean();
    loss.backward();
    opt.step();
    const double peak_mb = max_over_ranks((st::memory_stats().peak_bytes - base) / 1e6);
    auto t2 = clock::now();
    const double l = loss.item<double>();
    if (step == first_step) first_loss = l;
    last_loss = l;
    const double solve_s = std::chrono::duration<double>(t1 - t0).count();
    const double train_s = std::chrono::duration<double>(t2 - t1).count();
    if (root && (step % c.log_every == 0 || step + 1 == first_step + c.steps)) {
      // Per sample: the batch's samples are spread over the "data" mesh dim.
      const double per_sample = static_cast<double>(c.batch) / c.data;
      std::printf(
          "step %3lld  loss %.6f  %.2f samples/s (train %.3fs, solver+io %.3fs)  peak tensor "
          "memory/rank %.1f MB  io read/rank/sample %.0f..%.0f B of a %.0f B sample\n",
          (long long)step, l, c.batch / (solve_s + train_s), train_s, solve_s, peak_mb,
          read_min / per_sample, read_max / per_sample, sample_bytes);
      std::fflush(stdout);
    }
  }
  {
    // Parameters + gradients + Adam's two moments held by this rank, against
    // every rank holding them all (distribute_module). Measured from the
    // tensors themselves: the shards (fully_shard) or the parameters.
    double held = 0, replicated = 0;
    for (const auto& p : net->parameters()) replicated += 4.0 * p.numel() * p.element_size();
    for (const auto& t : trained_parameters(*net, c)) held += 4.0 * t.numel() * t.element_size();
    held = max_over_ranks(held);
    if (root) {
      std::printf(
          "parameter+gradient+Adam state bytes/rank: %.0f (replicated: %.0f; ratio %.4f, 1/D = "
          "%.4f)\n",
          held, replicated, held / replicated, 1.0 / static_cast<double>(c.data));
    }
  }
  if (root && c.steps > 0) {
    std::printf("loss %.6f -> %.6f (%.1fx lower)\n", first_loss, last_loss,
                first_loss / std::max(1e-30, last_loss));
  }

  // Validation sample (never trained on): gathered, drawn on rank 0.
  {
    torch::NoGradGuard no_grad;
    auto val = make_batch(mesh, c.data, c.size, c.solver_steps, 999999);
    auto pred = predict(net, val.input);
    auto vloss = (pred - val.target).pow(2).mean().item<double>();
    auto x = st::ShardTensor(val.input).full_tensor()[0];
    auto p = st::ShardTensor(pred).full_tensor()[0][0];
    auto y = st::ShardTensor(val.target).full_tensor()[0][0];
    // Baseline: "nothing happens" (predict u0).
    auto base_loss = (x[0] - y).pow(2).mean().item<double>();
    if (root) {
      std::printf("validation: mse %.6f (predicting u0 unchanged: %.6f)\n", vloss, base_loss);
      auto lo = std::min(y.min().item<double>(), x[0].min().item<double>());
      auto hi = std::max(y.max().item<double>(), x[0].max().item<double>());
      auto err = (p - y).abs();
      auto shrink = [&](const at::Tensor& t) {
        const int64_t f = std::max<int64_t>(1, t.size(0) / 512);
        return f == 1 ? t : at::avg_pool2d(t.unsqueeze(0).unsqueeze(0), f).squeeze(0).squeeze(0);
      };
      const double emax = std::max(1e-6, err.max().item<double>());
      if (!c.png.empty()) {
        // Note [validation picture] (examples/models/diffusion.h): titled panels with colour
        // bars; u0, prediction and target share one colour range.
        const int64_t shown = shrink(y).size(0);
        const std::string line = diffusion::draw_panels(
            c.png,
            {{"u0", shrink(x[0]), lo, hi},
             {"log kappa", shrink(x[1]), x[1].min().item<double>(), x[1].max().item<double>()},
             {"prediction", shrink(p), lo, hi},
             {"target", shrink(y), lo, hi},
             {"|error|", shrink(err), 0.0, emax}},
            "unet_train: validation sample after " + std::to_string(first_step + c.steps) +
                " training steps, " + std::to_string(c.size) + "x" + std::to_string(c.size) +
                " grid" +
                (shown != c.size
                     ? " (shown at " + std::to_string(shown) + "x" + std::to_string(shown) + ")"
                     : std::string()));
        std::printf("%s (|error| up to %.3g)\n", line.c_str(), emax);
      }
    }
  }
  if (!c.checkpoint.empty()) {
    st::io::save_checkpoint(c.checkpoint, mesh,
                            c.fully_shard
                                ? st::io::CheckpointState()
                                      .tensors(st::io::fully_shard_tensors(*net, mesh, &opt))
                                      .step(first_step + c.steps)
                                : st::io::CheckpointState().module(net.get()).optimizer(&opt).step(
                                      first_step + c.steps));
    if (root) {
      std::printf("saved sharded checkpoint %s/checkpoint.h5 (step %lld; --resume continues)\n",
                  c.checkpoint.c_str(), (long long)(first_step + c.steps));
    }
  }
  const bool ok = verify_small(c, mesh, root);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "rank " << st::world_rank() << ": " << e.what() << "\n";
    rc = 2;
  }
  // Same verdict everywhere.
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
