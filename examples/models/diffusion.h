#pragma once
// The main job's data: a domain-parallel diffusion solver (u_t = div(kappa
// grad u), zero-flux walls, explicit flux-form steps) that generates each
// sample on the fly on the sharded grid, and the validation picture (Note
// [validation picture]: titled panels with colour bars, drawn by
// examples/plot_panels.py). Shared by
// examples/unet_train.cpp and examples/fno_train.cpp, so that both train on
// exactly the same data.
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <ATen/CPUGeneratorImpl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace diffusion {

namespace st = shardtensor;

// ---- the solver -------------------------------------------------------------------

constexpr int kWaves = 8;
constexpr int kModes = 4;
constexpr double kLogKappaAmp = 0.4;  // per mode: kappa in [exp(-1.6), exp(1.6)]

/// The random parameters of one sample, identical on every rank (drawn from
/// the sample's seed); the fields are evaluated per subdomain.
/// u0: plane waves of wavelength 8..32 grid cells in random directions (so
/// that k explicit steps visibly damp them, at any resolution); log kappa: a
/// few large-scale Fourier modes of the unit square.
struct SampleParams {
  double amp[kWaves], wavelength[kWaves], angle[kWaves], wphase[kWaves];
  double b[kModes], p[kModes], q[kModes], phase[kModes];
};

inline SampleParams draw(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto r = at::rand({4 * kWaves + 4 * kModes}, gen, at::kDouble);
  auto a = r.accessor<double, 1>();
  SampleParams s{};
  int k = 0;
  for (int i = 0; i < kWaves; ++i) {
    s.amp[i] = (2 * a[k++] - 1) / std::sqrt(static_cast<double>(kWaves));
    s.wavelength[i] = 8 + 24 * a[k++];
    s.angle[i] = M_PI * a[k++];
    s.wphase[i] = 2 * M_PI * a[k++];
  }
  for (int m = 0; m < kModes; ++m) {
    s.b[m] = kLogKappaAmp * (2 * a[k++] - 1);
    s.p[m] = std::floor(7 * a[k++]) - 3;  // integer wave numbers in [-3, 3]
    s.q[m] = std::floor(7 * a[k++]) - 3;
    s.phase[m] = 2 * M_PI * a[k++];
  }
  return s;
}

/// Fields of one sample at rows [r0, r0 + rows) of an n x n grid: {u0, kappa}, [rows, n] each.
inline std::pair<at::Tensor, at::Tensor> fields(const SampleParams& s, int64_t n, int64_t r0,
                                                int64_t rows) {
  auto opt = at::TensorOptions().dtype(at::kFloat);
  auto I = at::arange(r0, r0 + rows, opt).unsqueeze(1);  // global row index
  auto J = at::arange(0, n, opt).unsqueeze(0);           // column index
  auto u = at::zeros({rows, n}, opt);
  for (int i = 0; i < kWaves; ++i) {
    const double w = 2 * M_PI / s.wavelength[i];
    u +=
        s.amp[i] * at::sin(w * (std::cos(s.angle[i]) * I + std::sin(s.angle[i]) * J) + s.wphase[i]);
  }
  auto X = (I + 0.5) / n, Y = (J + 0.5) / n;  // unit-square coordinates
  auto logk = at::zeros({rows, n}, opt);
  for (int m = 0; m < kModes; ++m) {
    logk += s.b[m] * at::sin(2 * M_PI * (s.p[m] * X + s.q[m] * Y) + s.phase[m]);
  }
  return {u, at::exp(logk)};
}

/// The sharded fields u0, kappa ([B, 1, n, n], Shard 0 over data, Shard 2 over
/// domain) of the global samples first_sample .. first_sample + batch - 1,
/// and the solution after `k` steps. Collective over the mesh.
struct Batch {
  at::Tensor input;   // ShardTensor [B, 2, n, n]
  at::Tensor target;  // ShardTensor [B, 1, n, n]
};

inline Batch make_batch(const st::DeviceMesh& mesh, int64_t batch, int64_t n, int64_t k,
                        uint64_t first_sample) {
  torch::NoGradGuard no_grad;
  const st::Placements pl{st::Shard{0}, st::Shard{2}};
  auto spec1 =
      std::make_shared<const st::ShardSpec>(mesh, pl, std::vector<int64_t>{batch, 1, n, n});
  auto spec2 =
      std::make_shared<const st::ShardSpec>(mesh, pl, std::vector<int64_t>{batch, 2, n, n});
  const auto off = spec1->local_offsets();
  const auto shape = spec1->local_shape();
  std::vector<at::Tensor> us, ks;
  for (int64_t b = 0; b < shape[0]; ++b) {
    auto s = draw(1000003ull * (first_sample + off[0] + b) + 17);
    auto [u, kap] = fields(s, n, off[2], shape[2]);
    us.push_back(u.unsqueeze(0));
    ks.push_back(kap.unsqueeze(0));
  }
  auto u0 = at::stack(us).contiguous();     // [b, 1, rows, n]
  auto kappa = at::stack(ks).contiguous();  // [b, 1, rows, n]
  // Face diffusivities (arithmetic means) from one halo of kappa; zero-flux
  // walls: PadMode::Replicate makes the ghost equal the edge, so the flux
  // through the wall vanishes.
  auto kst = st::ShardTensor::from_local_unchecked(kappa, spec1);
  auto kr = st::halo_exchange(kst, 2, 1, 1, st::PadMode::Replicate);  // [b,1,rows+2,n]
  const int64_t rows = shape[2];
  auto k_up = 0.5 * (kr.narrow(2, 0, rows) + kappa), k_dn = 0.5 * (kr.narrow(2, 2, rows) + kappa);
  auto kc = at::constant_pad_nd(kappa, {1, 1}, 0);  // columns are not sharded: local pad
  kc.select(3, 0).copy_(kappa.select(3, 0));
  kc.select(3, n + 1).copy_(kappa.select(3, n - 1));
  auto k_lf = 0.5 * (kc.narrow(3, 0, n) + kappa), k_rt = 0.5 * (kc.narrow(3, 2, n) + kappa);
  // Stable for every sample: dt <= h^2 / (4 kappa_max), kappa_max <= exp(kModes * amp).
  const double h = 1.0 / n;
  const double dt = 0.2 * h * h / std::exp(kModes * kLogKappaAmp);
  const double c = dt / (h * h);
  at::Tensor u = u0.clone();
  for (int64_t step = 0; step < k; ++step) {
    auto ust = st::ShardTensor::from_local_unchecked(u, spec1);
    auto ur = st::halo_exchange(ust, 2, 1, 1, st::PadMode::Replicate);
    auto uc = at::replication_pad2d(u, {1, 1, 0, 0});
    auto flux = k_up * (ur.narrow(2, 0, rows) - u) + k_dn * (ur.narrow(2, 2, rows) - u) +
                k_lf * (uc.narrow(3, 0, n) - u) + k_rt * (uc.narrow(3, 2, n) - u);
    u = u + c * flux;
  }
  Batch out;
  out.input =
      st::ShardTensor::from_local_unchecked(at::cat({u0, kappa.log()}, 1).contiguous(), spec2);
  out.target = st::ShardTensor::from_local_unchecked(u, spec1);
  return out;
}

// ---- the validation picture ------------------------------------------------------

/// One panel of the validation picture: a 2-D field, its title and its colour range.
struct Panel {
  std::string title;
  at::Tensor field;  // 2-D, any floating dtype
  double lo = 0, hi = 1;
};

namespace detail {

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

inline std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";  // Python's json module reads these
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

inline std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

/// Runs argv[0] (PATH is searched) with the process's environment and waits; the exit status,
/// 128 + N for a signal N, or -1 with `why` set when it could not start.
inline int run_and_wait(const std::vector<std::string>& args, std::string& why) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = -1;
  // posix_spawn, not fork: the child does not copy this rank's address space, and
  // nothing runs between fork and exec in an MPI process.
  const int rc = posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    why = "cannot run " + args[0] + ": " + std::strerror(rc);
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      why = std::string("waitpid: ") + std::strerror(errno);
      return -1;
    }
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
}

}  // namespace detail

