#pragma once
// A MeshGraphNet-style GNN on a generated unstructured 2-D triangle mesh,
// shared by examples/gnn_train.cpp and the `gnn` bench workload: the mesh
// generator (perturbed grid, Morton-ordered vertices), one explicit step of a
// graph diffusion solver as the target, the sharding of nodes and edges, and
// the model. See examples/gnn_train.cpp for the description.
#include <torch/torch.h>

#include <shardtensor/shardtensor.h>

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace models {

namespace st = shardtensor;

// ---- the mesh and the solver -----------------------------------------------------

struct Mesh {
  int64_t n = 0;          // vertices
  double h = 0;           // grid spacing
  at::Tensor pos;         // [n, 2] float64, in space-filling-curve order
  at::Tensor edges;       // [E, 2] int64 (src, dst), sorted by dst then src
  at::Tensor u0, target;  // [n, 1]
};

inline uint64_t morton(uint32_t x, uint32_t y) {
  uint64_t key = 0;
  for (int b = 0; b < 32; ++b) {
    key |= static_cast<uint64_t>((x >> b) & 1u) << (2 * b);
    key |= static_cast<uint64_t>((y >> b) & 1u) << (2 * b + 1);
  }
  return key;
}

/// The whole mesh, identical on every rank (generated from a fixed seed).
inline Mesh make_mesh(int64_t nodes, uint64_t seed) {
  const int64_t s = std::max<int64_t>(3, static_cast<int64_t>(std::ceil(std::sqrt(nodes))));
  Mesh m;
  m.n = s * s;
  m.h = 1.0 / static_cast<double>(s - 1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  // Grid vertex (i, j) -> Morton rank.
  std::vector<uint64_t> keys(m.n);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < s; ++j)
      keys[i * s + j] = morton(static_cast<uint32_t>(i), static_cast<uint32_t>(j));
  std::vector<int64_t> order(m.n);
  for (int64_t v = 0; v < m.n; ++v) order[v] = v;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<int64_t> id(m.n);
  for (int64_t r = 0; r < m.n; ++r) id[order[r]] = r;

  at::Tensor jitter = (at::rand({m.n, 2}, gen, at::kDouble) - 0.5) * 0.6 * m.h;
  at::Tensor diag = at::rand({s, s}, gen, at::kDouble).lt(0.5);
  m.pos = at::empty({m.n, 2}, at::kDouble);
  auto P = m.pos.accessor<double, 2>();
  auto J = jitter.accessor<double, 2>();
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t j = 0; j < s; ++j) {
      const int64_t v = i * s + j;
      const bool interior = i > 0 && j > 0 && i < s - 1 && j < s - 1;
      P[id[v]][0] = i * m.h + (interior ? J[v][0] : 0.0);
      P[id[v]][1] = j * m.h + (interior ? J[v][1] : 0.0);
    }
  }
  std::vector<std::pair<int64_t, int64_t>> e;  // (dst, src)
  auto D = diag.accessor<bool, 2>();
  auto add = [&](int64_t a, int64_t b) {
    e.push_back({id[a], id[b]});
    e.push_back({id[b], id[a]});
  };
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t j = 0; j < s; ++j) {
      const int64_t v = i * s + j;
      if (i + 1 < s) add(v, v + s);
      if (j + 1 < s) add(v, v + 1);
      if (i + 1 < s && j + 1 < s) {
        if (D[i][j])
          add(v, v + s + 1);
        else
          add(v + 1, v + s);
      }
    }
  }
  std::sort(e.begin(), e.end());
  m.edges = at::empty({static_cast<int64_t>(e.size()), 2}, at::kLong);
  auto E = m.edges.accessor<int64_t, 2>();
  for (size_t k = 0; k < e.size(); ++k) {
    E[k][0] = e[k].second;
    E[k][1] = e[k].first;
  }
  // A smooth initial field: a few plane waves with random directions.
  at::Tensor wave = at::randn({4, 4}, gen, at::kDouble);
  m.u0 = at::zeros({m.n, 1}, at::kDouble);
  for (int64_t w = 0; w < 4; ++w) {
    auto k = wave[w];
    m.u0 +=
        (at::sin(m.pos.select(1, 0) * (3 * k[0]) + m.pos.select(1, 1) * (3 * k[1]) + k[2]) * k[3])
            .unsqueeze(1);
  }
  // One explicit step of the graph diffusion solver; the target is the
  // rescaled change.
  at::Tensor src = m.edges.select(1, 0), dst = m.edges.select(1, 1);
  at::Tensor d = m.pos.index_select(0, src) - m.pos.index_select(0, dst);
  at::Tensor w = 1.0 / d.square().sum(1, true);
  const double dt = 0.05 * m.h * m.h;
  at::Tensor flux = w * (m.u0.index_select(0, src) - m.u0.index_select(0, dst));
  at::Tensor lap = at::zeros({m.n, 1}, at::kDouble).index_add(0, dst, flux);
  at::Tensor u1 = m.u0 + dt * lap;
  m.target = (u1 - m.u0) / (dt / (m.h * m.h)) * 0.05;
  return m;
}

inline at::Tensor node_features(const Mesh& m) { return at::cat({m.u0, m.pos}, 1); }

