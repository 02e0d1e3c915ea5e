// Shape ops: the view/reshape family, squeeze/unsqueeze, permute/transpose,
// narrow/slice/select, expand, split/unbind.
//
// Every rule here computes the result's layout from metadata alone (global
// shapes, placements, shard sizes, op arguments), validates everything before
// any communication, and applies the matching libtorch op to the local piece,
// so results that are views in libtorch are views of the local piece here
// (in-place ops on them reach the source).
#include <ATen/ATen.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/WrapDimUtils.h>

#include <numeric>
#include <sstream>

#include "comm/diagnostic.h"
#include "ops/common.h"
#include "ops/registry.h"

namespace shardtensor::ops {
namespace {

// ---------------------------------------------------------------- arguments

std::optional<int64_t> opt_int_arg(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return int_arg(v);
}

bool has_string_arg(const std::vector<c10::IValue>& args) {
  for (const auto& a : args) {
    if (a.isString()) return true;
    if (a.isList() && !a.toListRef().empty() && a.toListRef()[0].isString()) return true;
  }
  return false;
}

void reject_named(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  if (has_string_arg(args)) fail(op, args, "named dimensions are not supported on ShardTensors");
}

std::string mesh_dim_str(const ShardSpec& s, int64_t m) {
  std::ostringstream os;
  os << "Shard(" << shard_dim(s.placements()[m]) << ") on mesh dim " << m << ", sizes "
     << c10::IntArrayRef(s.shard_sizes(m));
  return os.str();
}

// ---------------------------------------------------------------- pieces

// A local tensor and its layout.
struct Piece {
  at::Tensor local;
  SpecPtr spec;
};

Piece piece_of(const at::Tensor& t) { return {local_of(t), spec_ptr_of(t)}; }

// Collective over the mesh dims in `dims` that are Shard: makes them Replicate.
Piece replicate_mesh_dims(const Piece& x, const std::vector<int64_t>& dims) {
  const ShardSpec& s = *x.spec;
  Placements p = s.placements();
  ShardSizes sizes = s.all_shard_sizes();
  bool changed = false;
  for (int64_t m : dims) {
    if (!is_shard(p[m])) continue;
    p[m] = Replicate{};
    sizes[m] = {};
    changed = true;
  }
  if (!changed) return x;
  SpecPtr spec = make_spec(s.mesh(), p, s.global_shape(), sizes);
  return {detail::redistribute_local(x.local, s, *spec), spec};
}

// Note [visible gathers] for a rule that replicates the mesh dims in `dims`
// of the whole input (unbind, diagonal along a sharded dim): counted, and
// refused in strict mode, on every rank before any communication.
void note_replication(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                      const Piece& x, const std::vector<int64_t>& dims, const std::string& what) {
  const ShardSpec& s = *x.spec;
  Placements p = s.placements();
  ShardSizes sizes = s.all_shard_sizes();
  std::string held;
  for (int64_t m : dims) {
    if (!is_shard(p[m])) continue;
    held += (held.empty() ? "" : ", ") + to_string(p[m]) + " on mesh dim " + std::to_string(m);
    p[m] = Replicate{};
    sizes[m] = {};
  }
  if (held.empty()) return;
  SpecPtr g = make_spec(s.mesh(), p, s.global_shape(), sizes);
  note_gather(op, args, s.mesh(), gathered_bytes(s, *g, x.local.element_size()),
              what + " replicates the whole input " + s.to_string() + " over " + held);
}

// What note_replication says of unbind along the sharded dim `dim`.
std::string unbind_what(int64_t dim) {
  return "unbind along the sharded dim " + std::to_string(dim);
}

// The layout after removing tensor dims `removed` (sorted ascending, none of
// them sharded) from `s`, with the new global shape `shape`.
SpecPtr drop_dims(const ShardSpec& s, const std::vector<int64_t>& removed,
                  std::vector<int64_t> shape) {
  Placements p = s.placements();
  for (auto& pl : p) {
    if (!is_shard(pl)) continue;
    const int64_t d = shard_dim(pl);
    int64_t below = 0;
    for (int64_t r : removed) {
      TORCH_INTERNAL_ASSERT(r != d, "drop_dims: removing the sharded dim ", d);
      if (r < d) ++below;
    }
    pl = Shard{d - below};
  }
  return make_spec(s.mesh(), p, std::move(shape), s.all_shard_sizes());
}

// Local. slice(dim, start, end, step) with start/end already normalized to
// 0 <= start <= end <= size. Along a sharded dim every coordinate keeps the
// selected indices it owns; they form a contiguous, ordered block of the
// result, so the result is sharded with sizes computed arithmetically.
Piece slice_piece(const Piece& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  const ShardSpec& s = *x.spec;
  std::vector<int64_t> shape = s.global_shape();
  shape[dim] = end > start ? (end - start + step - 1) / step : 0;
  const int64_t m = s.mesh_dim_of(dim);
  if (m < 0) {
    return {x.local.slice(dim, start, end, step),
            make_spec(s.mesh(), s.placements(), shape, s.all_shard_sizes())};
  }
  const auto& sz = s.shard_sizes(m);
  const auto off = offsets_of(sz);
  // Number of selected indices start + k*step that are < bound.
  auto count = [&](int64_t bound) {
    return bound <= start ? int64_t{0} : (std::min(bound, end) - start + step - 1) / step;
  };
  std::vector<int64_t> out(sz.size());
  for (size_t c = 0; c < sz.size(); ++c) {
    out[c] = std::max<int64_t>(0, count(off[c] + sz[c]) - count(off[c]));
  }
  const int64_t me = s.mesh().coordinate()[m];
  at::Tensor local;
  if (out[me] > 0) {
    const int64_t first = start + count(off[me]) * step - off[me];
    local = x.local.slice(dim, first, first + (out[me] - 1) * step + 1, step);
  } else {
    local = x.local.narrow(dim, 0, 0);
  }
  ShardSizes sizes = s.all_shard_sizes();
  sizes[m] = out;
  return {local, make_spec(s.mesh(), s.placements(), shape, sizes)};
}

// select(dim, index) with index normalized. Along a sharded dim: slice to the
// one element (held by one coordinate), replicate that mesh dim (collective),
// then select locally; the result is Replicate on that mesh dim.
Piece select_piece(const Piece& x, int64_t dim, int64_t index) {
  Piece y = x;
  int64_t local_index = index;
  const int64_t m = x.spec->mesh_dim_of(dim);
  if (m >= 0) {
    y = replicate_mesh_dims(slice_piece(x, dim, index, index + 1, 1), {m});
    local_index = 0;
  }
  std::vector<int64_t> shape = y.spec->global_shape();
  shape.erase(shape.begin() + dim);
  return {y.local.select(dim, local_index), drop_dims(*y.spec, {dim}, shape)};
}

void push_piece(Stack* stack, const Piece& p) { stack->push_back(wrap(p.local, p.spec)); }

void push_pieces(Stack* stack, const std::vector<Piece>& ps) {
  std::vector<at::Tensor> out;
  out.reserve(ps.size());
  for (const auto& p : ps) out.push_back(wrap(p.local, p.spec));
  stack->push_back(c10::IValue(out));
}

// Note [stale copy views]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A view op whose result had to be a copy where libtorch's is a view (select,
// squeeze, unbind or diagonal of a sharded dim, a view that moves data: Note
// [view layout]) writes in-place changes of the result back into its source
// (Note [view write-back]). The decision to copy depends on metadata only, so
// every rank holds such a copy or none does. The copy is exact only while the
// source is unchanged: libtorch's view would show later writes into the
// source, and writing the whole copy back would put its old values over them
// (even over elements the view never covered: unbind writes back its whole
// replicated block). So the copy follows its source, as libtorch's view does:
//  - Every wrapper has a version counter (libtorch's own). The dispatcher
//    bumps it on every in-place write into a ShardTensor, and a view op's
//    result that is a true view of its source shares the source's counter
//    (Note [view write-back], dispatch/dispatcher.cpp), so a write through any
//    alias is seen by all of them. Every rank runs the same ops, so the
//    counters are identical on every rank: unlike the local pieces' counters
//    (a rank whose piece of a written slice is empty, or whose rule skips an
//    empty piece, may not see a write), and unlike them they need no
//    communication to agree. A write-back bumps its source's counter too.
//  - Each copy records its source's version (alias_version) when it was made:
//    its Generation, shared by the copies made together (unbind's results view
//    one replicated block). Before any op uses the copy, or a view of it, as
//    an input or as the written tensor, the dispatcher calls WriteBack::refresh
//    (detail::refresh_copy_view; so do full_tensor() and redistribute()):
//    when the source's version moved on, the copy is made anew from the
//    source (the same collective that made it: a replication or a
//    redistribution of the current piece; a replication is a visible gather
//    again, counted and refused in strict mode like the first: Note [visible
//    gathers]) into the same memory, so that the
//    copy and every view of it show the current values. A write through the
//    copy therefore lands on the current values, and its write-back puts
//    nothing stale over the source. A copy of a copy (a select of a select,
//    each along a sharded dim) brings its source up to date first; the number
//    of times a copy was made anew is part of alias_version, so its own copies
//    see that.
//  - In-place view ops (t_, squeeze_, ...) change the source's layout; a copy
//    taken before cannot be made anew from it and its use is refused, on
//    every rank, naming the view op (take the view again).
//  - Copies that cannot write back but can be made anew by rerunning what
//    made them follow their source the same way (ops::refuse_in_place_following,
//    ops/common.h): the generic fallback's view results (as_strided,
//    view_as_real, ...: Note [generic fallback]; the rerun is a gather,
//    counted and refused in strict mode) and unfold along a sharded dim (Note
//    [unfold windows]; the rerun is its halo exchange).
// The cost where nothing is stale is a comparison of two integers per use of a
// copy view; plain tensors and true views pay nothing but the version bump
// of written arguments. Writes that bypass the dispatcher (into local()
// directly) are not seen. ShardTensor::local() never communicates, so it
// cannot make a stale copy anew: it raises instead (WriteBack::stale, local
// and identical on every rank), pointing to clone() or to taking the view
// again; I/O that reads pieces through local() raises alike rather than
// save old values.
struct Generation {
  CopyOrigin origin;                   // the source, its layout and version when the copy was made
  std::function<at::Tensor()> derive;  // collective: the copy, made anew from the source
};

std::shared_ptr<Generation> generation(const std::string& view_op, const at::Tensor& base,
                                       const SpecPtr& result, std::function<at::Tensor()> derive) {
  return std::make_shared<Generation>(
      Generation{CopyOrigin(base, view_op + " of " + spec_of(base)->to_string() +
                                      " (a copy laid out as " + result->to_string() + ")"),
                 std::move(derive)});
}

// Collective over every rank of the source's mesh where the source changed
// (every rank alike). `rep` is the copy (the result's piece views it, or is a
// contiguous copy of it when `copied`).
void refresh_copy(Generation& gen, const at::Tensor& rep, bool copied, const at::Tensor& r) {
  if (!gen.origin.outdated(r)) return;
  const at::Tensor fresh = gen.derive();
  // A copy that is in fact the source's own piece (a mesh dim of one
  // coordinate replicates nothing) is up to date already.
  if (!rep.is_alias_of(fresh)) rep.copy_(fresh);
  if (copied) local_of(r).copy_(rep.reshape(local_of(r).sizes()));
  gen.origin.remade();
}

void set_refresh(detail::WriteBack& wb, const at::Tensor& base, const at::Tensor& rep, bool copied,
                 const std::shared_ptr<Generation>& gen) {
  if (!gen) return;
  wb.refresh = [rep, copied, gen](const at::Tensor& r) { refresh_copy(*gen, rep, copied, r); };
  wb.stale = [base, rep, copied, gen](const at::Tensor&) {
    if (detail::stale_copy_view(base)) return true;
    // A "copy" that is the source's own piece (a mesh dim of one coordinate
    // replicates nothing) shows the current values already.
    if (!copied && rep.is_alias_of(local_of(base))) return false;
    return gen->origin.stale();
  };
  wb.refreshes = gen->origin.refreshes;
}

// After a write-back into `base`'s piece.
void wrote_back(const at::Tensor& base, const std::shared_ptr<Generation>& gen) {
  detail::bump_alias_version(base);
  if (gen) gen->origin.wrote_back();
}

// Note [view write-back] (tensor/shard_tensor_impl.h) for a view result whose
// local piece is a view of `rep`, which holds the piece of `base` except along
// the tensor dims in `dims`, where it holds the global range starting at
// dims[i].second, replicated over the mesh dims that shard them in `base`.
// After an in-place op on the result, `rep` is changed; the part of it that
// `base`'s piece owns is copied back. With `copied` the result's piece is a
// contiguous copy of `rep` (same elements in row-major order) that is copied
// into `rep` first. `rep` is replicated over those mesh dims but only its
// owner's part is used, so it goes through comm::use_replicated (its gradient
// is summed over them: Note [replicated gradients]), and ranks that own none
// of it still copy an empty slice so that every rank's backward makes that
// all-reduce. Forward is local. With `gen` the copy follows its source
// (Note [stale copy views]).
void set_write_back(const at::Tensor& result, const at::Tensor& base, const at::Tensor& rep,
                    std::vector<std::pair<int64_t, int64_t>> dims, bool copied,
                    const std::shared_ptr<Generation>& gen) {
  auto wb = std::make_shared<detail::WriteBack>();
  wb->fn = [base, rep, dims, copied, gen](const at::Tensor& r) {
    if (copied) rep.copy_(local_of(r).reshape(rep.sizes()));
    const ShardSpec& bs = *spec_of(base);
    at::Tensor dst = local_of(base);
    if (dst.is_same(rep)) {
      wrote_back(base, gen);
      return;
    }
    const auto offs = bs.local_offsets();
    const auto shape = bs.local_shape();
    at::Tensor src = rep;
    std::vector<int64_t> mesh_dims;
    for (const auto& d : dims) mesh_dims.push_back(bs.mesh_dim_of(d.first));
    if (!mesh_dims.empty() && src.requires_grad()) {
      src = comm::use_replicated(src, bs.mesh(), mesh_dims);
    }
    for (const auto& [d, start] : dims) {
      const int64_t lo = std::max(offs[d], start);
      const int64_t hi = std::min(offs[d] + shape[d], start + rep.size(d));
      if (hi <= lo) {  // this piece holds none of the viewed elements
        dst = dst.narrow(d, 0, 0);
        src = src.narrow(d, 0, 0);
      } else {
        dst = dst.narrow(d, lo - offs[d], hi - lo);
        src = src.narrow(d, lo - start, hi - lo);
      }
    }
    dst.copy_(src);
    wrote_back(base, gen);
  };
  set_refresh(*wb, base, rep, copied, gen);
  detail::shard_impl(result)->set_write_back(std::move(wb));
}

// ---------------------------------------------------------------- view / reshape

// Note [view layout]: a view/reshape maps the input's global shape to the
// output's. Leaving out size-1 dims, the dims of both shapes are grouped into
// minimal blocks of equal product (e.g. [6, 4] -> [24] is one block, [2, 3, 4]
// -> [6, 4] is {2, 3} -> {6} and {4} -> {4}). In row-major order a block is a
// contiguous run of the flattened tensor, so a tensor dim sharded by mesh dim
// m maps cleanly when it is the block's outermost input dim and the block's
// other input dims are not sharded: coordinate c holds the flat range
// [off_c * inner_in, (off_c + size_c) * inner_in) of the block, which is a
// block of whole rows of the output's outermost block dim iff size_c * inner_in
// (and so off_c * inner_in) is a multiple of inner_out; the output dim is then
// sharded with sizes size_c * inner_in / inner_out and the local view is the
// same view on the piece (no communication). Otherwise:
//  - a sharded size-1 dim holds all the data on one coordinate and has no
//    counterpart: that mesh dim is replicated first (cheap and correct; the
//    result is not a view of the source then);
//  - sizes that are not multiples (e.g. [24] over 4 ranks as [6, 6, 6, 6] ->
//    [6, 4] needs multiples of 4): that mesh dim is first repartitioned to the
//    balanced multiples (point-to-point, moving only the elements that change
//    owner). For view and unflatten (views in libtorch) the result is then a
//    copy: in-place ops on it are written back to the source (Note [view
//    write-back]), but later writes to the source do not reach it;
//  - a sharded dim that is not the block's outermost, or a block with two
//    sharded dims (e.g. [B, H, W] sharded on W -> [B, H*W]): Note [view merge]
//    moves it onto the block's outermost dim first (all-to-all), or, when
//    that dim is sharded too (H and W on a 2x2 mesh), replicates its mesh dim
//    (a visible gather); a mesh dim of one coordinate is simply replicated.
// A tensor with no elements maps every sharded dim to Replicate: every local
// piece is empty, so no data needs to move.
enum class ViewKind { View, Reshape, UnsafeView };

struct Block {
  std::vector<int64_t> in, out;
};

std::vector<Block> view_blocks(c10::IntArrayRef from, c10::IntArrayRef to) {
  std::vector<int64_t> in, out;
  for (int64_t d = 0; d < static_cast<int64_t>(from.size()); ++d) {
    if (from[d] != 1) in.push_back(d);
  }
  for (int64_t d = 0; d < static_cast<int64_t>(to.size()); ++d) {
    if (to[d] != 1) out.push_back(d);
  }
  std::vector<Block> blocks;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    TORCH_INTERNAL_ASSERT(i < in.size() && j < out.size(), "view_blocks: products differ");
    Block b;
    int64_t pi = from[in[i]], pj = to[out[j]];
    b.in.push_back(in[i++]);
    b.out.push_back(out[j++]);
    while (pi != pj) {
      if (pi < pj) {
        TORCH_INTERNAL_ASSERT(i < in.size(), "view_blocks: products differ");
        pi *= from[in[i]];
        b.in.push_back(in[i++]);
      } else {
        TORCH_INTERNAL_ASSERT(j < out.size(), "view_blocks: products differ");
        pj *= to[out[j]];
        b.out.push_back(out[j++]);
      }
    }
    blocks.push_back(std::move(b));
  }
  return blocks;
}

const char* kind_name(ViewKind k) {
  switch (k) {
    case ViewKind::View:
      return "view";
    case ViewKind::Reshape:
      return "reshape";
    case ViewKind::UnsafeView:
      return "_unsafe_view";
  }
  return "";
}

// Validates and plans: `mid` is the layout the input must first be brought to
// (equal to the input's when no data moves), `out` the result's. Note
// [view merge]: a sharded dim that is not the outermost of its block (or a
// block's second sharded dim) is first moved: onto the block's outermost dim
// when no mesh dim shards that one (an all-to-all; every rank keeps about its
// share), else its mesh dim is replicated (a gather, counted and refused in
// strict mode: Note [visible gathers]).
std::pair<SpecPtr, SpecPtr> plan_view(const c10::OperatorHandle& op,
                                      const std::vector<c10::IValue>& args, const ShardSpec& s,
                                      const std::vector<int64_t>& to, ViewKind kind,
                                      int64_t itemsize) {
  const auto& from = s.global_shape();
  const DeviceMesh& mesh = s.mesh();
  const int64_t nm = mesh.ndim();
  Placements mid_p = s.placements(), out_p(nm, Replicate{});
  ShardSizes mid_sizes = s.all_shard_sizes(), out_sizes(nm);
  for (int64_t m = 0; m < nm; ++m) {
    if (is_partial(s.placements()[m])) out_p[m] = Partial{};
  }
  if (s.numel() > 0) {
    const auto blocks = view_blocks(from, to);
    std::vector<int64_t> block_of(from.size(), -1);
    for (size_t b = 0; b < blocks.size(); ++b) {
      for (int64_t d : blocks[b].in) block_of[d] = static_cast<int64_t>(b);
    }
    // Pass 1 (Note [view merge]): the mesh dim that shards each block's
    // outermost dim keeps it; the other sharded dims of a block move.
    std::vector<int64_t> owner(blocks.size(), -1);
    for (int64_t m = 0; m < nm; ++m) {
      if (!is_shard(s.placements()[m])) continue;
      const int64_t d = shard_dim(s.placements()[m]);
      if (from[d] == 1) {
        // A sharded size-1 dim holds all its data on one coordinate.
        mid_p[m] = Replicate{};
        mid_sizes[m] = {};
      } else if (blocks[block_of[d]].in.front() == d) {
        owner[block_of[d]] = m;
      }
    }
    bool gather = false;
    std::string gather_what;
    for (int64_t m = 0; m < nm; ++m) {
      if (!is_shard(mid_p[m])) continue;
      const int64_t d = shard_dim(mid_p[m]);
      const Block& b = blocks[block_of[d]];
      if (b.in.front() == d) continue;
      const int64_t outer = b.in.front();
      if (mesh.size(m) == 1) {
        // One coordinate holds the whole extent: replicating moves nothing.
        mid_p[m] = Replicate{};
        mid_sizes[m] = {};
      } else if (owner[block_of[d]] < 0) {
        mid_p[m] = Shard{outer};
        mid_sizes[m] = balanced_sizes(from[outer], mesh.size(m));
        owner[block_of[d]] = m;
      } else {
        mid_p[m] = Replicate{};
        mid_sizes[m] = {};
        gather = true;
        gather_what = std::string(kind_name(kind)) + " merges tensor dims " + shape_str(b.in) +
                      " of which " + std::to_string(outer) + " and " + std::to_string(d) +
                      " are both sharded, so " + mesh_dim_str(s, m) + " is replicated";
      }
    }
    if (gather) {
      SpecPtr g = make_spec(mesh, mid_p, from, mid_sizes);
      note_gather(op, args, mesh, gathered_bytes(s, *g, itemsize), gather_what);
    }
    // Pass 2: every sharded dim is the outermost of its block.
    for (int64_t m = 0; m < nm; ++m) {
      if (!is_shard(mid_p[m])) continue;
      const int64_t d = shard_dim(mid_p[m]);
      const Block& b = blocks[block_of[d]];
      TORCH_INTERNAL_ASSERT(b.in.front() == d);
      int64_t inner_in = 1, inner_out = 1;
      for (size_t k = 1; k < b.in.size(); ++k) inner_in *= from[b.in[k]];
      for (size_t k = 1; k < b.out.size(); ++k) inner_out *= to[b.out[k]];
      const int64_t q = inner_out / std::gcd(inner_in, inner_out);
      const auto& sz = mid_sizes[m];
      const bool clean = std::all_of(sz.begin(), sz.end(), [&](int64_t n) { return n % q == 0; });
      if (!clean) {
        // Repartition that mesh dim to balanced multiples of q (Note [view layout]).
        auto balanced = balanced_sizes(from[d] / q, mesh.size(m));
        for (auto& n : balanced) n *= q;
        mid_sizes[m] = balanced;
      }
      out_p[m] = Shard{b.out.front()};
      for (int64_t n : mid_sizes[m]) out_sizes[m].push_back(n * inner_in / inner_out);
    }
  } else {
    for (int64_t m = 0; m < nm; ++m) {
      if (is_shard(mid_p[m])) out_p[m] = Replicate{};
    }
  }
  SpecPtr mid = make_spec(mesh, mid_p, from, mid_sizes);
  if (*mid == s) mid = nullptr;
  return {mid, make_spec(mesh, out_p, to, out_sizes)};
}

// Note [view write-back] for a view whose input was moved to the layout `mid`
// (Note [view merge], or a repartition to multiples): after an in-place op on
// the result, `rep` (the moved piece, which the result's piece views, or of
// which it is a contiguous copy when `copied`) is moved back to the source's
// layout and copied into the source's piece. Collective like the move (every
// rank runs the same in-place op).
void set_moved_write_back(const at::Tensor& result, const at::Tensor& base, const at::Tensor& rep,
                          SpecPtr mid, bool copied, const std::shared_ptr<Generation>& gen) {
  auto wb = std::make_shared<detail::WriteBack>();
  wb->fn = [base, rep, mid, copied, gen](const at::Tensor& r) {
    if (copied) rep.copy_(local_of(r).reshape(rep.sizes()));
    const ShardSpec& bs = *spec_of(base);
    local_of(base).copy_(detail::redistribute_local(rep, *mid, bs));
    wrote_back(base, gen);
  };
  set_refresh(*wb, base, rep, copied, gen);
  detail::shard_impl(result)->set_write_back(std::move(wb));
}

at::Tensor view_impl(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                     const at::Tensor& self, c10::IntArrayRef requested, ViewKind kind) {
  const ShardSpec& s = *spec_of(self);
  const std::vector<int64_t> to = at::infer_size(requested, s.numel());
  // Note [wrapper strides]: whether libtorch's result is a view is decided by
  // the global tensor's strides (the wrapper's), never by a piece's, so every
  // rank decides alike: view refuses what libtorch refuses, and reshape copies
  // exactly where libtorch copies.
  const bool global_view =
      at::detail::computeStride(self.sizes(), self.strides(), c10::IntArrayRef(to)).has_value();
  if (kind == ViewKind::View && !global_view) {
    fail(op, args,
         "view size " + shape_str(to) + " is not compatible with input tensor's size " +
             shape_str(self.sizes()) + " and stride " + shape_str(self.strides()) +
             " (at least one dimension spans across two contiguous subspaces), as in libtorch. "
             "Use .reshape(...) instead.");
  }
  const bool is_view = kind == ViewKind::View || (kind == ViewKind::Reshape && global_view);
  auto [mid, out] = plan_view(op, args, s, to, kind, self.element_size());
  at::Tensor local = local_of(self);
  if (mid) local = detail::redistribute_local(local, s, *mid);
  const at::Tensor rep = local;
  bool copied = false;
  const auto shape = out->local_shape();
  if (is_view) {
    // Note [view strides]: the global strides allow the view, and so do the
    // piece's in every layout plan_view produces, as long as the piece's
    // strides follow its wrapper's. Where they may not (the wrapper is not
    // contiguous: a piece of one row of a transposed tensor is contiguous on
    // one rank and not on another) the ranks agree (one uncounted all-reduce
    // of a flag; never for a contiguous wrapper, the common case): if any
    // piece refuses the view, every rank copies its piece to contiguous
    // memory, and writes through the result go back to the source (Note
    // [view write-back]), reads follow it (Note [stale copy views]). After a
    // move (`mid`) the result is a copy on every rank anyway, and only the
    // local steps differ. A contiguous wrapper over a piece that refuses the
    // view is refused (on that rank: its rule gave the wrapper wrong strides).
    const bool piece_ok =
        at::detail::computeStride(local.sizes(), local.strides(), c10::IntArrayRef(shape))
            .has_value();
    if (mid) {
      copied = !piece_ok;
    } else if (!self.is_contiguous()) {
      copied = !comm::diagnostic_agree(s.mesh(), 0, piece_ok).all_ok;
    } else if (!piece_ok) {
      fail(op, args,
           "the local piece's sizes " + shape_str(local.sizes()) + " and strides " +
               shape_str(local.strides()) +
               " do not allow this view while its wrapper's contiguous strides do (a rule gave "
               "the wrapper strides its pieces do not follow); use reshape");
    }
    local = copied ? local.clone(at::MemoryFormat::Contiguous).view(shape) : local.view(shape);
  } else if (kind == ViewKind::Reshape) {
    // libtorch copies: so does every rank, even where its piece could be viewed.
    local = at::_unsafe_view(local.clone(at::MemoryFormat::Contiguous), shape);
  } else {
    local = at::_unsafe_view(local, shape);
  }
  at::Tensor result = wrap(local, out);
  if (is_view && (mid || copied)) {
    // Not a view of the piece (a replicated mesh dim, or a contiguous copy):
    // writes go back through Note [view write-back]. `mid` only replicates.
    std::vector<std::pair<int64_t, int64_t>> back;
    bool only_replicates = true;
    if (mid) {
      for (int64_t m = 0; m < s.mesh().ndim(); ++m) {
        const auto& src = s.placements()[m];
        const auto& dst = mid->placements()[m];
        if (is_shard(src) && !is_shard(dst)) {
          back.emplace_back(shard_dim(src), 0);
        } else if (is_shard(dst)) {
          only_replicates =
              only_replicates && src == dst && s.shard_sizes(m) == mid->shard_sizes(m);
        }
      }
    }
    // Made on every rank alike (Note [stale copy views]).
    const SpecPtr from = spec_ptr_of(self);
    auto gen = generation(kind_name(kind), self, out, [self, from, mid = mid] {
      return mid ? detail::redistribute_local(local_of(self), *from, *mid) : local_of(self);
    });
    if (only_replicates) {
      set_write_back(result, self, rep, back, copied, gen);
    } else {
      set_moved_write_back(result, self, rep, mid, copied, gen);
    }
  }
  return result;
}

// view(self, size) and view.dtype(self, dtype).
void view_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  const at::Tensor& self = args[0].toTensor();
  if (op.schema().overload_name() == "dtype") {
    // Reinterpreting the dtype only changes the last dim, by the ratio of the
    // element sizes. Where that dim is sharded, every piece reinterprets its
    // own bytes (a local view): its extent scales by the same ratio, which
    // needs every piece's bytes along it to be a whole number of new elements
    // (metadata: every rank agrees, and all throw together otherwise).
    const auto dtype = args[1].toScalarType();
    at::Tensor local = local_of(self);
    const auto meta = at::empty(s.global_shape(), self.options().device(at::kMeta)).view(dtype);
    ShardSizes sizes = s.all_shard_sizes();
    const int64_t m = s.ndim() > 0 ? s.mesh_dim_of(s.ndim() - 1) : -1;
    if (meta.sizes().vec() != s.global_shape() && m >= 0) {
      const int64_t from = self.element_size(), to = c10::elementSize(dtype);
      for (int64_t& n : sizes[m]) {
        if ((n * from) % to != 0) {
          fail(op, args,
               "viewing as " + std::string(c10::toString(dtype)) +
                   " changes the sharded last dim, and a piece of " + std::to_string(n) +
                   " elements is not a whole number of the new elements; redistribute first");
        }
        n = n * from / to;
      }
    }
    auto spec = make_spec(s.mesh(), s.placements(), meta.sizes().vec(), sizes);
    // An empty piece has no bytes to reinterpret, and its strides may not
    // satisfy view's checks: it becomes an empty piece of the new dtype.
    at::Tensor out = local.numel() == 0
                         ? at::empty(spec->local_shape(), local.options().dtype(dtype))
                         : local.view(dtype);
    stack->push_back(wrap(out, spec));
    return;
  }
  stack->push_back(view_impl(op, args, self, int_list(args[1]), ViewKind::View));
}

