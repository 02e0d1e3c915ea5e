// Sharded checkpoints (io/checkpoint.h): Note [checkpoint layout] and
// Note [crash-safe checkpoint].
#include <shardtensor/io/checkpoint.h>
#include <shardtensor/io/hdf5.h>
#include <shardtensor/nn/fully_shard.h>
#include <shardtensor/tensor/shard_tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <system_error>

#include "comm/agree.h"
#include "io/h5.h"

namespace shardtensor::io {

namespace {

constexpr const char* kFile = "checkpoint.h5";
constexpr int64_t kFormatVersion = 1;

std::string final_path(const std::string& dir) { return dir + "/" + kFile; }
std::string temp_path(const std::string& dir) { return dir + "/" + kFile + ".tmp"; }

/// The ScalarType whose name is `name` (as c10::toString writes it), if any.
std::optional<at::ScalarType> dtype_named(const std::string& name) {
  for (auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong, at::kShort,
                 at::kChar, at::kByte, at::kBool}) {
    if (name == c10::toString(t)) return t;
  }
  return std::nullopt;
}

/// Reads a whole dataset on every rank as a plain tensor in its saved torch dtype.
at::Tensor read_plain(detail::File& file, const std::string& name, const DeviceMesh& mesh,
                      const DatasetInfo& info) {
  ReadOptions ro;
  if (auto t = dtype_named(info.torch_dtype)) ro.dtype(*t);
  Placements rep(static_cast<size_t>(mesh.ndim()), Replicate{});
  auto r = detail::read_dataset(file, name, mesh, rep, ro, false);
  return ShardTensor(r.tensor).local();
}

}  // namespace

bool checkpoint_exists(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(final_path(dir), ec);
}

void save_checkpoint(const std::string& dir, const DeviceMesh& mesh, const CheckpointState& state) {
  const std::string what = "save_checkpoint('" + dir + "')";
  // Rank 0 creates the directory; everyone agrees it is there.
  std::string err;
  if (mesh.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) err = "cannot create the directory: " + ec.message();
  }
  comm::check_all(mesh, err.empty(), what, err);
  err.clear();
  if (!std::filesystem::is_directory(dir)) err = "the directory is not visible on this rank";
  comm::check_all(mesh, err.empty(), what, err);

  const std::string tmp = temp_path(dir);
  {
    detail::File file(tmp, mesh, detail::OpenMode::Truncate);
    detail::write_root_int(file, "step", state.step());
    detail::write_root_int(file, "format_version", kFormatVersion);
    WriteOptions wo;
    for (const auto& [name, t] : state.tensors()) {
      detail::write_dataset(file, "tensors/" + name, t, wo);
    }
    if (state.module() != nullptr) {
      for (const auto& p : state.module()->named_parameters(/*recurse=*/true)) {
        detail::write_dataset(file, "module/params/" + p.key(), p.value(), wo);
      }
      for (const auto& b : state.module()->named_buffers(/*recurse=*/true)) {
        detail::write_dataset(file, "module/buffers/" + b.key(), b.value(), wo);
      }
    }
    if (state.optimizer() != nullptr) {
      // Rank 0's serialized state is the one written (the state is replicated);
      // the others only need its size to take part in the collective write.
      std::string bytes;
      if (mesh.rank() == 0) {
        torch::serialize::OutputArchive archive;
        state.optimizer()->save(archive);
        std::ostringstream os;
        archive.save_to(os);
        bytes = os.str();
      }
      const int64_t n = comm::broadcast_record(mesh, {static_cast<int64_t>(bytes.size())}, 0).at(0);
      at::Tensor blob = at::empty({n}, at::TensorOptions().dtype(at::kByte));
      if (mesh.rank() == 0 && n > 0) std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
      detail::write_dataset(file, "optimizer/state", blob, wo);
    }
    {
      // The saving mesh's shape, for the record.
      auto shape = at::tensor(mesh.shape(), at::TensorOptions().dtype(at::kLong));
      detail::write_dataset(file, "meta/mesh_shape", shape, wo);
    }
    file.close();  // agreed: every rank's data is in the file
  }
  // Note [crash-safe checkpoint]: only now does the checkpoint get its name.
  err.clear();
  if (mesh.rank() == 0 && std::rename(tmp.c_str(), final_path(dir).c_str()) != 0) {
    err = std::string("cannot rename ") + tmp + " to " + final_path(dir) + ": " +
          std::strerror(errno);
  }
  comm::check_all(mesh, err.empty(), what, err);
}

