// Ring neighbour search (k-NN and radius) over row-sharded points.
//
// Note [ring neighbour search]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank keeps its queries and, per query, a running best list of (squared
// distance, global id) pairs, k long, ordered by distance then id. It first
// merges its own point piece, then visits the other pieces on a shifted ring
// schedule: at step s = 1..P-1 rank r may receive the piece of rank r-s and
// may send its own piece to rank r+s (mod P), point-to-point, so at most one
// foreign piece is held at a time and memory stays O(local).
//
// Before step s, rank r decides from the all-gathered bounding boxes of the
// pieces whether piece r-s can still improve any of its lists: it is needed
// iff some query's box distance is <= its current k-th distance (or <= the
// radius). Equality counts, since an equally distant point with a smaller id
// wins the tie. The verdict travels to the owner as a one-word message and
// the owner sends its points only when asked, so on a spatially sorted cloud
// most pieces never move (NeighborStats::bytes_skipped counts them). Visiting
// pieces in a different order than brute force cannot change the result: the
// merge is an exact two-key sort, and distances are formed dim by dim in a
// fixed order, so they are bitwise those of a single-process search.
#include "comm/neighbors.h"

#include <ATen/ATen.h>
#include <shardtensor/core/error.h>

#include <limits>
#include <vector>

#include "comm/transport.h"