inline at::Tensor edge_features(const Mesh& m) {
  at::Tensor d =
      (m.pos.index_select(0, m.edges.select(1, 0)) - m.pos.index_select(0, m.edges.select(1, 1))) /
      m.h;
  return at::cat({d, d.norm(2, 1, true)}, 1);
}

// ---- the model -----------------------------------------------------------------------

inline torch::nn::Sequential mlp(int64_t in, int64_t hidden, int64_t out) {
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::SiLU(),
                               torch::nn::Linear(hidden, out));
}

/// The graph as one rank sees it: node and edge features (ShardTensors in the
/// sharded run, plain tensors in the single-process run), and the edge
/// endpoints as rows of the extended node layout (the plan) or as global ids.
struct Graph {
  at::Tensor x, e, target;
  at::Tensor src, dst;                // [E_local]
  std::optional<st::GhostPlan> plan;  // sharded run only
};

struct GraphNetImpl : torch::nn::Module {
  GraphNetImpl(int64_t hidden, int64_t layers) {
    node_enc = register_module("node_enc", mlp(3, hidden, hidden));
    edge_enc = register_module("edge_enc", mlp(3, hidden, hidden));
    for (int64_t l = 0; l < layers; ++l) {
      edge_mlp.push_back(
          register_module("edge" + std::to_string(l), mlp(3 * hidden, hidden, hidden)));
      node_mlp.push_back(
          register_module("node" + std::to_string(l), mlp(2 * hidden, hidden, hidden)));
    }
    decoder = register_module("decoder", mlp(hidden, hidden, 1));
  }

  at::Tensor forward(const Graph& g) {
    at::Tensor h = node_enc->forward(g.x);
    at::Tensor e = edge_enc->forward(g.e);
    for (size_t l = 0; l < edge_mlp.size(); ++l) {
      at::Tensor m;
      if (g.plan) {
        at::Tensor h_ext = st::extend_rows(h, *g.plan);
        m = st::rows_like(at::cat({st::ShardTensor(e).local(), st::gather_rows(h_ext, g.src),
                                   st::gather_rows(h_ext, g.dst)},
                                  1),
                          e);
      } else {
        m = at::cat({e, h.index_select(0, g.src), h.index_select(0, g.dst)}, 1);
      }
      e = e + edge_mlp[l]->forward(m);
      at::Tensor agg = g.plan
                           ? st::scatter_rows(e, g.dst, *g.plan)
                           : at::zeros({h.size(0), e.size(1)}, e.options()).index_add(0, g.dst, e);
      h = h + node_mlp[l]->forward(at::cat({h, agg}, 1));
    }
    return decoder->forward(h);
  }

  torch::nn::Sequential node_enc{nullptr}, edge_enc{nullptr}, decoder{nullptr};
  std::vector<torch::nn::Sequential> edge_mlp, node_mlp;
};
TORCH_MODULE(GraphNet);

/// The sharded graph: node rows in balanced contiguous blocks along the
/// curve, edges with their destination's owner.
inline Graph shard_graph(const Mesh& m, const st::DeviceMesh& mesh, at::ScalarType dtype) {
  const int64_t P = mesh.size(0);
  std::vector<int64_t> node_sizes(P), edge_sizes(P);
  for (int64_t c = 0; c < P; ++c) node_sizes[c] = m.n / P + (c < m.n % P ? 1 : 0);
  std::vector<int64_t> bounds(P + 1, 0);
  for (int64_t c = 0; c < P; ++c) bounds[c + 1] = bounds[c] + node_sizes[c];
  at::Tensor owner_end =
      at::searchsorted(m.edges.select(1, 1).contiguous(), at::tensor(bounds, at::kLong));
  for (int64_t c = 0; c < P; ++c)
    edge_sizes[c] = owner_end[c + 1].item<int64_t>() - owner_end[c].item<int64_t>();
  const st::Placements rows = {st::Shard{0}};
  Graph g;
  g.x = st::distribute_tensor(node_features(m).to(dtype), mesh, rows, false,
                              st::ShardSizes{node_sizes});
  g.target =
      st::distribute_tensor(m.target.to(dtype), mesh, rows, false, st::ShardSizes{node_sizes});
  g.e = st::distribute_tensor(edge_features(m).to(dtype), mesh, rows, false,
                              st::ShardSizes{edge_sizes});
  at::Tensor ei =
      st::ShardTensor(st::distribute_tensor(m.edges, mesh, rows, false, st::ShardSizes{edge_sizes}))
          .local();
  g.plan = st::ghost_plan(g.x, ei.flatten());
  g.src = g.plan->local_index(ei.select(1, 0).contiguous());
  g.dst = g.plan->local_index(ei.select(1, 1).contiguous());
  return g;
}

inline Graph whole_graph(const Mesh& m, at::ScalarType dtype) {
  Graph g;
  g.x = node_features(m).to(dtype);
  g.e = edge_features(m).to(dtype);
  g.target = m.target.to(dtype);
  g.src = m.edges.select(1, 0).contiguous();
  g.dst = m.edges.select(1, 1).contiguous();
  return g;
}

}  // namespace models
