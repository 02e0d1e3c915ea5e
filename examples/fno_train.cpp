// A Fourier neural operator learns the main job's diffusion solver, trained
// domain-parallel with shardtensor (make demo DEMO=fno_train).
//
//   mpirun --oversubscribe -np 4 build/examples/fno_train [flags]
//
// Data: examples/models/diffusion.h (the same domain-parallel solver as
// unet_train): input [u0, log kappa], target u after k explicit steps. The
// model: models::FNO2d (examples/models/fno.h), plain libtorch written the
// usual PyTorch way (rfft2, zeros spectrum, two mode corners by slice
// assignment with einsum, irfft2(s={H, W})). The grid is sharded along H over
// the "domain" mesh dim (and the batch over "data"); the FFTs become pencil
// transforms with one all-to-all each way (Note [fft layout]).
//
// At the end: one sharded Adam step on a 64x64 grid in float64 is compared
// with a single-process step (loss and every parameter); prints MATCH or
// MISMATCH, and the exit code says so. A PNG (--png, "" for none) shows input,
// prediction, target and error of one validation sample, each panel titled and
// with a colour bar (Note [validation picture] in examples/models/diffusion.h).
#include <mpi.h>
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "models/check.h"
#include "models/diffusion.h"
#include "models/fno.h"

namespace st = shardtensor;

namespace {

struct Config {
  int64_t size = 128;
  int64_t steps = 30;
  int64_t solver_steps = 100;
  double lr = 3e-3;
  int64_t data = 1, domain = -1;
  int64_t batch = -1;
  int64_t width = 16;
  int64_t modes = 12;
  std::string png = "fno_train.png";
  int64_t log_every = 5;
};

[[noreturn]] void usage(const std::string& why) {
  if (st::world_rank() == 0) {
    std::cerr << "fno_train: " << why << "\n"
              << "flags: --size N --steps S --solver-steps K --lr LR --mesh DATAxDOMAIN "
                 "--batch B --width C --modes M --png PATH --log-every N\n";
  }
  throw std::invalid_argument(why);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value for " + a);
      return argv[++i];
    };
    if (a == "--size") {
      c.size = std::stoll(value());
    } else if (a == "--steps") {
      c.steps = std::stoll(value());
    } else if (a == "--solver-steps") {
      c.solver_steps = std::stoll(value());
    } else if (a == "--lr") {
      c.lr = std::stod(value());
    } else if (a == "--mesh") {
      std::string m = value();
      auto x = m.find('x');
      if (x == std::string::npos) usage("--mesh wants DATAxDOMAIN, e.g. 1x4");
      c.data = std::stoll(m.substr(0, x));
      c.domain = std::stoll(m.substr(x + 1));
    } else if (a == "--batch") {
      c.batch = std::stoll(value());
    } else if (a == "--width") {
      c.width = std::stoll(value());
    } else if (a == "--modes") {
      c.modes = std::stoll(value());
    } else if (a == "--png") {
      c.png = value();
    } else if (a == "--log-every") {
      c.log_every = std::max<int64_t>(1, std::stoll(value()));
    } else {
      usage("unknown flag " + a);
    }
  }
  return c;
}

using check::max_over_ranks;

models::FNOOptions model_options(const Config& c, int64_t modes) {
  return models::FNOOptions(2, 1).width(c.width).modes1(modes).modes2(modes);
}

/// The emulator predicts the change: u_k = u0 + FNO([u0, log kappa]).
at::Tensor predict(models::FNO2d& net, const at::Tensor& input) {
  return input.narrow(1, 0, 1) + net->forward(input);
}

/// One sharded Adam step on a 64x64 grid in float64 against a single-process
/// step: the same model, the same samples (gathered), the same optimizer.
bool verify_small(const Config& c, const st::DeviceMesh& mesh, bool root) {
  const int64_t n = 64, batch = std::max<int64_t>(2, mesh.size(0));
  auto data = diffusion::make_batch(mesh, batch, n, 20, 424242);
  auto to_double = [](const at::Tensor& t) {
    st::ShardTensor s(t);
    return at::Tensor(
        st::ShardTensor::from_local_unchecked(s.local().to(at::kDouble), s.spec_ptr()));
  };
  data.input = to_double(data.input);
  data.target = to_double(data.target);
  auto x = st::ShardTensor(data.input).full_tensor();
  auto y = st::ShardTensor(data.target).full_tensor();
  const int64_t modes = std::min<int64_t>(c.modes, 8);
  torch::manual_seed(99);
  models::FNO2d ref(model_options(c, modes));
  ref->to(at::kDouble);
  torch::manual_seed(99);
  models::FNO2d net(model_options(c, modes));
  net->to(at::kDouble);
  st::distribute_module(*net, mesh);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(c.lr));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(c.lr));
  auto ref_loss = (predict(ref, x) - y).pow(2).mean();
  ref_loss.backward();
  ref_opt.step();
  auto loss = (predict(net, data.input) - data.target).pow(2).mean();
  loss.backward();
  opt.step();
  // float64: summation-order noise is ~1e-16 relative; Adam's first step
  // divides by |g| + 1e-8, so a parameter compares to within rtol 1e-8 of lr-sized moves.
  const double rtol = 1e-8, atol = 1e-10;
  const check::StepError err = check::compare_step(*net, *ref, loss, ref_loss, rtol, atol);
  const double worst = err.worst;
  const std::string& worst_name = err.where;
  const bool ok = err.ok();
  if (root) {
    std::printf(
        "check: one sharded Adam step on %lldx%lld (batch %lld, float64) vs single-process: loss "
        "%.12f vs %.12f; worst |diff|/(atol+rtol|ref|) = %.3g (%s; rtol %.0e, atol %.0e) -> %s\n",
        static_cast<long long>(n), static_cast<long long>(n), static_cast<long long>(batch),
        loss.item<double>(), ref_loss.item<double>(), worst, worst_name.c_str(), rtol, atol,
        ok ? "MATCH" : "MISMATCH");
  }
  return ok;
}

