// `--dspark off|on|static K` of `dsx run`, `dsx generate` and `dsx serve`: the option
// taken out of argv (its two-word form does not fit Args), and the decoding strategy it
// resolves to for a model directory and an engine (runtime/dspark_decoding.h; the server
// takes its drafter and options: server/scheduler.h). The one place of the default rule.
//
// The drafter computes where the engine does (runtime/dspark_decoding.h load_drafter:
// the CPU reference for a CPU engine, the CUDA drafter in the engine's precision for a
// CUDA one). Default (no --dspark): on when the model has DSpark stages and the engine's
// backend has a drafter. A model without stages runs plain decoding, silently; with an
// explicit --dspark on / static K it says so once.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/dspark.h"
#include "runtime/dspark_decoding.h"
#include "runtime/engine.h"
#include "runtime/generate.h"

namespace dsx::cli {

struct DSparkChoice {
  enum class Mode { Default, Off, On, Static } mode = Mode::Default;
  int k = 0;  // Static
  // --dspark-costs: "measure", "default" or "D:C1,..,CN" (parse_schedule_costs); empty:
  // the built-in table (measured tables chose fewer drafts and ran slower on the CPU:
  // the confidences underestimate acceptance; bench/RESULTS.md)
  std::string costs;
};

// Parses "off", "on", "static K", "static=K", "static:K". Throws dsx::Error otherwise.
DSparkChoice parse_dspark(const std::string& v);

// Takes every --dspark VALUE / --dspark=VALUE and --dspark-costs VALUE out of
// argv[0..argc) (the value "static" takes the number after it too), the last one wins;
// `rest` gets the other arguments (argv[0] first). Values of the options in value_opts
// are skipped, as Args reads them.
DSparkChoice take_dspark(int argc, char** argv, const std::vector<std::string>& value_opts, std::vector<char*>& rest);

// The strategy generation runs with: DSpark (drafter and strategy set), or plain
// (strategy null). `name` is the resolved mode: "off" | "on" | "static K".
struct DSparkSetup {
  std::unique_ptr<Drafter> drafter;
  std::unique_ptr<DSparkDecoding> strategy;
  std::string name = "off";
  std::string costs;  // where the schedule's cost table came from, and the table
};
// --dspark-costs VALUE: "measure", "default" or a table (parse_schedule_costs, whose
// error a bad table throws); returns VALUE.
const std::string& check_dspark_costs(const std::string& v);
// The schedule of VALUE ("default": base's table; "measure": measure_schedule on eng, or
// *measured when the caller has measured already; else the table given), static_k and
// threshold from base; *label says where its costs came from, and the table.
DSparkSchedule dspark_costs_schedule(const std::string& v, const DSparkSchedule& base, Engine& eng, const Drafter& d,
                                     std::string* label, const DSparkSchedule* measured = nullptr);
// Measuring the costs (--dspark-costs measure) runs steps on a scratch session of eng.
DSparkSetup setup_dspark(const DSparkChoice& c, const std::string& model_dir, Engine& eng);

// The --help lines of the option.
extern const char* const kDSparkHelp;

}  // namespace dsx::cli
