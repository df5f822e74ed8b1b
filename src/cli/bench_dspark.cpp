// `dsx bench --dspark` (bench_dspark.h).
#include "cli/bench_dspark.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/dspark_option.h"
#include "runtime/dspark_decoding.h"
#include "runtime/generate.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsx::cli {

namespace {

const char* const kCodePrompts[] = {
    "Complete this Python function: def fib(n):",
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Complete this Python function: def merge_sorted(a, b):",
    "Write a Python class Stack with push, pop and peek methods.",
};

const char* const kAgentTasks[] = {
    "Read the file app.py and fix the failing test.",
    "List the files in the src directory.",
    "Run the unit tests and tell me which ones fail.",
    "Rename the function parse to parse_args in cli.py.",
    "Create a file hello.py that prints hello world, then run it.",
};

// An agent turn: tools for files and a shell, one task.
std::string agent_request(const std::string& task) {
  return R"({"messages": [{"role": "system", "content": "You are a coding agent working in a repository. Use the tools."},
                         {"role": "user", "content": ")" +
         task + R"("}],
             "tools": [
  {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
  {"type": "function", "function": {"name": "write_file", "description": "Write a file of the repository.",
   "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                  "required": ["path", "content"]}}},
  {"type": "function", "function": {"name": "run", "description": "Run a shell command in the repository.",
   "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]})";
}

std::vector<int32_t> render_ids(const text::Tokenizer& tok, text::Conversation conv) {
  text::RenderOptions ro;
  ro.profile = text::Profile::V41;
  ro.thinking = false;
  return text::encode_segments(tok, text::render_prompt(conv, ro).segments);
}

struct Totals {
  int64_t plain_tokens = 0, ds_tokens = 0, prompts = 0, same = 0;
  double plain_s = 0, ds_s = 0;
  DSparkStats st;
  void add(const DSparkStats& s) {
    st.cycles += s.cycles, st.drafted += s.drafted, st.verified += s.verified, st.accepted += s.accepted;
    st.verify_rows += s.verify_rows, st.tokens += s.tokens, st.draft_seconds += s.draft_seconds;
    st.verify_seconds += s.verify_seconds;
    if (st.verify_steps_by_rows.size() < s.verify_steps_by_rows.size()) {
      st.verify_steps_by_rows.resize(s.verify_steps_by_rows.size());
      st.verify_seconds_by_rows.resize(s.verify_seconds_by_rows.size());
    }
    for (size_t r = 0; r < s.verify_steps_by_rows.size(); ++r) {
      st.verify_steps_by_rows[r] += s.verify_steps_by_rows[r];
      st.verify_seconds_by_rows[r] += s.verify_seconds_by_rows[r];
    }
  }
};

void print_costs(const DSparkStats& st, double plain_step_s) {
  std::printf("  draft %.3f ms per cycle (%.2fx a plain step)", st.drafted ? 1e3 * st.draft_seconds / st.drafted : 0.0,
              st.drafted && plain_step_s > 0 ? st.draft_seconds / st.drafted / plain_step_s : 0.0);
  std::printf("; verify by rows:");
  for (size_t r = 1; r < st.verify_steps_by_rows.size(); ++r) {
    if (st.verify_steps_by_rows[r] == 0) continue;
    const double ms = 1e3 * st.verify_seconds_by_rows[r] / st.verify_steps_by_rows[r];
    std::printf(" %zu: %.3f ms (%.2fx, %lld)", r, ms, plain_step_s > 0 ? ms / 1e3 / plain_step_s : 0.0,
                static_cast<long long>(st.verify_steps_by_rows[r]));
  }
  std::printf("\n");
}

}  // namespace

int bench_dspark_model(Engine& eng, const std::string& dir, const DSparkBenchOptions& o) {
  std::string why;
  if (!dspark_available(dir, &why)) fail("--dspark: ", why);
  const text::Tokenizer tok = text::Tokenizer::from_model_dir(dir);
  const std::unique_ptr<Drafter> drafter = load_drafter(dir, eng);
  std::printf("# dsx bench --dspark: drafter %s, %d stages, block %d, weights %.3f GB; %lld tokens per prompt, T = 0\n",
              drafter->backend_name().c_str(), drafter->n_stages(), drafter->block_size(), drafter->weight_bytes() / 1e9,
              static_cast<long long>(o.tokens));
  std::vector<std::pair<std::string, std::vector<std::vector<int32_t>>>> cats;
  std::stringstream cs(o.categories);
  std::string cat_name;
  while (std::getline(cs, cat_name, ',')) {
    std::vector<std::vector<int32_t>> ps;
    if (cat_name == "code") {
      for (const char* p : kCodePrompts) {
        text::Conversation c;
        text::Message m;
        m.role = text::Role::User;
        m.content = p;
        c.messages.push_back(m);
        ps.push_back(render_ids(tok, c));
      }
    } else if (cat_name == "agent") {
      for (const char* t : kAgentTasks) ps.push_back(render_ids(tok, text::parse_conversation(agent_request(t))));
    } else {
      fail("--dspark-prompts: unknown category '", cat_name, "' (code, agent)");
    }
    if (o.prompts > 0 && static_cast<int>(ps.size()) > o.prompts) ps.resize(static_cast<size_t>(o.prompts));
    cats.emplace_back(cat_name, std::move(ps));
  }
  GenerateOptions go;
  go.sampling.temperature = 0;
  go.max_tokens = o.tokens;
  go.stop_ids.clear();  // (every generation o.tokens long)
  // one session per strategy, each reused across the prompts (a prompt's shared prefix
  // is then computed by the same kind of prefill on both: a prefill's numbers may depend
  // on how its rows were split into passes)
  // the schedule's costs measured on this engine (printed; used with --dspark-costs measure)
  DSparkOptions dso;
  const DSparkSchedule measured = measure_schedule(eng, *drafter);
  std::printf("# schedule costs measured: %s\n", measured.describe().c_str());
  std::string used;
  dso.schedule = dspark_costs_schedule(o.costs, dso.schedule, eng, *drafter, &used, &measured);
  std::printf("# schedule costs used: %s\n", used.c_str());
  auto sp = eng.new_session(), sd = eng.new_session();
  PlainDecoding plain;
  DSparkDecoding ds(*drafter, dso);
  {  // warm-up: graphs of both paths captured, one-time costs out of the figures
    GenerateOptions w = go;
    w.max_tokens = std::min<int64_t>(64, o.tokens);
    generate(*sp, cats.front().second.front(), w, plain);
    generate(*sd, cats.front().second.front(), w, ds);
  }
  int status = 0;
  Totals all;
  for (const auto& [name, prompts] : cats) {
    Totals t;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const GenerateResult a = generate(*sp, prompts[i], go, plain);
      ds.reset_stats();
      const GenerateResult b = generate(*sd, prompts[i], go, ds);
      const bool same = a.ids == b.ids;
      size_t first = 0;
      while (first < std::min(a.ids.size(), b.ids.size()) && a.ids[first] == b.ids[first]) ++first;
      if (!same) status = 1;
      const double pa = a.generated_tokens > 1 ? (a.generated_tokens - 1) / a.decode_seconds : 0;
      const double pb = b.generated_tokens > 1 ? (b.generated_tokens - 1) / b.decode_seconds : 0;
      std::printf("%s %zu: prompt %lld tokens; plain %.1f tok/s, dspark %.1f tok/s (%.2fx); %.3f tokens per cycle; "
                  "outputs %s\n",
                  name.c_str(), i, static_cast<long long>(a.prompt_tokens), pa, pb, pa > 0 ? pb / pa : 0.0,
                  ds.stats().tokens_per_cycle(),
                  same ? "identical" : cat("DIFFER from token ", first, " of ", a.ids.size()).c_str());
      t.plain_tokens += a.generated_tokens - 1, t.plain_s += a.decode_seconds;
      t.ds_tokens += b.generated_tokens - 1, t.ds_s += b.decode_seconds;
      ++t.prompts, t.same += same;
      t.add(ds.stats());
      all.add(ds.stats());
      all.plain_tokens += a.generated_tokens - 1, all.plain_s += a.decode_seconds;
      all.ds_tokens += b.generated_tokens - 1, all.ds_s += b.decode_seconds;
      ++all.prompts, all.same += same;
    }
    const double pt = t.plain_tokens / std::max(t.plain_s, 1e-9), dt = t.ds_tokens / std::max(t.ds_s, 1e-9);
    std::printf("== %s (%lld prompts, %lld identical): plain %.1f tok/s, dspark %.1f tok/s: %.2fx; %.3f accepted drafts "
                "per cycle, %.3f tokens per cycle, %.1f%% of verified drafts accepted\n",
                name.c_str(), static_cast<long long>(t.prompts), static_cast<long long>(t.same), pt, dt, dt / pt,
                t.st.accepted_per_cycle(), t.st.tokens_per_cycle(), 100 * t.st.acceptance());
    print_costs(t.st, t.plain_s / std::max<int64_t>(t.plain_tokens, 1));
  }
  std::printf("== all: %lld of %lld DSpark outputs identical to plain; plain %.1f tok/s, dspark %.1f tok/s: %.2fx\n",
              static_cast<long long>(all.same), static_cast<long long>(all.prompts),
              all.plain_tokens / std::max(all.plain_s, 1e-9), all.ds_tokens / std::max(all.ds_s, 1e-9),
              (all.ds_tokens / std::max(all.ds_s, 1e-9)) / (all.plain_tokens / std::max(all.plain_s, 1e-9)));
  return status;
}

int bench_dspark_synthetic(Engine& eng, Drafter& drafter, const DSparkBenchOptions& o) {
  const int B = drafter.block_size();
  const int64_t V = eng.config().vocab_size;
  std::printf("# dsx bench --dspark --synthetic: drafter %s, %d stages, block %d, weights %.3f GB (random: the costs "
              "only)\n",
              drafter.backend_name().c_str(), drafter.n_stages(), B, drafter.weight_bytes() / 1e9);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tk(3, static_cast<int32_t>(std::min<int64_t>(V, 128000) - 1));
  std::vector<int32_t> prompt(256);
  for (auto& x : prompt) x = tk(rng);
  GenerateOptions go;
  go.max_tokens = std::max<int64_t>(o.iters, 8);
  go.stop_ids.clear();
  auto s = eng.new_session();
  PlainDecoding plain;
  generate(*s, prompt, go, plain);  // (warm-up)
  const GenerateResult pr = generate(*s, prompt, go, plain);
  const double plain_step = pr.decode_seconds / std::max<int64_t>(pr.generated_tokens - 1, 1);
  std::printf("plain: %.3f ms per token\n", 1e3 * plain_step);
  DSparkDecoding ds(drafter);
  for (int k = 0; k <= B; ++k) {
    ds.options().schedule.static_k = k;
    generate(*s, prompt, go, ds);  // (warm-up: this row count's graphs)
    ds.reset_stats();
    generate(*s, prompt, go, ds);
    const DSparkStats& st = ds.stats();
    std::printf("static %d: %.3f ms per cycle;", k, 1e3 * (st.draft_seconds + st.verify_seconds) / std::max<int64_t>(st.cycles, 1));
    print_costs(st, plain_step);
  }
  return 0;
}

}  // namespace dsx::cli