int run(int argc, char** argv) {
  Config c = parse(argc, argv);
  const int P = st::world_size();
  if (c.domain < 0) c.domain = P / c.data;
  if (c.data * c.domain != P) usage("--mesh DATAxDOMAIN must multiply to the number of ranks");
  if (c.batch < 0) c.batch = std::max<int64_t>(2, c.data);
  if (c.batch < c.data) usage("--batch must be at least DATA");
  if (2 * c.modes > c.size) usage("--modes must be at most size/2");
  auto mesh = st::DeviceMesh::create({c.data, c.domain}, {"data", "domain"});
  const bool root = mesh.rank() == 0;
  if (root) {
    std::printf(
        "fno_train: %lldx%lld grid, mesh %lld (data) x %lld (domain), batch %lld, FNO width %lld "
        "modes %lld, 4 spectral blocks, %lld solver steps, %lld training steps, Adam lr %g\n",
        (long long)c.size, (long long)c.size, (long long)c.data, (long long)c.domain,
        (long long)c.batch, (long long)c.width, (long long)c.modes, (long long)c.solver_steps,
        (long long)c.steps, c.lr);
    std::fflush(stdout);
  }
  torch::manual_seed(1);
  models::FNO2d net(model_options(c, c.modes));
  st::distribute_module(*net, mesh);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(c.lr));

  using clock = std::chrono::steady_clock;
  // A fixed training set of 4 batches, cycled (the solver is the slow part).
  std::vector<diffusion::Batch> train;
  for (int64_t i = 0; i < 4; ++i) {
    train.push_back(diffusion::make_batch(mesh, c.batch, c.size, c.solver_steps,
                                          static_cast<uint64_t>(i * c.batch)));
  }
  double first_loss = 0, last_loss = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const auto& data = train[step % train.size()];
    auto t0 = clock::now();
    const int64_t base = st::memory_stats().current_bytes;
    st::reset_peak_memory_stats();
    st::reset_comm_stats();
    opt.zero_grad();
    auto loss = (predict(net, data.input) - data.target).pow(2).mean();
    loss.backward();
    opt.step();
    const double peak_mb = max_over_ranks((st::memory_stats().peak_bytes - base) / 1e6);
    const double sent_mb = max_over_ranks(st::comm_stats().bytes_sent / 1e6);
    const double train_s = std::chrono::duration<double>(clock::now() - t0).count();
    const double l = loss.item<double>();
    if (step == 0) first_loss = l;
    last_loss = l;
    if (root && (step % c.log_every == 0 || step + 1 == c.steps)) {
      std::printf(
          "step %3lld  loss %.6f  %.2fs/step  peak tensor memory/rank %.1f MB  sent/rank "
          "%.2f MB\n",
          (long long)step, l, train_s, peak_mb, sent_mb);
      std::fflush(stdout);
    }
  }
  if (root && c.steps > 0) {
    const double ratio = first_loss / std::max(1e-30, last_loss);
    if (ratio >= 1.0) {
      std::printf("loss %.6f -> %.6f (%.1fx lower)\n", first_loss, last_loss, ratio);
    } else {
      std::printf("loss %.6f -> %.6f (%.1fx HIGHER: more steps or a lower --lr)\n", first_loss,
                  last_loss, 1.0 / ratio);
    }
  }
  {
    torch::NoGradGuard no_grad;
    auto val = diffusion::make_batch(mesh, c.data, c.size, c.solver_steps, 999999);
    auto pred = predict(net, val.input);
    auto vloss = (pred - val.target).pow(2).mean().item<double>();
    auto x = st::ShardTensor(val.input).full_tensor()[0];
    auto p = st::ShardTensor(pred).full_tensor()[0][0];
    auto y = st::ShardTensor(val.target).full_tensor()[0][0];
    auto base_loss = (x[0] - y).pow(2).mean().item<double>();
    if (root) {
      std::printf("validation: mse %.6f (predicting u0 unchanged: %.6f)\n", vloss, base_loss);
      auto lo = std::min(y.min().item<double>(), x[0].min().item<double>());
      auto hi = std::max(y.max().item<double>(), x[0].max().item<double>());
      auto err = (p - y).abs();
      const double emax = std::max(1e-6, err.max().item<double>());
      if (!c.png.empty()) {
        // Note [validation picture] (examples/models/diffusion.h).
        const std::string line = diffusion::draw_panels(
            c.png,
            {{"u0", x[0], lo, hi},
             {"log kappa", x[1], x[1].min().item<double>(), x[1].max().item<double>()},
             {"prediction", p, lo, hi},
             {"target", y, lo, hi},
             {"|error|", err, 0.0, emax}},
            "fno_train: validation sample after " + std::to_string(c.steps) + " training steps, " +
                std::to_string(c.size) + "x" + std::to_string(c.size) + " grid");
        std::printf("%s (|error| up to %.3g)\n", line.c_str(), emax);
      }
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
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