void reshape_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  self_spec(op, args);
  stack->push_back(view_impl(op, args, args[0].toTensor(), int_list(args[1]), ViewKind::Reshape));
}

void unsafe_view_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  self_spec(op, args);
  if (!op.schema().overload_name().empty()) fail(op, args, "the out= variant is not supported");
  stack->push_back(
      view_impl(op, args, args[0].toTensor(), int_list(args[1]), ViewKind::UnsafeView));
}

// _reshape_alias(self, size, stride): reached only when called directly (we
// intercept reshape before it decomposes). The strides refer to the global
// tensor, whose strides are contiguous; only those are meaningful here.
void reshape_alias_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  self_spec(op, args);
  const auto size = int_list(args[1]);
  const auto stride = int_list(args[2]);
  std::vector<int64_t> contiguous(size.size());
  int64_t acc = 1;
  for (int64_t d = static_cast<int64_t>(size.size()) - 1; d >= 0; --d) {
    contiguous[d] = acc;
    acc *= std::max<int64_t>(size[d], 1);
  }
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] != 1 && stride[d] != contiguous[d]) {
      fail(op, args, "only contiguous strides are supported on ShardTensors");
    }
  }
  stack->push_back(view_impl(op, args, args[0].toTensor(), size, ViewKind::View));
}

