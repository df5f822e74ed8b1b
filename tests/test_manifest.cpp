// Reproducibility manifests (cli/manifest.h): `dsx generate` / `dsx run --manifest FILE`
// on tiny models, `dsx manifest verify` on the result and on tampered copies (an output
// id, a model file byte, the self-hash, malformed / truncated JSON), and reruns that
// must reproduce the output ids byte for byte (greedy, CPU; DSpark on / off).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/manifest.h"
#include "model/weights.h"
#include "test_util.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"
#include "util/sha256.h"

using namespace dsx;
using namespace dsx::cli;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The dsx executable: $DSX_BUILD_DIR/dsx (ctest), else next to this test binary.
std::string dsx_binary() {
  if (const char* b = std::getenv("DSX_BUILD_DIR")) return std::string(b) + "/dsx";
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "" : (self.parent_path() / "dsx").string();
}

// Runs a shell command; *out gets its stdout and (merge_stderr) its stderr.
int run(const std::string& cmd, std::string* out = nullptr, bool merge_stderr = true) {
  const std::string full = cmd + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
  const int rc = pclose(p);
  if (out) *out = s;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
}

std::string read(const std::string& path) { return read_text_file(path); }
void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

json load(const std::string& path) { return json::parse(read(path)); }
void save(const std::string& path, const json& j) { write(path, j.dump(2)); }

// Re-seals a manifest JSON object (both hashes recomputed): a consistent forgery.
void reseal(json& j) {
  Manifest m = manifest_from_json(j);
  j = json::parse(seal_manifest(m));
}

std::string copy_dir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from))
    if (e.is_regular_file()) {
      fs::copy_file(e.path(), fs::path(to) / e.path().filename(), fs::copy_options::overwrite_existing);
      fs::permissions(fs::path(to) / e.path().filename(), fs::perms::owner_read | fs::perms::owner_write,
                      fs::perm_options::add);
    }
  return to;
}

struct Env {
  std::string bin, golden, tmp;
};

#define MANIFEST_ENV(env)                                                                          \
  Env env;                                                                                         \
  env.bin = dsx_binary();                                                                          \
  if (env.bin.empty() || !fs::exists(env.bin)) GTEST_SKIP() << "dsx binary not found";             \
  env.golden = dsx_test::golden_dir();                                                             \
  if (env.golden.empty() || !fs::exists(env.golden + "/deepseek_v41_tiny/model.safetensors"))      \
    GTEST_SKIP() << "golden data not found (../shared/golden/deepseek_v41_tiny)";                  \
  env.tmp = dsx_test::temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name())

// `dsx generate` greedy on a copy of the tiny golden model (16 ids from its prompt):
// returns the manifest's path; *dir gets the model copy, *ids the printed ids.
std::string generate_manifest(const Env& env, std::string* dir, std::string* ids = nullptr, const std::string& extra = "") {
  *dir = copy_dir(env.golden + "/deepseek_v41_tiny", env.tmp + "/model");
  const std::string mf = env.tmp + "/gen.manifest.json";
  std::string out;
  EXPECT_EQ(0, run(env.bin + " generate -m " + *dir + " --ids " + *dir + "/golden.safetensors -n 16 " +
                       extra + " --manifest " + mf,
                   &out, false))
      << out;
  if (ids) *ids = out.substr(0, out.find('\n'));
  return mf;
}

bool has_dspark_option(const Env& env) {
  std::string out;
  return run(env.bin + " generate --help", &out) == 0 && out.find("--dspark") != std::string::npos;
}

}  // namespace

// ---- the format, in process ----------------------------------------------------------

