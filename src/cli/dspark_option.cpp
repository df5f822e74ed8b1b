// `--dspark off|on|static K` (dspark_option.h).
#include "cli/dspark_option.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "util/error.h"

namespace dsx::cli {

const char* const kDSparkHelp =
    "  --dspark off|on|static K  speculative decoding with the model's DSpark draft stages\n"
    "                      (output identical to plain decoding at temperature 0, the same\n"
    "                      distribution when sampling): on chooses how many drafts to\n"
    "                      verify per cycle from the drafter's confidences, static K always\n"
    "                      verifies K (0 .. dspark_block_size); default on when the model\n"
    "                      has stages (the drafter computes on the engine's backend: the\n"
    "                      CUDA drafter, in the engine's precision, for cuda)\n"
    "  --dspark-costs measure|default|D:C1,..,CN  the schedule's cost table: the drafter\n"
    "                      pass D and a verify of 1..N rows C(N), in one-row steps;\n"
    "                      measure times them on the engine at load (a seed then fixes\n"
    "                      sampled output only with a given table); default: built-in\n";

namespace {
bool is_number(const std::string& s) {
  return !s.empty() && s.size() < 9 && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}
}  // namespace

DSparkChoice parse_dspark(const std::string& v) {
  DSparkChoice c;
  if (v == "off") {
    c.mode = DSparkChoice::Mode::Off;
  } else if (v == "on") {
    c.mode = DSparkChoice::Mode::On;
  } else if (v.rfind("static", 0) == 0 && v.size() > 7 && (v[6] == ' ' || v[6] == '=' || v[6] == ':') &&
             is_number(v.substr(7))) {
    c.mode = DSparkChoice::Mode::Static;
    c.k = std::stoi(v.substr(7));
  } else {
    fail("--dspark must be off, on or static K (got '", v, "')");
  }
  return c;
}

DSparkChoice take_dspark(int argc, char** argv, const std::vector<std::string>& value_opts, std::vector<char*>& rest) {
  DSparkChoice c;
  std::string costs;
  rest.assign(argv, argv + (argc > 0 ? 1 : 0));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string v;
    if (a == "--dspark") {
      if (i + 1 >= argc) fail("option --dspark needs a value (off, on or static K)");
      v = argv[++i];
      if (v == "static") {
        if (i + 1 >= argc || !is_number(argv[i + 1])) fail("--dspark static needs the number of drafts K");
        v += std::string(" ") + argv[++i];
      }
      c = parse_dspark(v);
    } else if (a.rfind("--dspark=", 0) == 0) {
      c = parse_dspark(a.substr(9));
    } else if (a == "--dspark-costs" || a.rfind("--dspark-costs=", 0) == 0) {
      if (a == "--dspark-costs" && i + 1 >= argc) fail("option --dspark-costs needs a value (measure, default or D:C1,..)");
      costs = check_dspark_costs(a == "--dspark-costs" ? argv[++i] : a.substr(15));  // (a bad table fails here)
    } else {
      rest.push_back(argv[i]);
      if (std::find(value_opts.begin(), value_opts.end(), a) != value_opts.end() && i + 1 < argc) rest.push_back(argv[++i]);
    }
  }
  c.costs = costs;
  return c;
}

const std::string& check_dspark_costs(const std::string& v) {
  if (v != "measure" && v != "default") parse_schedule_costs(v);
  return v;
}

DSparkSchedule dspark_costs_schedule(const std::string& v, const DSparkSchedule& base, Engine& eng, const Drafter& d,
                                     std::string* label, const DSparkSchedule* measured) {
  DSparkSchedule s = base;
  std::string how;
  if (v == "measure") {
    s = measured ? *measured : measure_schedule(eng, d, base);
    s.static_k = base.static_k, s.threshold = base.threshold;
    how = "measured on " + eng.backend_name();
  } else if (v == "default") {
    how = "built-in";
  } else {
    s = parse_schedule_costs(v, base);
    how = "given";
  }
  if (label) *label = how + ": " + s.describe();
  return s;
}

DSparkSetup setup_dspark(const DSparkChoice& c, const std::string& dir, Engine& eng) {
  DSparkSetup s;
  if (c.mode == DSparkChoice::Mode::Off) return s;
  std::string why;
  // (the default is silent: plain decoding is what a model without stages, or a backend
  // without a drafter, is expected to do; an explicit request says why not)
  if (!dspark_available(dir, &why)) {
    if (c.mode != DSparkChoice::Mode::Default) std::fprintf(stderr, "model has no DSpark stages: plain decoding\n");
    return s;
  }
  // default on for every backend with a drafter: greedy DSpark output equals plain
  // greedy on the CPU and on CUDA fp32 and bf16 (CudaDSpark.GreedyIdentity*: the k-row
  // verify step computes each row's numbers as the one-row step does)
  if (!drafter_backend_available(eng.backend_name())) {
    if (c.mode == DSparkChoice::Mode::Default) return s;
    fail("--dspark: no DSpark drafter for backend '", eng.backend_name(), "' in this build");
  }
  s.drafter = load_drafter(dir, eng);
  DSparkOptions o;
  if (c.mode == DSparkChoice::Mode::Static) {
    const int B = s.drafter->block_size();
    if (c.k < 0 || c.k > B) fail("--dspark static K: K must be in 0 .. ", B, " (dspark_block_size), got ", c.k);
    o.schedule.static_k = c.k;
    s.name = cat("static ", c.k);
  } else {
    s.name = "on";
  }
  if (o.schedule.static_k >= 0)
    s.costs = "none (static K)";
  else
    o.schedule = dspark_costs_schedule(c.costs.empty() ? "default" : c.costs, o.schedule, eng, *s.drafter, &s.costs);
  s.strategy = std::make_unique<DSparkDecoding>(*s.drafter, o);
  return s;
}

}  // namespace dsx::cli