// Note [validation picture]
// The examples' picture (input, prediction, target, error side by side) is drawn by
// examples/plot_panels.py with matplotlib, so that every panel carries its title and a
// colour bar: rank 0 writes the gathered fields as <png stem>_panels.json (titles, shapes,
// colour ranges) + <png stem>_panels.f32 (raw float32) next to the PNG and runs the script
// with the project's Python (SHARDTENSOR_PYTHON and SHARDTENSOR_PLOT_PANELS, compiled in by
// examples/CMakeLists.txt). The Python examples call the same script's plot_panels(). When
// the picture is drawn the two data files are removed; when it cannot be (no Python, no
// matplotlib) they stay and the log line says how to draw them later. A missing picture
// never fails the job: training, the checkpoint and the MATCH check do not depend on it.

/// Draws `panels` side by side into `png`, each with its title and a colour bar, under
/// `suptitle` (Note [validation picture]). Local: call it on one rank, with gathered
/// fields. Never throws; returns one line for the log that says what was written, or why
/// the picture is missing and where its data is.
inline std::string draw_panels(const std::string& png, const std::vector<Panel>& panels,
                               const std::string& suptitle) {
  const bool dot_png = png.size() > 4 && png.compare(png.size() - 4, 4, ".png") == 0;
  const std::string stem = dot_png ? png.substr(0, png.size() - 4) : png;
  const std::string header = stem + "_panels.json", data = stem + "_panels.f32";
  std::string titles;
  for (const auto& p : panels) titles += (titles.empty() ? "" : " | ") + p.title;
  try {
    FILE* f = std::fopen(data.c_str(), "wb");
    if (!f) return "could not write " + data + ": " + std::strerror(errno) + " (no picture)";
    std::string panels_json;
    bool written = true;
    for (const auto& p : panels) {
      TORCH_CHECK(p.field.dim() == 2, "draw_panels: panel '", p.title, "' is not 2-D");
      const at::Tensor t = p.field.to(at::kFloat).contiguous();
      written =
          written && std::fwrite(t.data_ptr<float>(), sizeof(float), static_cast<size_t>(t.numel()),
                                 f) == static_cast<size_t>(t.numel());
      panels_json += std::string(panels_json.empty() ? "" : ",\n  ") +
                     "{\"title\": " + detail::json_string(p.title) + ", \"shape\": [" +
                     std::to_string(t.size(0)) + ", " + std::to_string(t.size(1)) +
                     "], \"vmin\": " + detail::json_number(p.lo) +
                     ", \"vmax\": " + detail::json_number(p.hi) + ", \"cmap\": \"viridis\"}";
    }
    written = (std::fclose(f) == 0) && written;
    const uint16_t one = 1;
    const bool little = *reinterpret_cast<const unsigned char*>(&one) == 1;
    FILE* h = written ? std::fopen(header.c_str(), "w") : nullptr;
    if (h) {
      const std::string text = "{\"format\": \"shardtensor-panels-1\", \"data\": " +
                               detail::json_string(detail::base_name(data)) +
                               ", \"dtype\": \"float32\", \"byte_order\": \"" +
                               (little ? "little" : "big") +
                               "\",\n \"png\": " + detail::json_string(detail::base_name(png)) +
                               ", \"suptitle\": " + detail::json_string(suptitle) +
                               ",\n \"panels\": [\n  " + panels_json + "]}\n";
      written = std::fputs(text.c_str(), h) >= 0;
      written = (std::fclose(h) == 0) && written;
    } else {
      written = false;
    }
    if (!written) {
      std::remove(data.c_str());
      std::remove(header.c_str());
      return "could not write " + header + " / " + data + " (no picture)";
    }
#if defined(SHARDTENSOR_PYTHON) && defined(SHARDTENSOR_PLOT_PANELS)
    const std::string python = SHARDTENSOR_PYTHON, script = SHARDTENSOR_PLOT_PANELS;
    std::string why;
    const int status = detail::run_and_wait({python, script, header}, why);
    if (status == 0) {
      std::remove(data.c_str());
      std::remove(header.c_str());
      return "wrote " + png + ": " + titles;
    }
    if (status == 3) {
      why = "matplotlib is not available to " + python;
    } else if (why.empty()) {
      why = script + " ended with status " + std::to_string(status);
    }
#else
    const std::string python = "python3", script = "examples/plot_panels.py";
    const std::string why = "built without the plotting script";
#endif
    return "could not draw " + png + " (" + why + "); its data is in " + header + " + " +
           detail::base_name(data) + " (" + titles + "): `" + python + " " + script + " " + header +
           "` draws it";
  } catch (const std::exception& e) {
    return "could not draw " + png + ": " + e.what();
  }
}

}  // namespace diffusion
