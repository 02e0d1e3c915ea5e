// einsum with sharded dims in any position.
//
// Note [einsum layout]: einsum reaches the dispatcher whole (it is
// CompositeImplicitAutograd); its decomposition permutes and reshapes the
// operands into one bmm, and those reshapes merge a sharded dim with others,
// which the view rules cannot keep sharded. The rule below works on labels
// instead. Per mesh dim m it picks one label L: the label that the largest
// operand (global numel) is sharded along on m, provided that operand spans L
// at full extent, L occurs once in every operand that has it, and no earlier
// mesh dim took L. Every operand that spans L at full extent is brought to
// Shard(L) with that operand's split (a plain or replicated one is only sliced:
// no communication); every other operand is made Replicate on m (collective
// only if it was sharded there). Then every rank runs at::einsum on its pieces
// with the user's equation. If L is in the output, the output is Shard(L) on m;
// if it is contracted, each rank holds a partial sum and the output is Partial
// on m, summed where a consumer needs it (einsum is multilinear and only L's
// range is split, so the partial sums add up to the whole sum; Note [pending
// partial sums], ops/pointwise.cpp); a 0-d output is all-reduced at once. A replicated operand used
// in sharded compute passes through comm::use_replicated (Note [replicated gradients]). Everything
// is decided from the equation, global shapes and specs, so every rank plans alike and errors are
// thrown everywhere before any communication.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

// Labels: letters are 0..51 (A-Z then a-z, einsum's implicit output order);
// ellipsis dims are 100 + j, right-aligned over the broadcast ellipsis rank.
struct Term {
  std::vector<int> labels;  // per operand dim
};

struct Parsed {
  std::vector<Term> in;
  std::vector<int> out;
};

bool parse_term(const std::string& s, std::vector<int>* labels, bool* ellipsis, int* ell_pos) {
  *ellipsis = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '.') {
      if (*ellipsis || s.compare(i, 3, "...") != 0) return false;
      *ellipsis = true;
      *ell_pos = static_cast<int>(labels->size());
      i += 2;
    } else if (c >= 'A' && c <= 'Z') {
      labels->push_back(c - 'A');
    } else if (c >= 'a' && c <= 'z') {
      labels->push_back(c - 'a' + 26);
    } else if (c != ' ') {
      return false;
    }
  }
  return true;
}

// Parses `eq` for operands of the given ranks; returns false if malformed.
bool parse(const std::string& eq, const std::vector<int64_t>& ranks, Parsed* out) {
  const auto arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  std::vector<std::string> terms;
  size_t start = 0;
  while (true) {
    const auto comma = lhs.find(',', start);
    terms.push_back(
        lhs.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (terms.size() != ranks.size()) return false;
  int64_t ell_rank = 0;
  std::vector<std::vector<int>> raw(terms.size());
  std::vector<bool> has_ell(terms.size());
  std::vector<int> ell_pos(terms.size(), 0);
  for (size_t k = 0; k < terms.size(); ++k) {
    bool e = false;
    int pos = 0;
    if (!parse_term(terms[k], &raw[k], &e, &pos)) return false;
    has_ell[k] = e;
    ell_pos[k] = pos;
    const int64_t covered = ranks[k] - static_cast<int64_t>(raw[k].size());
    if (e ? covered < 0 : covered != 0) return false;
    if (e) ell_rank = std::max(ell_rank, covered);
  }
  std::map<int, int> count;
  for (size_t k = 0; k < terms.size(); ++k) {
    Term t;
    const int64_t covered = ranks[k] - static_cast<int64_t>(raw[k].size());
    for (size_t i = 0; i < raw[k].size(); ++i) {
      if (has_ell[k] && static_cast<int>(i) == ell_pos[k]) {
        for (int64_t j = 0; j < covered; ++j) t.labels.push_back(100 + int(ell_rank - covered + j));
      }
      t.labels.push_back(raw[k][i]);
    }
    if (has_ell[k] && ell_pos[k] == static_cast<int>(raw[k].size())) {
      for (int64_t j = 0; j < covered; ++j) t.labels.push_back(100 + int(ell_rank - covered + j));
    }
    for (int l : raw[k]) ++count[l];
    out->in.push_back(std::move(t));
  }
  if (arrow != std::string::npos) {
    std::vector<int> o;
    bool e = false;
    int pos = 0;
    if (!parse_term(eq.substr(arrow + 2), &o, &e, &pos)) return false;
    for (size_t i = 0; i <= o.size(); ++i) {
      if (e && static_cast<int>(i) == pos) {
        for (int64_t j = 0; j < ell_rank; ++j) out->out.push_back(100 + int(j));
      }
      if (i < o.size()) out->out.push_back(o[i]);
    }
  } else {
    for (int64_t j = 0; j < ell_rank; ++j) out->out.push_back(100 + int(j));
    for (const auto& [l, c] : count) {
      if (c == 1) out->out.push_back(l);
    }
  }
  return true;
}

int64_t position(const std::vector<int>& labels, int l) {
  int64_t pos = -1;
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] == l) {
      if (pos >= 0) return -2;  // repeated (a diagonal)
      pos = static_cast<int64_t>(i);
    }
  }
  return pos;
}

