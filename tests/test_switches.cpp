// The switch registry (src/util/switches.{def,h,cpp}) and `dsx env`: the table matches
// the declarations, values are the declared defaults unless the environment or an
// override set them, sw::Scoped overrides and restores, malformed values are errors
// naming the switch, Bool parsing, describe() lists every switch once.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <vector>

#include "util/error.h"
#include "util/switches.h"

using namespace dsx;

namespace {

// The declarations, read here independently of the registry's own table.
struct Declared {
  sw::Id id;
  const char* name;
  const char* kind;
  const char* dflt;
  const char* doc;
};
const Declared kDeclared[] = {
#define DSX_SWITCH(id, kind, dflt, doc) {sw::Id::id, #id, #kind, dflt, doc},
#include "util/switches.def"
#undef DSX_SWITCH
};
constexpr size_t kDeclaredN = sizeof kDeclared / sizeof kDeclared[0];

const char* kind_name(sw::Kind k) { return k == sw::Kind::Bool ? "Bool" : k == sw::Kind::Int ? "Int" : "Str"; }

// The message of the dsx::Error that f throws ("" and a test failure if none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no dsx::Error";
  return "";
}

std::vector<std::string> split_ws(const std::string& line) {
  std::istringstream is(line);
  std::vector<std::string> t;
  for (std::string w; is >> w;) t.push_back(w);
  return t;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string l; std::getline(is, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}

// The lines of a describe() table whose first field is DSX_<name>.
std::vector<std::vector<std::string>> rows_named(const std::string& table, const std::string& name) {
  std::vector<std::vector<std::string>> r;
  for (const std::string& l : lines_of(table)) {
    std::vector<std::string> t = split_ws(l);
    if (!t.empty() && t[0] == "DSX_" + name) r.push_back(t);
  }
  return r;
}

}  // namespace

TEST(Switches, TableMatchesDeclarations) {
  const std::vector<sw::Info>& all = sw::all();
  ASSERT_EQ(all.size(), kDeclaredN);
  ASSERT_EQ(static_cast<size_t>(sw::Id::kCount), kDeclaredN);
  std::set<std::string> names;
  for (size_t i = 0; i < kDeclaredN; ++i) {
    const Declared& d = kDeclared[i];
    SCOPED_TRACE(d.name);
    EXPECT_EQ(all[i].id, d.id);
    EXPECT_STREQ(all[i].name, d.name);
    EXPECT_STREQ(sw::info(d.id).name, d.name);
    EXPECT_STREQ(kind_name(sw::info(d.id).kind), d.kind);
    EXPECT_STREQ(sw::info(d.id).dflt, d.dflt);
    EXPECT_STREQ(sw::info(d.id).doc, d.doc);
    EXPECT_NE(std::string(d.doc), "");
    EXPECT_TRUE(names.insert(d.name).second) << "declared twice";
    if (std::string(d.kind) == "Bool") EXPECT_TRUE(std::string(d.dflt) == "0" || std::string(d.dflt) == "1");
  }
}

TEST(Switches, DefaultsAreTheDeclaredDefaults) {
  size_t checked = 0;
  for (const Declared& d : kDeclared) {
    SCOPED_TRACE(d.name);
    if (sw::is_set(d.id)) {  // (set in this process's environment)
      std::printf("[          ] DSX_%s is set in the environment: its default is not checked\n", d.name);
      continue;
    }
    ++checked;
    EXPECT_EQ(sw::get_str(d.id), d.dflt);
    const std::string kind = d.kind;
    if (kind == "Int") EXPECT_EQ(sw::get_int(d.id), std::stoll(d.dflt));
    if (kind == "Bool") EXPECT_EQ(sw::on(d.id), std::string(d.dflt) == "1");
    if (kind == "Str") EXPECT_EQ(sw::get_int(d.id), 0);
  }
  EXPECT_GT(checked, kDeclaredN / 2);
}

