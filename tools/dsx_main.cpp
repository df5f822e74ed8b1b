// dsx: command-line entry point. Subcommands register themselves (src/cli/registry.h).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cli/registry.h"
#include "util/error.h"

static void usage() {
  std::fprintf(stderr, "usage: dsx <command> [options]\n\ncommands:\n");
  for (const auto& c : dsx::cli::commands()) std::fprintf(stderr, "  %-12s %s\n", c.name.c_str(), c.summary.c_str());
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  for (const auto& c : dsx::cli::commands()) {
    if (c.name != name) continue;
    try {
      return c.fn(argc - 1, argv + 1);
    } catch (const dsx::Error& e) {
      std::fprintf(stderr, "dsx %s: error: %s\n", name.c_str(), e.what());
      return 1;
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "dsx %s: error: out of memory\n", name.c_str());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dsx %s: error: %s\n", name.c_str(), e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "dsx: unknown command '%s'\n", name.c_str());
  usage();
  return 2;
}