void einsum_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const std::string eq = args[0].toStringRef();
  std::vector<at::Tensor> ts;
  for (const c10::IValue& v : args[1].toListRef()) ts.push_back(v.toTensor());
  const DeviceMesh mesh = common_mesh(op, args);
  std::vector<int64_t> ranks;
  for (const auto& t : ts) ranks.push_back(t.dim());
  Parsed pe;
  if (!parse(eq, ranks, &pe)) fail(op, args, "malformed equation for the operands' ranks");

  // Global extent of every label (size-1 dims broadcast).
  std::map<int, int64_t> extent;
  for (size_t k = 0; k < ts.size(); ++k) {
    for (size_t i = 0; i < pe.in[k].labels.size(); ++i) {
      const int l = pe.in[k].labels[i];
      const int64_t n = ts[k].size(static_cast<int64_t>(i));
      auto it = extent.find(l);
      if (it == extent.end() || it->second == 1) {
        extent[l] = n;
      } else if (n != 1 && n != it->second) {
        fail(op, args, "operands disagree on the extent of a subscript");
      }
    }
  }
  std::vector<int64_t> out_shape;
  for (int l : pe.out) {
    if (!extent.count(l)) fail(op, args, "an output subscript appears in no operand");
    out_shape.push_back(extent[l]);
  }

  // Operands' own layouts (Partial counts as Replicate: it is summed first).
  std::vector<ShardSpec> own;
  for (const auto& t : ts) {
    if (const ShardSpec* s = spec_of(t)) {
      own.push_back(without_partial(*s));
    } else {
      own.emplace_back(mesh, Placements(mesh.ndim(), Replicate{}), t.sizes().vec());
    }
  }
  std::vector<size_t> order(ts.size());
  for (size_t k = 0; k < ts.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return ts[a].numel() > ts[b].numel(); });

  const int64_t nm = mesh.ndim();
  std::vector<Placements> tp(ts.size(), Placements(nm, Replicate{}));
  std::vector<ShardSizes> tsz(ts.size(), ShardSizes(nm));
  Placements op_place(nm, Replicate{});
  ShardSizes op_sizes(nm);
  std::vector<int64_t> reduce_dims, compute_dims;
  std::vector<int> used;
  for (int64_t m = 0; m < nm; ++m) {
    int label = -1;
    std::vector<int64_t> sizes;
    for (size_t k : order) {
      const auto& pl = own[k].placements()[m];
      if (!is_shard(pl)) continue;
      const int64_t d = shard_dim(pl);
      const int l = pe.in[k].labels[d];
      if (ts[k].size(d) != extent[l]) continue;
      if (std::find(used.begin(), used.end(), l) != used.end()) continue;
      bool ok = true;
      for (size_t j = 0; j < ts.size(); ++j) {
        if (position(pe.in[j].labels, l) == -2) ok = false;
      }
      if (position(pe.out, l) == -2) ok = false;
      if (!ok) continue;
      label = l;
      sizes = own[k].shard_sizes(m);
      break;
    }
    if (label < 0) continue;
    used.push_back(label);
    compute_dims.push_back(m);
    for (size_t k = 0; k < ts.size(); ++k) {
      const int64_t d = position(pe.in[k].labels, label);
      if (d >= 0 && ts[k].size(d) == extent[label]) {
        tp[k][m] = Shard{d};
        tsz[k][m] = sizes;
      }
    }
    const int64_t od = position(pe.out, label);
    if (od >= 0) {
      op_place[m] = Shard{od};
      op_sizes[m] = sizes;
    } else {
      reduce_dims.push_back(m);
    }
  }

  std::vector<at::Tensor> locals;
  for (size_t k = 0; k < ts.size(); ++k) {
    ShardSpec target(mesh, tp[k], ts[k].sizes().vec(), tsz[k]);
    at::Tensor local = to_layout(ts[k], target, target);
    std::vector<int64_t> rep;
    for (int64_t m : compute_dims) {
      if (!is_shard(tp[k][m])) rep.push_back(m);
    }
    if (!rep.empty() && local.requires_grad()) local = comm::use_replicated(local, mesh, rep);
    locals.push_back(local);
  }
  at::Tensor out = at::einsum(eq, locals);
  if (out_shape.empty()) {
    if (!reduce_dims.empty()) out = comm::all_reduce(out.contiguous(), mesh, reduce_dims);
  } else {
    for (int64_t m : reduce_dims) op_place[m] = Partial{};
  }
  stack->push_back(wrap(out, make_spec(mesh, op_place, out_shape, op_sizes)));
}

