// The engine's switches (DSX_* environment variables), declared once in switches.def
// with kind, default and meaning. Read from the environment on first use, then held in
// this registry: every reader asks the registry (no function-local statics), `dsx env`
// prints the table, and code can override a value (tests run both settings of a switch
// in one process: sw::Scoped). A malformed value is an error naming the variable.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx::sw {

enum class Id : int {
#define DSX_SWITCH(id, kind, dflt, doc) id,
#include "util/switches.def"
#undef DSX_SWITCH
  kCount
};

enum class Kind { Bool, Int, Str };

struct Info {
  Id id;
  const char* name;  // without the DSX_ prefix
  Kind kind;
  const char* dflt;
  const char* doc;
};

// The declared switches, in declaration order.
const std::vector<Info>& all();
const Info& info(Id id);

int64_t get_int(Id id);      // Int or Bool (0 / 1)
inline bool on(Id id) { return get_int(id) != 0; }
std::string get_str(Id id);  // any kind, as text
// Whether the value came from the environment or an override (not the default).
bool is_set(Id id);

// Overrides a value (kept until reset). Throws dsx::Error for a value the kind rejects.
void set(Id id, const std::string& value);
void reset(Id id);  // back to the environment's value or the default

// An override for the lifetime of the object (tests).
class Scoped {
 public:
  Scoped(Id id, const std::string& value);
  ~Scoped();
  Scoped(const Scoped&) = delete;
  Scoped& operator=(const Scoped&) = delete;

 private:
  Id id_;
  bool had_override_;
  std::string old_;
};

// The table `dsx env` prints: name, value, where it came from, meaning.
std::string describe();

}  // namespace dsx::sw