TEST(Manifest, JsonRoundTripAndHashes) {
  Manifest m;
  m.created = "2025-01-01T00:00:00Z";
  m.command = "run";
  m.model_dir = "/models/x";
  m.model_id = std::string(64, 'a');
  m.family = "deepseek_v41";
  m.files = {{"config.json", 10, std::string(64, 'b')}, {"model.safetensors", 20, std::string(64, 'c')}};
  m.max_tokens = 5;
  m.temperature = 0.7f;
  m.top_p = 0.9f;
  m.top_k = 40;
  m.seed = 18446744073709551615ull;
  m.stop_ids = {1};
  m.stop_strings = {"\n\n", "ünï"};
  m.prompt_ids = {0, 5, 7};
  m.prompt_text = "héllo \"quoted\"";
  m.output_ids = {3, 4, 5};
  m.output_text = "abc";
  m.generated_tokens = 3;
  const std::string text = seal_manifest(m);
  const json j = json::parse(text);
  const Manifest r = manifest_from_json(j);
  EXPECT_EQ(manifest_to_json(r), manifest_to_json(m));
  EXPECT_EQ(manifest_self_hash(j), m.manifest_sha256);
  EXPECT_EQ(manifest_result_hash(r), m.result_sha256);
  // formatting and key order do not matter
  EXPECT_EQ(manifest_self_hash(json::parse(j.dump(4))), m.manifest_sha256);
  // the result hash covers prompt ids, output-affecting settings and output ids only
  Manifest o = r;
  o.backend = "cuda";
  o.dspark = "static 3";
  o.created = "later";
  o.threads = 99;
  EXPECT_EQ(manifest_result_hash(o), m.result_sha256);
  o.output_ids[1] = 9;
  EXPECT_NE(manifest_result_hash(o), m.result_sha256);
  o = r;
  o.temperature = 0.8f;
  EXPECT_NE(manifest_result_hash(o), m.result_sha256);
  // arrays of ids stay on one line
  EXPECT_NE(text.find("\"ids\": [0, 5, 7]"), std::string::npos) << text;
}

TEST(Manifest, FieldErrorsNameTheField) {
  Manifest m;
  m.command = "generate";
  m.model_id = "x";
  m.files = {{"config.json", 1, std::string(64, '0')}};
  m.prompt_ids = {1};
  seal_manifest(m);
  const json good = manifest_to_json(m);
  auto error_of = [](const json& j) {
    try {
      manifest_from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  json j = good;
  j["output"].erase("ids");
  EXPECT_NE(error_of(j).find("'output.ids' is missing"), std::string::npos) << error_of(j);
  j = good;
  j["settings"]["max_tokens"] = "many";
  EXPECT_NE(error_of(j).find("'settings.max_tokens' must be an integer"), std::string::npos) << error_of(j);
  j = good;
  j["output"]["ids"][0] = -4;
  EXPECT_NE(error_of(j).find("'output.ids[0]'"), std::string::npos) << error_of(j);
  j = good;
  j["model"]["files"][0]["name"] = "../../etc/passwd";
  EXPECT_NE(error_of(j).find("not a file name of the model directory"), std::string::npos) << error_of(j);
  j = good;
  j["model"]["files"][0]["sha256"] = "xyz";
  EXPECT_NE(error_of(j).find("'model.files[0].sha256'"), std::string::npos) << error_of(j);
  j = good;
  j["version"] = 2;
  EXPECT_NE(error_of(j).find("version 2 is not supported"), std::string::npos) << error_of(j);
  j = good;
  j["format"] = "something";
  EXPECT_NE(error_of(j).find("not a dsx manifest"), std::string::npos) << error_of(j);
  EXPECT_NE(error_of(json::array()).find("not a dsx manifest"), std::string::npos);
  EXPECT_EQ(error_of(good), "(no error)");
}

TEST(Manifest, HashModelFilesReportsUnreadableFiles) {
  const std::string d = dsx_test::temp_dir("manifest_hash_files");
  write(d + "/config.json", "{}");
  write(d + "/model.safetensors", "not really");
  EXPECT_EQ(model_file_names(d), (std::vector<std::string>{"config.json", "model.safetensors"}));
  const auto h = hash_model_files(d, {"config.json", "model.safetensors", "gone.safetensors"});
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].sha256, sha256_hex("{}"));
  EXPECT_EQ(h[0].bytes, 2);
  EXPECT_EQ(h[1].sha256, sha256_file_hex(d + "/model.safetensors"));
  EXPECT_TRUE(h[1].error.empty());
  EXPECT_FALSE(h[2].error.empty());
  EXPECT_THROW(model_file_names(d + "/nope"), Error);
  // sharded: the index and its shards, each once, in name order
  write(d + "/model.safetensors.index.json",
        R"({"weight_map": {"a": "model-00002.safetensors", "b": "model-00001.safetensors", "c": "model-00002.safetensors"}})");
  write(d + "/tokenizer.json", "{}");
  EXPECT_EQ(model_file_names(d), (std::vector<std::string>{"config.json", "tokenizer.json", "model.safetensors.index.json",
                                                          "model-00001.safetensors", "model-00002.safetensors"}));
  write(d + "/model.safetensors.index.json", "{\"weight_map\": 3}");
  EXPECT_THROW(model_file_names(d), Error);
}