LoadedCheckpoint load_checkpoint(const std::string& dir, const DeviceMesh& mesh,
                                 const LoadOptions& opts) {
  const std::string what = "load_checkpoint('" + dir + "')";
  const std::string path = final_path(dir);
  comm::check_all(mesh, checkpoint_exists(dir), what,
                  "no complete checkpoint (" + path + " does not exist)");
  detail::File file(path, mesh, detail::OpenMode::Read);
  LoadedCheckpoint out;
  out.step = detail::read_root_int(file, "step");
  const int64_t version = detail::read_root_int(file, "format_version");
  file.agree(
      version == kFormatVersion, what,
      "format_version " + std::to_string(version) + " is not " + std::to_string(kFormatVersion));
  {
    auto info = detail::dataset_info(file, "meta/mesh_shape");
    auto t = read_plain(file, "meta/mesh_shape", mesh, info);
    out.saved_mesh_shape.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  }

  // Named tensors: those with a layout are read as ShardTensors (each rank its piece).
  std::vector<std::string> names;
  std::function<void(const std::string&)> walk = [&](const std::string& group) {
    for (const auto& n : detail::list_group(file, "tensors/" + group)) {
      const std::string full = group.empty() ? n : group + "/" + n;
      // A group holds further names; a dataset is a leaf.
      if (detail::list_group(file, "tensors/" + full).empty()) {
        names.push_back(full);
      } else {
        walk(full);
      }
    }
  };
  walk("");
  std::string missing;
  for (const auto& [name, layout] : opts.layouts()) {
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      missing += (missing.empty() ? "" : ", ") + name;
    }
  }
  file.agree(missing.empty(), what, "the checkpoint has no tensor named " + missing);
  for (const auto& name : names) {
    const std::string ds = "tensors/" + name;
    auto info = detail::dataset_info(file, ds);
    auto it = opts.layouts().find(name);
    if (it == opts.layouts().end()) {
      out.tensors[name] = read_plain(file, ds, mesh, info);
      continue;
    }
    ReadOptions ro;
    ro.sizes(it->second.sizes);
    if (auto t = dtype_named(info.torch_dtype)) ro.dtype(*t);
    out.tensors[name] =
        detail::read_dataset(file, ds, mesh, it->second.placements, ro, false).tensor;
  }

  if (opts.module() != nullptr) {
    torch::NoGradGuard no_grad;
    auto load_into = [&](const std::string& group, const std::string& name, at::Tensor target) {
      const std::string ds = group + name;
      const bool there = file.exists(ds);
      file.agree(there, what, "the checkpoint has no '" + ds + "' for the module");
      auto info = detail::dataset_info(file, ds);
      file.agree(info.shape == target.sizes().vec(), what,
                 "'" + ds + "' has shape " + c10::str(c10::IntArrayRef(info.shape)) +
                     " but the module's is " + c10::str(target.sizes()));
      auto v = read_plain(file, ds, mesh, info);
      target.copy_(v);
    };
    for (const auto& p : opts.module()->named_parameters(true)) {
      load_into("module/params/", p.key(), p.value());
    }
    for (const auto& b : opts.module()->named_buffers(true)) {
      load_into("module/buffers/", b.key(), b.value());
    }
  }
  if (opts.optimizer() != nullptr) {
    file.agree(file.exists("optimizer/state"), what, "the checkpoint has no optimizer state");
    auto info = detail::dataset_info(file, "optimizer/state");
    auto blob = read_plain(file, "optimizer/state", mesh, info).contiguous();
    std::string err;
    try {
      std::istringstream is(std::string(static_cast<const char*>(blob.data_ptr()),
                                        static_cast<size_t>(blob.numel())));
      torch::serialize::InputArchive archive;
      archive.load_from(is);
      opts.optimizer()->load(archive);
    } catch (const std::exception& e) {
      err = std::string("cannot load the optimizer state: ") + e.what();
    }
    file.agree(err.empty(), what, err);
  }
  file.close();
  return out;
}

