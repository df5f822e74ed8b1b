#include "cli/manifest.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "util/error.h"
#include "util/mmap_file.h"
#include "util/sha256.h"
#include "util/threadpool.h"

#ifndef DSX_GIT_COMMIT
#define DSX_GIT_COMMIT "unknown"
#endif

namespace dsx::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "dsx-manifest";

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// ---- writing --------------------------------------------------------------------

bool scalar(const json& j) { return !j.is_object() && !j.is_array(); }

bool flat(const json& j) {
  return std::all_of(j.begin(), j.end(), [](const json& e) { return scalar(e); });
}

// Keys in the documented order (others after them, sorted).
std::vector<std::string> ordered_keys(const json& obj) {
  static const std::vector<std::string> kOrder = {
      "format",     "version",  "created",     "dsx",        "command",     "model",         "backend",
      "settings",   "prompt",   "output",      "result_sha256", "manifest_sha256", "name",   "dir",
      "id",         "family",   "files",       "bytes",      "sha256",      "precision",     "threads",
      "max_tokens", "sampling", "temperature", "top_p",      "top_k",       "seed",          "stop_ids",
      "stop_strings", "dspark", "ids",         "text",       "system",      "thinking",      "raw",
      "ids_file",   "finish",   "stop_id",     "stop_string", "generated_tokens"};
  std::vector<std::string> keys;
  for (const std::string& k : kOrder)
    if (obj.contains(k)) keys.push_back(k);
  for (auto it = obj.begin(); it != obj.end(); ++it)
    if (std::find(kOrder.begin(), kOrder.end(), it.key()) == kOrder.end()) keys.push_back(it.key());
  return keys;
}

// Objects one key a line, except objects and arrays of scalars (token ids, one model
// file), which stay on one line.
void print(const json& j, int indent, std::string& out) {
  if (scalar(j) || j.empty()) {
    out += dump(j);
    return;
  }
  const bool one_line = flat(j);
  const std::string pad = one_line ? "" : std::string(static_cast<size_t>(indent + 2), ' ');
  bool first = true;
  auto item = [&](const std::string* key, const json& v) {
    out += first ? (one_line ? "" : "\n") : (one_line ? ", " : ",\n");
    first = false;
    out += pad;
    if (key) out += dump(json(*key)) + ": ";
    print(v, indent + 2, out);
  };
  const std::string close = one_line ? "" : "\n" + std::string(static_cast<size_t>(indent), ' ');
  if (j.is_array()) {
    out += "[";
    for (const json& e : j) item(nullptr, e);
    out += close + "]";
  } else {
    out += "{";
    for (const std::string& k : ordered_keys(j)) item(&k, j.at(k));
    out += close + "}";
  }
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

json settings_for_result(const Manifest& m) {
  return {{"max_tokens", m.max_tokens},
          {"sampling", {{"temperature", m.temperature}, {"top_p", m.top_p}, {"top_k", m.top_k}, {"seed", m.seed}}},
          {"stop_ids", m.stop_ids},
          {"stop_strings", m.stop_strings}};
}

// ---- reading --------------------------------------------------------------------

std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

[[noreturn]] void bad_field(const std::string& path, const std::string& what) {
  fail("manifest field '", path, "' ", what);
}

const json& field(const json& obj, const std::string& path, const char* key) {
  if (!obj.is_object()) bad_field(path, "must be an object");
  auto it = obj.find(key);
  if (it == obj.end()) bad_field(join(path, key), "is missing");
  return *it;
}

const json& object_field(const json& obj, const std::string& path, const char* key) {
  const json& v = field(obj, path, key);
  if (!v.is_object()) bad_field(join(path, key), cat("must be an object, not ", v.type_name()));
  return v;
}

std::string string_field(const json& obj, const std::string& path, const char* key) {
  const json& v = field(obj, path, key);
  if (!v.is_string()) bad_field(join(path, key), cat("must be a string, not ", v.type_name()));
  return v.get<std::string>();
}

std::optional<std::string> string_or_null(const json& obj, const std::string& path, const char* key) {
  const json& v = field(obj, path, key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_string()) bad_field(join(path, key), cat("must be a string or null, not ", v.type_name()));
  return v.get<std::string>();
}

bool bool_field(const json& obj, const std::string& path, const char* key) {
  const json& v = field(obj, path, key);
  if (!v.is_boolean()) bad_field(join(path, key), cat("must be true or false, not ", v.type_name()));
  return v.get<bool>();
}

int64_t int_of(const json& v, const std::string& path, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) bad_field(path, cat("must be an integer, not ", v.is_number() ? "a fraction" : v.type_name()));
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) bad_field(path, "is out of range");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) bad_field(path, cat("is ", x, ", outside [", lo, ", ", hi, "]"));
  return x;
}

