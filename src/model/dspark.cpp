// The DSpark drafter on the CPU (see dspark.h for the steps, the spec sections and the
// corrections followed). Arithmetic as the target's CPU forward (v41_cpu.cpp): f32, the
// multiply-adds fused, the shared block pieces of cpu_common.h told so (kFusedF32).
#include "model/dspark.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "model/cpu/linear.h"
#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "model/cpu_common.h"
#include "model/inventory.h"
#include "model/weight_binder.h"
#include "util/error.h"
#include "util/threadpool.h"

namespace dsx {

using Vec = std::vector<float>;

namespace {

constexpr fwd::Arith kArith = fwd::Arith::kFusedF32;

// ---- the target's quantization points (as in v41_cpu.cpp) -------------------------------

Vec qa8_rows(const Vec& x, int64_t k, int block) {
  Vec q = x;
  const int64_t rows = static_cast<int64_t>(x.size()) / k;
  for (int64_t r = 0; r < rows; ++r) cpu::qa8_inplace(q.data() + r * k, k, block);
  return q;
}

// The official linear(): an FP8 / FP4 weight takes a QA8'd activation, others the plain one.
Vec linear(const float* x, int64_t T, const QMatrix& W, int block) {
  Vec y(static_cast<size_t>(T * W.rows));
  if (W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4) {
    Vec xq(x, x + T * W.cols);
    for (int64_t r = 0; r < T; ++r) cpu::qa8_inplace(xq.data() + r * W.cols, W.cols, block);
    cpu::matmul(xq.data(), T, W, y.data());
  } else {
    cpu::matmul(x, T, W, y.data());
  }
  return y;
}
Vec linear(const Vec& x, int64_t T, const QMatrix& W, int block) { return linear(x.data(), T, W, block); }

void rmsnorm_rows(Vec& x, int64_t n, const Vec& w, float eps) {
  const int64_t rows = static_cast<int64_t>(x.size()) / n;
  for (int64_t r = 0; r < rows; ++r) cpu::rmsnorm(x.data() + r * n, w.data(), n, eps, x.data() + r * n);
}

// C1: the window-KV round trip of the whole head vector (skipped, as by the reference,
// when the width is not a multiple of the block).
void fq8_vec(float* x, int64_t n) {
  if (n % 32 == 0) cpu::qa8_inplace(x, n, 32);
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int32_t>(best);
}

// The stage index of an mtp.<s>. tensor name, -1 for other names; -2 when it is under
// mtp. without a stage number.
int stage_of(const std::string& n) {
  if (n.rfind("mtp.", 0) != 0) return -1;
  size_t i = 4;
  int s = 0;
  while (i < n.size() && std::isdigit(static_cast<unsigned char>(n[i])) && i < 12) s = s * 10 + (n[i++] - '0');
  if (i == 4 || i >= n.size() || n[i] != '.') return -2;
  return s;
}

// The compress_ratios array as stored (backbone + stages), from the raw config.json.
std::vector<int> stored_ratios(const ModelConfig& c) {
  std::vector<int> r;
  if (c.config_json.empty()) return r;
  try {
    const auto j = nlohmann::json::parse(c.config_json);
    const auto& t = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
    if (t.contains("compress_ratios") && t["compress_ratios"].is_array())
      for (const auto& v : t["compress_ratios"]) r.push_back(v.is_number_integer() ? v.get<int>() : -1);
  } catch (const nlohmann::json::exception&) {
  }
  return r;
}

// An integer key of the raw config (text_config first), -1 when absent.
int64_t raw_key(const ModelConfig& c, const char* key) {
  if (c.config_json.empty()) return -1;
  try {
    const auto j = nlohmann::json::parse(c.config_json);
    for (const auto* o : {j.contains("text_config") ? &j["text_config"] : nullptr, &j})
      if (o && o->is_object() && o->contains(key) && (*o)[key].is_number_integer()) return (*o)[key].get<int64_t>();
  } catch (const nlohmann::json::exception&) {
  }
  return -1;
}

// The config the stages are read with (§2.1 - §2.3): S stages (n_nextn_layers = S, for
// dspark_inventory), the stage MoE sizes resolved as the official get_moe_config does
// (dspark_* or the target's; the official config spells the top-k
// dspark_n_activated_experts), and the enabling rule checked. `origin` names the model.
ModelConfig stage_config(const ModelConfig& c, int S, const std::string& origin) {
  auto bad = [&](const auto&... what) { fail(origin, ": cannot enable DSpark: ", what...); };
  if (c.family != Family::V41) bad("the drafter is implemented for deepseek_v41 only (model_type '", c.model_type, "')");
  ModelConfig s = c;
  s.n_nextn_layers = S;
  if (s.dspark_experts_per_tok <= 0) {
    const int64_t alt = raw_key(c, "dspark_n_activated_experts");
    if (alt > 0) s.dspark_experts_per_tok = static_cast<int>(alt);
  }
  if (s.dspark_n_routed_experts <= 0) s.dspark_n_routed_experts = c.n_routed_experts;
  if (s.dspark_experts_per_tok <= 0) s.dspark_experts_per_tok = c.n_experts_per_tok;
  if (s.dspark_block_size < 1) bad("dspark_block_size is missing or < 1");
  if (s.dspark_noise_token_id < 0 || s.dspark_noise_token_id >= s.vocab_size)
    bad("dspark_noise_token_id ", s.dspark_noise_token_id, " is missing or outside the vocabulary (", s.vocab_size, ")");
  if (s.dspark_target_layers.empty()) bad("dspark_target_layer_ids is missing or empty");
  for (int l : s.dspark_target_layers)
    if (l < 1 || l >= s.n_layers) bad("dspark target layer ", l, " outside [1, ", s.n_layers, ") (V4.1 taps layer inputs)");
  if (s.dspark_markov_rank < 1) bad("dspark_markov_rank is missing or < 1");
  if (s.dspark_experts_per_tok > s.dspark_n_routed_experts)
    bad("dspark_num_experts_per_tok ", s.dspark_experts_per_tok, " > dspark_n_routed_experts ", s.dspark_n_routed_experts);
  const std::vector<int> r = stored_ratios(c);
  for (size_t i = static_cast<size_t>(c.n_layers); i < r.size(); ++i)
    if (r[i] != 0) bad("compress_ratios[", i, "] = ", r[i], ": a DSpark stage is window-only (ratio 0)");
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------
// §2.2 stage count, cross-checked against the tensor index.
int dspark_stage_count(const ModelConfig& c, const ModelFiles& f) {
  const int S = c.n_ratio_entries - c.n_layers;
  std::set<int> stages;
  for (const std::string& n : f.names()) {
    const int s = stage_of(n);
    if (s == -2) fail(f.find(n)->file, ": tensor '", n, "' is under mtp. but names no stage");
    if (s >= 0) stages.insert(s);
  }
  const int found = static_cast<int>(stages.size());
  const bool contiguous = stages.empty() || *stages.rbegin() == found - 1;
  if (S != found || !contiguous) {
    std::string list;
    for (int s : stages) list += (list.empty() ? "" : ", ") + std::to_string(s);
    fail(f.dir(), ": the config declares ", S, " DSpark stage", S == 1 ? "" : "s",
         " (len(compress_ratios) ", c.n_ratio_entries, " - num_hidden_layers ", c.n_layers,
         ") but the tensor index holds mtp.<s>. stages {", list, "}");
  }
  return S;
}

bool dspark_available(const std::string& model_dir, std::string* why) {
  try {
    const ModelConfig c = load_model_config(model_dir);
    const ModelFiles f(model_dir);
    const int S = dspark_stage_count(c, f);
    if (S == 0) {
      if (why) *why = model_dir + ": no DSpark stages (no mtp.* tensors, compress_ratios has no stage entries)";
      return false;
    }
    stage_config(c, S, model_dir);
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

// ---------------------------------------------------------------------------
// §3 binding and validation of mtp.<s>.* (errors name the tensor).
DSparkWeights load_dspark_weights(const ModelConfig& c, std::shared_ptr<ModelFiles> files) {
  const int S = dspark_stage_count(c, *files);
  if (S == 0)
    fail(files->dir(), ": no DSpark stages (no mtp.* tensors, compress_ratios has ", c.n_ratio_entries,
         " entries for ", c.n_layers, " layers): run plain decoding");
  const ModelConfig sc = stage_config(c, S, files->dir());
  WeightBinder b(sc, *files, /*skip_vision=*/true);
  DSparkWeights w;
  w.files = files;
  w.n_stages = S;
  w.stages.resize(static_cast<size_t>(S));
  const TensorInventory inv(sc);
  w.embed = b.matrix(inv.at(-1, Role::embed));
  w.head = b.matrix(inv.at(-1, Role::head));
  std::set<std::string> expected;
  for (const TensorSpec& t : dspark_inventory(sc)) {
    for (const StoredTensor& st : stored_tensors(t)) expected.insert(st.name);
    if (t.optional && !b.has(t.name)) continue;
    switch (t.role) {
      case Role::main_proj: {
        // FP8 in the public releases; a BF16 artifact is accepted too (§3.2)
        expected.insert(t.name + ".weight");
        if (!b.has(t.name + ".weight") || b.has(t.name + ".scale")) {
          w.main_proj = b.matrix(t);
        } else {
          TensorSpec bf = t;
          bf.name = t.name + ".weight";
          bf.storage = Storage::BF16Matrix;
          w.main_proj = b.matrix(bf);
        }
        break;
      }
      case Role::main_norm: w.main_norm = b.values(t); break;
      case Role::stage_norm: w.norm = b.values(t); break;
      case Role::markov_embed: w.markov_embed = b.matrix(t); break;
      case Role::markov_head: w.markov_head = b.matrix(t); break;
      case Role::confidence_proj: w.confidence = b.f32(t.name, t.shape); break;  // evaluated in f32
      default:
        if (t.stage < 0 || t.stage >= S || !bind_layer_tensor(b, t, w.stages[static_cast<size_t>(t.stage)]))
          fail("load_dspark_weights: no place for the ", role_name(t.role), " tensor '", t.name, "'");
    }
  }
  // Leftovers under mtp.*: an error, except a third-party conversion's copies of the
  // target's embedding / head (the drafter uses the target's own, §3.2).
  for (const std::string& n : files->names()) {
    const int s = stage_of(n);
    if (s < 0 || expected.count(n)) continue;
    const std::string p = "mtp." + std::to_string(s) + ".";
    if (n == p + "embed.weight" || n == p + "head.weight") continue;
    fail(files->find(n)->file, ": unexpected tensor '", n, "' (not part of the ", S, " DSpark stages of this config)");
  }
  return w;
}

// ---------------------------------------------------------------------------
// §5.1 state.
DSparkState::DSparkState(int n_stages, int window, int head_dim, int rollback_depth)
    : S_(n_stages), W_(window), cap_(window + std::max(rollback_depth, 0)), hd_(head_dim) {
  rows_.assign(static_cast<size_t>(S_) * cap_ * hd_, 0.0f);
  held_.assign(static_cast<size_t>(cap_), -1);
}

const float* DSparkState::row(int s, int64_t p) const {
  if (p < 0 || s < 0 || s >= S_ || cap_ == 0 || held_[static_cast<size_t>(p % cap_)] != p) return nullptr;
  return rows_.data() + (static_cast<int64_t>(s) * cap_ + p % cap_) * hd_;
}

void DSparkState::truncate(int64_t p) {
  for (int64_t& h : held_)
    if (h >= p) h = -1;
  end_ = std::min(end_, std::max<int64_t>(p, 0));
}

int64_t DSparkState::context_rows(int64_t n) const {
  int64_t k = 0;
  for (int64_t q = std::max<int64_t>(0, n - W_); q < n; ++q) k += row(0, q) != nullptr;
  return k;
}

// ---------------------------------------------------------------------------
DSparkDrafter::DSparkDrafter(ModelConfig cfg, DSparkWeights w) : w_(std::move(w)) {
  const std::string origin = w_.files ? w_.files->dir() : std::string("DSpark drafter");
  DSX_CHECK(w_.n_stages > 0 && static_cast<int>(w_.stages.size()) == w_.n_stages, origin, ": no DSpark stages");
  cfg_ = stage_config(cfg, w_.n_stages, origin);
  stage_cfg_ = cfg_;
  stage_cfg_.n_routed_experts = cfg_.dspark_n_routed_experts;
  stage_cfg_.n_experts_per_tok = cfg_.dspark_experts_per_tok;
  rope_ = make_main_rope(cfg_);
}

std::unique_ptr<DSparkDrafter> DSparkDrafter::load(const std::string& model_dir) {
  ModelConfig c = load_model_config(model_dir);
  auto files = std::make_shared<ModelFiles>(model_dir);
  DSparkWeights w = load_dspark_weights(c, files);
  return std::make_unique<DSparkDrafter>(std::move(c), std::move(w));
}

DSparkState DSparkDrafter::new_state(int rollback_depth) const {
  return DSparkState(w_.n_stages, cfg_.window, cfg_.head_dim, rollback_depth);
}

std::unique_ptr<DrafterState> DSparkDrafter::make_state(int rollback_depth) const {
  return std::make_unique<DSparkState>(new_state(rollback_depth));
}

int64_t DSparkDrafter::weight_bytes() const {
  int64_t n = w_.main_proj.bytes() + w_.markov_embed.bytes() + w_.markov_head.bytes();
  for (const LayerWeights& L : w_.stages) {
    for (const QMatrix* q : {&L.hc_attn_fn, &L.hc_ffn_fn, &L.wq_a, &L.wq_b, &L.wkv, &L.wo_a, &L.wo_b, &L.gate, &L.sw1,
                             &L.sw2, &L.sw3})
      n += q->bytes();
    for (const auto* e : {&L.w1, &L.w2, &L.w3})
      for (const QMatrix& q : *e) n += q.bytes();
  }
  return n;
}

namespace {
DSparkState& cpu_state(DrafterState& st) {
  auto* s = dynamic_cast<DSparkState*>(&st);
  DSX_CHECK(s, "DSpark: a drafter state of another backend given to the CPU drafter");
  return *s;
}
const DSparkState& cpu_state(const DrafterState& st) { return cpu_state(const_cast<DrafterState&>(st)); }
const DSparkBlock& cpu_block(const DraftBlock& b) {
  const auto* p = dynamic_cast<const DSparkBlock*>(&b);
  DSX_CHECK(p, "DSpark: a draft block of another backend given to the CPU drafter");
  return *p;
}
}  // namespace

void DSparkDrafter::observe(DrafterState& st, const float* taps, int64_t T, int64_t p0) const {
  observe(cpu_state(st), taps, T, p0);
}

std::unique_ptr<DraftBlock> DSparkDrafter::draft_block(const DrafterState& st, int32_t anchor, int64_t n) const {
  return std::make_unique<DSparkBlock>(block(cpu_state(st), anchor, n));
}

// §5.1 step 1: u_p = RMSNorm_{main_norm}(main_proj . QA8(g_p)).
void DSparkDrafter::fuse(const float* taps, int64_t T, float* u) const {
  if (T <= 0) return;
  Vec y = linear(taps, T, w_.main_proj, cfg_.quant_block);
  rmsnorm_rows(y, cfg_.hidden, w_.main_norm, cfg_.rms_eps);
  std::memcpy(u, y.data(), y.size() * 4);
}

// §5.1 steps 2-5: per stage, fq8(rope_p(kv_norm(wkv . QA8(u_p)))) into slot p mod capacity.
void DSparkDrafter::observe(DSparkState& st, const float* taps, int64_t T, int64_t p0) const {
  DSX_CHECK(st.S_ == w_.n_stages && st.hd_ == cfg_.head_dim && st.W_ == cfg_.window,
            "DSpark observe: the state was made for another drafter");
  DSX_CHECK(T >= 0 && p0 >= 0, "DSpark observe: bad rows (", T, " at position ", p0, ")");
  st.truncate(p0);  // (p0 > end: positions end .. p0 - 1 stay holes)
  const int64_t skip = std::max<int64_t>(0, T - st.cap_);  // older rows are overwritten anyway
  const int64_t n = T - skip, D = cfg_.hidden, hd = cfg_.head_dim;
  const int np = cfg_.rope_dim / 2;
  if (n > 0) {
    Vec u(static_cast<size_t>(n * D));
    fuse(taps + skip * tap_width(), n, u.data());
    Vec cs(static_cast<size_t>(np)), sn(static_cast<size_t>(np));
    for (int s = 0; s < w_.n_stages; ++s) {
      const LayerWeights& L = w_.stages[static_cast<size_t>(s)];
      Vec kv = linear(u, n, L.wkv, cfg_.quant_block);
      rmsnorm_rows(kv, hd, L.kv_norm, cfg_.rms_eps);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = p0 + skip + t;
        rope_.angles(p, cs.data(), sn.data());
        float* r = kv.data() + t * hd;
        cpu::rope_apply(r, hd, np, cs.data(), sn.data(), false);
        fq8_vec(r, hd);
        std::memcpy(st.slot(s, p), r, static_cast<size_t>(hd) * 4);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = p0 + skip + t;
      st.held_[static_cast<size_t>(p % st.cap_)] = p;
    }
  }
  st.end_ = p0 + T;
}

// ---------------------------------------------------------------------------
// §5.2 - §5.5 the block through the stages and the head.
DSparkBlock DSparkDrafter::block(const DSparkState& st, int32_t anchor, int64_t n, DSparkDebug* dbg) const {
  DSX_CHECK(st.S_ == w_.n_stages && st.hd_ == cfg_.head_dim && st.W_ == cfg_.window,
            "DSpark draft: the state was made for another drafter");
  if (n < 2) fail("DSpark draft: anchor position ", n, " < 2 (the official drafter drafts from position 2 on)");
  if (n > st.end_)
    fail("DSpark draft: anchor position ", n, " but the drafter observed positions up to ", st.end_ - 1,
         " only (observe the committed positions first)");
  if (anchor < 0 || anchor >= cfg_.vocab_size)
    fail("DSpark draft: anchor token ", anchor, " outside the vocabulary (", cfg_.vocab_size, ")");
  const int64_t B = cfg_.dspark_block_size, D = cfg_.hidden, M = cfg_.hc_mult, V = cfg_.vocab_size;
  const int np = cfg_.rope_dim / 2;
  if (dbg) *dbg = DSparkDebug{};

  // §5.2 block input: anchor then noise, every stream the target's embedding, one-hot pre
  std::vector<int32_t> ids(static_cast<size_t>(B), cfg_.dspark_noise_token_id);
  ids[0] = anchor;
  Vec X = fwd::embed_streams(w_.embed, ids.data(), B, M, D);
  Vec pre(static_cast<size_t>(B * M), 0.0f);
  for (int64_t j = 0; j < B; ++j) pre[static_cast<size_t>(j * M)] = 1.0f;
  Vec cos(static_cast<size_t>(B * np)), sin(cos.size());
  for (int64_t j = 0; j < B; ++j) rope_.angles(n + j, cos.data() + j * np, sin.data() + j * np);

  // §5.3 the stages
  for (int s = 0; s < w_.n_stages; ++s) stage(s, st, n, X, pre, cos, sin, dbg);

  // §5.5 head: z = the last FFN pre's collapse; base logits of the target's head
  DSparkBlock b;
  b.n = n;
  b.anchor = anchor;
  b.z = fwd::hc_collapse(X, pre, B, M, D, kArith);
  Vec h = b.z;
  rmsnorm_rows(h, D, w_.norm, cfg_.rms_eps);
  b.base_logits.resize(static_cast<size_t>(B * V));
  cpu::matmul(h.data(), B, w_.head, b.base_logits.data());
  return b;
}

// §5.3 one stage: the target's block order (v41_cpu.cpp forward) with DSpark attention.
void DSparkDrafter::stage(int s, const DSparkState& st, int64_t n, Vec& X, Vec& pre, const Vec& cos, const Vec& sin,
                          DSparkDebug* dbg) const {
  const LayerWeights& L = w_.stages[static_cast<size_t>(s)];
  const int64_t B = cfg_.dspark_block_size, D = cfg_.hidden, M = cfg_.hc_mult, F = cfg_.hc_dim();
  // C6: the official hc_mixes, (fn . v) * rsqrt(mean(v^2) + eps), then the target's coefficients
  auto hc_mix = [&](const QMatrix& fn, const Vec& base, const Vec& scale, Vec& p, Vec& q, Vec& C) {
    Vec z = linear(X, B, fn, cfg_.quant_block);  // F32 matrix: no QA8
    const int64_t mix = cfg_.hc_mix_dim();
    for (int64_t t = 0; t < B; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < F; ++i) ss += static_cast<double>(X[t * F + i]) * X[t * F + i];
      const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(F)) + cfg_.rms_eps);
      for (int64_t i = 0; i < mix; ++i) z[t * mix + i] *= r;
    }
    fwd::hc_coefficients(cfg_, z, base, scale, B, kArith, p, q, C);
  };
  Vec pa, qa, Ca, pf, qf, Cf, y;
  hc_mix(L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, pa, qa, Ca);
  Vec a = fwd::hc_collapse(X, pre, B, M, D, kArith);
  rmsnorm_rows(a, D, L.attn_norm, cfg_.rms_eps);
  attention(s, st, n, a, cos, sin, y, dbg);
  fwd::hc_expand(X, y, qa, Ca, B, M, D, kArith);
  hc_mix(L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, pf, qf, Cf);
  Vec f = fwd::hc_collapse(X, pa, B, M, D, kArith);
  rmsnorm_rows(f, D, L.ffn_norm, cfg_.rms_eps);
  moe(s, f, y, dbg);
  fwd::hc_expand(X, y, qf, Cf, B, M, D, kArith);
  pre = pf;
  if (dbg) {
    dbg->stage_out.insert(dbg->stage_out.end(), X.begin(), X.end());
    dbg->stage_pre.insert(dbg->stage_pre.end(), pf.begin(), pf.end());
  }
}

// §5.4 DSpark attention of the block rows y [B, D].
void DSparkDrafter::attention(int s, const DSparkState& st, int64_t n, const Vec& y, const Vec& cos, const Vec& sin,
                              Vec& out, DSparkDebug* dbg) const {
  const LayerWeights& L = w_.stages[static_cast<size_t>(s)];
  const int64_t B = cfg_.dspark_block_size, H = cfg_.n_heads, hd = cfg_.head_dim, W = cfg_.window;
  const int qb = cfg_.quant_block;
  const int np = cfg_.rope_dim / 2;

  // 1. queries (C2: no per-head RMS)
  Vec q_lat = linear(y, B, L.wq_a, qb);
  rmsnorm_rows(q_lat, cfg_.q_lora_rank, L.q_norm, cfg_.rms_eps);
  Vec q = linear(q_lat, B, L.wq_b, qb);  // [B, H * hd]
  for (int64_t j = 0; j < B; ++j)
    for (int64_t h = 0; h < H; ++h) cpu::rope_apply(q.data() + (j * H + h) * hd, hd, np, &cos[j * np], &sin[j * np], false);

  // 2. block K = V rows (C1), attended once, never stored
  Vec kv = linear(y, B, L.wkv, qb);
  rmsnorm_rows(kv, hd, L.kv_norm, cfg_.rms_eps);
  for (int64_t j = 0; j < B; ++j) {
    cpu::rope_apply(kv.data() + j * hd, hd, np, &cos[j * np], &sin[j * np], false);
    fq8_vec(kv.data() + j * hd, hd);
  }
  if (dbg) dbg->block_kv.insert(dbg->block_kv.end(), kv.begin(), kv.end());

  // 3. the visible set, the same for every row: ring rows of positions max(0, n - W) ..
  // n - 1 in the official slot order (slot i = position mod W), then the B block rows
  std::vector<const float*> keys;
  const int64_t lo = std::max<int64_t>(0, n - W);
  for (int64_t i = 0; i < std::min(W, n); ++i) {
    const int64_t p = n <= W ? i : lo + (((i - lo) % W) + W) % W;
    if (const float* r = st.row(s, p)) {
      keys.push_back(r);
      if (dbg && s == 0) dbg->ring_positions.push_back(p);
    }
  }
  for (int64_t j = 0; j < B; ++j) keys.push_back(kv.data() + j * hd);

  // 4-5. softmax with the per-head sink in the denominator, inverse RoPE at n + j
  const float scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  Vec o(static_cast<size_t>(B * H * hd));
  parallel_for(B * H, 1, [&](int64_t b0, int64_t b1) {
    Vec logit(keys.size());
    for (int64_t jh = b0; jh < b1; ++jh) {
      const int64_t j = jh / H, h = jh % H;
      const float* qh = q.data() + (j * H + h) * hd;
      const float sink = L.attn_sink[static_cast<size_t>(h)];
      float mx = sink;
      for (size_t k = 0; k < keys.size(); ++k) {
        logit[k] = cpu::dot(qh, keys[k], hd) * scale;
        mx = std::max(mx, logit[k]);
      }
      float den = std::exp(sink - mx);
      for (size_t k = 0; k < keys.size(); ++k) den += (logit[k] = std::exp(logit[k] - mx));
      float* oh = o.data() + (j * H + h) * hd;
      std::fill(oh, oh + hd, 0.0f);
      for (size_t k = 0; k < keys.size(); ++k) {
        const float pr = logit[k] / den;
        for (int64_t i = 0; i < hd; ++i) oh[i] += pr * keys[k][i];
      }
      cpu::rope_apply(oh, hd, np, &cos[j * np], &sin[j * np], true);
    }
  });

  // 6. grouped wo_a (no QA8), wo_b
  Vec zeta = fwd::grouped_output(o, B, H, hd, cfg_.o_groups, cfg_.o_lora_rank, L.wo_a, cpu::matmul_rows);
  out = linear(zeta, B, L.wo_b, qb);
}

// §5.3 the stage's MoE: the target's router and experts with the stage's sizes.
void DSparkDrafter::moe(int s, const Vec& f, Vec& out, DSparkDebug* dbg) const {
  const LayerWeights& L = w_.stages[static_cast<size_t>(s)];
  const ModelConfig& c = stage_cfg_;
  const int64_t B = c.dspark_block_size, D = c.hidden, K = c.n_experts_per_tok;
  const int qb = c.quant_block;
  Vec logits = linear(f, B, L.gate, qb);  // BF16 gate: f32, no QA8
  std::vector<int32_t> chosen;
  Vec weight;
  fwd::route(c, logits, B, L.gate_bias.data(), /*hash=*/nullptr, /*ids=*/nullptr, c.norm_topk_prob && K > 1, chosen,
             weight);
  if (dbg) dbg->router_experts.insert(dbg->router_experts.end(), chosen.begin(), chosen.end());
  Vec fq = qa8_rows(f, D, qb);
  fwd::experts(c, fq, B, chosen, weight, {L.w1, L.w2, L.w3, L.sw1, L.sw2, L.sw3}, cpu::matmul,
               [&](const Vec& g, int64_t rows, const QMatrix& W, int64_t, const int64_t*) { return linear(g, rows, W, qb); },
               out);
}

// ---------------------------------------------------------------------------
// §5.6 Markov walk and §5.7 confidence; prev null: greedy (prev_j = d_j).
void DSparkDrafter::markov_row(const DSparkBlock& b, int64_t j, int32_t p, float* lj, float* e, float* conf) const {
  const int64_t D = cfg_.hidden, V = cfg_.vocab_size, R = cfg_.dspark_markov_rank;
  if (p < 0 || p >= V) fail("DSpark: previous token ", p, " of block row ", j, " outside the vocabulary (", V, ")");
  thread_local Vec bias, cat;
  bias.resize(static_cast<size_t>(V));
  cat.resize(static_cast<size_t>(D + R));
  w_.markov_embed.dequant_rows(p, p + 1, e);
  cpu::matmul(e, 1, w_.markov_head, bias.data());  // f32 accumulation
  const float* base = b.base_logits.data() + j * V;
  for (int64_t v = 0; v < V; ++v) lj[v] = base[v] + bias[static_cast<size_t>(v)];
  std::memcpy(cat.data(), b.z.data() + j * D, static_cast<size_t>(D) * 4);
  std::memcpy(cat.data() + D, e, static_cast<size_t>(R) * 4);
  *conf = cpu::dot(w_.confidence.data(), cat.data(), D + R);
}

void DSparkDrafter::markov(const DSparkBlock& b, const int32_t* prev, DSparkDraft& d) const {
  const int64_t B = cfg_.dspark_block_size, D = cfg_.hidden, V = cfg_.vocab_size, R = cfg_.dspark_markov_rank;
  DSX_CHECK(static_cast<int64_t>(b.base_logits.size()) == B * V && static_cast<int64_t>(b.z.size()) == B * D,
            "DSpark: the block was made by another drafter");
  d = DSparkDraft{};
  d.prev.resize(static_cast<size_t>(B));
  d.tokens.resize(static_cast<size_t>(B));
  d.markov_logits.resize(static_cast<size_t>(B * V));
  d.markov_embed.resize(static_cast<size_t>(B * R));
  d.confidence_logits.resize(static_cast<size_t>(B));
  for (int64_t j = 0; j < B; ++j) {
    const int32_t p = prev ? prev[j] : (j == 0 ? b.anchor : d.tokens[static_cast<size_t>(j - 1)]);
    d.prev[static_cast<size_t>(j)] = p;
    float* lj = d.markov_logits.data() + j * V;
    markov_row(b, j, p, lj, d.markov_embed.data() + j * R, &d.confidence_logits[static_cast<size_t>(j)]);
    d.tokens[static_cast<size_t>(j)] = argmax(lj, V);
  }
}

DSparkDraft DSparkDrafter::greedy(const DraftBlock& b, bool) const {
  DSparkDraft d;
  markov(cpu_block(b), nullptr, d);
  return d;
}

DSparkDraft DSparkDrafter::forced(const DraftBlock& b, const int32_t* prev, bool) const {
  DSX_CHECK(prev, "DSpark forced: no previous tokens");
  DSparkDraft d;
  markov(cpu_block(b), prev, d);
  return d;
}

void DSparkDrafter::forced_row(const DraftBlock& blk, int j, int32_t prev, float* logits, float* conf) const {
  const DSparkBlock& b = cpu_block(blk);
  DSX_CHECK(j >= 0 && j < cfg_.dspark_block_size, "DSpark forced_row: row ", j, " outside the block");
  std::vector<float> e(static_cast<size_t>(cfg_.dspark_markov_rank));
  markov_row(b, j, prev, logits, e.data(), conf);
}

void DSparkDrafter::block_values(const DraftBlock& blk, std::vector<float>* z, std::vector<float>* base) const {
  const DSparkBlock& b = cpu_block(blk);
  if (z) *z = b.z;
  if (base) *base = b.base_logits;
}

}  // namespace dsx