// --- fully_shard units (Note [fully_shard checkpoint]) ------------------------

namespace {

/// The optimizer's state tensors of one shard, by name (created empty-valued
/// with zeros when `create` and the shard has no state yet).
struct ShardState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int64_t step = 0;
};

std::vector<std::string> state_names(torch::optim::Optimizer* opt) {
  if (opt == nullptr) return {};
  if (auto* a = dynamic_cast<torch::optim::Adam*>(opt)) {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(a->defaults());
    if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return {"exp_avg", "exp_avg_sq"};
  }
  if (auto* a = dynamic_cast<torch::optim::AdamW*>(opt)) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(a->defaults());
    if (o.amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return {"exp_avg", "exp_avg_sq"};
  }
  if (auto* sgd = dynamic_cast<torch::optim::SGD*>(opt)) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(sgd->defaults());
    if (o.momentum() != 0) return {"momentum_buffer"};
    return {};
  }
  TORCH_CHECK(false,
              "fully_shard checkpoint: only Adam, AdamW and SGD optimizer state can be saved "
              "per shard");
}

template <typename State>
at::Tensor& adam_slot(State& s, const std::string& name) {
  if (name == "exp_avg") return s.exp_avg();
  if (name == "exp_avg_sq") return s.exp_avg_sq();
  return s.max_exp_avg_sq();
}

/// Pointers to the state tensors `names` of `shard` in `opt` (those absent
/// are made, zero; nothing else is added to the state).
std::vector<at::Tensor*> state_slots(torch::optim::Optimizer* opt, const at::Tensor& shard,
                                     const std::vector<std::string>& names, int64_t** step) {
  *step = nullptr;
  std::vector<at::Tensor*> out;
  if (opt == nullptr || names.empty()) return out;
  auto& states = opt->state();
  void* key = shard.unsafeGetTensorImpl();
  auto slot = [&](at::Tensor& t) {
    if (!t.defined()) t = at::zeros_like(shard.detach(), at::MemoryFormat::Contiguous);
    out.push_back(&t);
  };
  auto fill = [&](auto& st) {
    for (const auto& n : names) slot(adam_slot(st, n));
    *step = &st.step();
  };
  if (dynamic_cast<torch::optim::Adam*>(opt)) {
    if (!states.count(key)) states[key] = std::make_unique<torch::optim::AdamParamState>();
    fill(static_cast<torch::optim::AdamParamState&>(*states[key]));
  } else if (dynamic_cast<torch::optim::AdamW*>(opt)) {
    if (!states.count(key)) states[key] = std::make_unique<torch::optim::AdamWParamState>();
    fill(static_cast<torch::optim::AdamWParamState&>(*states[key]));
  } else {
    if (!states.count(key)) states[key] = std::make_unique<torch::optim::SGDParamState>();
    slot(static_cast<torch::optim::SGDParamState&>(*states[key]).momentum_buffer());
  }
  return out;
}

/// Shard(0) over the data dim, replicated elsewhere, with the real (unpadded) extents.
TensorLayout unit_layout(const FullyShard& u, const DeviceMesh& mesh) {
  TORCH_CHECK(u.mesh() == mesh,
              "fully_shard checkpoint: a unit of the module lives on another mesh than ", mesh);
  const int64_t data_dim = u.data_dim();
  TensorLayout l;
  l.placements.assign(static_cast<size_t>(mesh.ndim()), Replicate{});
  l.placements[static_cast<size_t>(data_dim)] = Shard{0};
  ShardSizes sizes(static_cast<size_t>(mesh.ndim()));
  for (int64_t c = 0; c < mesh.size(data_dim); ++c) {
    sizes[static_cast<size_t>(data_dim)].push_back(
        std::clamp<int64_t>(u.numel() - c * u.shard_numel(), 0, u.shard_numel()));
  }
  l.sizes = sizes;
  return l;
}

