// `dsx draft`: the DSpark drafter check against a golden file (../shared/golden README §8).
// Reads the prompt, the anchors and the forced previous tokens of a dspark golden file,
// prefills the target on the CPU engine (its taps), observes the committed positions of
// every anchor into the drafter's rings and drafts there (model/dspark.h): greedy drafts
// and the forced variant. Writes the taps and the drafter's outputs under the golden's
// names, shapes and dtypes, and, when the file carries the reference values, prints how
// far they are. --backend cuda runs the target and the drafter on the GPU (the CUDA
// drafter, backend/cuda/dspark_drafter.h) in --precision fp32 (the golden's) or bf16.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/golden_check.h"
#include "cli/registry.h"
#include "model/dspark.h"
#include "runtime/dspark_decoding.h"
#include "runtime/engine.h"
#include "util/error.h"
#include "util/safetensors.h"
#include "util/threadpool.h"

namespace dsx::cli {

namespace {

const std::vector<std::string> kValueOpts = {"-m", "--golden", "-o", "--threads", "--backend", "--precision"};
const std::vector<std::string> kFlagOpts = {"--quiet", "-h", "--help"};

void usage() {
  std::printf(
      "usage: dsx draft -m DIR --golden FILE -o OUT [options]\n"
      "\n"
      "Runs the DSpark drafter of a model directory on the anchors of a DSpark golden file:\n"
      "prefills the file's input_ids on the target (its DSpark taps), writes the taps of\n"
      "the committed positions into the drafter's rings and drafts at every anchor (greedy,\n"
      "and with the file's forced previous tokens). Reads input_ids, anchor_positions,\n"
      "anchor_tokens and dspark.forced_prev_tokens; writes taps, dspark.base_logits,\n"
      "dspark.draft_tokens, dspark.markov_logits, dspark.confidence_logits,\n"
      "dspark.forced_markov_logits, dspark.forced_confidence_logits (and z, markov_embed,\n"
      "markov_prev_tokens, confidence, forced_confidence, greedy_margin, block_ids,\n"
      "block_positions) with the golden's shapes and dtypes.\n"
      "\n"
      "options:\n"
      "  -m DIR          model directory with DSpark stages (config.json, weights, tokenizer.json)\n"
      "  --golden FILE   dspark golden safetensors (e.g. dspark_golden.safetensors)\n"
      "  -o OUT          output safetensors file\n"
      "  --backend B     cpu (default) or cuda: the target and the drafter on this backend\n"
      "  --precision P   cuda: fp32 (default, the golden's arithmetic) or bf16\n"
      "  --threads N     CPU threads\n"
      "  --quiet         no per-anchor lines and no comparison with the golden's values\n"
      "  -h, --help      this text\n");
}

// An I32 tensor of the golden file with the given rank.
const TensorView& golden_i32(const SafetensorsFile& g, const std::string& name, size_t rank) {
  const TensorView* t = g.find(name);
  if (!t)
    fail(g.path(), ": tensor '", name,
         "' is missing (dsx draft reads input_ids, anchor_positions, anchor_tokens, dspark.forced_prev_tokens)");
  if (t->dtype != DType::I32) fail(g.path(), ": tensor '", name, "' has dtype ", dtype_name(t->dtype), ", expected I32");
  if (t->shape.size() != rank)
    fail(g.path(), ": tensor '", name, "' has shape ", t->shape_str(), ", expected ", rank, " dimension", rank > 1 ? "s" : "");
  return *t;
}

// Largest row-wise relative L2 error of got [rows, n] against the golden's tensor.
double max_row_err(const SafetensorsFile& g, const char* name, const std::vector<float>& got, int64_t n) {
  const TensorView* t = g.find(name);
  if (!t || t->dtype != DType::F32 || t->numel() != static_cast<int64_t>(got.size())) return -1;
  double m = 0;
  for (size_t r = 0; r * n < got.size(); ++r)
    m = std::max(m, row_rel_l2(got.data() + r * n, t->as<float>() + r * n, n));
  return m;
}

double max_abs_err(const SafetensorsFile& g, const char* name, const std::vector<float>& got) {
  const TensorView* t = g.find(name);
  if (!t || t->dtype != DType::F32 || t->numel() != static_cast<int64_t>(got.size())) return -1;
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(got[i]) - t->as<float>()[i]));
  return m;
}