int64_t int_field(const json& obj, const std::string& path, const char* key, int64_t lo, int64_t hi) {
  return int_of(field(obj, path, key), join(path, key), lo, hi);
}

double number_field(const json& obj, const std::string& path, const char* key) {
  const json& v = field(obj, path, key);
  if (!v.is_number()) bad_field(join(path, key), cat("must be a number, not ", v.type_name()));
  return v.get<double>();
}

std::vector<int32_t> ids_field(const json& obj, const std::string& path, const char* key, int32_t lo) {
  const json& v = field(obj, path, key);
  const std::string p = join(path, key);
  if (!v.is_array()) bad_field(p, cat("must be an array of token ids, not ", v.type_name()));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) ids.push_back(static_cast<int32_t>(int_of(v[i], cat(p, "[", i, "]"), lo, INT32_MAX)));
  return ids;
}

std::string hex_field(const json& obj, const std::string& path, const char* key) {
  std::string s = string_field(obj, path, key);
  if (s.size() != 64 || !std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }))
    bad_field(join(path, key), "must be a SHA-256 in lower-case hex (64 characters)");
  return s;
}

}  // namespace

// ---- the model -------------------------------------------------------------------

json manifest_to_json(const Manifest& m) {
  json files = json::array();
  for (const ManifestFile& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  json settings = settings_for_result(m);
  settings["dspark"] = m.dspark;
  json prompt = {{"ids", m.prompt_ids}};
  if (m.command == "run") {
    prompt["text"] = m.prompt_text ? json(*m.prompt_text) : json(nullptr);
    prompt["system"] = m.system ? json(*m.system) : json(nullptr);
    prompt["thinking"] = m.thinking;
    prompt["raw"] = m.raw;
  } else {
    prompt["ids_file"] = m.ids_file;
  }
  json j = {
      {"format", kFormat},
      {"version", m.version},
      {"created", m.created},
      {"dsx", {{"commit", m.dsx_commit}}},
      {"command", m.command},
      {"model", {{"dir", m.model_dir}, {"id", m.model_id}, {"family", m.family}, {"files", files}}},
      {"backend", {{"name", m.backend}, {"precision", m.precision}, {"threads", m.threads}}},
      {"settings", settings},
      {"prompt", prompt},
      {"output",
       {{"ids", m.output_ids},
        {"text", m.output_text ? json(*m.output_text) : json(nullptr)},
        {"finish", m.finish},
        {"stop_id", m.stop_id},
        {"stop_string", m.stop_string},
        {"generated_tokens", m.generated_tokens}}},
      {"result_sha256", m.result_sha256},
      {"manifest_sha256", m.manifest_sha256},
  };
  return j;
}

Manifest manifest_from_json(const json& j) {
  if (!j.is_object()) fail("not a dsx manifest: the file holds a JSON ", j.type_name(), ", not an object");
  if (!j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != kFormat)
    fail("not a dsx manifest (\"format\" is not \"", kFormat, "\")");
  Manifest m;
  m.version = static_cast<int>(int_field(j, "", "version", 0, INT32_MAX));
  if (m.version != kManifestVersion)
    fail("manifest format version ", m.version, " is not supported (this dsx reads version ", kManifestVersion, ")");
  m.created = string_field(j, "", "created");
  m.dsx_commit = string_field(object_field(j, "", "dsx"), "dsx", "commit");
  m.command = string_field(j, "", "command");
  if (m.command != "run" && m.command != "generate") bad_field("command", cat("is '", m.command, "', not run or generate"));

  const json& model = object_field(j, "", "model");
  m.model_dir = string_field(model, "model", "dir");
  m.model_id = string_field(model, "model", "id");
  m.family = string_field(model, "model", "family");
  const json& files = field(model, "model", "files");
  if (!files.is_array() || files.empty()) bad_field("model.files", "must be a non-empty array");
  std::set<std::string> names;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string p = cat("model.files[", i, "]");
    ManifestFile f;
    f.name = string_field(files[i], p, "name");
    if (f.name.empty() || f.name[0] == '.' || f.name.find('/') != std::string::npos || f.name.find('\\') != std::string::npos)
      bad_field(p + ".name", cat("'", f.name, "' is not a file name of the model directory"));
    if (!names.insert(f.name).second) bad_field(p + ".name", cat("'", f.name, "' is listed twice"));
    f.bytes = int_field(files[i], p, "bytes", 0, INT64_MAX);
    f.sha256 = hex_field(files[i], p, "sha256");
    m.files.push_back(f);
  }

  const json& backend = object_field(j, "", "backend");
  m.backend = string_field(backend, "backend", "name");
  m.precision = string_field(backend, "backend", "precision");
  m.threads = static_cast<int>(int_field(backend, "backend", "threads", 0, INT32_MAX));

  const json& s = object_field(j, "", "settings");
  m.max_tokens = int_field(s, "settings", "max_tokens", 0, INT64_MAX);
  const json& sa = object_field(s, "settings", "sampling");
  m.temperature = number_field(sa, "settings.sampling", "temperature");
  m.top_p = number_field(sa, "settings.sampling", "top_p");
  m.top_k = static_cast<int>(int_field(sa, "settings.sampling", "top_k", 0, INT32_MAX));
  {
    const json& v = field(sa, "settings.sampling", "seed");
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      bad_field("settings.sampling.seed", "must be a non-negative integer");
    m.seed = v.get<uint64_t>();
  }
  m.stop_ids = ids_field(s, "settings", "stop_ids", 0);
  const json& ss = field(s, "settings", "stop_strings");
  if (!ss.is_array()) bad_field("settings.stop_strings", cat("must be an array of strings, not ", ss.type_name()));
  for (size_t i = 0; i < ss.size(); ++i) {
    if (!ss[i].is_string() || ss[i].get<std::string>().empty())
      bad_field(cat("settings.stop_strings[", i, "]"), "must be a non-empty string");
    m.stop_strings.push_back(ss[i].get<std::string>());
  }
  m.dspark = string_field(s, "settings", "dspark");

  const json& p = object_field(j, "", "prompt");
  m.prompt_ids = ids_field(p, "prompt", "ids", 0);
  if (m.prompt_ids.empty()) bad_field("prompt.ids", "is empty");
  if (m.command == "run") {
    m.prompt_text = string_or_null(p, "prompt", "text");
    m.system = string_or_null(p, "prompt", "system");
    m.thinking = bool_field(p, "prompt", "thinking");
    m.raw = bool_field(p, "prompt", "raw");
  } else {
    m.ids_file = string_field(p, "prompt", "ids_file");
  }

  const json& o = object_field(j, "", "output");
  m.output_ids = ids_field(o, "output", "ids", 0);
  m.output_text = string_or_null(o, "output", "text");
  m.finish = string_field(o, "output", "finish");
  if (m.finish != "stop" && m.finish != "length" && m.finish != "cancelled")
    bad_field("output.finish", cat("is '", m.finish, "', not stop, length or cancelled"));
  m.stop_id = static_cast<int32_t>(int_field(o, "output", "stop_id", -1, INT32_MAX));
  m.stop_string = string_field(o, "output", "stop_string");
  m.generated_tokens = int_field(o, "output", "generated_tokens", 0, INT64_MAX);

  m.result_sha256 = hex_field(j, "", "result_sha256");
  m.manifest_sha256 = hex_field(j, "", "manifest_sha256");
  return m;
}