// flatten.using_ints(self, start_dim, end_dim): libtorch's reshape semantics
// (a view when possible); start_dim == end_dim returns self.
void flatten_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  reject_named(op, args);
  const ShardSpec& s = self_spec(op, args);
  const at::Tensor& self = args[0].toTensor();
  const int64_t start = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  const int64_t end = at::maybe_wrap_dim(args[2].toInt(), s.ndim());
  TORCH_CHECK(start <= end, "flatten() has invalid args: start_dim cannot come after end_dim");
  if (s.ndim() == 0) {
    stack->push_back(view_impl(op, args, self, {1}, ViewKind::Reshape));
    return;
  }
  if (start == end) {
    stack->push_back(self);
    return;
  }
  const auto& g = s.global_shape();
  std::vector<int64_t> shape(g.begin(), g.begin() + start);
  shape.push_back(
      std::accumulate(g.begin() + start, g.begin() + end + 1, int64_t{1}, std::multiplies<>()));
  shape.insert(shape.end(), g.begin() + end + 1, g.end());
  stack->push_back(view_impl(op, args, self, shape, ViewKind::Reshape));
}

// unflatten.int(self, dim, sizes): a view in libtorch, so a view here.
void unflatten_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  reject_named(op, args);
  const ShardSpec& s = self_spec(op, args);
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  const auto sizes = int_list(args[2]);
  TORCH_CHECK(!sizes.empty(), "unflatten: sizes must be non-empty");
  const auto& g = s.global_shape();
  std::vector<int64_t> inferred;
  try {
    inferred = at::infer_size(sizes, g[dim]);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "unflatten: Provided sizes ", c10::IntArrayRef(sizes),
                " don't multiply up to the size of dim ", dim, " (", g[dim],
                ") in the input tensor");
  }
  std::vector<int64_t> shape(g.begin(), g.begin() + dim);
  shape.insert(shape.end(), inferred.begin(), inferred.end());
  shape.insert(shape.end(), g.begin() + dim + 1, g.end());
  stack->push_back(view_impl(op, args, args[0].toTensor(), shape, ViewKind::View));
}

