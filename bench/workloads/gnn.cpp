// gnn: the MeshGraphNet-style model of examples/gnn_train.cpp on its
// generated triangle mesh (--shape N: about N vertices, Morton order). Nodes
// are sharded by rows (mesh dim 0); every rank takes the edges whose
// destination it owns; index halos (GhostPlan) bring in the source rows.
// --base-channels is the hidden width, --layers the message-passing layers.
#include <shardtensor/shardtensor.h>

#include <map>
#include <memory>
#include <vector>

#include "bench.h"
#include "models/graphnet.h"

namespace bench {
namespace {

namespace st = shardtensor;

struct GnnState {
  models::Mesh mesh;
  models::GraphNet net{nullptr};
  // Per node partition (sizes along mesh dim 0): the sharded graph.
  std::map<std::vector<int64_t>, models::Graph> sharded;
  std::optional<models::Graph> whole;
};

models::Graph graph_for(GnnState& s, const at::Tensor& x) {
  if (!st::ShardTensor::is_shard_tensor(x)) {
    if (!s.whole) s.whole = models::whole_graph(s.mesh, x.scalar_type());
    models::Graph g = *s.whole;
    g.x = x;
    return g;
  }
  st::ShardTensor sx(x);
  const auto& sizes = sx.spec().shard_sizes(0);
  auto it = s.sharded.find(sizes);
  if (it == s.sharded.end()) {
    const auto& m = s.mesh;
    const int64_t P = static_cast<int64_t>(sizes.size());
    std::vector<int64_t> bounds(P + 1, 0), edge_sizes(P);
    for (int64_t c = 0; c < P; ++c) bounds[c + 1] = bounds[c] + sizes[c];
    at::Tensor end =
        at::searchsorted(m.edges.select(1, 1).contiguous(), at::tensor(bounds, at::kLong));
    for (int64_t c = 0; c < P; ++c)
      edge_sizes[c] = end[c + 1].item<int64_t>() - end[c].item<int64_t>();
    const int64_t me = sx.mesh().coordinate()[0];
    const int64_t e0 = end[me].item<int64_t>();
    at::Tensor ei = m.edges.narrow(0, e0, edge_sizes[me]);
    st::ShardSizes es(sx.mesh().ndim());
    es[0] = edge_sizes;
    models::Graph g;
    g.e = st::ShardTensor::from_local(
        models::edge_features(m).narrow(0, e0, edge_sizes[me]).to(x.scalar_type()).contiguous(),
        sx.mesh(), sx.placements(), es);
    g.plan = st::ghost_plan(x, ei.flatten());
    g.src = g.plan->local_index(ei.select(1, 0).contiguous());
    g.dst = g.plan->local_index(ei.select(1, 1).contiguous());
    it = s.sharded.emplace(sizes, std::move(g)).first;
  }
  models::Graph g = it->second;
  g.x = x;
  return g;
}

Instance make_gnn(const Problem& p) {
  TORCH_CHECK(p.shape.size() == 1, "gnn: --shape takes the number of vertices N");
  auto state = std::make_shared<GnnState>();
  state->mesh = models::make_mesh(p.shape[0], 1234);
  state->net = models::GraphNet(p.base_channels, p.layers);
  Instance in;
  in.module = state->net.ptr();
  in.inputs = {Input{{state->mesh.n, 3}, {0}, false}};
  in.spatial_dims = 1;
  in.forward = [state](const std::vector<at::Tensor>& x) {
    return state->net->forward(graph_for(*state, x[0]));
  };
  return in;
}

const Registrar reg(Workload{"gnn",
                             "MeshGraphNet-style GNN (layers message-passing layers, base_channels "
                             "wide) on a Morton-ordered triangle mesh of N vertices",
                             {40000},
                             [](const Problem&) { return int64_t{1}; },
                             make_gnn});

}  // namespace
}  // namespace bench