std::string manifest_result_hash(const Manifest& m) {
  const json r = {{"prompt_ids", m.prompt_ids}, {"settings", settings_for_result(m)}, {"output_ids", m.output_ids}};
  return sha256_hex("dsx-result-v1\n" + dump(r));
}

std::string manifest_self_hash(const json& j) {
  json c = j;
  if (c.is_object()) c.erase("manifest_sha256");
  return sha256_hex("dsx-manifest-v1\n" + dump(c));
}

std::string seal_manifest(Manifest& m) {
  m.result_sha256 = manifest_result_hash(m);
  m.manifest_sha256.clear();
  json j = manifest_to_json(m);
  m.manifest_sha256 = manifest_self_hash(j);
  j["manifest_sha256"] = m.manifest_sha256;
  std::string out;
  print(j, 0, out);
  return out + "\n";
}

ManifestFileData read_manifest(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail(path, ": no such manifest file");
  std::string text;
  try {
    text = read_text_file(path);
  } catch (const Error& e) {
    fail(path, ": cannot read the manifest: ", e.what());
  }
  ManifestFileData d;
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) fail(path, ": the manifest is empty");
  // A manifest nests 4 levels; far deeper nesting is refused before parsing (a hostile
  // file must not exhaust the stack of the recursive serialization).
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > 64) fail(path, ": not a dsx manifest (JSON nested deeper than 64 levels)");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    d.json = json::parse(text);
  } catch (const json::exception& e) {
    // nlohmann's message names the byte offset ("parse error at line 3, column 7: ...")
    std::string what = e.what();
    if (auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
    fail(path, ": not valid JSON (a truncated or corrupt manifest?): ", what);
  }
  try {
    d.manifest = manifest_from_json(d.json);
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
  return d;
}

// ---- model files -------------------------------------------------------------------

std::vector<std::string> model_file_names(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir, ": not a model directory");
  std::vector<std::string> names;
  for (const char* n : {"config.json", "tokenizer.json"})
    if (file_exists(dir + "/" + n)) names.push_back(n);
  const std::string index = "model.safetensors.index.json";
  if (file_exists(dir + "/" + index)) {
    json j;
    try {
      j = json::parse(read_text_file(dir + "/" + index));
    } catch (const json::exception& e) {
      fail(dir, "/", index, ": not valid JSON: ", e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(dir, "/", index, ": lacks a weight_map object");
    std::set<std::string> shards;
    for (const auto& v : j["weight_map"]) {
      if (!v.is_string()) fail(dir, "/", index, ": a weight_map entry is not a file name");
      shards.insert(v.get<std::string>());
    }
    names.push_back(index);
    names.insert(names.end(), shards.begin(), shards.end());
  } else if (file_exists(dir + "/model.safetensors")) {
    names.push_back("model.safetensors");
  } else {
    fail(dir, ": no model.safetensors or model.safetensors.index.json");
  }
  return names;
}

std::vector<FileHash> hash_model_files(const std::string& dir, const std::vector<std::string>& names) {
  std::vector<FileHash> out(names.size());
  int64_t total = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    out[i].name = names[i];
    std::error_code ec;
    const auto sz = fs::file_size(dir + "/" + names[i], ec);
    if (!ec) total += static_cast<int64_t>(sz);
  }
  const bool show = total >= (int64_t{256} << 20);
  if (show) std::fflush(stdout);  // (the lines before stay before)
  const bool tty = isatty(2) != 0;
  std::atomic<int64_t> hashed{0};
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < names.size();) {
      FileHash& f = out[i];
      const std::string path = dir + "/" + f.name;
      int64_t last = 0;
      try {
        std::error_code ec;
        if (!fs::is_regular_file(path, ec)) fail("no such file");
        f.bytes = static_cast<int64_t>(fs::file_size(path));
        f.sha256 = sha256_file_hex(path, [&](int64_t done) {
          hashed += done - last;
          last = done;
        });
      } catch (const std::exception& e) {
        f.error = e.what();
        f.bytes = -1;
      }
    }
    std::lock_guard<std::mutex> l(mu);
    ++finished;
    cv.notify_all();
  };
  const size_t n_threads =
      std::max<size_t>(1, std::min<size_t>({names.size(), static_cast<size_t>(std::max(1, num_threads())), 8}));
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  constexpr double GiB = 1024.0 * 1024.0 * 1024.0;
  if (show && !tty)
    std::fprintf(stderr, "manifest: hashing %zu model files (%.2f GiB) in %s\n", names.size(), total / GiB, dir.c_str());
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n_threads; ++t) threads.emplace_back(work);
  {
    std::unique_lock<std::mutex> l(mu);
    while (finished < n_threads) {
      cv.wait_for(l, std::chrono::milliseconds(500));
      if (show && tty)
        std::fprintf(stderr, "\rmanifest: hashing model files: %.2f / %.2f GiB (%.0f%%)   ", hashed.load() / GiB,
                     total / GiB, total > 0 ? 100.0 * hashed.load() / total : 100.0);
    }
  }
  for (auto& t : threads) t.join();
  if (show)
    std::fprintf(stderr, "%smanifest: hashed %.2f GiB in %.1f s\n", tty ? "\r" : "", total / GiB, elapsed());
  return out;
}

