// Reproducibility manifests: `dsx run` / `dsx generate` with `--manifest FILE` record
// what a generation ran on, with what, and what it produced, so that a greedy run can be
// reproduced byte for byte across runs, backends (fp32) and DSpark on / off;
// `dsx manifest verify FILE` (cli/cmd_manifest.cpp) checks one.
//
// The file is one JSON object (UTF-8; whitespace and key order do not matter):
//
//   {
//     "format": "dsx-manifest",
//     "version": 1,                       // kManifestVersion; other versions are refused
//     "created": "2025-01-31T12:00:00Z",  // UTC, informational
//     "dsx": {"commit": "<git describe of the tree when the build was configured, or \"unknown\">"},
//     "command": "run" | "generate",
//     "model": {
//       "dir": "/abs/model/dir",
//       "id": "<ModelFiles::fingerprint: SHA-256 over config.json and every shard's header>",
//       "family": "deepseek_v41" | "deepseek_v4",
//       "files": [{"name": "config.json", "bytes": 2803, "sha256": "<hex>"}, ...]
//                // every file the engine reads: config.json, tokenizer.json,
//                // model.safetensors.index.json (if sharded) and every safetensors shard
//     },
//     "backend": {"name": "cpu" | "cuda", "precision": "fp32" | "bf16", "threads": 16},
//     "settings": {
//       "max_tokens": 64,
//       "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
//       "stop_ids": [1],                  // resolved (GenerateOptions::kEos -> eos_id)
//       "stop_strings": [],
//       "dspark": "off" | "on" | "static K"
//     },
//     "prompt": {
//       "ids": [0, 128803, ...],          // the token ids generation started from
//       // run:      "text": "<the user message>", "system": "<text>" | null,
//       //           "thinking": false, "raw": false
//       // generate: "ids_file": "<the --ids file as given>"
//     },
//     "output": {"ids": [...], "text": "<reply>" | null (generate prints ids only),
//                "finish": "stop" | "length" | "cancelled", "stop_id": -1, "stop_string": "",
//                "generated_tokens": 24},
//     "result_sha256": "<hex>",
//     "manifest_sha256": "<hex>"
//   }
//
// Hashes (SHA-256, lower-case hex):
//   result_sha256   = SHA256("dsx-result-v1\n" + C(R)), R = {"prompt_ids": prompt.ids,
//                     "settings": {max_tokens, sampling, stop_ids, stop_strings},
//                     "output_ids": output.ids}: what the output depends on besides the
//                     model, and the output, so equal across backends, runs and DSpark
//                     modes exactly when the outputs are equal.
//   manifest_sha256 = SHA256("dsx-manifest-v1\n" + C(M)), M = the whole object without
//                     "manifest_sha256" (so any later edit of any field is detected).
// C(x) is the canonical serialization: nlohmann::json::dump() of x (compact, keys in
// byte order, UTF-8 unescaped, numbers in the shortest form that reads back the same).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "runtime/generate.h"

namespace dsx::cli {

constexpr int kManifestVersion = 1;

struct ManifestFile {
  std::string name;  // relative to the model directory
  int64_t bytes = 0;
  std::string sha256;
};

struct Manifest {
  int version = kManifestVersion;
  std::string created;
  std::string dsx_commit = "unknown";
  std::string command;  // run | generate
  // model
  std::string model_dir, model_id, family;
  std::vector<ManifestFile> files;
  // backend
  std::string backend = "cpu", precision = "fp32";
  int threads = 0;
  // settings
  int64_t max_tokens = 0;
  double temperature = 0, top_p = 1;
  int top_k = 0;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
  std::string dspark = "off";
  // prompt
  std::vector<int32_t> prompt_ids;
  std::optional<std::string> prompt_text, system;  // run
  bool thinking = false, raw = false;                  // run
  std::string ids_file;                            // generate
  // output
  std::vector<int32_t> output_ids;
  std::optional<std::string> output_text;
  std::string finish = "length";
  int32_t stop_id = -1;
  std::string stop_string;
  int64_t generated_tokens = 0;
  // hashes (filled by seal / read from the file)
  std::string result_sha256, manifest_sha256;
};

// The JSON object above (with the hashes as they are in m).
nlohmann::json manifest_to_json(const Manifest& m);
// Checks the structure (every field, its type and range) and reads it; throws dsx::Error
// naming the offending field ("manifest field 'output.ids[3]': ...").
Manifest manifest_from_json(const nlohmann::json& j);
// The hashes as defined above.
std::string manifest_result_hash(const Manifest& m);
std::string manifest_self_hash(const nlohmann::json& j);  // ignores j's "manifest_sha256"
// Fills both hashes and returns the file's text (arrays of numbers kept on one line).
std::string seal_manifest(Manifest& m);

// A manifest file read back: its JSON and the parsed form. Throws dsx::Error for a file
// that cannot be read, is not JSON (e.g. truncated), is not a manifest, has another
// version or a malformed field. Hashes are not checked here.
struct ManifestFileData {
  nlohmann::json json;
  Manifest manifest;
};
ManifestFileData read_manifest(const std::string& path);

// The files of a model directory that the engine reads (see "files" above), in order.
// Throws dsx::Error when the directory or its weight index is unusable.
std::vector<std::string> model_file_names(const std::string& dir);
// SHA-256 of each file (in parallel); `error` is set instead for a file that cannot be
// read. Progress on stderr when the files are large (at least 256 MiB in all).
struct FileHash {
  std::string name;
  int64_t bytes = -1;
  std::string sha256;
  std::string error;
};
std::vector<FileHash> hash_model_files(const std::string& dir, const std::vector<std::string>& names);

// What `dsx run` / `dsx generate` hand over after generating (one call, below).
struct ManifestRun {
  std::string command{};  // run | generate
  std::string model_dir{};
  const Engine* engine = nullptr;
  GenerateOptions options{};  // as generated with
  std::vector<int32_t> prompt_ids{};
  GenerateResult result{};
  std::string dspark = "off";
  std::optional<std::string> prompt_text{}, system{};  // run
  bool thinking = false, raw = false;                  // run
  std::string ids_file{};                              // generate
};
// Hashes the model files, builds and seals the manifest and writes it atomically to
// path. Throws dsx::Error naming the problem.
void write_manifest(const std::string& path, const ManifestRun& run);

}  // namespace dsx::cli