TEST(Switches, ScopedOverridesAndRestores) {
  const bool pdl = sw::on(sw::Id::PDL), pdl_set = sw::is_set(sw::Id::PDL);
  const int64_t chunk = sw::get_int(sw::Id::PREFILL_CHUNK);
  const std::string trace = sw::get_str(sw::Id::TRACE);
  {
    sw::Scoped a(sw::Id::PDL, pdl ? "0" : "1");
    sw::Scoped b(sw::Id::PREFILL_CHUNK, "123");
    sw::Scoped c(sw::Id::TRACE, "/tmp/some trace file");
    EXPECT_EQ(sw::on(sw::Id::PDL), !pdl);
    EXPECT_TRUE(sw::is_set(sw::Id::PDL));
    EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), 123);
    EXPECT_EQ(sw::get_str(sw::Id::PREFILL_CHUNK), "123");
    EXPECT_EQ(sw::get_str(sw::Id::TRACE), "/tmp/some trace file");
    {
      sw::Scoped inner(sw::Id::PREFILL_CHUNK, "-7");
      EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), -7);
    }
    EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), 123);  // the outer override again
  }
  EXPECT_EQ(sw::on(sw::Id::PDL), pdl);
  EXPECT_EQ(sw::is_set(sw::Id::PDL), pdl_set);
  EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), chunk);
  EXPECT_EQ(sw::get_str(sw::Id::TRACE), trace);

  // a Scoped over a sw::set override gives that override back, reset the environment's
  // value or the default
  sw::set(sw::Id::PREFILL_CHUNK, "77");
  {
    sw::Scoped s(sw::Id::PREFILL_CHUNK, "88");
    EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), 88);
  }
  EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), 77);
  EXPECT_TRUE(sw::is_set(sw::Id::PREFILL_CHUNK));
  sw::reset(sw::Id::PREFILL_CHUNK);
  EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), chunk);
  EXPECT_EQ(sw::is_set(sw::Id::PREFILL_CHUNK), getenv("DSX_PREFILL_CHUNK") && *getenv("DSX_PREFILL_CHUNK"));
}

TEST(Switches, MalformedValueThrowsNamingTheSwitch) {
  const int64_t chunk = sw::get_int(sw::Id::PREFILL_CHUNK);
  const bool pdl = sw::on(sw::Id::PDL);
  for (const char* bad : {"abc", "12x", "", "1.5", "0x10", " "}) {
    SCOPED_TRACE(std::string("'") + bad + "'");
    const std::string m = error_of([&] { sw::set(sw::Id::PREFILL_CHUNK, bad); });
    EXPECT_NE(m.find("DSX_PREFILL_CHUNK"), std::string::npos) << m;
    EXPECT_NE(m.find(std::string("'") + bad + "'"), std::string::npos) << m;
    EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), chunk);  // unchanged
  }
  for (const char* bad : {"2", "-1", "maybe", "", "On1"}) {
    SCOPED_TRACE(std::string("'") + bad + "'");
    const std::string m = error_of([&] { sw::set(sw::Id::PDL, bad); });
    EXPECT_NE(m.find("DSX_PDL"), std::string::npos) << m;
    EXPECT_EQ(sw::on(sw::Id::PDL), pdl);
  }
  // Scoped with a malformed value: the error, and nothing to restore
  const std::string m = error_of([&] { sw::Scoped s(sw::Id::PREFILL_CHUNK, "lots"); });
  EXPECT_NE(m.find("DSX_PREFILL_CHUNK"), std::string::npos) << m;
  EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), chunk);
  // a Str switch takes any text
  sw::Scoped s(sw::Id::TRACE, "12x");
  EXPECT_EQ(sw::get_str(sw::Id::TRACE), "12x");
}

TEST(Switches, BoolParsing) {
  for (const char* v : {"1", "on", "true", "yes"}) {
    sw::Scoped s(sw::Id::PDL, v);
    EXPECT_TRUE(sw::on(sw::Id::PDL)) << v;
    EXPECT_EQ(sw::get_int(sw::Id::PDL), 1) << v;
    EXPECT_EQ(sw::get_str(sw::Id::PDL), v);
  }
  for (const char* v : {"0", "off", "false", "no"}) {
    sw::Scoped s(sw::Id::PDL, v);
    EXPECT_FALSE(sw::on(sw::Id::PDL)) << v;
    EXPECT_EQ(sw::get_int(sw::Id::PDL), 0) << v;
  }
}

TEST(Switches, IntParsing) {
  for (const auto& [text, value] : std::vector<std::pair<std::string, int64_t>>{
           {"0", 0}, {"-1", -1}, {"4096", 4096}, {"+12", 12}, {"9000000000", 9000000000LL}}) {
    sw::Scoped s(sw::Id::PREFILL_CHUNK, text);
    EXPECT_EQ(sw::get_int(sw::Id::PREFILL_CHUNK), value) << text;
  }
}

