// `dsx manifest verify FILE`: checks a reproducibility manifest (cli/manifest.h) written
// by `dsx run` / `dsx generate --manifest FILE`: its structure, its own hash and its
// result hash; the SHA-256 of every model file; with --rerun, the recorded generation is
// run again (the same command, in a child process of this executable, with the recorded
// prompt and settings; backend, precision and DSpark mode may be overridden) and its
// output ids are compared byte for byte with the recorded ones.
//
// Exit status: 0 all checks match, 1 a mismatch (each one named), 2 bad input (options,
// an unreadable / truncated / malformed manifest, a rerun that could not run).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/manifest.h"
#include "cli/registry.h"
#include "model/weights.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"

extern char** environ;

namespace dsx::cli {

namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kValueOpts = {"-m", "--backend", "--precision", "--dspark", "--threads"};
const std::vector<std::string> kFlagOpts = {"--rerun", "-h", "--help"};

void usage() {
  std::printf(
      "usage: dsx manifest verify FILE [options]\n"
      "\n"
      "Checks a reproducibility manifest written by `dsx run --manifest FILE` or\n"
      "`dsx generate --manifest FILE`: its structure and format version, its own SHA-256\n"
      "(any edit of the file is detected) and its result hash; the SHA-256 of every model\n"
      "file (in -m DIR, else in the recorded directory when it exists), naming the files\n"
      "that differ, are missing or are new. With --rerun it generates again from the\n"
      "recorded prompt ids with the recorded settings and compares the output ids byte\n"
      "for byte, naming the first position that differs.\n"
      "\n"
      "options:\n"
      "  -m DIR                 model directory (default: the recorded one)\n"
      "  --rerun                run the recorded generation again and compare its output\n"
      "  --backend cpu|cuda     for --rerun: the backend (default: the recorded one)\n"
      "  --precision fp32|bf16  for --rerun: the CUDA precision (default: the recorded one)\n"
      "  --dspark MODE          for --rerun: off | on | static K (default: the recorded mode)\n"
      "  --threads N            for --rerun: CPU threads\n"
      "  -h, --help             this text\n"
      "\n"
      "exit status: 0 when everything checked matches, 1 on a mismatch, 2 on bad input\n"
      "(options, an unreadable, truncated or malformed manifest, a rerun that cannot run).\n");
}

void top_usage() {
  std::printf(
      "usage: dsx manifest verify FILE [-m DIR] [--rerun] [--backend cpu|cuda] [--precision fp32|bf16]\n"
      "                                [--dspark off|on|static K] [--threads N]\n"
      "\n"
      "Reproducibility manifests: `dsx run` and `dsx generate` write one with --manifest FILE\n"
      "(model identity and per-file SHA-256, backend, settings, prompt ids, output ids and\n"
      "text, a result hash and the manifest's own hash).\n"
      "\n"
      "commands:\n"
      "  verify   check a manifest (dsx manifest verify --help)\n");
}

std::string short_hash(const std::string& h) { return h.size() > 16 ? h.substr(0, 16) + "..." : h; }

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+=./:,@") ==
                        std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string number_text(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// The findings, printed as they come; mismatches are counted.
struct Report {
  int mismatches = 0;
  void ok(const std::string& what) { std::printf("  %s\n", what.c_str()); }
  void note(const std::string& what) { std::printf("  note: %s\n", what.c_str()); }
  void mismatch(const std::string& what) {
    ++mismatches;
    std::printf("  MISMATCH: %s\n", what.c_str());
  }
};

// Recorded files against the directory's files now (`now`: the current listing, each
// hashed or with an error).
void compare_files(Report& rep, const std::string& dir, const std::vector<ManifestFile>& recorded,
                   const std::vector<FileHash>& now) {
  int bad = 0;
  for (const ManifestFile& f : recorded) {
    const FileHash* cur = nullptr;
    for (const FileHash& h : now)
      if (h.name == f.name) cur = &h;
    if (!cur || (!cur->error.empty() && !file_exists(dir + "/" + f.name))) {
      rep.mismatch(cat("model file ", f.name, ": missing from ", dir));
      ++bad;
    } else if (!cur->error.empty()) {
      rep.mismatch(cat("model file ", f.name, ": cannot be hashed: ", cur->error));
      ++bad;
    } else if (cur->sha256 != f.sha256) {
      rep.mismatch(cat("model file ", f.name, ": SHA-256 differs (recorded ", short_hash(f.sha256), ", now ",
                       short_hash(cur->sha256), cur->bytes != f.bytes ? cat("; ", f.bytes, " bytes then, ", cur->bytes, " now") : "",
                       ")"));
      ++bad;
    }
  }
  for (const FileHash& h : now) {
    bool listed = false;
    for (const ManifestFile& f : recorded) listed = listed || f.name == h.name;
    if (!listed) {
      rep.mismatch(cat("model file ", h.name, ": not in the manifest (the model directory has changed)"));
      ++bad;
    }
  }
  if (!bad) rep.ok(cat("model files: ", recorded.size(), " files match (", dir, ")"));
}

// First difference of two id sequences: "" when equal.
std::string id_difference(const std::vector<int32_t>& want, const std::vector<int32_t>& got, const char* what) {
  const size_t n = std::min(want.size(), got.size());
  for (size_t i = 0; i < n; ++i)
    if (want[i] != got[i])
      return cat(what, " differ at position ", i, ": recorded ", want[i], ", rerun ", got[i], " (", i,
                 " ids identical before it)");
  if (want.size() != got.size())
    return cat(what, ": recorded ", want.size(), " ids, rerun ", got.size(), " (identical for the first ", n, ")");
  return "";
}

class TempDir {
 public:
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/dsx-manifest-XXXXXX";
    if (!mkdtemp(tmpl.data())) fail("cannot create a temporary directory (", tmpl, ")");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string self_exe() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) fail("cannot find the dsx executable (/proc/self/exe) to rerun with");
  return p.string();
}

// Runs argv (stdout to stdout_path, stderr inherited); returns the exit status.
int spawn(const std::vector<std::string>& args, const std::string& stdout_path = "/dev/null") {
  std::vector<char*> av;
  for (const std::string& s : args) av.push_back(const_cast<char*>(s.c_str()));
  av.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, av[0], &fa, nullptr, av.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) fail("cannot start ", args[0], ": ", std::strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) fail("waitpid failed");
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// Reruns the recorded command; returns the rerun's manifest. Throws dsx::Error when it
// cannot run (exit status 2 of verify).
Manifest rerun(const Manifest& m, const std::string& dir, const Args& a, const TempDir& tmp, std::string* how) {
  const std::string backend = a.get_or("--backend", m.backend);
  const std::string precision = a.get_or("--precision", m.precision);
  const std::string dspark = a.get_or("--dspark", m.dspark);
  std::vector<std::string> args = {self_exe(), m.command, "-m", dir};
  if (m.command == "run") {
    if (!m.prompt_text) fail("the manifest records no prompt text to rerun `dsx run` with");
    const std::string pf = tmp.path() + "/prompt.txt";
    write_file_atomic(pf, m.prompt_text->data(), m.prompt_text->size());
    args.insert(args.end(), {"-f", pf, "--thinking", m.thinking ? "on" : "off"});
    if (m.system) args.insert(args.end(), {"--system", *m.system});
    if (m.raw) args.push_back("--raw");
    for (const std::string& s : m.stop_strings) args.insert(args.end(), {"--stop", s});
  } else {
    if (!m.stop_strings.empty()) fail("a `dsx generate` manifest with stop strings cannot be rerun");
    if (m.stop_ids.size() > 1) fail("a `dsx generate` manifest with several stop ids cannot be rerun");
    const std::string idf = tmp.path() + "/ids.safetensors";
    SafetensorsWriter w;
    w.add("input_ids", DType::I32, {static_cast<int64_t>(m.prompt_ids.size())}, m.prompt_ids);
    w.write(idf);
    args.insert(args.end(), {"--ids", idf});
    if (!m.stop_ids.empty()) args.push_back("--stop-eos");  // (compared with the rerun's below)
  }
  args.insert(args.end(), {"-n", std::to_string(m.max_tokens), "--temperature", number_text(m.temperature), "--top-p",
                           number_text(m.top_p), "--top-k", std::to_string(m.top_k), "--seed",
                           std::to_string(static_cast<int64_t>(m.seed)), "--backend", backend, "--precision", precision});
  // The DSpark mode is always passed when the command has the option (its default may
  // differ from the recorded mode); a dsx without it decodes plainly, i.e. "off".
  const std::string help = tmp.path() + "/help.txt";
  const bool has_dspark = spawn({args[0], m.command, "--help"}, help) == 0 &&
                          read_text_file(help).find("--dspark") != std::string::npos;
  if (has_dspark)
    args.insert(args.end(), {"--dspark", dspark});
  else if (dspark != "off")
    fail("this dsx ", m.command, " has no --dspark option to rerun with DSpark mode '", dspark, "'");
  if (a.has("--threads")) args.insert(args.end(), {"--threads", a.require("--threads")});
  const std::string out = tmp.path() + "/rerun.json";
  args.insert(args.end(), {"--manifest", out});
  std::string line = "dsx";
  for (size_t i = 1; i < args.size(); ++i) line += " " + shell_quote(args[i]);
  std::printf("  rerun: %s\n", line.c_str());
  std::fflush(stdout);
  const int rc = spawn(args);
  if (rc != 0) fail("the rerun failed (exit status ", rc, "; its error is above)");
  *how = cat(backend, " ", precision, ", dspark ", dspark);
  return read_manifest(out).manifest;
}

void compare_rerun(Report& rep, const Manifest& m, const Manifest& r, const std::string& how) {
  if (r.model_id != m.model_id)
    rep.mismatch(cat("model identity differs: recorded ", short_hash(m.model_id), ", rerun ", short_hash(r.model_id)));
  auto settings = [](const Manifest& x) {
    return nlohmann::json{{"max_tokens", x.max_tokens}, {"temperature", x.temperature}, {"top_p", x.top_p},
                          {"top_k", x.top_k},           {"seed", x.seed},               {"stop_ids", x.stop_ids},
                          {"stop_strings", x.stop_strings}};
  };
  if (settings(m) != settings(r))
    rep.mismatch(cat("the rerun's settings differ: recorded ", settings(m).dump(), ", rerun ", settings(r).dump()));
  if (std::string d = id_difference(m.prompt_ids, r.prompt_ids, "prompt ids"); !d.empty())
    rep.mismatch(d + " (the prompt renders or tokenizes differently now)");
  if (std::string d = id_difference(m.output_ids, r.output_ids, "output ids"); !d.empty()) {
    rep.mismatch(d + cat(" [", how, "]"));
  } else {
    rep.ok(cat("rerun (", how, "): ", r.output_ids.size(), " output ids identical, result ", short_hash(r.result_sha256)));
    if (m.output_text && r.output_text && *m.output_text != *r.output_text)
      rep.mismatch("output text differs although the ids are identical (the tokenizer changed?)");
  }
  if (r.finish != m.finish) rep.mismatch(cat("finish reason: recorded ", m.finish, ", rerun ", r.finish));
  if (r.result_sha256 != m.result_sha256 && rep.mismatches == 0)
    rep.mismatch(cat("result hash: recorded ", short_hash(m.result_sha256), ", rerun ", short_hash(r.result_sha256)));
}

int verify(int argc, char** argv) {
  // "--dspark static K" is one value in two words
  std::vector<std::string> words(argv, argv + argc);
  for (size_t i = 0; i + 2 < words.size(); ++i)
    if (words[i] == "--dspark" && words[i + 1] == "static" && !words[i + 2].empty() &&
        std::isdigit(static_cast<unsigned char>(words[i + 2][0]))) {
      words[i + 1] += " " + words[i + 2];
      words.erase(words.begin() + static_cast<std::ptrdiff_t>(i) + 2);
    }
  std::vector<char*> av;
  for (std::string& w : words) av.push_back(w.data());
  Args a(static_cast<int>(av.size()), av.data(), kValueOpts, kFlagOpts);
  if (a.has("-h") || a.has("--help")) {
    usage();
    return 0;
  }
  if (a.positional().size() != 1)
    fail(a.positional().empty() ? "missing the manifest FILE" : cat("unexpected argument '", a.positional()[1], "'"));
  for (const char* o : {"--backend", "--precision", "--dspark", "--threads"})
    if (a.has(o) && !a.has("--rerun")) fail("option ", o, " is for --rerun");
  const std::string path = a.positional()[0];
  const ManifestFileData d = read_manifest(path);
  const Manifest& m = d.manifest;
  std::printf("manifest %s: dsx %s, %s %s, written %s by dsx %s\n", path.c_str(), m.command.c_str(), m.backend.c_str(),
              m.precision.c_str(), m.created.c_str(), m.dsx_commit.c_str());
  Report rep;
  rep.ok(cat("format: version ", m.version, ", structure ok"));
  const std::string self = manifest_self_hash(d.json);
  if (self != m.manifest_sha256)
    rep.mismatch(cat("manifest hash: recorded ", short_hash(m.manifest_sha256), ", computed ", short_hash(self),
                     " (the file was changed after it was written)"));
  else
    rep.ok(cat("manifest hash: ok (", short_hash(self), ")"));
  const std::string result = manifest_result_hash(m);
  if (result != m.result_sha256)
    rep.mismatch(cat("result hash: recorded ", short_hash(m.result_sha256), ", computed ", short_hash(result),
                     " (the prompt ids, settings or output ids were changed)"));
  else
    rep.ok(cat("result hash: ok (", short_hash(result), ")"));

  const std::string dir = a.get_or("-m", m.model_dir);
  std::error_code ec;
  const bool have_dir = fs::is_directory(dir, ec);
  if (a.has("--rerun")) {
    if (!have_dir) fail(dir, ": no such model directory to rerun with (give -m DIR)");
    TempDir tmp;
    std::string how;
    const Manifest r = rerun(m, dir, a, tmp, &how);
    // the rerun hashed the model files as it found them
    std::vector<FileHash> now;
    for (const ManifestFile& f : r.files) now.push_back({f.name, f.bytes, f.sha256, ""});
    compare_files(rep, dir, m.files, now);
    compare_rerun(rep, m, r, how);
  } else if (!have_dir) {
    rep.note(cat("model files not checked: ", dir, " is not a directory here (give -m DIR)"));
  } else {
    std::vector<FileHash> now;
    try {
      now = hash_model_files(dir, model_file_names(dir));
    } catch (const Error& e) {
      rep.mismatch(cat("model files: ", e.what()));
    }
    // recorded files the listing no longer names (e.g. a deleted index) are hashed too
    for (const ManifestFile& f : m.files) {
      bool listed = false;
      for (const FileHash& h : now) listed = listed || h.name == f.name;
      if (!listed && file_exists(dir + "/" + f.name)) {
        auto extra = hash_model_files(dir, {f.name});
        now.push_back(extra[0]);
      }
    }
    if (!now.empty() || m.files.empty()) compare_files(rep, dir, m.files, now);
    try {
      const std::string id = ModelFiles(dir).fingerprint();
      if (id != m.model_id)
        rep.mismatch(cat("model identity: recorded ", short_hash(m.model_id), ", now ", short_hash(id)));
      else
        rep.ok(cat("model identity: ok (", short_hash(id), ")"));
    } catch (const Error& e) {
      rep.mismatch(cat("model identity cannot be computed: ", e.what()));
    }
  }
  if (rep.mismatches) {
    std::printf("verify: MISMATCH (%d problem%s)\n", rep.mismatches, rep.mismatches > 1 ? "s" : "");
    return 1;
  }
  std::printf("verify: OK\n");
  return 0;
}

int cmd_manifest(int argc, char** argv) {
  std::fflush(stdout);
  try {
    if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
      top_usage();
      return argc < 2 ? 2 : 0;
    }
    const std::string sub = argv[1];
    if (sub == "verify") {
      const int rc = verify(argc - 1, argv + 1);
      std::fflush(stdout);
      return rc;
    }
    std::fprintf(stderr, "dsx manifest: unknown command '%s' (dsx manifest --help)\n", sub.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dsx manifest: error: %s\n", e.what());
    return 2;
  }
}

}  // namespace

DSX_COMMAND("manifest", "check a reproducibility manifest of dsx run / generate (verify)", cmd_manifest);

}  // namespace dsx::cli