// ---- dsx generate / run --manifest, dsx manifest verify -----------------------------------

TEST(Manifest, GenerateWritesAManifestThatVerifies) {
  MANIFEST_ENV(env);
  std::string dir, ids, out;
  const std::string mf = generate_manifest(env, &dir, &ids);
  const json j = load(mf);
  EXPECT_EQ(j["format"], "dsx-manifest");
  EXPECT_EQ(j["version"], kManifestVersion);
  EXPECT_EQ(j["command"], "generate");
  EXPECT_EQ(j["model"]["dir"], fs::canonical(dir).string());
  EXPECT_EQ(j["model"]["id"], ModelFiles(dir).fingerprint());
  std::vector<std::string> names;
  for (const auto& f : j["model"]["files"]) names.push_back(f["name"]);
  EXPECT_EQ(names, (std::vector<std::string>{"config.json", "tokenizer.json", "model.safetensors"}));
  EXPECT_EQ(j["model"]["files"][2]["sha256"], sha256_file_hex(dir + "/model.safetensors"));
  EXPECT_EQ(j["backend"]["name"], "cpu");
  EXPECT_EQ(j["settings"]["max_tokens"], 16);
  EXPECT_EQ(j["settings"]["dspark"], "off");
  SafetensorsFile g(dir + "/golden.safetensors");
  const TensorView& in = g.get("input_ids");
  ASSERT_EQ(j["prompt"]["ids"].size(), static_cast<size_t>(in.numel()));
  for (int64_t i = 0; i < in.numel(); ++i) ASSERT_EQ(j["prompt"]["ids"][i].get<int64_t>(), in.as<int32_t>()[i]);
  std::string printed;
  for (const auto& id : j["output"]["ids"]) printed += (printed.empty() ? "" : " ") + std::to_string(id.get<int>());
  EXPECT_EQ(printed, ids);
  EXPECT_EQ(j["output"]["ids"].size(), 16u);
  EXPECT_EQ(j["result_sha256"], manifest_result_hash(manifest_from_json(j)));
  EXPECT_EQ(j["manifest_sha256"], manifest_self_hash(j));

  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf, &out)) << out;
  EXPECT_NE(out.find("model files: 3 files match"), std::string::npos) << out;
  EXPECT_NE(out.find("model identity: ok"), std::string::npos) << out;
  EXPECT_NE(out.find("verify: OK"), std::string::npos) << out;
  // the same run again: the same result hash
  const std::string mf2 = env.tmp + "/again.json";
  ASSERT_EQ(0, run(env.bin + " generate -m " + dir + " --ids " + dir + "/golden.safetensors -n 16 --manifest " + mf2, &out)) << out;
  EXPECT_EQ(load(mf2)["result_sha256"], j["result_sha256"]);
}

TEST(Manifest, GreedyRerunReproducesTheOutput) {
  MANIFEST_ENV(env);
  std::string dir, out;
  const std::string mf = generate_manifest(env, &dir);
  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf + " --rerun", &out)) << out;
  EXPECT_NE(out.find("16 output ids identical"), std::string::npos) << out;
  EXPECT_NE(out.find("verify: OK"), std::string::npos) << out;
  // with another thread count
  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf + " --rerun --threads 1", &out)) << out;
  // -m: the model elsewhere
  const std::string moved = copy_dir(dir, env.tmp + "/moved");
  fs::remove_all(dir);
  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf, &out)) << out;
  EXPECT_NE(out.find("model files not checked"), std::string::npos) << out;
  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf + " -m " + moved + " --rerun", &out)) << out;
  EXPECT_NE(out.find("verify: OK"), std::string::npos) << out;
}

