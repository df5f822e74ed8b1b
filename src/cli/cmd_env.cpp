// `dsx env`: prints the engine's switches (the DSX_* environment variables declared in
// util/switches.def): each one's value, where the value came from (environment,
// override or default) and what it does.
#include <cstdio>

#include "cli/registry.h"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cli {

namespace {

int cmd_env(int argc, char** argv) {
  Args args(argc, argv, {}, {"-h", "--help"});
  if (args.has("-h") || args.has("--help")) {
    std::fprintf(stdout,
                 "usage: dsx env [-h | --help]\n"
                 "\n"
                 "Prints every DSX_* switch of the engine, one a line: its name, its value, where\n"
                 "the value came from (environment, override or default) and what it does.\n"
                 "A switch is set by exporting DSX_<NAME>=VALUE (Bool: 1 / 0, on / off); a value\n"
                 "its kind rejects is an error naming the variable.\n"
                 "\n"
                 "options:\n"
                 "  -h, --help   this text\n");
    return 0;
  }
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  const std::string table = sw::describe();
  std::fwrite(table.data(), 1, table.size(), stdout);
  return 0;
}

}  // namespace

DSX_COMMAND("env", "print the DSX_* switches: value, where it came from, meaning", cmd_env);

}  // namespace dsx::cli
