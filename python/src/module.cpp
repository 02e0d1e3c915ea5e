// shardtensor._C: the pybind11 binding of the public C++ API (python/ layer).
//
// The pure-Python package (python/shardtensor/) is the user's API; this module
// is its thin, private back end. Tensors cross as ordinary torch tensors
// (torch's own caster, libtorch_python): a ShardTensor made here is a
// torch.Tensor whose impl is a ShardTensorImpl, and the Python layer gives it
// the Python class shardtensor.ShardTensor (Note [python ShardTensor class] in
// _tensor.py).
//
// Note [python GIL]
// ~~~~~~~~~~~~~~~~~
// Every entry point that may communicate (mesh creation, factories,
// full_tensor, redistribute, backward, distribute_module, attention, halo
// exchange, neighbour search, ghost plans and exchanges, rebalancing, init,
// finalize) releases the GIL (py::call_guard<py::gil_scoped_release>): they run
// no Python, and another Python thread of this rank keeps running while this
// one waits in MPI. Arguments are converted before, and results after, the
// guard, with the GIL held. torch's own bindings release the GIL around
// dispatch and backward, so sharded ops called through torch do the same.
//
// Placements cross as (kind, dim) pairs: kind 0 = Shard(dim), 1 = Replicate,
// 2 = Partial. Communicators cross as the integer handle mpi4py gives
// (MPI._handleof(comm)); 0 means MPI_COMM_WORLD.
#include <ATen/core/custom_class.h>
#include <shardtensor/core/launch.h>
#include <shardtensor/core/process_group.h>
#include <shardtensor/shardtensor.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace st = shardtensor;

namespace {

using PlacementCode = std::pair<int, int64_t>;
using Release = py::call_guard<py::gil_scoped_release>;

st::Placements to_placements(const std::vector<PlacementCode>& codes) {
  st::Placements out;
  out.reserve(codes.size());
  for (const auto& [kind, dim] : codes) {
    switch (kind) {
      case 0:
        out.emplace_back(st::Shard{dim});
        break;
      case 1:
        out.emplace_back(st::Replicate{});
        break;
      case 2:
        out.emplace_back(st::Partial{});
        break;
      default:
        TORCH_CHECK_VALUE(false, "shardtensor: unknown placement kind ", kind);
    }
  }
  return out;
}

std::vector<PlacementCode> from_placements(const st::Placements& placements) {
  std::vector<PlacementCode> out;
  out.reserve(placements.size());
  for (const auto& p : placements) {
    if (st::is_shard(p)) {
      out.emplace_back(0, st::shard_dim(p));
    } else if (st::is_replicate(p)) {
      out.emplace_back(1, 0);
    } else {
      out.emplace_back(2, 0);
    }
  }
  return out;
}

// An mpi4py handle (MPI._handleof) as a communicator, without calling MPI:
// OpenMPI's MPI_Comm is a pointer, MPICH's an int.
template <typename C>
C comm_cast(std::uintptr_t handle) {
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<C>(handle);
  } else {
    return static_cast<C>(handle);
  }
}

st::Comm comm_from_handle(std::uintptr_t handle) {
  if (handle == 0) return st::comm_world();
#if SHARDTENSOR_WITH_MPI
  return comm_cast<st::Comm>(handle);
#else
  TORCH_CHECK_VALUE(false,
                    "shardtensor.DeviceMesh: this shardtensor was built without MPI "
                    "(SHARDTENSOR_WITH_MPI=OFF), so it takes no MPI communicator; leave comm "
                    "unset (every process of the job)");
#endif
}