TEST(Manifest, RunManifestRecordsTheChatAndReruns) {
  MANIFEST_ENV(env);
  const std::string tok = env.golden + "/tokenizer/tokenizer-v41.json";
  if (!fs::exists(tok)) GTEST_SKIP() << tok << " not found";
  const std::string dir = env.tmp + "/chat";
  std::string out, reply;
  ASSERT_EQ(0, run(env.bin + " make-tiny -o " + dir + " --tokenizer " + tok, &out)) << out;
  const std::string mf = env.tmp + "/run.json";
  ASSERT_EQ(0, run(env.bin + " run -m " + dir +
                       " -p 'Write a haiku about the sea.' --system 'Be brief.' -n 12 --stop QQQQ --manifest " + mf,
                   &reply, false))
      << reply;
  const json j = load(mf);
  EXPECT_EQ(j["command"], "run");
  EXPECT_EQ(j["prompt"]["text"], "Write a haiku about the sea.");
  EXPECT_EQ(j["prompt"]["system"], "Be brief.");
  EXPECT_EQ(j["prompt"]["thinking"], false);
  EXPECT_EQ(j["settings"]["stop_strings"], json::array({"QQQQ"}));
  EXPECT_EQ(j["output"]["text"].get<std::string>() + "\n", reply);
  EXPECT_EQ(j["output"]["ids"].size(), 12u);
  ASSERT_EQ(0, run(env.bin + " manifest verify " + mf + " --rerun", &out)) << out;
  EXPECT_NE(out.find("12 output ids identical"), std::string::npos) << out;
  // a manifest whose prompt text was changed (and re-sealed) renders other prompt ids
  json t = j;
  t["prompt"]["text"] = "Write a haiku about the moon.";
  reseal(t);
  save(env.tmp + "/moon.json", t);
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/moon.json --rerun", &out)) << out;
  EXPECT_NE(out.find("prompt ids differ at position"), std::string::npos) << out;
}

TEST(Manifest, TamperedOutputIdIsDetected) {
  MANIFEST_ENV(env);
  std::string dir, out;
  const std::string mf = generate_manifest(env, &dir);
  json j = load(mf);
  const int orig = j["output"]["ids"][5];
  j["output"]["ids"][5] = orig == 7 ? 8 : 7;
  save(env.tmp + "/edited.json", j);
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/edited.json", &out)) << out;
  EXPECT_NE(out.find("MISMATCH: manifest hash"), std::string::npos) << out;
  EXPECT_NE(out.find("MISMATCH: result hash"), std::string::npos) << out;
  EXPECT_NE(out.find("verify: MISMATCH (2 problems)"), std::string::npos) << out;
  // re-sealed: the hashes agree, the rerun names the position
  reseal(j);
  save(env.tmp + "/forged.json", j);
  EXPECT_EQ(0, run(env.bin + " manifest verify " + env.tmp + "/forged.json", &out)) << out;
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/forged.json --rerun", &out)) << out;
  EXPECT_NE(out.find("output ids differ at position 5: recorded " + std::to_string(j["output"]["ids"][5].get<int>()) +
                     ", rerun " + std::to_string(orig)),
            std::string::npos)
      << out;
  // fewer ids recorded than the rerun makes
  j["output"]["ids"][5] = orig;
  j["output"]["ids"].erase(15);
  reseal(j);
  save(env.tmp + "/short.json", j);
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/short.json --rerun", &out)) << out;
  EXPECT_NE(out.find("output ids: recorded 15 ids, rerun 16"), std::string::npos) << out;
}

TEST(Manifest, TamperedModelFilesAreNamed) {
  MANIFEST_ENV(env);
  std::string dir, out;
  const std::string mf = generate_manifest(env, &dir);
  {  // one byte of tensor data (the end of the file), not the header
    std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(-3, std::ios::end);
    f.write(&c, 1);
  }
  EXPECT_EQ(1, run(env.bin + " manifest verify " + mf, &out)) << out;
  EXPECT_NE(out.find("MISMATCH: model file model.safetensors: SHA-256 differs"), std::string::npos) << out;
  EXPECT_EQ(out.find("config.json: "), std::string::npos) << out;
  // (the identity samples the tensor bytes, the file's end among them: model/weights.cpp)
  EXPECT_NE(out.find("MISMATCH: model identity"), std::string::npos) << out;
  EXPECT_NE(out.find("verify: MISMATCH (2 problems)"), std::string::npos) << out;
  // a changed config: its file and the model identity
  write(dir + "/config.json", read(dir + "/config.json") + "\n");
  EXPECT_EQ(1, run(env.bin + " manifest verify " + mf, &out)) << out;
  EXPECT_NE(out.find("model file config.json: SHA-256 differs"), std::string::npos) << out;
  EXPECT_NE(out.find("MISMATCH: model identity"), std::string::npos) << out;
  // a missing file and a new one
  fs::remove(dir + "/tokenizer.json");
  EXPECT_EQ(1, run(env.bin + " manifest verify " + mf, &out)) << out;
  EXPECT_NE(out.find("model file tokenizer.json: missing"), std::string::npos) << out;
}