// ---------------------------------------------------------------- squeeze / unsqueeze

// The global size-1 dims that squeeze removes, ascending.
std::vector<int64_t> squeeze_dims(const c10::OperatorHandle& op,
                                  const std::vector<c10::IValue>& args, const ShardSpec& s) {
  reject_named(op, args);
  const auto& g = s.global_shape();
  std::vector<int64_t> wanted;
  if (args.size() < 2) {
    for (int64_t d = 0; d < s.ndim(); ++d) wanted.push_back(d);
  } else if (args[1].isInt()) {
    wanted.push_back(at::maybe_wrap_dim(args[1].toInt(), s.ndim()));
  } else {
    for (int64_t d : int_list(args[1])) wanted.push_back(at::maybe_wrap_dim(d, s.ndim()));
  }
  std::vector<int64_t> dims;
  for (int64_t d : wanted) {
    if (s.ndim() > 0 && g[d] == 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end());
  dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
  return dims;
}

// Note [squeeze]: only GLOBAL size-1 dims are squeezed (a piece may hold one
// element of a longer dim, or none). A sharded size-1 dim has its element on
// one coordinate, so that mesh dim is replicated first (collective).
void squeeze_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  const auto dims = squeeze_dims(op, args, s);
  std::vector<int64_t> rep;
  for (int64_t d : dims) {
    if (s.mesh_dim_of(d) >= 0) rep.push_back(s.mesh_dim_of(d));
  }
  Piece x = replicate_mesh_dims(piece_of(args[0].toTensor()), rep);
  at::Tensor local = x.local;
  if (dims.empty()) {
    local = local.alias();
  } else {
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) local = local.squeeze(*it);
  }
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < s.ndim(); ++d) {
    if (!std::binary_search(dims.begin(), dims.end(), d)) shape.push_back(s.global_shape()[d]);
  }
  at::Tensor out = wrap(local, drop_dims(*x.spec, dims, shape));
  if (!rep.empty()) {
    // Sharded size-1 dims were replicated: writes go back to their owners.
    std::vector<std::pair<int64_t, int64_t>> back;
    for (int64_t d : dims) {
      if (s.mesh_dim_of(d) >= 0) back.emplace_back(d, 0);
    }
    const at::Tensor base = args[0].toTensor();
    set_write_back(out, base, x.local, back, /*copied=*/false,
                   generation("squeeze", base, spec_ptr_of(out), [base, rep] {
                     return replicate_mesh_dims(piece_of(base), rep).local;
                   }));
  }
  stack->push_back(out);
}