st::ShardTensor view(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(st::ShardTensor::is_shard_tensor(t), "shardtensor.", what,
                    ": expected a ShardTensor, got a plain tensor of shape ", t.sizes());
  return st::ShardTensor(t);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardtensor's C++ core (private; use the shardtensor package)";
  // Note [c10d-only build]: False for a build without MPI (torchrun launches only, no HDF5 I/O).
  m.attr("with_mpi") = static_cast<bool>(SHARDTENSOR_WITH_MPI);

  // c10 errors carry the op, shapes and placements: keep the message, drop the
  // C++ backtrace, and map the c10 error kinds to the Python ones torch uses.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  // ---- runtime ---------------------------------------------------------------
  m.def(
      "init", [] { st::init(); }, Release(),
      "Collective over MPI_COMM_WORLD on first call: initializes MPI or adopts an MPI "
      "already initialized (e.g. by mpi4py). Idempotent.");
  // Note [adopted process group]: the group crosses as its boxed form
  // (ProcessGroup.boxed(), a ScriptObject), which torch's own converter
  // unpacks, so no pybind11 type needs to be shared with torch's module.
  m.def(
      "init_with_group",
      [](const py::object& boxed) {
        const auto type = c10::getCustomClassType<c10::intrusive_ptr<::c10d::ProcessGroup>>();
        auto group = torch::jit::toIValue(boxed, type).toCustomClass<::c10d::ProcessGroup>();
        py::gil_scoped_release release;
        st::init(group);
      },
      py::arg("boxed_group"),
      "Collective over the group's ranks: runs shardtensor on a torch.distributed process group "
      "(ProcessGroup.boxed()). Idempotent for the same group.");
  m.def("finalize", &st::finalize, Release(),
        "Collective. Frees the library's communicators; finalizes MPI only if init() started it.");
  m.def("set_timeout", &st::set_timeout, py::arg("seconds"));
  m.def("timeout", &st::timeout);
  m.def("set_strict", &st::set_strict, py::arg("on"));
  m.def("strict", &st::strict);
  m.def("is_initialized", &st::is_initialized);
  m.def("world_rank", &st::world_rank);
  m.def("world_size", &st::world_size);
  m.def("local_rank", &st::local_rank);
  m.def("abort", &st::abort, py::arg("code"),
        "Ends the whole job now (MPI_Abort if MPI is up). Never returns.");

  // ---- mesh ------------------------------------------------------------------
  py::class_<st::DeviceMesh>(m, "DeviceMesh")
      .def_static(
          "create",
          [](std::vector<int64_t> shape, std::vector<std::string> names, std::uintptr_t comm,
             const std::string& device_type) {
            return st::DeviceMesh::create(c10::Device(device_type).type(), std::move(shape),
                                          std::move(names), comm_from_handle(comm));
          },
          py::arg("shape"), py::arg("names"), py::arg("comm") = 0, py::arg("device_type") = "cpu",
          Release())
      .def_property_readonly("device_type",
                             [](const st::DeviceMesh& mesh) {
                               return c10::DeviceTypeName(mesh.device_type(), /*lower_case=*/true);
                             })
      .def("device", &st::DeviceMesh::device)
      .def_property_readonly("ndim", &st::DeviceMesh::ndim)
      .def_property_readonly("shape", &st::DeviceMesh::shape)
      .def_property_readonly("dim_names", &st::DeviceMesh::dim_names)
      .def("size", py::overload_cast<>(&st::DeviceMesh::size, py::const_))
      .def("dim_size", py::overload_cast<int64_t>(&st::DeviceMesh::size, py::const_))
      .def("dim_index", &st::DeviceMesh::dim_index)
      .def("coordinate", &st::DeviceMesh::coordinate)
      .def("rank", &st::DeviceMesh::rank)
      .def("rank_of", &st::DeviceMesh::rank_of)
      .def("same", [](const st::DeviceMesh& a, const st::DeviceMesh& b) { return a == b; })
      .def("__repr__", &st::DeviceMesh::to_string);

  // ---- ShardTensor -----------------------------------------------------------
  m.def("is_shard_tensor", [](const py::handle& obj) {
    // Cheap and never throws: called on every torch op result (_tensor.py).
    if (!THPVariable_Check(obj.ptr())) return false;
    return st::ShardTensor::is_shard_tensor(THPVariable_Unpack(obj.ptr()));
  });
  m.def(
      "scatter_tensor",
      [](std::optional<at::Tensor> full, int src, const st::DeviceMesh& mesh,
         const std::vector<PlacementCode>& placements, bool requires_grad,
         std::optional<at::Device> device) {
        return st::scatter_tensor(full.value_or(at::Tensor()), src, mesh, to_placements(placements),
                                  requires_grad, device);
      },
      py::arg("full"), py::arg("src"), py::arg("mesh"), py::arg("placements"),
      py::arg("requires_grad") = false, py::arg("device") = py::none(), Release());
  m.def(
      "distribute_tensor",
      [](const at::Tensor& full, const st::DeviceMesh& mesh,
         const std::vector<PlacementCode>& placements, bool requires_grad,
         std::optional<st::ShardSizes> sizes, std::optional<at::Device> device) {
        return st::distribute_tensor(full, mesh, to_placements(placements), requires_grad,
                                     std::move(sizes), device);
      },
      py::arg("full"), py::arg("mesh"), py::arg("placements"), py::arg("requires_grad") = false,
      py::arg("sizes") = py::none(), py::arg("device") = py::none(), Release());
  m.def(
      "from_local",
      [](const at::Tensor& local, const st::DeviceMesh& mesh,
         const std::vector<PlacementCode>& placements, std::optional<st::ShardSizes> sizes) {
        return st::ShardTensor::from_local(local, mesh, to_placements(placements),
                                           std::move(sizes));
      },
      Release());
  m.def(
      "full_tensor", [](const at::Tensor& t) { return view(t, "full_tensor").full_tensor(); },
      Release());
  m.def(
      "redistribute",
      [](const at::Tensor& t, const std::vector<PlacementCode>& placements,
         std::optional<st::ShardSizes> sizes) {
        return view(t, "redistribute").redistribute(to_placements(placements), std::move(sizes));
      },
      Release());
  m.def("local", [](const at::Tensor& t) { return view(t, "to_local").local(); });
  m.def("grad", [](const at::Tensor& t) -> std::optional<at::Tensor> {
    st::ShardTensor g = view(t, "grad").grad();
    if (!g.defined()) return std::nullopt;
    return at::Tensor(g);
  });
  m.def("set_grad", [](const at::Tensor& t, std::optional<at::Tensor> g) {
    const at::Tensor& local = view(t, "grad").local();
    if (!g.has_value()) {
      local.mutable_grad() = at::Tensor();
      return;
    }
    at::Tensor value = *g;
    if (st::ShardTensor::is_shard_tensor(value)) {
      st::ShardTensor sg(value);
      TORCH_CHECK_VALUE(sg.spec().same_layout(st::ShardTensor(t).spec()),
                        "shardtensor: the gradient's layout ", sg.spec().to_string(),
                        " differs from the tensor's ", st::ShardTensor(t).spec().to_string());
      value = sg.local();
    }
    TORCH_CHECK_VALUE(value.sizes() == local.sizes(), "shardtensor: a gradient of local shape ",
                      value.sizes(), " does not fit the local shape ", local.sizes());
    local.mutable_grad() = value;
  });
  m.def("requires_grad",
        [](const at::Tensor& t) { return view(t, "requires_grad").requires_grad(); });
  m.def("set_requires_grad", [](const at::Tensor& t, bool requires_grad) {
    const at::Tensor& local = view(t, "requires_grad_").local();
    TORCH_CHECK(local.is_leaf() || requires_grad,
                "shardtensor.requires_grad_: you can only change requires_grad flags of leaf "
                "ShardTensors (this one's local piece has autograd history)");
    local.set_requires_grad(requires_grad);
  });
  m.def("is_leaf", [](const at::Tensor& t) { return view(t, "is_leaf").local().is_leaf(); });
  m.def("placements",
        [](const at::Tensor& t) { return from_placements(view(t, "placements").placements()); });
  m.def("mesh", [](const at::Tensor& t) { return view(t, "device_mesh").mesh(); });
  m.def("shard_sizes",
        [](const at::Tensor& t) { return view(t, "sharding_shapes").spec().all_shard_sizes(); });
  m.def("local_shape",
        [](const at::Tensor& t) { return view(t, "local_shape").spec().local_shape(); });
  m.def("local_offsets",
        [](const at::Tensor& t) { return view(t, "local_offsets").spec().local_offsets(); });
  m.def("to_string", [](const at::Tensor& t) { return view(t, "repr").to_string(); });
  m.def(
      "backward",
      [](const at::Tensor& output, std::optional<at::Tensor> grad, std::optional<bool> retain_graph,
         bool create_graph) {
        st::backward(output, grad.value_or(at::Tensor()), retain_graph, create_graph);
      },
      py::arg("output"), py::arg("grad") = py::none(), py::arg("retain_graph") = py::none(),
      py::arg("create_graph") = false, Release());
  m.def(
      "grad",
      [](const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
         const std::vector<std::optional<at::Tensor>>& grad_outputs,
         std::optional<bool> retain_graph, bool create_graph, bool allow_unused) {
        std::vector<at::Tensor> go;
        for (const auto& g : grad_outputs) go.push_back(g.value_or(at::Tensor()));
        return st::grad(outputs, inputs, go, retain_graph, create_graph, allow_unused);
      },
      py::arg("outputs"), py::arg("inputs"), py::arg("grad_outputs"), py::arg("retain_graph"),
      py::arg("create_graph"), py::arg("allow_unused"), Release());

  // ---- nn --------------------------------------------------------------------
  // A Python module's parameters and buffers are registered on a throwaway C++
  // torch::nn::Module (same TensorImpls, so the broadcast writes into the
  // Python tensors and the gradient hooks sit on the Python parameters); the
  // gradient reducer keeps what it needs alive. Names only feed the
  // cross-rank fingerprint check.
  m.def(
      "distribute_module",
      [](const std::vector<std::pair<std::string, at::Tensor>>& params,
         const std::vector<std::pair<std::string, at::Tensor>>& buffers, const st::DeviceMesh& mesh,
         int64_t bucket_cap_bytes, bool bucket_gradients) {
        torch::nn::Module holder("PythonModule");
        int64_t i = 0;
        for (const auto& [name, p] : params) {
          holder.register_parameter("p" + std::to_string(i++) + "_" + name, p, p.requires_grad());
        }
        i = 0;
        for (const auto& [name, b] : buffers) {
          holder.register_buffer("b" + std::to_string(i++) + "_" + name, b);
        }
        st::distribute_module(holder, mesh,
                              st::DistributeOptions()
                                  .bucket_cap_bytes(bucket_cap_bytes)
                                  .bucket_gradients(bucket_gradients));
      },
      Release());

  // fully_shard (Note [fully_shard]): the Python package passes a unit's named
  // parameters (not those of inner units) and the module's buffers.
  py::class_<st::FullyShard>(m, "FullyShard")
      .def("shard", &st::FullyShard::shard)
      .def("set_shard", &st::FullyShard::set_shard)
      .def("numel", &st::FullyShard::numel)
      .def("padded_numel", &st::FullyShard::padded_numel)
      .def("shard_numel", &st::FullyShard::shard_numel)
      .def("names", &st::FullyShard::names)
      .def("is_sharded", &st::FullyShard::is_sharded)
      .def("unshard", &st::FullyShard::unshard, Release())
      .def("reshard", &st::FullyShard::reshard)
      .def("full_state_dict", &st::FullyShard::full_state_dict, Release())
      .def("load_full_state_dict", &st::FullyShard::load_full_state_dict)
      .def("unflatten", &st::FullyShard::unflatten, Release());
  m.def(
      "fully_shard",
      [](const std::vector<std::pair<std::string, at::Tensor>>& params,
         const std::vector<std::pair<std::string, at::Tensor>>& buffers, const st::DeviceMesh& mesh,
         const std::string& dim, bool reshard_after_forward, bool is_root) {
        return st::fully_shard(params, buffers, mesh, dim,
                               st::FullyShardOptions().reshard_after_forward(reshard_after_forward),
                               is_root);
      },
      Release());
  m.def(
      "clip_grad_norm_",
      [](const std::vector<st::FullyShard>& units, double max_norm) {
        return st::clip_grad_norm_(units, max_norm);
      },
      Release());

  // ---- ops -------------------------------------------------------------------
  m.def(
      "scaled_dot_product_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         std::optional<at::Tensor> mask, bool is_causal, std::optional<double> scale) {
        return st::scaled_dot_product_attention(q, k, v, mask.value_or(at::Tensor()), is_causal,
                                                scale);
      },
      Release());

  auto pad_mode_of = [](const std::string& op, const std::string& mode) {
    if (mode == "constant" || mode == "zeros") return st::PadMode::Constant;
    if (mode == "reflect") return st::PadMode::Reflect;
    if (mode == "replicate") return st::PadMode::Replicate;
    if (mode == "circular") return st::PadMode::Circular;
    TORCH_CHECK_VALUE(false, "shardtensor.", op,
                      ": mode must be constant, reflect, replicate or circular, got '", mode, "'");
  };
  m.def(
      "halo_exchange",
      [pad_mode_of](const at::Tensor& t, int64_t dim, int64_t left, int64_t right,
                    const std::string& mode, double value) {
        return st::halo_exchange(t, dim, left, right, pad_mode_of("halo_exchange", mode), value);
      },
      Release());

  // Split-phase halo (Note [split-phase halo]): begin returns the pending
  // exchange; its end() (or halo_exchange_end) waits and returns the piece.
  py::class_<st::PendingHaloExchange, std::unique_ptr<st::PendingHaloExchange>>(
      m, "PendingHaloExchange")
      .def("test", &st::PendingHaloExchange::test, Release())
      .def(
          "end", [](st::PendingHaloExchange& p) { return st::halo_exchange_end(p); }, Release());
  m.def(
      "halo_exchange_begin",
      [pad_mode_of](const at::Tensor& t, int64_t dim, int64_t left, int64_t right,
                    const std::string& mode, double value) {
        return std::make_unique<st::PendingHaloExchange>(st::halo_exchange_begin(
            t, dim, left, right, pad_mode_of("halo_exchange_begin", mode), value));
      },
      Release());

  // ---- irregular data (Python: python/shardtensor/_irregular.py) -----------------
  // Point clouds, graphs and meshes sharded by rows (docs/irregular.md): neighbour
  // search, neighbourhood attention, index halos (GhostPlan), message passing and
  // rebalancing by cost. Options structs cross as plain values (the Python layer
  // takes them as keyword arguments); dtypes cross as torch.dtype (torch's caster).
  m.def(
      "neighborhood_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t kernel_size,
         int64_t dilation, bool is_causal, std::optional<double> scale) {
        return st::neighborhood_attention(q, k, v, kernel_size, dilation, is_causal, scale);
      },
      Release());

  auto stats_dict = [](const st::NeighborStats& s) {
    py::dict d;
    d["pieces_fetched"] = s.pieces_fetched;
    d["pieces_skipped"] = s.pieces_skipped;
    d["bytes_fetched"] = s.bytes_fetched;
    d["bytes_skipped"] = s.bytes_skipped;
    return d;
  };
  // (index, distance, stats): the GIL is taken back only to build the dict.
  m.def("knn", [stats_dict](const at::Tensor& queries, const at::Tensor& points, int64_t k) {
    st::NeighborStats stats;
    std::pair<at::Tensor, at::Tensor> r;
    {
      py::gil_scoped_release release;
      r = st::knn(queries, points, k, &stats);
    }
    return py::make_tuple(r.first, r.second, stats_dict(stats));
  });
  m.def("radius_search", [stats_dict](const at::Tensor& queries, const at::Tensor& points, double r,
                                      int64_t max_neighbors) {
    st::NeighborStats stats;
    std::pair<at::Tensor, at::Tensor> res;
    {
      py::gil_scoped_release release;
      res = st::radius_search(queries, points, r, max_neighbors, &stats);
    }
    return py::make_tuple(res.first, res.second, stats_dict(stats));
  });

  // A GhostPlan is immutable shared metadata (cheap to copy): the Python class
  // shardtensor.GhostPlan holds one. Accessors are local; build is collective.
  py::class_<st::GhostPlan>(m, "GhostPlan")
      .def_static(
          "build",
          [](const st::DeviceMesh& mesh, int64_t mesh_dim, std::vector<int64_t> sizes,
             const at::Tensor& needed_ids) {
            return st::GhostPlan::build(mesh, mesh_dim, std::move(sizes), needed_ids);
          },
          Release())
      .def_property_readonly("defined", &st::GhostPlan::defined)
      .def_property_readonly("mesh",
                             [](const st::GhostPlan& p) { return st::DeviceMesh(p.mesh()); })
      .def_property_readonly("mesh_dim", &st::GhostPlan::mesh_dim)
      .def_property_readonly("sizes", &st::GhostPlan::sizes)
      .def_property_readonly("num_global", &st::GhostPlan::num_global)
      .def_property_readonly("owned_offset", &st::GhostPlan::owned_offset)
      .def_property_readonly("num_owned", &st::GhostPlan::num_owned)
      .def_property_readonly("num_ghost", &st::GhostPlan::num_ghost)
      .def_property_readonly("num_extended", &st::GhostPlan::num_extended)
      // A copy: the plan's own tensor must not be written through Python.
      .def_property_readonly("ghost_ids",
                             [](const st::GhostPlan& p) { return p.ghost_ids().clone(); })
      .def_property_readonly("num_send_rows", &st::GhostPlan::num_send_rows)
      .def_property_readonly("recv_peers", &st::GhostPlan::recv_peers)
      .def("local_index", &st::GhostPlan::local_index);

  m.def("ghost_plan", &st::ghost_plan, Release());
  m.def("ghost_exchange", &st::ghost_exchange, Release());
  m.def(
      "ghost_accumulate",
      [](const at::Tensor& extended, const st::GhostPlan& plan,
         std::optional<at::ScalarType> accumulate_dtype) {
        return st::ghost_accumulate(extended, plan,
                                    st::GhostOptions().accumulate_dtype(accumulate_dtype));
      },
      Release());
  m.def(
      "ghost_accumulate_nograd",
      [](const at::Tensor& extended, const st::GhostPlan& plan, const std::string& reduce) {
        st::ReduceOp op = st::ReduceOp::Sum;
        if (reduce == "sum") {
          op = st::ReduceOp::Sum;
        } else if (reduce == "amax") {
          op = st::ReduceOp::Max;
        } else if (reduce == "amin") {
          op = st::ReduceOp::Min;
        } else if (reduce == "prod") {
          op = st::ReduceOp::Product;
        } else {
          TORCH_CHECK_VALUE(false,
                            "shardtensor.ghost_accumulate_nograd: reduce must be sum, amax, amin "
                            "or prod, got '",
                            reduce, "'");
        }
        return st::ghost_accumulate_nograd(extended, plan, op);
      },
      Release());
  m.def("extend_rows", &st::extend_rows, Release());
  m.def("gather_rows", &st::gather_rows, Release());
  m.def(
      "scatter_rows",
      [](const at::Tensor& messages, const at::Tensor& local_index, const st::GhostPlan& plan,
         const std::string& reduce, std::optional<at::ScalarType> accumulate_dtype) {
        st::ScatterReduce r = st::ScatterReduce::Sum;
        if (reduce == "sum") {
          r = st::ScatterReduce::Sum;
        } else if (reduce == "mean") {
          r = st::ScatterReduce::Mean;
        } else if (reduce == "amax") {
          r = st::ScatterReduce::Amax;
        } else {
          TORCH_CHECK_VALUE(false,
                            "shardtensor.scatter_rows: reduce must be sum, mean or amax, got '",
                            reduce, "'");
        }
        return st::scatter_rows(messages, local_index, plan,
                                st::ScatterOptions().reduce(r).accumulate_dtype(accumulate_dtype));
      },
      Release());
  m.def("node_tensor", &st::node_tensor, Release());
  m.def("rows_like", &st::rows_like, Release());

  m.def("balanced_sizes_by_cost", &st::balanced_sizes_by_cost, Release());
  m.def(
      "rebalance",
      [](const std::vector<at::Tensor>& tensors, const at::Tensor& weights) {
        std::vector<int64_t> sizes;
        auto out = st::rebalance(tensors, weights, &sizes);
        return std::make_pair(std::move(out), std::move(sizes));
      },
      Release());
  m.def(
      "rebalance_measured",
      [](const std::vector<at::Tensor>& tensors, double measured_seconds) {
        std::vector<int64_t> sizes;
        auto out = st::rebalance(tensors, measured_seconds, &sizes);
        return std::make_pair(std::move(out), std::move(sizes));
      },
      Release());
  m.def(
      "rebalance_graph",
      [](const std::vector<at::Tensor>& node_tensors, const at::Tensor& edge_index,
         const std::vector<at::Tensor>& edge_tensors, const at::Tensor& weights,
         int64_t dst_column) {
        auto g = st::rebalance_graph(node_tensors, edge_index, edge_tensors, weights, dst_column);
        return std::make_tuple(std::move(g.nodes), std::move(g.edge_index), std::move(g.edges),
                               std::move(g.plan), std::move(g.node_sizes), std::move(g.edge_sizes));
      },
      Release());

  // ---- io (Python: shardtensor.io, python/shardtensor/io.py) ---------------------
  // Options cross as plain values; the Python layer validates and documents them.
  auto transfer_of = [](const std::string& t) {
    TORCH_CHECK_VALUE(t == "collective" || t == "independent",
                      "shardtensor.io: transfer must be 'collective' or 'independent', got '", t,
                      "'");
    return t == "collective" ? st::io::Transfer::Collective : st::io::Transfer::Independent;
  };
  auto read_options = [transfer_of](
                          std::optional<st::ShardSizes> sizes, std::optional<at::Tensor> dtype_like,
                          std::optional<std::vector<int64_t>> start,
                          std::optional<std::vector<int64_t>> count, const std::string& transfer) {
    st::io::ReadOptions o;
    o.sizes(std::move(sizes)).transfer(transfer_of(transfer));
    if (dtype_like) o.dtype(dtype_like->scalar_type());
    if (start || count) {
      TORCH_CHECK_VALUE(start && count, "shardtensor.io: a selection needs start and count");
      o.select(st::io::Selection{*start, *count});
    }
    return o;
  };
  m.def(
      "io_read_hdf5",
      [read_options](const std::string& path, const std::string& dataset,
                     const st::DeviceMesh& mesh, const std::vector<PlacementCode>& placements,
                     std::optional<st::ShardSizes> sizes, std::optional<at::Tensor> dtype,
                     std::optional<std::vector<int64_t>> start,
                     std::optional<std::vector<int64_t>> count, const std::string& transfer) {
        return st::io::read_hdf5(
            path, dataset, mesh, to_placements(placements),
            read_options(std::move(sizes), dtype, std::move(start), std::move(count), transfer));
      },
      Release());
  m.def(
      "io_read_hdf5_with_halo",
      [read_options](const std::string& path, const std::string& dataset,
                     const st::DeviceMesh& mesh, const std::vector<PlacementCode>& placements,
                     std::vector<int64_t> halo, const std::string& halo_mode,
                     std::optional<st::ShardSizes> sizes, std::optional<at::Tensor> dtype,
                     std::optional<std::vector<int64_t>> start,
                     std::optional<std::vector<int64_t>> count, const std::string& transfer) {
        auto o =
            read_options(std::move(sizes), dtype, std::move(start), std::move(count), transfer);
        st::io::HaloMode mode = st::io::HaloMode::Zeros;
        if (halo_mode == "none") {
          mode = st::io::HaloMode::None;
        } else if (halo_mode == "zeros") {
          mode = st::io::HaloMode::Zeros;
        } else if (halo_mode == "replicate") {
          mode = st::io::HaloMode::Replicate;
        } else if (halo_mode == "circular") {
          mode = st::io::HaloMode::Circular;
        } else {
          TORCH_CHECK_VALUE(false,
                            "shardtensor.io.read_hdf5_with_halo: halo_mode must be none, zeros, "
                            "replicate or circular, got '",
                            halo_mode, "'");
        }
        o.halo(std::move(halo)).halo_mode(mode);
        auto r = st::io::read_hdf5_with_halo(path, dataset, mesh, to_placements(placements), o);
        return std::make_tuple(r.tensor, r.with_halo, r.halo_left, r.halo_right);
      },
      Release());
  m.def(
      "io_write_hdf5",
      [transfer_of](const std::string& path, const std::string& dataset, const at::Tensor& tensor,
                    std::optional<st::DeviceMesh> mesh, std::vector<int64_t> chunks,
                    const std::string& units, bool overwrite, bool truncate,
                    const std::string& transfer) {
        st::io::write_hdf5(path, dataset, tensor,
                           st::io::WriteOptions()
                               .mesh(std::move(mesh))
                               .chunks(std::move(chunks))
                               .units(units)
                               .overwrite(overwrite)
                               .truncate(truncate)
                               .transfer(transfer_of(transfer)));
      },
      Release());
  m.def("io_read_hdf5_info",
        [](const std::string& path, const std::string& dataset, const st::DeviceMesh& mesh) {
          st::io::DatasetInfo i;
          {
            py::gil_scoped_release release;
            i = st::io::read_hdf5_info(path, dataset, mesh);
          }
          py::dict d;
          d["shape"] = i.shape;
          d["dtype_like"] = at::empty({0}, at::TensorOptions().dtype(i.dtype));  // .dtype in Python
          d["placements"] = i.placements;
          d["mesh_shape"] = i.mesh_shape;
          d["torch_dtype"] = i.torch_dtype;
          d["units"] = i.units;
          return d;
        });
  m.def(
      "io_save_checkpoint",
      [](const std::string& dir, const st::DeviceMesh& mesh, st::io::NamedTensors tensors,
         int64_t step) {
        st::io::save_checkpoint(dir, mesh,
                                st::io::CheckpointState().tensors(std::move(tensors)).step(step));
      },
      Release());
  m.def(
      "io_load_checkpoint",
      [](const std::string& dir, const st::DeviceMesh& mesh,
         const std::map<std::string, std::pair<std::vector<PlacementCode>,
                                               std::optional<st::ShardSizes>>>& layouts) {
        st::io::TensorLayouts l;
        for (const auto& [name, layout] : layouts) {
          l[name] = st::io::TensorLayout{to_placements(layout.first), layout.second};
        }
        auto r = st::io::load_checkpoint(dir, mesh, st::io::LoadOptions().layouts(std::move(l)));
        return std::make_tuple(std::move(r.tensors), r.step, std::move(r.saved_mesh_shape));
      },
      Release());
  m.def("io_checkpoint_exists", &st::io::checkpoint_exists);
  m.def("io_stats", [] {
    const auto s = st::io_stats();
    py::dict d;
    d["bytes_read"] = s.bytes_read;
    d["bytes_written"] = s.bytes_written;
    d["reads"] = s.reads;
    d["writes"] = s.writes;
    return d;
  });
  m.def("reset_io_stats", &st::reset_io_stats);

  // ---- observability (local) -------------------------------------------------
  m.def("comm_stats", [] {
    const auto s = st::comm_stats();
    py::dict d;
    d["bytes_sent"] = s.bytes_sent;
    d["bytes_received"] = s.bytes_received;
    d["messages"] = s.messages;
    d["comm_seconds"] = s.comm_seconds;
    d["gathered_bytes"] = s.gathered_bytes;
    d["staged_bytes"] = s.staged_bytes;
    return d;
  });
  m.def("reset_comm_stats", &st::reset_comm_stats);
  m.def("memory_stats", [] {
    const auto s = st::memory_stats();
    py::dict d;
    d["current_bytes"] = s.current_bytes;
    d["peak_bytes"] = s.peak_bytes;
    d["device"] = s.device;
    d["device_current_bytes"] = s.device_current_bytes;
    d["device_peak_bytes"] = s.device_peak_bytes;
    return d;
  });
  m.def("reset_peak_memory_stats", &st::reset_peak_memory_stats);
  // ---- launcher detection (Note [launcher detection], src/core/launch.cpp) ----
  // env: a dict of variables, or None for this process's environment.
  auto env_of = [](const std::optional<std::map<std::string, std::string>>& env) -> st::EnvLookup {
    if (!env) return st::process_env();
    return [vars = *env](const char* name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  };
  m.def(
      "detect_launch",
      [env_of](const std::optional<std::map<std::string, std::string>>& env) {
        const st::LaunchInfo info = st::detect_launch(env_of(env));
        py::dict d;
        d["launcher"] = info.launcher;
        d["rank_variable"] = info.rank_variable;
        d["size_variable"] = info.size_variable;
        d["rank"] = info.rank;
        d["world_size"] = info.world_size;
        d["local_rank"] = info.local_rank;
        d["local_world_size"] = info.local_world_size;
        d["mpi_launcher"] = info.mpi_launcher;
        return d;
      },
      py::arg("env") = py::none(), "Local. Which launcher started this process (a dict).");
  m.def(
      "resolve_transport",
      [env_of](const std::optional<std::map<std::string, std::string>>& env) {
        const auto lookup = env_of(env);
        return st::resolve_transport(st::detect_launch(lookup), lookup);
      },
      py::arg("env") = py::none(),
      "Local. 'mpi' or 'gloo' (the c10d transport), or raises (SHARDTENSOR_BACKEND).");
  m.def(
      "transport", [] { return st::current_transport(); },
      "Local. The transport init() chose ('mpi' or 'gloo'); '' before init().");
  m.def(
      "mpi_cuda_support",
      [] {
        const auto s = st::mpi_cuda_support();
        py::dict d;
        d["aware"] = s.aware;
        d["reason"] = s.reason;
        return d;
      },
      "Local. Whether the MPI library takes CUDA memory (Note [CUDA-aware MPI]): "
      "{'aware': bool, 'reason': str}.");
  m.def("exported_launch_env", [] {
    py::dict d;
    for (const auto& [k, v] : st::exported_launch_env()) d[py::str(k)] = v;
    return d;
  });
}