int cmd_draft(int argc, char** argv) {
  Args a(argc, argv, kValueOpts, kFlagOpts);
  if (a.has("-h") || a.has("--help")) {
    usage();
    return 0;
  }
  if (!a.positional().empty()) fail("unexpected argument '", a.positional()[0], "'");
  const std::string dir = a.require("-m"), golden = a.require("--golden"), out = a.require("-o");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  const bool quiet = a.has("--quiet");

  // a model without stages is refused before anything runs
  {
    std::string why;
    if (!dspark_available(dir, &why)) fail(why);
  }
  const ModelConfig cfg0 = load_model_config(dir);
  const int64_t B = cfg0.dspark_block_size, V = cfg0.vocab_size;

  // the golden's inputs
  const SafetensorsFile g(golden);
  const TensorView& ids_t = golden_i32(g, "input_ids", 1);
  const TensorView& pos_t = golden_i32(g, "anchor_positions", 1);
  const TensorView& tok_t = golden_i32(g, "anchor_tokens", 1);
  const TensorView& forced_t = golden_i32(g, "dspark.forced_prev_tokens", 2);
  const int64_t T = ids_t.numel(), A = pos_t.numel();
  if (T < 2) fail(g.path(), ": input_ids has ", T, " tokens (the drafter drafts from position 2 on)");
  if (A < 1) fail(g.path(), ": anchor_positions is empty");
  if (tok_t.numel() != A)
    fail(g.path(), ": anchor_tokens has shape ", tok_t.shape_str(), ", expected [", A, "] (one per anchor position)");
  if (forced_t.dim(0) != A || forced_t.dim(1) != B)
    fail(g.path(), ": dspark.forced_prev_tokens has shape ", forced_t.shape_str(), ", expected [", A, ", ", B,
         "] (anchors x dspark_block_size)");
  const int32_t* ids = ids_t.as<int32_t>();
  const int32_t* apos = pos_t.as<int32_t>();
  const int32_t* atok = tok_t.as<int32_t>();
  const int32_t* fprev = forced_t.as<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= V) fail(g.path(), ": input_ids[", t, "] = ", ids[t], " is outside the vocabulary (", V, ")");
  for (int64_t i = 0; i < A; ++i) {
    if (apos[i] < 2 || apos[i] > T)
      fail(g.path(), ": anchor_positions[", i, "] = ", apos[i], " outside [2, ", T, "] (taps exist for the prompt only)");
    if (atok[i] < 0 || atok[i] >= V) fail(g.path(), ": anchor_tokens[", i, "] = ", atok[i], " is outside the vocabulary");
    for (int64_t j = 0; j < B; ++j)
      if (fprev[i * B + j] < 0 || fprev[i * B + j] >= V)
        fail(g.path(), ": dspark.forced_prev_tokens[", i, ", ", j, "] = ", fprev[i * B + j], " is outside the vocabulary");
  }

  // the target: one prefill of the prompt, its taps; the drafter on the same backend
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (o.backend != "cpu" && o.backend != "cuda") fail("--backend must be cpu or cuda (got '", o.backend, "')");
  o.max_context = T + 16;
  auto eng = load_engine(dir, o);
  const std::unique_ptr<Drafter> drafter = load_drafter(dir, *eng);
  const ModelConfig& cfg = drafter->config();
  const int64_t D = cfg.hidden, R = cfg.dspark_markov_rank, TW = drafter->tap_width();
  if (eng->tap_width() != TW) fail(dir, ": the target's taps are ", eng->tap_width(), " wide, the drafter's ", TW);
  std::vector<float> taps(static_cast<size_t>(T * TW));
  {
    auto s = eng->new_session();
    Step st;
    st.feeds.push_back(Feed{s.get(), ids, T, nullptr, taps.data(), nullptr, nullptr});
    eng->step(st);
  }

  // the drafts
  std::vector<float> base(static_cast<size_t>(A * B * V)), mk(base.size()), fmk(base.size());
  std::vector<float> conf(static_cast<size_t>(A * B)), fconf(conf.size()), confp(conf.size()), fconfp(conf.size());
  std::vector<float> margin(conf.size()), z(static_cast<size_t>(A * B * D)), emb(static_cast<size_t>(A * B * R));
  std::vector<int32_t> drafts(conf.size()), prev(conf.size()), bids(conf.size()), bpos(conf.size());
  std::unique_ptr<DrafterState> st = drafter->make_state();
  std::vector<float> bz, bbase;
  for (int64_t i = 0; i < A; ++i) {
    const int64_t n = apos[i];
    if (n < st->end()) st = drafter->make_state();  // (anchors out of order: a fresh window)
    const int64_t p0 = std::max<int64_t>(st->end(), std::max<int64_t>(0, n - st->capacity()));
    drafter->observe(*st, taps.data() + p0 * TW, n - p0, p0);
    const std::unique_ptr<DraftBlock> blk = drafter->draft_block(*st, atok[i], n);
    const DSparkDraft gd = drafter->greedy(*blk);
    drafter->block_values(*blk, &bz, &bbase);
    const DSparkDraft fd = drafter->forced(*blk, fprev + i * B);
    std::copy(bbase.begin(), bbase.end(), base.begin() + i * B * V);
    std::copy(gd.markov_logits.begin(), gd.markov_logits.end(), mk.begin() + i * B * V);
    std::copy(fd.markov_logits.begin(), fd.markov_logits.end(), fmk.begin() + i * B * V);
    std::copy(bz.begin(), bz.end(), z.begin() + i * B * D);
    std::copy(gd.markov_embed.begin(), gd.markov_embed.end(), emb.begin() + i * B * R);
    for (int64_t j = 0; j < B; ++j) {
      const size_t k = static_cast<size_t>(i * B + j);
      drafts[k] = gd.tokens[j];
      prev[k] = gd.prev[j];
      conf[k] = gd.confidence_logits[j];
      fconf[k] = fd.confidence_logits[j];
      confp[k] = dspark_confidence(conf[k]);
      fconfp[k] = dspark_confidence(fconf[k]);
      bids[k] = j == 0 ? atok[i] : cfg.dspark_noise_token_id;
      bpos[k] = static_cast<int32_t>(n + j);
      const float* l = gd.markov_logits.data() + j * V;
      float top1 = -INFINITY, top2 = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        if (l[v] > top1) top2 = top1, top1 = l[v];
        else if (l[v] > top2) top2 = l[v];
      }
      margin[k] = top1 - top2;
    }
    if (!quiet) {
      std::printf("anchor %lld (token %d, %lld ring rows): drafts", static_cast<long long>(n), atok[i],
                  static_cast<long long>(st->context_rows(n)));
      for (int64_t j = 0; j < B; ++j) std::printf(" %d", gd.tokens[j]);
      std::printf("  confidence");
      for (int64_t j = 0; j < B; ++j) std::printf(" %.3f", dspark_confidence(gd.confidence_logits[j]));
      std::printf("\n");
    }
  }

  SafetensorsWriter w;
  w.set_metadata("producer", "dsx draft");
  w.add("input_ids", DType::I32, {T}, ids, static_cast<size_t>(T) * 4);
  w.add("anchor_positions", DType::I32, {A}, apos, static_cast<size_t>(A) * 4);
  w.add("anchor_tokens", DType::I32, {A}, atok, static_cast<size_t>(A) * 4);
  w.add("taps", DType::F32, {T, TW}, taps);
  w.add("dspark.base_logits", DType::F32, {A, B, V}, base);
  w.add("dspark.draft_tokens", DType::I32, {A, B}, drafts);
  w.add("dspark.markov_logits", DType::F32, {A, B, V}, mk);
  w.add("dspark.markov_prev_tokens", DType::I32, {A, B}, prev);
  w.add("dspark.markov_embed", DType::F32, {A, B, R}, emb);
  w.add("dspark.greedy_margin", DType::F32, {A, B}, margin);
  w.add("dspark.confidence_logits", DType::F32, {A, B}, conf);
  w.add("dspark.confidence", DType::F32, {A, B}, confp);
  w.add("dspark.forced_prev_tokens", DType::I32, {A, B}, fprev, static_cast<size_t>(A * B) * 4);
  w.add("dspark.forced_markov_logits", DType::F32, {A, B, V}, fmk);
  w.add("dspark.forced_confidence_logits", DType::F32, {A, B}, fconf);
  w.add("dspark.forced_confidence", DType::F32, {A, B}, fconfp);
  w.add("dspark.z", DType::F32, {A, B, D}, z);
  w.add("dspark.block_ids", DType::I32, {A, B}, bids);
  w.add("dspark.block_positions", DType::I32, {A, B}, bpos);
  w.write(out);

  if (!quiet && g.find("dspark.base_logits")) {
    // informative: how far the golden's values are (the tests hold the acceptance rules)
    int64_t lead = 0;
    if (const TensorView* gt = g.find("taps"); gt && gt->numel() == T * TW)
      while (lead < T && row_rel_l2(taps.data() + lead * TW, gt->as<float>() + lead * TW, TW) <= 1e-5) ++lead;
    int64_t same = 0;
    if (const TensorView* gd = g.find("dspark.draft_tokens"); gd && gd->numel() == A * B)
      for (int64_t k = 0; k < A * B; ++k) same += gd->as<int32_t>()[k] == drafts[static_cast<size_t>(k)];
    std::printf(
        "vs golden: taps %lld/%lld leading rows within 1e-5; max row rel-L2 base %.3g, markov %.3g, forced markov "
        "%.3g; max |d confidence logit| %.3g, forced %.3g; draft tokens %lld/%lld equal\n",
        static_cast<long long>(lead), static_cast<long long>(T), max_row_err(g, "dspark.base_logits", base, V),
        max_row_err(g, "dspark.markov_logits", mk, V), max_row_err(g, "dspark.forced_markov_logits", fmk, V),
        max_abs_err(g, "dspark.confidence_logits", conf), max_abs_err(g, "dspark.forced_confidence_logits", fconf),
        static_cast<long long>(same), static_cast<long long>(A * B));
  }
  if (!quiet) std::printf("wrote %s (%lld anchors x %lld rows)\n", out.c_str(), static_cast<long long>(A), static_cast<long long>(B));
  return 0;
}

}  // namespace

DSX_COMMAND("draft", "DSpark drafter check: draft at a golden file's anchors, write the drafts", cmd_draft);

}  // namespace dsx::cli