SpecPtr unsqueeze_spec(const ShardSpec& s, int64_t dim) {
  Placements p = s.placements();
  for (auto& pl : p) {
    if (is_shard(pl) && shard_dim(pl) >= dim) pl = Shard{shard_dim(pl) + 1};
  }
  std::vector<int64_t> shape = s.global_shape();
  shape.insert(shape.begin() + dim, 1);
  return make_spec(s.mesh(), p, shape, s.all_shard_sizes());
}

void unsqueeze_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim() + 1);
  stack->push_back(wrap(local_of(args[0].toTensor()).unsqueeze(dim), unsqueeze_spec(s, dim)));
}

// ---------------------------------------------------------------- permute / transpose

SpecPtr permute_spec(const ShardSpec& s, const std::vector<int64_t>& perm) {
  Placements p = s.placements();
  for (auto& pl : p) {
    if (!is_shard(pl)) continue;
    const auto it = std::find(perm.begin(), perm.end(), shard_dim(pl));
    TORCH_INTERNAL_ASSERT(it != perm.end());
    pl = Shard{static_cast<int64_t>(it - perm.begin())};
  }
  std::vector<int64_t> shape;
  for (int64_t d : perm) shape.push_back(s.global_shape()[d]);
  return make_spec(s.mesh(), p, shape, s.all_shard_sizes());
}

