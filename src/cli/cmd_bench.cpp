// `dsx bench`: walks a prompt to context frontiers with incremental prefill,
// measuring prefill tokens/s for each interval and decode tokens/s at each
// frontier; writes CSV (and an SVG plot). Works on any backend; the CUDA
// backend adds roofline figures (bytes per token vs measured bandwidth).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/bench_dspark.h"
#include "cli/dspark_option.h"
#include "cli/gpus_option.h"
#include "cli/registry.h"
#include "runtime/bench_report.h"
#include "model/cost_model.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "util/error.h"
#include "util/threadpool.h"
#ifdef DSX_HAVE_CUDA
#include "runtime/cuda_drafter.h"
#include "runtime/cuda_engine.h"
#endif

namespace dsx::cli {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int64_t> parse_frontiers(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    double x = std::strtod(item.c_str(), &end);
    if (end && (*end == 'k' || *end == 'K')) x *= 1024;
    if (x < 1) fail("bad frontier '", item, "'");
    v.push_back(static_cast<int64_t>(x));
  }
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] <= v[i - 1]) fail("frontiers must increase");
  return v;
}

std::vector<int> parse_rows(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long x = std::strtol(item.c_str(), &end, 10);
    if (!end || *end || x < 1 || x > 64) fail("bad row count '", item, "' (1 .. 64)");
    v.push_back(static_cast<int>(x));
  }
  if (v.empty()) fail("--rows: no row counts");
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Step time by row count at the session's context: one session, k rows per step with the
// greedy id of every row (the shape of a speculative verify: the weights streamed once,
// the head over every row), then rolled back; with --batch also k sessions of one row
// each (batched decode). Each shape first runs a few steps (eager, then captured).
void bench_rows(Engine& eng, Session& s, const std::vector<int>& rows, int iters, bool batch) {
  const int64_t f = s.position();
  std::mt19937 rng(7);
  const int32_t V = static_cast<int32_t>(std::min<int64_t>(eng.config().vocab_size, 128000));
  std::uniform_int_distribution<int32_t> tok(3, V - 1);
  auto time_step = [&](const Step& st, const std::function<void()>& undo) {
    std::vector<double> ms;
    for (int i = 0; i < iters + 3; ++i) {
      const double t0 = now_s();
      eng.step(st);
      const double t1 = now_s();
      undo();
      if (i >= 3) ms.push_back((t1 - t0) * 1e3);
    }
    return median(ms);
  };
  double one = 0;
  for (int k : rows) {
    if (k > eng.options().rollback_depth) fail("--rows: ", k, " rows exceed the rollback depth (", eng.options().rollback_depth, ")");
    std::vector<int32_t> ids(static_cast<size_t>(k)), picks(static_cast<size_t>(k));
    for (auto& x : ids) x = tok(rng);
    Step st;
    st.feeds.push_back(Feed{&s, ids.data(), k, nullptr, nullptr, nullptr, picks.data()});
    const double ms = time_step(st, [&] { s.rollback(f); });
    if (k == rows.front()) one = ms;
    std::printf("rows %2d  context %lld  step %.3f ms  (%.2fx the %d-row step)\n", k, (long long)f, ms,
                one > 0 ? ms / one : 0.0, rows.front());
    std::fflush(stdout);
  }
  if (!batch) return;
  const std::vector<uint8_t> snap = s.save();
  double one_b = 0;
  for (int k : rows) {
    std::vector<std::unique_ptr<Session>> ss;
    for (int i = 0; i < k; ++i) {
      ss.push_back(eng.new_session());
      ss.back()->restore(snap);
    }
    std::vector<int32_t> ids(static_cast<size_t>(k)), picks(static_cast<size_t>(k));
    for (auto& x : ids) x = tok(rng);
    Step st;
    for (int i = 0; i < k; ++i) st.feeds.push_back(Feed{ss[static_cast<size_t>(i)].get(), &ids[i], 1, nullptr, nullptr, &picks[i]});
    const double ms = time_step(st, [&] {
      for (auto& x : ss) x->rollback(f);
    });
    if (k == rows.front()) one_b = ms;
    std::printf("sessions %2d x 1 row  context %lld  step %.3f ms  (%.2fx the %d-session step)\n", k, (long long)f, ms,
                one_b > 0 ? ms / one_b : 0.0, rows.front());
    std::fflush(stdout);
  }
}