int64_t my_extent(const TensorLayout& l, const DeviceMesh& mesh) {
  for (size_t m = 0; m < l.placements.size(); ++m) {
    if (std::holds_alternative<Shard>(l.placements[m])) {
      return (*l.sizes)[m][static_cast<size_t>(mesh.coordinate()[m])];
    }
  }
  return 0;
}

}  // namespace

NamedTensors fully_shard_tensors(torch::nn::Module& module, const DeviceMesh& mesh,
                                 torch::optim::Optimizer* optimizer) {
  const auto names = state_names(optimizer);
  NamedTensors out;
  const auto units = fully_shard_units(module);
  for (size_t k = 0; k < units.size(); ++k) {
    const auto& u = units[k];
    const TensorLayout l = unit_layout(u, mesh);
    const int64_t n = my_extent(l, mesh);
    const std::string base = "fsdp/" + std::to_string(k) + "/";
    auto piece = [&](const at::Tensor& t) {
      return ShardTensor::from_local(t.detach().narrow(0, 0, n).contiguous(), mesh, l.placements,
                                     l.sizes);
    };
    out.emplace_back(base + "param", piece(u.shard()));
    int64_t* step = nullptr;
    const auto slots = state_slots(optimizer, u.shard(), names, &step);
    for (size_t i = 0; i < slots.size(); ++i) out.emplace_back(base + names[i], piece(*slots[i]));
    if (step != nullptr) {
      out.emplace_back(base + "step", at::full({1}, *step, at::TensorOptions().dtype(at::kLong)));
    }
  }
  return out;
}

TensorLayouts fully_shard_layouts(torch::nn::Module& module, const DeviceMesh& mesh,
                                  torch::optim::Optimizer* optimizer) {
  const auto names = state_names(optimizer);
  TensorLayouts out;
  const auto units = fully_shard_units(module);
  for (size_t k = 0; k < units.size(); ++k) {
    const TensorLayout l = unit_layout(units[k], mesh);
    const std::string base = "fsdp/" + std::to_string(k) + "/";
    out[base + "param"] = l;
    for (const auto& n : names) out[base + n] = l;
  }
  return out;
}

void load_fully_shard_tensors(const LoadedCheckpoint& loaded, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer) {
  const auto names = state_names(optimizer);
  const auto units = fully_shard_units(module);
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < units.size(); ++k) {
    const auto& u = units[k];
    const std::string base = "fsdp/" + std::to_string(k) + "/";
    auto take = [&](const std::string& name, const at::Tensor& into) {
      auto it = loaded.tensors.find(base + name);
      TORCH_CHECK(it != loaded.tensors.end(), "fully_shard checkpoint: no tensor '", base + name,
                  "' (was it saved with fully_shard_tensors for the same model and optimizer?)");
      TORCH_CHECK(ShardTensor::is_shard_tensor(it->second) && it->second.numel() == u.numel(),
                  "fully_shard checkpoint: '", base + name, "' has ", it->second.numel(),
                  " elements, the unit has ", u.numel(), " (load it with fully_shard_layouts)");
      const at::Tensor local = ShardTensor(it->second).local();
      into.zero_();
      into.narrow(0, 0, local.numel()).copy_(local);
    };
    u.reshard();
    take("param", u.shard().detach());
    int64_t* step = nullptr;
    const auto slots = state_slots(optimizer, u.shard(), names, &step);
    for (size_t i = 0; i < slots.size(); ++i) take(names[i], *slots[i]);
    if (step != nullptr) {
      auto it = loaded.tensors.find(base + "step");
      TORCH_CHECK(it != loaded.tensors.end(), "fully_shard checkpoint: no tensor '", base, "step'");
      *step = it->second.item<int64_t>();
    }
  }
}

}  // namespace shardtensor::io