void permute_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  auto perm = int_list(args[1]);
  // libtorch's own checks and messages, on a shape-only tensor.
  at::empty(s.global_shape(), at::TensorOptions().device(at::kMeta)).permute(perm);
  for (auto& d : perm) d = at::maybe_wrap_dim(d, s.ndim());
  stack->push_back(wrap(local_of(args[0].toTensor()).permute(perm), permute_spec(s, perm)));
}

std::vector<int64_t> transpose_perm(int64_t ndim, int64_t d0, int64_t d1) {
  std::vector<int64_t> perm(ndim);
  std::iota(perm.begin(), perm.end(), 0);
  if (ndim > 0) std::swap(perm[d0], perm[d1]);
  return perm;
}

// transpose.int(self, dim0, dim1) and t(self).
void transpose_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  int64_t d0 = 0, d1 = 1;
  if (args.size() >= 3) {
    d0 = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
    d1 = at::maybe_wrap_dim(args[2].toInt(), s.ndim());
  } else {
    TORCH_CHECK(s.ndim() <= 2, "t() expects a tensor with <= 2 dimensions, but self is ", s.ndim(),
                "D");
    if (s.ndim() < 2) d1 = 0;
  }
  const at::Tensor local = local_of(args[0].toTensor());
  stack->push_back(
      wrap(local.transpose(d0, d1), permute_spec(s, transpose_perm(s.ndim(), d0, d1))));
}

// ---------------------------------------------------------------- in-place view ops

// squeeze_, unsqueeze_, transpose_, t_: the local piece is changed in place
// and the ShardTensor takes the new layout. A squeeze_ that would need
// communication (a sharded size-1 dim) is refused: the piece could not stay
// the same tensor.
void inplace_view_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  const at::Tensor& self = args[0].toTensor();
  at::Tensor local = local_of(self);
  const std::string& name = op.schema().name();
  SpecPtr spec;
  if (name == "aten::squeeze_") {
    const auto dims = squeeze_dims(op, args, s);
    for (int64_t d : dims) {
      if (s.mesh_dim_of(d) >= 0) {
        fail(op, args,
             "in-place squeeze of the sharded size-1 dim " + std::to_string(d) +
                 " would need communication; use squeeze() (out of place)");
      }
    }
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < s.ndim(); ++d) {
      if (!std::binary_search(dims.begin(), dims.end(), d)) shape.push_back(s.global_shape()[d]);
    }
    spec = drop_dims(s, dims, shape);
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) local.squeeze_(*it);
  } else if (name == "aten::unsqueeze_") {
    const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim() + 1);
    spec = unsqueeze_spec(s, dim);
    local.unsqueeze_(dim);
  } else {
    int64_t d0 = 0, d1 = 1;
    if (name == "aten::transpose_") {
      d0 = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
      d1 = at::maybe_wrap_dim(args[2].toInt(), s.ndim());
    } else {
      TORCH_CHECK(s.ndim() <= 2, "t_() expects a tensor with <= 2 dimensions, but self is ",
                  s.ndim(), "D");
      if (s.ndim() < 2) d1 = 0;
    }
    spec = permute_spec(s, transpose_perm(s.ndim(), d0, d1));
    local.transpose_(d0, d1);
  }
  detail::shard_impl(self)->shallow_copy_from(
      c10::make_intrusive<detail::ShardTensorImpl>(local, spec));
  stack->push_back(self);
}

// ---------------------------------------------------------------- narrow / slice / select

// slice.Tensor(self, dim, start?, end?, step): libtorch's normalization of the
// bounds (negative wrap, then clamp), then slice_piece.
void slice_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK(s.ndim() > 0, "slice() cannot be applied to a 0-dim tensor.");
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  const int64_t size = s.global_shape()[dim];
  int64_t start = opt_int_arg(args[2]).value_or(0);
  int64_t end = opt_int_arg(args[3]).value_or(INT64_MAX);
  const int64_t step = int_arg(args[4]);
  TORCH_CHECK(step > 0, "slice step must be positive");
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  push_piece(stack, slice_piece(piece_of(args[0].toTensor()), dim, start, end, step));
}

// narrow(self, dim, start, length) and narrow.Tensor (start as a 0-dim tensor).
void narrow_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK(s.ndim() > 0, "narrow() cannot be applied to a 0-dim tensor.");
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  int64_t start;
  if (args[2].isTensor()) {
    const at::Tensor& t = args[2].toTensor();
    if (spec_of(t)) fail(op, args, "`start` must be a plain tensor");
    TORCH_CHECK(t.dim() == 0 && at::isIntegralType(t.scalar_type(), /*includeBool=*/false),
                "start must be an 0-dim integral Tensor.");
    start = t.item<int64_t>();
  } else {
    start = int_arg(args[2]);
  }
  const int64_t length = int_arg(args[3]);
  const int64_t cur = s.global_shape()[dim];
  if (start != cur) start = at::maybe_wrap_dim(start, cur);
  TORCH_CHECK(length >= 0 && start <= cur - length, "start (", start, ") + length (", length,
              ") exceeds dimension size (", cur, ").");
  push_piece(stack, slice_piece(piece_of(args[0].toTensor()), dim, start, start + length, 1));
}