const RuleRegistrar r_einsum({"einsum"}, einsum_rule);

// new_zeros / new_ones / new_empty / new_full (self, size, [fill_value,] dtype...):
// the result takes self's layout, right-aligned on the new shape: a mesh dim
// sharding self's dim d shards the result's dim d + (new rank - self's rank),
// with self's split if the extent is unchanged, else balanced; it is Replicate
// where that dim does not exist. So `x_ft.new_zeros({B, C, H, W})` is a sharded
// buffer laid out like x_ft (the usual way spectral layers allocate out_ft).
void new_factory_rule(const c10::OperatorHandle& op, Stack* stack) {
  if (!op.operator_name().overload_name.empty()) {
    auto args = pop_args(op, stack);
    fail(op, args, "the out= form has no sharding rule");
  }
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* s = spec_of(x);
  if (!s) fail(op, args, "the first argument must be the ShardTensor");
  const std::vector<int64_t> shape = int_list(args[1]);
  for (int64_t n : shape) {
    if (n < 0) fail(op, args, "negative size");
  }
  const int64_t lead = static_cast<int64_t>(shape.size()) - s->ndim();
  Placements p;
  ShardSizes sizes;
  for (int64_t m = 0; m < s->mesh().ndim(); ++m) {
    const auto& pl = s->placements()[m];
    const int64_t d = is_shard(pl) ? shard_dim(pl) + lead : -1;
    if (d >= 0) {
      p.push_back(Shard{d});
      sizes.push_back(shape[d] == s->global_shape()[shard_dim(pl)]
                          ? s->shard_sizes(m)
                          : balanced_sizes(shape[d], s->mesh().size(m)));
    } else {
      p.push_back(Replicate{});
      sizes.push_back({});
    }
  }
  SpecPtr spec = make_spec(s->mesh(), p, shape, sizes);
  const std::string& name = op.operator_name().name;
  const bool full = name == "aten::new_full";
  const size_t dt = full ? 3 : 2;
  at::TensorOptions opts = local_of(x).options();
  if (!args[dt].isNone()) opts = opts.dtype(args[dt].toScalarType());
  const auto local_shape = spec->local_shape();
  at::Tensor out;
  if (full) {
    out = at::full(local_shape, args[2].toScalar(), opts);
  } else if (name == "aten::new_ones") {
    out = at::ones(local_shape, opts);
  } else if (name == "aten::new_zeros") {
    out = at::zeros(local_shape, opts);
  } else {
    out = at::empty(local_shape, opts);
  }
  stack->push_back(wrap(out, spec));
}

const RuleRegistrar r_new({"new_zeros", "new_ones", "new_empty", "new_full"}, new_factory_rule);

}  // namespace
}  // namespace shardtensor::ops
