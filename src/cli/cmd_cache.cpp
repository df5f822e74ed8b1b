// `dsx cache ls|stats|verify|prune --kv-cache DIR`: the on-disk KV cache of dsx serve
// (cache/disk_cache.h), without a model: every entry of every model in the directory.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "cache/disk_cache.h"
#include "cli/registry.h"
#include "util/error.h"

namespace dsx::cli {

namespace {

const char* kUsage =
    "usage: dsx cache ls|stats|verify|prune --kv-cache DIR [options]\n"
    "\n"
    "The on-disk KV cache of `dsx serve --kv-cache DIR`: session snapshots keyed by\n"
    "their token prefix. No model is needed; entries of every model are shown.\n"
    "\n"
    "actions:\n"
    "  ls       one line per entry, most recently used first: file, model, tokens,\n"
    "           bytes, created, last used; then the files that were refused and why\n"
    "  stats    entries and bytes (per model), refused files, temporary files\n"
    "  verify   read every entry fully and check its headers, sections and checksums;\n"
    "           exits 1 if a file is bad (--delete removes the bad ones)\n"
    "  prune    delete least recently used entries until at most --size BYTES remain\n"
    "           (also removes temporary files and entries that fail validation)\n"
    "\n"
    "options:\n"
    "  --kv-cache DIR   the cache directory (required)\n"
    "  --size BYTES     prune: the target size (8G, 512MiB, 1.5GB, 1000000; 0: all)\n"
    "  --delete         verify: delete the bad files\n"
    "  --json           ls / stats / verify: JSON output\n"
    "  -h, --help       this text\n"
    "\n"
    "prune and verify --delete take the directory's lock: they fail while a dsx serve\n"
    "owns the directory (its --kv-cache-size budget prunes it then).\n";

std::string when(int64_t ns) {
  if (ns <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S", &tm);
  return b;
}

std::string mb(int64_t bytes) {
  char b[32];
  const double v = static_cast<double>(bytes);
  if (bytes < 10000) std::snprintf(b, sizeof b, "%lld B", static_cast<long long>(bytes));
  else if (v < 1e7) std::snprintf(b, sizeof b, "%.1f KB", v / 1e3);
  else if (v < 1e10) std::snprintf(b, sizeof b, "%.1f MB", v / 1e6);
  else std::snprintf(b, sizeof b, "%.2f GB", v / 1e9);
  return b;
}

void print(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

int cmd_cache(int argc, char** argv) {
  Args args(argc, argv, {"--kv-cache", "--size"}, {"--json", "--delete", "-h", "--help"});
  if (args.has("-h") || args.has("--help")) {
    print(kUsage);
    return 0;
  }
  if (args.positional().size() != 1) fail("give one action: ls, stats, verify or prune (dsx cache --help)");
  const std::string action = args.positional()[0];
  if (action != "ls" && action != "stats" && action != "verify" && action != "prune")
    fail("unknown action '", action, "' (ls, stats, verify, prune)");
  const std::string dir = args.require("--kv-cache");
  if (args.has("--size") && action != "prune") fail("--size is an option of prune");
  if (args.has("--delete") && action != "verify") fail("--delete is an option of verify");
  const bool json = args.has("--json");
  const bool owner = action == "prune" || args.has("--delete");
  DiskCacheOptions o;
  o.exclusive = owner;
  o.create = false;
  o.log = [](const std::string& line) { std::fprintf(stderr, "dsx cache: %s\n", line.c_str()); };
  std::unique_ptr<DiskCache> c = DiskCache::open_any(dir, o);

  if (action == "ls") {
    const auto es = c->entries();
    const auto refused = c->refused_files();
    if (json) {
      nlohmann::json j = {{"entries", nlohmann::json::array()}, {"refused", nlohmann::json::array()}};
      for (const auto& e : es)
        j["entries"].push_back({{"file", e.name}, {"model", e.model}, {"tokens", e.tokens}, {"bytes", e.bytes},
                                {"created_ns", e.created_ns}, {"last_use_ns", e.last_use_ns}});
      for (const auto& r : refused) j["refused"].push_back({{"file", r.name}, {"reason", r.reason}});
      print(j.dump(1) + "\n");
      return 0;
    }
    std::string out;
    for (const auto& e : es) {
      char line[512];
      std::snprintf(line, sizeof line, "%s  %-16.16s  %9lld tokens  %12s  created %s  used %s\n", e.name.c_str(),
                    e.model.c_str(), static_cast<long long>(e.tokens), mb(e.bytes).c_str(), when(e.created_ns).c_str(),
                    when(e.last_use_ns).c_str());
      out += line;
    }
    for (const auto& r : refused) out += cat(r.name, "  refused: ", r.reason, "\n");
    out += cat(es.size(), " entries", refused.empty() ? "" : cat(", ", refused.size(), " refused files"), "\n");
    print(out);
    return 0;
  }

  if (action == "stats") {
    const DiskCacheStats s = c->stats();
    std::map<std::string, std::pair<int64_t, int64_t>> per_model;  // entries, bytes
    int64_t tokens = 0, oldest = 0, newest = 0;
    for (const auto& e : c->entries()) {
      auto& m = per_model[e.model];
      ++m.first;
      m.second += e.bytes;
      tokens += e.tokens;
      if (!oldest || e.last_use_ns < oldest) oldest = e.last_use_ns;
      newest = std::max(newest, e.last_use_ns);
    }
    if (json) {
      nlohmann::json j = {{"dir", dir},          {"entries", s.entries},         {"bytes", s.bytes},
                          {"tokens", tokens},    {"refused", s.refused},         {"kept_foreign", s.foreign_files},
                          {"oldest_use_ns", oldest}, {"newest_use_ns", newest},  {"models", nlohmann::json::object()}};
      for (const auto& [m, v] : per_model) j["models"][m] = {{"entries", v.first}, {"bytes", v.second}};
      print(j.dump(1) + "\n");
      return 0;
    }
    std::string out = cat("kv cache ", dir, "\n  entries   ", s.entries, "\n  bytes     ", s.bytes, " (", mb(s.bytes),
                          ")\n  tokens    ", tokens, "\n  used      ", when(oldest), " .. ", when(newest), "\n");
    for (const auto& [m, v] : per_model)
      out += cat("  model ", m.substr(0, 16), "…: ", v.first, " entries, ", mb(v.second), "\n");
    if (s.refused) out += cat("  refused   ", s.refused, " files (dsx cache ls says why)\n");
    print(out);
    return 0;
  }

  if (action == "verify") {
    const VerifyReport r = c->verify();
    if (json) {
      nlohmann::json j = {{"files", nlohmann::json::array()}, {"bad", r.bad}, {"seconds", r.seconds}};
      for (const auto& f : r.files)
        j["files"].push_back({{"file", f.name}, {"ok", f.ok}, {"bytes", f.bytes}, {"reason", f.reason}});
      print(j.dump(1) + "\n");
    } else {
      std::string out;
      int64_t bytes = 0;
      for (const auto& f : r.files) {
        bytes += f.bytes;
        out += cat(f.name, "  ", f.ok ? "ok" : f.foreign ? "kept: " + f.reason : "BAD: " + f.reason, "\n");
      }
      char rate[64];
      std::snprintf(rate, sizeof rate, "%.2f s", r.seconds);
      out += cat(r.files.size(), " files, ", mb(bytes), " read in ", rate, "; ", r.bad, " bad",
                 r.bad && args.has("--delete") ? " (deleted)" : "", "\n");
      print(out);
    }
    return r.bad ? 1 : 0;
  }

  // prune
  const int64_t target = parse_byte_size(args.require("--size"));
  const int64_t before = c->stats().bytes;
  const int64_t n_before = c->stats().entries;
  const int64_t freed = c->prune(target);
  const DiskCacheStats s = c->stats();
  print(cat("pruned ", n_before - s.entries, " entries (", mb(freed), "): ", s.entries, " entries, ", mb(s.bytes),
            " remain (of ", mb(before), ")\n"));
  return 0;
}

}  // namespace

DSX_COMMAND("cache", "the on-disk KV cache: ls | stats | verify | prune --kv-cache DIR [--size BYTES]", cmd_cache);

}  // namespace dsx::cli