void select_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK_INDEX(s.ndim() > 0, "select() cannot be applied to a 0-dim tensor.");
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  int64_t index = int_arg(args[2]);
  const int64_t size = s.global_shape()[dim];
  TORCH_CHECK_INDEX(!(size < -index || size <= index), "select(): index ", index,
                    " out of range for tensor of size ", c10::IntArrayRef(s.global_shape()),
                    " at dimension ", dim);
  if (index < 0) index += size;
  const at::Tensor& self = args[0].toTensor();
  const int64_t m = s.mesh_dim_of(dim);
  if (m < 0) {
    push_piece(stack, select_piece(piece_of(self), dim, index));
    return;
  }
  // Along a sharded dim the result is replicated over m: writes through it go
  // back to the coordinate that owns `index` (Note [view write-back]).
  Piece rep = replicate_mesh_dims(slice_piece(piece_of(self), dim, index, index + 1, 1), {m});
  std::vector<int64_t> shape = s.global_shape();
  shape.erase(shape.begin() + dim);
  at::Tensor out = wrap(rep.local.select(dim, 0), drop_dims(*rep.spec, {dim}, shape));
  set_write_back(out, self, rep.local, {{dim, index}}, /*copied=*/false,
                 generation("select", self, spec_ptr_of(out), [self, dim, index, m] {
                   return replicate_mesh_dims(slice_piece(piece_of(self), dim, index, index + 1, 1),
                                              {m})
                       .local;
                 }));
  stack->push_back(out);
}

// ---------------------------------------------------------------- expand

// expand(self, size, implicit): new leading dims are unsharded; a sharded dim
// must keep its size (expanding a sharded size-1 dim is refused).
void expand_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  const auto size = int_list(args[1]);
  const bool implicit = args.size() > 2 && args[2].toBool();
  // libtorch's checks and result shape, on a shape-only tensor.
  const std::vector<int64_t> shape =
      at::empty(s.global_shape(), at::TensorOptions().device(at::kMeta))
          .expand(size, implicit)
          .sizes()
          .vec();
  const int64_t lead = static_cast<int64_t>(shape.size()) - s.ndim();
  Placements p = s.placements();
  for (int64_t m = 0; m < s.mesh().ndim(); ++m) {
    if (!is_shard(p[m])) continue;
    const int64_t d = shard_dim(p[m]);
    if (shape[d + lead] != s.global_shape()[d]) {
      fail(op, args,
           "expand cannot change the size of the sharded dim " + std::to_string(d) + " (" +
               mesh_dim_str(s, m) + "); redistribute mesh dim " + std::to_string(m) +
               " to Replicate first");
    }
    p[m] = Shard{d + lead};
  }
  SpecPtr spec = make_spec(s.mesh(), p, shape, s.all_shard_sizes());
  stack->push_back(wrap(local_of(args[0].toTensor()).expand(spec->local_shape(), implicit), spec));
}

// ---------------------------------------------------------------- split / unbind

// split.Tensor, unsafe_split.Tensor (split_size) and split_with_sizes,
// unsafe_split_with_sizes (sizes): one slice per piece, libtorch's checks.
void split_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK(s.ndim() != 0, "split expects at least a 1-dimensional tensor");
  const int64_t dim = at::maybe_wrap_dim(args[2].toInt(), s.ndim());
  const int64_t dim_size = s.global_shape()[dim];
  std::vector<int64_t> lengths;
  if (args[1].isInt() || args[1].isSymInt()) {
    const int64_t split_size = int_arg(args[1]);
    TORCH_CHECK(split_size >= 0,
                "split expects split_size be non-negative, but got split_size=", split_size);
    TORCH_CHECK(split_size > 0 || dim_size == 0,
                "split_size can only be 0 if dimension size is 0, but got dimension size of ",
                dim_size);
    int64_t n = 1;
    if (split_size != 0) n = std::max<int64_t>((dim_size + split_size - 1) / split_size, 1);
    for (int64_t i = 0; i < n; ++i) {
      lengths.push_back(i < n - 1 ? split_size : split_size - (split_size * n - dim_size));
    }
  } else {
    lengths = int_list(args[1]);
    int64_t total = 0;
    for (int64_t l : lengths) {
      TORCH_CHECK(l >= 0, "split_with_sizes expects split_sizes have only non-negative ",
                  "entries, but got split_sizes=", c10::IntArrayRef(lengths));
      total += l;
    }
    TORCH_CHECK(total == dim_size, "split_with_sizes expects split_sizes to sum exactly to ",
                dim_size, " (input tensor's size at dimension ", dim, "), ",
                "but got split_sizes=", c10::IntArrayRef(lengths));
  }
  const Piece x = piece_of(args[0].toTensor());
  std::vector<Piece> out;
  int64_t start = 0;
  for (int64_t l : lengths) {
    out.push_back(slice_piece(x, dim, start, start + l, 1));
    start += l;
  }
  push_pieces(stack, out);
}

// unbind.int(self, dim): along a sharded dim, one replication of that mesh dim
// (rather than one per element), then a local unbind; writes through the
// results go back to the owners (Note [view write-back]).
void unbind_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  reject_named(op, args);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK_INDEX(s.ndim() > 0, "Dimension specified as 0 but tensor has no dimensions");
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), s.ndim());
  const int64_t m = s.mesh_dim_of(dim);
  Piece x = piece_of(args[0].toTensor());
  if (m >= 0) {
    note_replication(op, args, x, {m}, unbind_what(dim));
    x = replicate_mesh_dims(x, {m});
  }
  std::vector<int64_t> shape = s.global_shape();
  shape.erase(shape.begin() + dim);
  SpecPtr spec = drop_dims(*x.spec, {dim}, shape);
  std::vector<at::Tensor> out;
  for (const auto& t : x.local.unbind(dim)) out.push_back(wrap(t, spec));
  if (m >= 0) {
    // The results are views of the replicated copy: writes through any of
    // them go back to the owners (Note [view write-back]).
    // One generation for all of them: a write-back through one writes the
    // whole replicated block, which the others view (Note [stale copy views]).
    const at::Tensor base = args[0].toTensor();
    const auto gen = generation("unbind", base, spec, [op, args, base, m, dim] {
      const Piece src = piece_of(base);
      note_replication(op, args, src, {m},
                       "made anew after a write into its source, " + unbind_what(dim));
      return replicate_mesh_dims(src, {m}).local;
    });
    for (const auto& t : out) {
      set_write_back(t, args[0].toTensor(), x.local, {{dim, 0}}, /*copied=*/false, gen);
    }
  }
  stack->push_back(c10::IValue(out));
}

// diagonal(self, offset, dim1, dim2): a view of the piece when neither dim is
// sharded (the diagonal becomes the last dim, unsharded). Mesh dims sharding
// dim1 or dim2 are replicated first (collective); writes through the result
// then go back to the owners (Note [view write-back]).
void diagonal_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  reject_named(op, args);
  const ShardSpec& s = self_spec(op, args);
  TORCH_CHECK(s.ndim() >= 2, "diagonal() requires a tensor with at least 2 dims");
  const int64_t offset = args[1].toInt();
  const int64_t d1 = at::maybe_wrap_dim(args[2].toInt(), s.ndim());
  const int64_t d2 = at::maybe_wrap_dim(args[3].toInt(), s.ndim());
  TORCH_CHECK(d1 != d2, "diagonal dimensions cannot be identical ", d1, ", ", d2);
  const at::Tensor& self = args[0].toTensor();
  std::vector<int64_t> rep_dims;
  std::vector<std::pair<int64_t, int64_t>> back;
  for (int64_t d : {d1, d2}) {
    if (s.mesh_dim_of(d) >= 0) {
      rep_dims.push_back(s.mesh_dim_of(d));
      back.emplace_back(d, 0);
    }
  }
  const std::string what = "diagonal over the dims " + std::to_string(d1) + " and " +
                           std::to_string(d2) + ", at least one of them sharded,";
  note_replication(op, args, piece_of(self), rep_dims, what);
  Piece x = replicate_mesh_dims(piece_of(self), rep_dims);
  const auto meta =
      at::empty(s.global_shape(), self.options().device(at::kMeta)).diagonal(offset, d1, d2);
  at::Tensor out =
      wrap(x.local.diagonal(offset, d1, d2),
           drop_dims(*x.spec, {std::min(d1, d2), std::max(d1, d2)}, meta.sizes().vec()));
  if (!rep_dims.empty()) {
    set_write_back(out, self, x.local, back, /*copied=*/false,
                   generation("diagonal", self, spec_ptr_of(out), [op, args, self, rep_dims, what] {
                     const Piece src = piece_of(self);
                     note_replication(op, args, src, rep_dims,
                                      "made anew after a write into its source, " + what);
                     return replicate_mesh_dims(src, rep_dims).local;
                   }));
  }
  stack->push_back(out);
}

