#include "util/switches.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "util/error.h"

namespace dsx::sw {

namespace {

constexpr int kN = static_cast<int>(Id::kCount);

// (a function-local static: a reader in another file's static initializer finds it built)
const std::vector<Info>& infos() {
  static const std::vector<Info> v = {
#define DSX_SWITCH(id, kind, dflt, doc) {Id::id, #id, Kind::kind, dflt, doc},
#include "util/switches.def"
#undef DSX_SWITCH
  };
  return v;
}

struct Slot {
  std::atomic<int64_t> value{0};  // Int / Bool
  std::string text;               // every kind (guarded by the registry mutex)
  std::string env_text;           // what the environment said (empty: unset)
  bool from_env = false;
  bool overridden = false;
};

int64_t parse(const Info& in, const std::string& v, const char* origin) {
  if (in.kind == Kind::Str) return 0;
  if (in.kind == Kind::Bool) {
    if (v == "1" || v == "on" || v == "true" || v == "yes") return 1;
    if (v == "0" || v == "off" || v == "false" || v == "no") return 0;
    fail(origin, " DSX_", in.name, "='", v, "' is not a boolean (1 / 0)");
  }
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || !end || *end) fail(origin, " DSX_", in.name, "='", v, "' is not an integer");
  return x;
}

class Registry {
 public:
  Registry() {
    for (int i = 0; i < kN; ++i) {
      const Info& in = infos()[static_cast<size_t>(i)];
      Slot& s = slots_[i];
      const std::string name = std::string("DSX_") + in.name;
      const char* e = std::getenv(name.c_str());
      s.from_env = e && *e;
      s.env_text = s.from_env ? e : "";
      load(i);
    }
  }
  Slot& slot(Id id) { return slots_[static_cast<int>(id)]; }
  std::mutex mu;

  // value from override / environment / default (the slot's text is already set for an override)
  void load(int i) {
    const Info& in = infos()[static_cast<size_t>(i)];
    Slot& s = slots_[i];
    if (!s.overridden) s.text = s.from_env ? s.env_text : in.dflt;
    s.value.store(parse(in, s.text, s.overridden ? "override" : (s.from_env ? "environment:" : "default:")));
  }

 private:
  Slot slots_[kN];
};

Registry& reg() {
  static Registry r;
  return r;
}

}  // namespace

const std::vector<Info>& all() { return infos(); }
const Info& info(Id id) { return infos()[static_cast<size_t>(id)]; }

int64_t get_int(Id id) { return reg().slot(id).value.load(std::memory_order_relaxed); }

std::string get_str(Id id) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  return r.slot(id).text;
}

bool is_set(Id id) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  return r.slot(id).overridden || r.slot(id).from_env;
}

void set(Id id, const std::string& value) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  const int64_t v = parse(info(id), value, "override:");
  Slot& s = r.slot(id);
  s.overridden = true;
  s.text = value;
  s.value.store(v);
}

void reset(Id id) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  r.slot(id).overridden = false;
  r.load(static_cast<int>(id));
}

Scoped::Scoped(Id id, const std::string& value) : id_(id) {
  {
    Registry& r = reg();
    std::lock_guard<std::mutex> lk(r.mu);
    had_override_ = r.slot(id).overridden;
    old_ = r.slot(id).text;
  }
  set(id, value);
}

Scoped::~Scoped() {
  if (had_override_)
    set(id_, old_);
  else
    reset(id_);
}

std::string describe() {
  std::string out;
  for (const Info& in : infos()) {
    const std::string v = get_str(in.id);
    Registry& r = reg();
    bool env, ovr;
    {
      std::lock_guard<std::mutex> lk(r.mu);
      env = r.slot(in.id).from_env;
      ovr = r.slot(in.id).overridden;
    }
    const char* src = ovr ? "override" : env ? "environment" : "default";
    char line[512];
    std::snprintf(line, sizeof line, "DSX_%-16s %-10s %-12s %s\n", in.name, v.empty() ? "(unset)" : v.c_str(), src,
                  in.doc);
    out += line;
  }
  return out;
}

}  // namespace dsx::sw