TEST(Manifest, SelfHashAndEditsAreDetected) {
  MANIFEST_ENV(env);
  std::string dir, out;
  const std::string mf = generate_manifest(env, &dir);
  json j = load(mf);
  std::string h = j["manifest_sha256"];
  h[0] = h[0] == '0' ? '1' : '0';
  j["manifest_sha256"] = h;
  save(env.tmp + "/selfhash.json", j);
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/selfhash.json", &out)) << out;
  EXPECT_NE(out.find("MISMATCH: manifest hash"), std::string::npos) << out;
  EXPECT_NE(out.find("the file was changed after it was written"), std::string::npos) << out;
  EXPECT_NE(out.find("result hash: ok"), std::string::npos) << out;
  // an informational field, edited
  j = load(mf);
  j["backend"]["threads"] = 123;
  save(env.tmp + "/threads.json", j);
  EXPECT_EQ(1, run(env.bin + " manifest verify " + env.tmp + "/threads.json", &out)) << out;
  EXPECT_NE(out.find("MISMATCH: manifest hash"), std::string::npos) << out;
  // reformatting is not an edit
  save(env.tmp + "/pretty.json", load(mf));
  EXPECT_EQ(0, run(env.bin + " manifest verify " + env.tmp + "/pretty.json", &out)) << out;
}

TEST(Manifest, MalformedFilesAreBadInput) {
  MANIFEST_ENV(env);
  std::string dir, out;
  const std::string mf = generate_manifest(env, &dir);
  const std::string text = read(mf);
  auto check = [&](const std::string& name, const std::string& content, const std::string& msg) {
    const std::string p = env.tmp + "/" + name;
    write(p, content);
    EXPECT_EQ(2, run(env.bin + " manifest verify " + p, &out)) << name << ": " << out;
    EXPECT_NE(out.find(msg), std::string::npos) << name << ": " << out;
    EXPECT_NE(out.find(p), std::string::npos) << name << " (the message names the file): " << out;
  };
  check("truncated.json", text.substr(0, text.size() / 2), "not valid JSON (a truncated or corrupt manifest?)");
  check("empty.json", "", "the manifest is empty");
  check("garbage.json", std::string("\x00\xff\x13garbage", 10), "not valid JSON");
  check("array.json", "[1, 2, 3]", "not a dsx manifest");
  check("deep.json", "{\"format\": \"dsx-manifest\", \"x\": " + std::string(100000, '[') + std::string(100000, ']') + "}",
        "nested deeper than 64 levels");
  check("other.json", "{\"hello\": 1}", "not a dsx manifest");
  json j = load(mf);
  j["version"] = 99;
  check("version.json", j.dump(), "format version 99 is not supported");
  j = load(mf);
  j["output"]["ids"] = "1 2 3";
  check("ids.json", j.dump(), "manifest field 'output.ids' must be an array of token ids");
  j = load(mf);
  j["model"].erase("files");
  check("nofiles.json", j.dump(), "manifest field 'model.files' is missing");
  j = load(mf);
  j["prompt"]["ids"][0] = 1.5;
  check("fraction.json", j.dump(), "manifest field 'prompt.ids[0]' must be an integer");
  EXPECT_EQ(2, run(env.bin + " manifest verify " + env.tmp + "/does-not-exist.json", &out)) << out;
  EXPECT_NE(out.find("no such manifest file"), std::string::npos) << out;
}