// Note [wrapper strides]
// ~~~~~~~~~~~~~~~~~~~~~~
// A ShardTensor's wrapper holds no data, but libtorch (and user code) read its
// strides: Tensor::contiguous() returns `self` when is_contiguous() is true,
// without reaching the dispatcher. A wrapper that always reported contiguous
// strides made `x.t().contiguous()` (or after permute, a slice, ...) return
// the view itself, so a later in-place op on it wrote into `x`, at any number
// of ranks. So every rule of this file gives its results the strides that
// libtorch's own tensor would have: the same op on a meta tensor with the
// input's global sizes and strides (metadata only, identical on every rank).
// A non-contiguous wrapper then makes contiguous() reach the dispatcher, whose
// clone copies the piece, as in libtorch; view and reshape decide view or copy
// from them (Note [view strides]). The pieces' own strides are unchanged.
// The view ops whose rules live elsewhere get the same wrapping
// (alias, detach, lift_fresh, positive, resolve_conj, resolve_neg, _conj,
// real, imag and clone in ops/pointwise.cpp; unfold in ops/unfold.cpp):
// before, `x.real.contiguous()`, `x.unfold(...).contiguous()` and
// `x.t().detach().contiguous()` returned the view, so writes through them
// reached `x`. The generic fallback gives its view results (copies: as_strided,
// view_as_real, ...) the same strides (ops::set_torch_strides), so that
// `x.as_strided(...).contiguous()` copies and can be written, as in libtorch.
// Results of every other rule have contiguous strides; they are fresh
// tensors, so only is_contiguous() and stride() can tell.
}  // namespace

void set_torch_strides(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                       Stack* stack) {
  Stack meta(args.begin(), args.end());
  for (auto& v : meta) {
    // Plain tensor operands too: a meta call refuses to mix devices.
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const at::Tensor& t = v.toTensor();
    v = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  }
  try {
    op.callBoxed(&meta);
  } catch (const c10::Error&) {
    return;  // libtorch would refuse what the rule took: the strides stay contiguous
  }
  const size_t nret = op.schema().returns().size();
  if (meta.size() < nret || stack->size() < nret) return;
  auto set = [](const at::Tensor& r, const at::Tensor& m) {
    auto* impl = detail::shard_impl(r);
    if (impl && m.defined() && m.sizes() == r.sizes()) impl->set_global_strides(m.strides());
  };
  for (size_t j = 0; j < nret; ++j) {
    const c10::IValue& r = (*stack)[stack->size() - nret + j];
    const c10::IValue& m = meta[meta.size() - nret + j];
    if (r.isTensor() && m.isTensor()) {
      set(r.toTensor(), m.toTensor());
    } else if (r.isTensorList() && m.isTensorList()) {
      const auto rs = r.toTensorVector();
      const auto ms = m.toTensorVector();
      for (size_t k = 0; k < rs.size() && k < ms.size(); ++k) set(rs[k], ms[k]);
    }
  }
}

Rule with_torch_strides(Rule rule) {
  return [rule = std::move(rule)](const c10::OperatorHandle& op, Stack* stack) {
    const size_t n = op.schema().arguments().size();
    const std::vector<c10::IValue> args(stack->end() - n, stack->end());
    rule(op, stack);
    set_torch_strides(op, args, stack);
  };
}

namespace {

// contiguous(self, memory_format): libtorch returns `self` when self is
// contiguous in that format and self.clone(memory_format) otherwise, decided
// by the wrapper's strides (Note [wrapper strides]), identical on every rank.
// Never the piece's: a piece of one row or column of a transposed view is
// contiguous, and contiguous() of it would return the piece itself, so that
// writes through the result reached the source on some ranks only.
void contiguous_rule(const c10::OperatorHandle& op, Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const at::Tensor self = (*stack)[stack->size() - n].toTensor();
  const auto format = (*stack)[stack->size() - n + 1].toOptional<c10::MemoryFormat>().value_or(
      c10::MemoryFormat::Contiguous);
  if (self.is_contiguous(format)) {
    stack->erase(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    stack->push_back(self);
    return;
  }
  static const c10::OperatorHandle clone =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::clone", "");
  const Rule* rule = find_rule(clone.operator_name());
  TORCH_INTERNAL_ASSERT(rule != nullptr, "ShardTensor: no rule for aten::clone");
  (*rule)(clone, stack);  // same arguments: (self, memory_format)
}

const RuleRegistrar view_ops({"view"}, with_torch_strides(view_rule));
const RuleRegistrar reshape_ops({"reshape"}, with_torch_strides(reshape_rule));
const RuleRegistrar unsafe_view_ops({"_unsafe_view"}, with_torch_strides(unsafe_view_rule));
const RuleRegistrar reshape_alias_ops({"_reshape_alias"}, with_torch_strides(reshape_alias_rule));
const RuleRegistrar flatten_ops({"flatten.using_ints"}, with_torch_strides(flatten_rule));
const RuleRegistrar unflatten_ops({"unflatten.int"}, with_torch_strides(unflatten_rule));
const RuleRegistrar squeeze_ops({"squeeze"}, with_torch_strides(squeeze_rule));
const RuleRegistrar unsqueeze_ops({"unsqueeze"}, with_torch_strides(unsqueeze_rule));
const RuleRegistrar permute_ops({"permute"}, with_torch_strides(permute_rule));
const RuleRegistrar transpose_ops({"transpose.int", "t"}, with_torch_strides(transpose_rule));
const RuleRegistrar inplace_view_ops({"squeeze_", "unsqueeze_", "transpose_", "t_"},
                                     with_torch_strides(inplace_view_rule));
const RuleRegistrar slice_ops({"slice.Tensor"}, with_torch_strides(slice_rule));
const RuleRegistrar narrow_ops({"narrow"}, with_torch_strides(narrow_rule));
const RuleRegistrar select_ops({"select.int"}, with_torch_strides(select_rule));
const RuleRegistrar expand_ops({"expand"}, with_torch_strides(expand_rule));
const RuleRegistrar split_ops({"split.Tensor", "split_with_sizes", "unsafe_split.Tensor",
                               "unsafe_split_with_sizes"},
                              with_torch_strides(split_rule));
const RuleRegistrar unbind_ops({"unbind.int"}, with_torch_strides(unbind_rule));
const RuleRegistrar diagonal_ops({"diagonal"}, with_torch_strides(diagonal_rule));
const RuleRegistrar contiguous_ops({"contiguous"}, with_torch_strides(contiguous_rule));

}  // namespace
}  // namespace shardtensor::ops
