// `dsx bench`: walks a prompt to context frontiers with incremental prefill,
// measuring prefill tokens/s for each interval and decode tokens/s at each
// frontier; writes CSV (and an SVG plot). Works on any backend; the CUDA
// backend adds roofline figures (bytes per token vs measured bandwidth).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "runtime/bench_report.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "util/error.h"
#include "util/threadpool.h"

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

int cmd_bench(int argc, char** argv) {
  Args a(argc, argv,
         {"-m", "--backend", "--precision", "--threads", "--frontiers", "--chunk", "--decode-tokens", "--csv", "--svg",
          "--seed"},
         {});
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  auto frontiers = parse_frontiers(a.get_or("--frontiers", "128,256,512"));
  o.max_context = frontiers.back() + 64;
  const int64_t chunk = a.get_int("--chunk", 512);
  const int64_t ndec = a.get_int("--decode-tokens", 16);
  auto eng = load_engine(a.require("-m"), o);
  const int64_t V = eng->config().vocab_size;
  std::mt19937 rng(static_cast<uint32_t>(a.get_int("--seed", 1)));
  std::uniform_int_distribution<int32_t> tok(3, static_cast<int32_t>(std::min<int64_t>(V, 128000) - 1));
  std::printf("# dsx bench: %s\n", eng->describe().c_str());
  std::vector<BenchRow> rows;
  auto s = eng->new_session();
  std::vector<float> logits(static_cast<size_t>(V * chunk));
  for (int64_t f : frontiers) {
    BenchRow r;
    r.context = f;
    // incremental prefill from the previous frontier
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
    int32_t next = argmax(logits.data(), V);
    double d0 = now_s();
    for (int64_t i = 0; i < ndec; ++i) {
      s->feed(&next, 1, logits.data(), false);
      next = argmax(logits.data(), V);
    }
    double d1 = now_s();
    r.decode_tok_s = ndec / std::max(d1 - d0, 1e-9);
    s->restore(snap);
    rows.push_back(r);
    std::printf("context %7lld  prefill %9.1f tok/s (%lld tokens)  decode %8.2f tok/s\n", (long long)f,
                r.prefill_tok_s, (long long)r.prefill_tokens, r.decode_tok_s);
    std::fflush(stdout);
  }
  if (a.has("--csv")) write_bench_csv(a.require("--csv"), rows);
  if (a.has("--svg")) write_bench_svg(a.require("--svg"), rows, eng->describe());
  return 0;
}

}  // namespace

DSX_COMMAND("bench", "benchmark prefill and decode speed at growing context lengths", cmd_bench);

}  // namespace dsx::cli
