#include "cli/registry.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "util/error.h"

namespace dsx::cli {

static std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}

void register_command(Command c) {
  auto& r = registry();
  r.push_back(std::move(c));
  std::sort(r.begin(), r.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
}

const std::vector<Command>& commands() { return registry(); }

Args::Args(int argc, char** argv, const std::vector<std::string>& value_opts,
           const std::vector<std::string>& flag_opts) {
  auto in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  // --help (unless the command answers it itself): the command's summary and options
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--help" || a == "-h") && !in(flag_opts, a)) {
      const std::string name = argc > 0 ? argv[0] : "?";
      std::printf("usage: dsx %s [options]\n", name.c_str());
      for (const Command& c : registry())
        if (c.name == name) std::printf("%s\n", c.summary.c_str());
      std::printf("\noptions:\n");
      for (const auto& o : value_opts) std::printf("  %s VALUE\n", o.c_str());
      for (const auto& o : flag_opts) std::printf("  %s\n", o.c_str());
      std::printf("  -h, --help\n");
      std::exit(0);
    }
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.size() > 1 && a[0] == '-' && !(a.size() > 1 && (std::isdigit(static_cast<unsigned char>(a[1])) != 0))) {
      std::string key = a, val;
      bool inline_val = false;
      if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
        key = a.substr(0, eq);
        val = a.substr(eq + 1);
        inline_val = true;
      }
      if (in(value_opts, key)) {
        if (!inline_val) {
          if (i + 1 >= argc) fail("option ", key, " needs a value");
          val = argv[++i];
        }
        values_[key] = val;
      } else if (in(flag_opts, key) && !inline_val) {
        flags_.push_back(key);
      } else {
        fail("unknown option ", a);
      }
    } else {
      positional_.push_back(a);
    }
  }
}

bool Args::has(const std::string& opt) const {
  return values_.count(opt) > 0 || std::find(flags_.begin(), flags_.end(), opt) != flags_.end();
}

std::optional<std::string> Args::get(const std::string& opt) const {
  auto it = values_.find(opt);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Args::require(const std::string& opt) const {
  auto v = get(opt);
  if (!v) fail("missing required option ", opt);
  return *v;
}

std::string Args::get_or(const std::string& opt, const std::string& def) const {
  auto v = get(opt);
  return v ? *v : def;
}

long long Args::get_int(const std::string& opt, long long def) const {
  auto v = get(opt);
  if (!v) return def;
  char* end = nullptr;
  long long r = std::strtoll(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0') fail("option ", opt, ": '", *v, "' is not an integer");
  return r;
}

double Args::get_double(const std::string& opt, double def) const {
  auto v = get(opt);
  if (!v) return def;
  char* end = nullptr;
  double r = std::strtod(v->c_str(), &end);
  if (end == v->c_str() || *end != '\0') fail("option ", opt, ": '", *v, "' is not a number");
  return r;
}

}  // namespace dsx::cli