namespace shardtensor::comm {

namespace {

constexpr int kFlagTag = 7051;
constexpr int kPointTag = 7052;
constexpr int64_t kNoId = std::numeric_limits<int64_t>::max();
constexpr int64_t kBlock = int64_t{1} << 20;  // distance-matrix elements per block

/// Merges candidates (dist2 [m, n], ids [n]) into the running lists in place.
void merge(at::Tensor& best_d, at::Tensor& best_i, const at::Tensor& d2, const at::Tensor& ids,
           double r2) {
  const int64_t m = best_d.size(0), k = best_d.size(1);
  at::Tensor cd = d2, ci = ids.unsqueeze(0).expand({m, ids.numel()});
  if (r2 < std::numeric_limits<double>::infinity()) {
    at::Tensor far = cd.gt(r2);
    cd = cd.masked_fill(far, std::numeric_limits<double>::infinity());
    ci = ci.masked_fill(far, kNoId);
  }
  cd = at::cat({best_d, cd}, 1);
  ci = at::cat({best_i, ci}, 1);
  // Two-key order: by id, then stably by distance.
  at::Tensor by_id = std::get<1>(at::sort(ci, /*stable=*/true, /*dim=*/1, /*descending=*/false));
  cd = cd.gather(1, by_id);
  ci = ci.gather(1, by_id);
  at::Tensor by_d = std::get<1>(at::sort(cd, /*stable=*/true, 1, false)).narrow(1, 0, k);
  best_d = cd.gather(1, by_d);
  best_i = ci.gather(1, by_d);
}

/// Merges a whole point piece, blocking the queries so that the distance
/// matrix stays below kBlock elements.
void merge_piece(const at::Tensor& q, at::Tensor& best_d, at::Tensor& best_i, const at::Tensor& p,
                 int64_t first_id, double r2) {
  const int64_t m = q.size(0), n = p.size(0);
  if (m == 0 || n == 0) return;
  at::Tensor ids = at::arange(first_id, first_id + n, at::kLong);
  const int64_t rows = std::max<int64_t>(1, kBlock / std::max<int64_t>(n, 1));
  for (int64_t s = 0; s < m; s += rows) {
    const int64_t len = std::min(rows, m - s);
    at::Tensor bd = best_d.narrow(0, s, len), bi = best_i.narrow(0, s, len);
    merge(bd, bi, squared_distances(q.narrow(0, s, len), p), ids, r2);
    best_d.narrow(0, s, len).copy_(bd);
    best_i.narrow(0, s, len).copy_(bi);
  }
}

}  // namespace

at::Tensor squared_distances(const at::Tensor& q, const at::Tensor& p) {
  at::Tensor qd = q.to(at::kDouble), pd = p.to(at::kDouble);
  at::Tensor acc = at::zeros({q.size(0), p.size(0)}, qd.options());
  for (int64_t j = 0; j < q.size(1); ++j) {
    acc.add_((qd.select(1, j).unsqueeze(1) - pd.select(1, j).unsqueeze(0)).square());
  }
  return acc;
}

NeighborResult ring_neighbors(const at::Tensor& queries, const at::Tensor& points,
                              const DeviceMesh& mesh, int64_t mesh_dim,
                              const std::vector<int64_t>& point_sizes, int64_t k, double radius) {
  const double inf = std::numeric_limits<double>::infinity();
  const double r2 = radius < inf ? radius * radius : inf;
  const bool distributed = mesh.defined();
  const int64_t P = distributed ? mesh.size(mesh_dim) : 1;
  const int64_t me = distributed ? mesh.coordinate()[mesh_dim] : 0;
  Comm comm = distributed ? mesh.comm(mesh_dim) : comm_null();
  std::vector<int64_t> off(P + 1, 0);
  for (int64_t c = 0; c < P; ++c) off[c + 1] = off[c] + point_sizes[c];

  at::Tensor q = queries.contiguous(), pts = points.contiguous();
  const int64_t m = q.size(0), d = q.size(1);
  at::Tensor best_d = at::full({m, k}, inf, at::kDouble);
  at::Tensor best_i = at::full({m, k}, kNoId, at::kLong);
  RingStats stats;

  merge_piece(q, best_d, best_i, pts, off[me], r2);

  if (P > 1) {
    // Bounding boxes of every piece: [P, 2, d] (lo, hi); empty: lo=+inf, hi=-inf.
    at::Tensor box = at::empty({2, d}, at::kDouble);
    if (pts.size(0) > 0) {
      at::Tensor pd = pts.to(at::kDouble);
      box[0].copy_(std::get<0>(pd.min(0)));
      box[1].copy_(std::get<0>(pd.max(0)));
    } else {
      box[0].fill_(inf);
      box[1].fill_(-inf);
    }
    at::Tensor boxes = at::empty({P, 2, d}, at::kDouble);
    transport::all_gatherv(box, boxes, std::vector<int64_t>(P, 2 * d * 8), comm);
    at::Tensor qd = q.to(at::kDouble);
    const int64_t row_bytes = d * static_cast<int64_t>(pts.element_size());

    for (int64_t s = 1; s < P; ++s) {
      const int64_t src = (me - s + P) % P, dst = (me + s) % P;
      bool need = false;
      if (m > 0 && point_sizes[src] > 0) {
        at::Tensor lo = boxes[src][0], hi = boxes[src][1];
        at::Tensor gap = (lo.unsqueeze(0) - qd).clamp_min(0) + (qd - hi.unsqueeze(0)).clamp_min(0);
        at::Tensor box_d2 = gap.square().sum(1);
        at::Tensor bound = best_d.select(1, k - 1);
        if (r2 < inf) bound = bound.clamp_max(r2);
        need = box_d2.le(bound).any().item<bool>();
      }
      // Phase 1: tell the owner of piece src whether to send it.
      at::Tensor ask = at::tensor({static_cast<int64_t>(need)}, at::kLong);
      at::Tensor asked = at::zeros({1}, at::kLong);
      {
        auto x = transport::start_exchange({{static_cast<int>(src), ask}},
                                           {{static_cast<int>(dst), asked}}, comm, kFlagTag);
        x.finish();
      }
      // Phase 2: the piece itself, only where asked.
      std::vector<transport::PeerBuffer> sends, recvs;
      if (asked.item<int64_t>() != 0 && pts.size(0) > 0)
        sends.push_back({static_cast<int>(dst), pts});
      at::Tensor piece;
      if (need) {
        piece = at::empty({point_sizes[src], d}, pts.options());
        recvs.push_back({static_cast<int>(src), piece});
      }
      {
        auto x = transport::start_exchange(sends, recvs, comm, kPointTag);
        x.finish();
      }
      if (need) {
        ++stats.pieces_fetched;
        stats.bytes_fetched += point_sizes[src] * row_bytes;
        merge_piece(q, best_d, best_i, piece, off[src], r2);
        piece = at::Tensor();
      } else if (point_sizes[src] > 0) {
        ++stats.pieces_skipped;
        stats.bytes_skipped += point_sizes[src] * row_bytes;
      }
    }
  }

  NeighborResult res;
  at::Tensor missing = best_i.eq(kNoId);
  res.index = best_i.masked_fill(missing, -1);
  res.dist = best_d.sqrt().to(points.scalar_type());
  res.stats = stats;
  return res;
}

}  // namespace shardtensor::comm