TEST(Switches, DescribeListsEverySwitchOnce) {
  sw::Scoped chunk(sw::Id::PREFILL_CHUNK, "640");
  const std::string table = sw::describe();
  EXPECT_EQ(lines_of(table).size(), kDeclaredN);
  for (const Declared& d : kDeclared) {
    SCOPED_TRACE(d.name);
    const auto rows = rows_named(table, d.name);
    ASSERT_EQ(rows.size(), 1u);
    const std::vector<std::string>& t = rows[0];
    ASSERT_GE(t.size(), 4u);
    const std::string src = t[2];
    EXPECT_TRUE(src == "default" || src == "environment" || src == "override") << src;
    EXPECT_EQ(src == "default", !sw::is_set(d.id));
    const std::string v = sw::get_str(d.id);
    EXPECT_EQ(t[1], v.empty() ? "(unset)" : v);
    const std::string line = [&] {
      for (const std::string& l : lines_of(table))
        if (split_ws(l)[0] == std::string("DSX_") + d.name) return l;
      return std::string();
    }();
    EXPECT_NE(line.find(d.doc), std::string::npos) << line;
  }
  const auto row = rows_named(table, "PREFILL_CHUNK");
  ASSERT_EQ(row.size(), 1u);
  EXPECT_EQ(row[0][1], "640");
  EXPECT_EQ(row[0][2], "override");
}

// ---- `dsx env` -------------------------------------------------------------------

namespace {

std::string dsx_binary() {
  const char* b = std::getenv("DSX_BUILD_DIR");
  return b ? std::string(b) + "/dsx" : "";
}

int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
  const int rc = pclose(p);
  *out = s;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST(CliEnv, PrintsEveryValueAndWhereItCameFrom) {
  const std::string dsx = dsx_binary();
  if (dsx.empty()) GTEST_SKIP() << "DSX_BUILD_DIR not set (ctest sets it)";
  std::string out;
  ASSERT_EQ(run("env DSX_PDL=off DSX_PREFILL_CHUNK=512 DSX_TRACE= '" + dsx + "' env", &out), 0) << out;
  EXPECT_EQ(lines_of(out).size(), kDeclaredN) << out;
  const auto pdl = rows_named(out, "PDL"), chunk = rows_named(out, "PREFILL_CHUNK"), trace = rows_named(out, "TRACE");
  ASSERT_EQ(pdl.size(), 1u);
  ASSERT_EQ(chunk.size(), 1u);
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_EQ(pdl[0][1], "off");
  EXPECT_EQ(pdl[0][2], "environment");
  EXPECT_EQ(chunk[0][1], "512");
  EXPECT_EQ(chunk[0][2], "environment");
  EXPECT_EQ(trace[0][1], "(unset)");  // an empty variable counts as unset
  EXPECT_EQ(trace[0][2], "default");
}

TEST(CliEnv, MalformedEnvironmentValueIsAnErrorNamingIt) {
  const std::string dsx = dsx_binary();
  if (dsx.empty()) GTEST_SKIP() << "DSX_BUILD_DIR not set (ctest sets it)";
  std::string out;
  EXPECT_EQ(run("env DSX_PREFILL_CHUNK=lots '" + dsx + "' env", &out), 1) << out;
  EXPECT_NE(out.find("DSX_PREFILL_CHUNK='lots'"), std::string::npos) << out;
  EXPECT_EQ(run("env DSX_PDL=2 '" + dsx + "' env", &out), 1) << out;
  EXPECT_NE(out.find("DSX_PDL='2'"), std::string::npos) << out;
}

TEST(CliEnv, HelpAndBadArguments) {
  const std::string dsx = dsx_binary();
  if (dsx.empty()) GTEST_SKIP() << "DSX_BUILD_DIR not set (ctest sets it)";
  std::string out;
  for (const char* h : {"--help", "-h"}) {
    ASSERT_EQ(run("'" + dsx + "' env " + h, &out), 0) << out;
    EXPECT_NE(out.find("usage: dsx env"), std::string::npos) << out;
    EXPECT_NE(out.find("--help"), std::string::npos) << out;
    EXPECT_EQ(rows_named(out, "PDL").size(), 0u) << "--help printed the table";
  }
  EXPECT_NE(run("'" + dsx + "' env --bogus", &out), 0) << out;
  EXPECT_NE(out.find("--bogus"), std::string::npos) << out;
  EXPECT_NE(run("'" + dsx + "' env PDL", &out), 0) << out;
  ASSERT_EQ(run("'" + dsx + "' --help", &out), 0) << out;
  EXPECT_NE(out.find("  env "), std::string::npos) << "dsx --help does not list env: " << out;
}