TEST(Manifest, CommandLine) {
  MANIFEST_ENV(env);
  std::string out;
  EXPECT_EQ(0, run(env.bin + " manifest --help", &out)) << out;
  EXPECT_NE(out.find("verify"), std::string::npos) << out;
  EXPECT_EQ(0, run(env.bin + " manifest verify --help", &out)) << out;
  for (const char* o : {"FILE", "-m DIR", "--rerun", "--backend cpu|cuda", "--precision", "--dspark", "exit status"})
    EXPECT_NE(out.find(o), std::string::npos) << o << "\n" << out;
  EXPECT_EQ(0, run(env.bin + " run --help", &out));
  EXPECT_NE(out.find("--manifest FILE"), std::string::npos) << out;
  EXPECT_EQ(0, run(env.bin + " generate --help", &out));
  EXPECT_NE(out.find("--manifest FILE"), std::string::npos) << out;
  EXPECT_EQ(2, run(env.bin + " manifest", &out)) << out;
  EXPECT_EQ(2, run(env.bin + " manifest check x.json", &out)) << out;
  EXPECT_NE(out.find("unknown command 'check'"), std::string::npos) << out;
  EXPECT_EQ(2, run(env.bin + " manifest verify", &out)) << out;
  EXPECT_NE(out.find("missing the manifest FILE"), std::string::npos) << out;
  EXPECT_EQ(2, run(env.bin + " manifest verify a.json b.json", &out)) << out;
  EXPECT_EQ(2, run(env.bin + " manifest verify a.json --bogus", &out)) << out;
  EXPECT_EQ(2, run(env.bin + " manifest verify a.json --backend cuda", &out)) << out;
  EXPECT_NE(out.find("--backend is for --rerun"), std::string::npos) << out;
  // an unwritable manifest path fails clearly
  std::string dir;
  dir = copy_dir(env.golden + "/deepseek_v41_tiny", env.tmp + "/model");
  EXPECT_EQ(1, run(env.bin + " generate -m " + dir + " --ids " + dir + "/golden.safetensors -n 2 --manifest " + env.tmp +
                       "/no/such/dir/m.json",
                   &out));
  EXPECT_NE(out.find("--manifest: cannot write"), std::string::npos) << out;
}

// Greedy output is the same with DSpark off, on and static K: manifests of either mode
// rerun in the other and agree on the result hash.
TEST(Manifest, RerunAcrossDSparkModes) {
  MANIFEST_ENV(env);
  if (!has_dspark_option(env)) GTEST_SKIP() << "dsx generate has no --dspark option";
  const std::string src = env.golden + "/deepseek_v41_dspark_tiny";
  if (!fs::exists(src + "/model.safetensors")) GTEST_SKIP() << src << " not found";
  const std::string ids = env.golden + "/deepseek_v41_tiny/golden.safetensors";  // (the same prompt, case.json)
  std::string out;
  const std::string off = env.tmp + "/off.json", on = env.tmp + "/on.json";
  ASSERT_EQ(0, run(env.bin + " generate -m " + src + " --ids " + ids + " -n 24 --dspark off --manifest " + off, &out)) << out;
  ASSERT_EQ(0, run(env.bin + " generate -m " + src + " --ids " + ids + " -n 24 --dspark on --manifest " + on, &out)) << out;
  EXPECT_EQ(load(off)["settings"]["dspark"], "off");
  EXPECT_EQ(load(on)["settings"]["dspark"], "on");
  EXPECT_EQ(load(off)["result_sha256"], load(on)["result_sha256"]);
  EXPECT_NE(load(off)["manifest_sha256"], load(on)["manifest_sha256"]);
  ASSERT_EQ(0, run(env.bin + " manifest verify " + off + " --rerun --dspark on", &out)) << out;
  EXPECT_NE(out.find("dspark on): 24 output ids identical"), std::string::npos) << out;
  ASSERT_EQ(0, run(env.bin + " manifest verify " + off + " --rerun --dspark static 3", &out)) << out;
  EXPECT_NE(out.find("dspark static 3): 24 output ids identical"), std::string::npos) << out;
  ASSERT_EQ(0, run(env.bin + " manifest verify " + on + " --rerun --dspark off", &out)) << out;
  EXPECT_NE(out.find("dspark off): 24 output ids identical"), std::string::npos) << out;
  ASSERT_EQ(0, run(env.bin + " manifest verify " + on + " --rerun", &out)) << out;
  EXPECT_NE(out.find("dspark on): 24 output ids identical"), std::string::npos) << out;
}