int cmd_bench(int argc, char** argv) {
  Args a(argc, argv,
         {"-m", "--backend", "--precision", "--threads", "--frontiers", "--chunk", "--decode-tokens", "--csv", "--svg",
          "--seed", "--synthetic", "--layers", "--prefill-max", "--rows", "--iters", "--dspark-tokens",
          "--dspark-prompts", "--dspark-per-category", "--dspark-costs", "--gpus"},
         {"--batch", "--dspark"});
  // Intervals longer than --prefill-max tokens are prefilled only for their last
  // --prefill-max tokens; the rest is filled with random cache contents
  // (synthetic_fill) when the backend supports it. 0 = always prefill.
  const int64_t prefill_max = a.get_int("--prefill-max", 0);
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  auto frontiers = parse_frontiers(a.get_or("--frontiers", "128,256,512"));
  o.max_context = frontiers.back() + 64;
  o.checkpoint_every = 0;  // (steady decode: no prefix-sync checkpoints inside the timed steps)
  const int64_t chunk = a.get_int("--chunk", 512);
  const int64_t ndec = a.get_int("--decode-tokens", 16);
  std::unique_ptr<Engine> eng;
  const bool synthetic = a.has("--synthetic");
  apply_gpus_option(a, o);
  [[maybe_unused]] const int layers = static_cast<int>(a.get_int("--layers", 4));
#ifdef DSX_HAVE_CUDA
  ModelConfig syn_cfg;
  if (synthetic) {
    if (a.require("--synthetic") != "v41-flash") fail("--synthetic: only v41-flash is known");
    o.backend = "cuda";
    syn_cfg = synthetic_v41_flash_config(layers);
    if (a.has("--dspark")) {
      // the release's DSpark keys (spec dspark.md §2.1): taps of the last three layers
      // (layer inputs, so from layer 1 on), 3 stages of 128 experts, top-3
      for (int l = std::max(1, layers - 3); l < layers; ++l) syn_cfg.dspark_target_layers.push_back(l);
      syn_cfg.dspark_block_size = 5;
      syn_cfg.dspark_noise_token_id = 128799;
      syn_cfg.dspark_markov_rank = 256;
      syn_cfg.dspark_n_routed_experts = 128;
      syn_cfg.dspark_experts_per_tok = 3;
    }
    eng = make_synthetic_cuda_engine(syn_cfg, o, static_cast<uint64_t>(a.get_int("--seed", 1)));
  }
#else
  if (synthetic) fail("--synthetic needs the CUDA backend (this build has none)");
#endif
  if (!eng) {
    eng = load_engine(a.require("-m"), o);
    print_placement_at_load(*eng, o);
  }
  [[maybe_unused]] double copy_bw = 0, bytes40_per_layer_ratio = 0;
  [[maybe_unused]] int64_t weight_bytes_step = 0;
#ifdef DSX_HAVE_CUDA
  if (o.backend == "cuda") {
    auto st = cuda_engine_stats(*eng);
    copy_bw = st.copy_bandwidth_gb_s;
    weight_bytes_step = st.decode_weight_bytes;
    std::printf("# device copy bandwidth %.1f GB/s; weights on device %.2f GB; weight bytes per decode step %.3f GB; "
                "shared workspace %.2f GB\n",
                copy_bw, st.weight_bytes / 1e9, weight_bytes_step / 1e9, st.workspace_bytes / 1e9);
    bytes40_per_layer_ratio = 1;
  }
#endif
  if (a.has("--dspark")) {
    DSparkBenchOptions d;
    d.tokens = a.get_int("--dspark-tokens", 512);
    d.categories = a.get_or("--dspark-prompts", "code,agent");
    d.prompts = static_cast<int>(a.get_int("--dspark-per-category", 0));
    d.costs = check_dspark_costs(a.get_or("--dspark-costs", "default"));  // (a bad table fails here)
    d.iters = static_cast<int>(a.get_int("--iters", 20));
    if (d.tokens < 2) fail("--dspark-tokens must be >= 2");
    std::printf("# dsx bench: %s\n", eng->describe().c_str());
#ifdef DSX_HAVE_CUDA
    if (synthetic) {
      auto dr = make_synthetic_cuda_drafter(syn_cfg, 3, o.precision, static_cast<uint64_t>(a.get_int("--seed", 1)) + 1);
      return bench_dspark_synthetic(*eng, *dr, d);
    }
#endif
    return bench_dspark_model(*eng, a.require("-m"), d);
  }
  const int64_t V = eng->config().vocab_size;
  std::mt19937 rng(static_cast<uint32_t>(a.get_int("--seed", 1)));
  std::uniform_int_distribution<int32_t> tok(3, static_cast<int32_t>(std::min<int64_t>(V, 128000) - 1));
  std::printf("# dsx bench: %s\n", eng->describe().c_str());
  std::vector<BenchRow> rows;
  {
    // warm-up: the first prefill of a process pays one-time costs (kernel modules
    // loaded on first use, cuBLAS heuristics); keep them out of the first frontier
    auto w = eng->new_session();
    std::vector<int32_t> ids(static_cast<size_t>(std::min<int64_t>(chunk, frontiers.front())));
    for (auto& x : ids) x = tok(rng);
    std::vector<float> wl(static_cast<size_t>(V));
    w->feed(ids.data(), static_cast<int64_t>(ids.size()), wl.data(), false);
  }
  auto s = eng->new_session();
  const StateFootprint fp = eng->footprint();
  std::printf("# session state: %.3f GB allocated for up to %lld tokens (%.0f B per token, %.2f MB fixed)\n",
              s->state_bytes() / 1e9, (long long)o.max_context, fp.bytes_per_token, fp.fixed_bytes / 1e6);
  std::vector<float> logits(static_cast<size_t>(V));  // the last row of each fed chunk
  for (int64_t f : frontiers) {
    BenchRow r;
    r.context = f;
    // incremental prefill from the previous frontier
    if (prefill_max > 0 && f - s->position() > prefill_max) {
      const int64_t jump = f - s->position() - prefill_max;
      if (!s->backend().synthetic_fill(jump, static_cast<uint64_t>(f)))
        fail("--prefill-max: this backend cannot fill a context synthetically");
      std::printf("# context %lld: %lld tokens filled with random cache contents, %lld prefilled\n", (long long)f,
                  (long long)jump, (long long)prefill_max);
    }
    const int64_t from = s->position();
    std::vector<int32_t> ids(static_cast<size_t>(f - from));
    for (auto& x : ids) x = tok(rng);
    double t0 = now_s();
    for (int64_t p = 0; p < f - from; p += chunk) {
      const int64_t n = std::min(chunk, f - from - p);
      s->feed(ids.data() + p, n, logits.data(), false);
    }
    double t1 = now_s();
    r.prefill_tokens = f - from;
    r.prefill_tok_s = (f - from) / std::max(t1 - t0, 1e-9);
    // decode ndec tokens, then roll back so the next interval starts at f
    auto snap = s->save();
    const int32_t first = argmax(logits.data(), V);
    int32_t next = first;
    // warm-up: the first decode steps of a session build its decode graph; time the
    // steady state (the same tokens are decoded again after the rollback)
    for (int i = 0; i < 3 && i < ndec; ++i) next = s->feed_greedy(&next, 1);
    s->restore(snap);
    next = first;
    double d0 = now_s();
    for (int64_t i = 0; i < ndec; ++i) next = s->feed_greedy(&next, 1);  // greedy on the backend
    double d1 = now_s();
    r.decode_tok_s = ndec / std::max(d1 - d0, 1e-9);
    s->restore(snap);
#ifdef DSX_HAVE_CUDA
    if (bytes40_per_layer_ratio > 0) {
      const ModelConfig& cfg = eng->config();
      r.bytes_per_token = static_cast<double>(weight_bytes_step + decode_state_bytes(cfg, f));
      r.achieved_gb_s = r.bytes_per_token * r.decode_tok_s / 1e9;
      r.roofline_fraction = copy_bw > 0 ? r.achieved_gb_s / copy_bw : 0;
      if (synthetic) {
        // the 40-layer release at the same achieved bandwidth
        const ModelConfig full = synthetic_v41_flash_config(40);
        const double full_bytes = static_cast<double>(v41_decode_weight_bytes(full) + decode_state_bytes(full, f));
        r.projected_tok_s = r.achieved_gb_s * 1e9 / full_bytes;
      }
    }
#endif
    rows.push_back(r);
    std::printf("context %7lld  prefill %9.1f tok/s (%lld tokens)  decode %8.2f tok/s", (long long)f,
                r.prefill_tok_s, (long long)r.prefill_tokens, r.decode_tok_s);
    if (r.bytes_per_token > 0)
      std::printf("  | %.3f GB/token, %.0f GB/s, %.1f%% of copy bw%s", r.bytes_per_token / 1e9, r.achieved_gb_s,
                  100 * r.roofline_fraction,
                  r.projected_tok_s > 0 ? cat(", projected 40 layers ", r.projected_tok_s, " tok/s").c_str() : "");
    std::printf("\n");
    std::fflush(stdout);
  }
  if (a.has("--rows")) {
    std::printf("# step time by row count (one session; --batch: sessions of one row)\n");
    bench_rows(*eng, *s, parse_rows(a.require("--rows")), static_cast<int>(a.get_int("--iters", 20)), a.has("--batch"));
  }
  if (a.has("--csv")) write_bench_csv(a.require("--csv"), rows);
  if (a.has("--svg")) write_bench_svg(a.require("--svg"), rows, eng->describe());
  return 0;
}

}  // namespace

DSX_COMMAND("bench", "benchmark prefill and decode speed at growing context lengths", cmd_bench);

}  // namespace dsx::cli