void write_manifest(const std::string& path, const ManifestRun& run) {
  if (!run.engine) fail("write_manifest: no engine");
  const Engine& eng = *run.engine;
  Manifest m;
  m.created = utc_now();
  m.dsx_commit = DSX_GIT_COMMIT;
  m.command = run.command;
  std::error_code ec;
  fs::path dir = fs::canonical(run.model_dir, ec);
  m.model_dir = ec ? fs::absolute(run.model_dir).lexically_normal().string() : dir.string();
  m.model_id = eng.state_identity().model_id;
  m.family = eng.state_identity().family;
  for (const FileHash& f : hash_model_files(run.model_dir, model_file_names(run.model_dir))) {
    if (!f.error.empty()) fail("--manifest: cannot hash ", run.model_dir, "/", f.name, ": ", f.error);
    m.files.push_back({f.name, f.bytes, f.sha256});
  }
  m.backend = eng.backend_name();
  m.precision = m.backend == "cpu" ? "fp32" : eng.options().precision;  // the CPU engine computes in f32
  m.threads = num_threads();
  const GenerateOptions& o = run.options;
  m.max_tokens = o.max_tokens;
  m.temperature = o.sampling.temperature;
  m.top_p = o.sampling.top_p;
  m.top_k = o.sampling.top_k;
  m.seed = o.sampling.seed;
  for (int32_t id : o.stop_ids) m.stop_ids.push_back(id == GenerateOptions::kEos ? eng.config().eos_id : id);
  m.stop_strings = o.stop_strings;
  m.dspark = run.dspark;
  m.prompt_ids = run.prompt_ids;
  m.prompt_text = run.prompt_text;
  m.system = run.system;
  m.thinking = run.thinking;
  m.raw = run.raw;
  m.ids_file = run.ids_file;
  const GenerateResult& r = run.result;
  m.output_ids = r.ids;
  if (run.command == "run") m.output_text = r.text;
  m.finish = finish_reason_name(r.finish);
  m.stop_id = r.stop_id;
  m.stop_string = r.stop_string;
  m.generated_tokens = r.generated_tokens;
  const std::string text = seal_manifest(m);
  try {
    write_file_atomic(path, text.data(), text.size());
  } catch (const Error& e) {
    fail("--manifest: cannot write ", path, ": ", e.what());
  }
}

}  // namespace dsx::cli
