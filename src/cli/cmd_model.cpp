// Model commands: logits, generate, and `model plan` (the multi-GPU placement).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "cli/dspark_option.h"
#include "cli/gpus_option.h"
#include "cli/manifest.h"
#include "cli/registry.h"
#include "model/placement.h"
#include "model/release_config.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "util/error.h"
#include "util/safetensors.h"
#include "util/threadpool.h"

namespace dsx::cli {

namespace {

const std::vector<std::string> kEngineOpts = {"--backend", "--precision", "--threads", "--gpus"};

EngineOptions engine_options(const Args& a) {
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  apply_gpus_option(a, o);
  return o;
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int32_t> read_ids_file(const std::string& path) {
  SafetensorsFile f(path);
  const TensorView* t = f.find("input_ids");
  if (!t) fail(path, ": no tensor 'input_ids'");
  if (t->dtype != DType::I32 && t->dtype != DType::I64)
    fail(path, ": input_ids must be I32 (or I64), got ", dtype_name(t->dtype));
  if (t->shape.size() != 1) fail(path, ": input_ids must be one-dimensional, got ", t->shape_str());
  std::vector<int32_t> ids(static_cast<size_t>(t->numel()));
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t v = t->dtype == DType::I32 ? t->as<int32_t>()[i] : t->as<int64_t>()[i];
    if (v < 0 || v > INT32_MAX) fail(path, ": input_ids[", i, "] = ", v, " is not a token id");
    ids[i] = static_cast<int32_t>(v);
  }
  if (ids.empty()) fail(path, ": input_ids is empty");
  return ids;
}

int cmd_logits(int argc, char** argv) {
  Args a(argc, argv, with({"-m", "--ids", "--decode-from", "-o"}, kEngineOpts), {});
  const std::string dir = a.require("-m"), out = a.require("-o");
  auto ids = read_ids_file(a.require("--ids"));
  const int64_t T = static_cast<int64_t>(ids.size());
  const int64_t t0 = a.get_int("--decode-from", T);
  if (t0 < 1 || t0 > T) fail("--decode-from ", t0, " must be in [1, ", T, "]");
  auto eng = load_engine(dir, engine_options(a));
  const int64_t V = eng->config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(T * V));
  auto s = eng->new_session();
  s->feed(ids.data(), t0, logits.data(), true);
  for (int64_t t = t0; t < T; ++t) s->feed(ids.data() + t, 1, logits.data() + t * V, false);
  SafetensorsWriter w;
  w.add("logits", DType::F32, {T, V}, logits);
  w.write(out);
  return 0;
}

void generate_usage() {
  std::printf(
      "usage: dsx generate -m DIR --ids FILE [options]\n"
      "\n"
      "Continues a prompt of token ids (the I32 / I64 tensor input_ids of a safetensors\n"
      "file) and prints the new ids on one line, separated by spaces. Without --stop-eos\n"
      "it does not stop at the end-of-sentence token: it prints -n ids.\n"
      "\n"
      "options:\n"
      "  -m DIR              model directory\n"
      "  --ids FILE          safetensors file with input_ids\n"
      "  -n N                ids to generate (default 16)\n"
      "  --greedy            temperature 0 (the default; overrides --temperature)\n"
      "  --temperature T     sampling temperature (default 0: greedy)\n"
      "  --top-p P           nucleus sampling (default 1: off)\n"
      "  --top-k K           top-k sampling (default 0: off)\n"
      "  --seed S            sampling seed (default 0)\n"
      "  --stop-eos          stop at the model's eos_id (not printed)\n"
      "%s"
      "  --stats             print DSpark's accepted drafts per cycle to stderr\n"
      "  --backend cpu|cuda  (default cpu)\n"
      "  --precision fp32|bf16  CUDA precision (default fp32)\n"
      "  --threads N         CPU threads\n"
      "%s"
      "  --manifest FILE     write a reproducibility manifest (dsx manifest verify FILE)\n"
      "  -h, --help          this text\n",
      kDSparkHelp, kGpusHelp);
}

int cmd_generate(int argc0, char** argv0) {
  std::vector<char*> args;
  const std::vector<std::string> value_opts =
      with({"-m", "--ids", "-n", "--temperature", "--top-p", "--top-k", "--seed", "--manifest"}, kEngineOpts);
  const DSparkChoice dspark = take_dspark(argc0, argv0, value_opts, args);
  const int argc = static_cast<int>(args.size());
  char** argv = args.data();
  Args a(argc, argv, with({"-m", "--ids", "-n", "--temperature", "--top-p", "--top-k", "--seed", "--manifest"}, kEngineOpts),
         {"--greedy", "--stop-eos", "--stats", "-h", "--help"});
  if (a.has("-h") || a.has("--help")) {
    generate_usage();
    return 0;
  }
  const std::string dir = a.require("-m");
  auto ids = read_ids_file(a.require("--ids"));
  const int64_t n = a.get_int("-n", 16);
  if (n < 0) fail("-n must be >= 0");
  GenerateOptions go;
  go.sampling.temperature = a.has("--greedy") ? 0.0f : static_cast<float>(a.get_double("--temperature", 0.0));
  go.sampling.top_p = static_cast<float>(a.get_double("--top-p", 1.0));
  go.sampling.top_k = static_cast<int>(a.get_int("--top-k", 0));
  go.sampling.seed = static_cast<uint64_t>(a.get_int("--seed", 0));
  go.max_tokens = n;
  if (!a.has("--stop-eos")) go.stop_ids.clear();
  const EngineOptions eo = engine_options(a);
  auto eng = load_engine(dir, eo);
  print_placement_at_load(*eng, eo);
  const DSparkSetup ds = setup_dspark(dspark, dir, *eng);  // (before the session: it may measure on a scratch one)
  auto s = eng->new_session();
  PlainDecoding plain;
  DecodingStrategy& strategy = ds.strategy ? static_cast<DecodingStrategy&>(*ds.strategy) : plain;
  const GenerateResult r = generate(*s, ids, go, strategy);
  if (a.has("--stats") && ds.strategy)
    std::fprintf(stderr, "%s\nDSpark costs %s\n", ds.strategy->stats().summary().c_str(), ds.costs.c_str());
  std::string line;
  for (size_t i = 0; i < r.ids.size(); ++i) line += (i ? " " : "") + std::to_string(r.ids[i]);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (a.has("--manifest"))
    write_manifest(a.require("--manifest"), {.command = "generate", .model_dir = dir, .engine = eng.get(), .options = go,
                                             .prompt_ids = ids, .result = r, .dspark = ds.name,
                                             .ids_file = a.require("--ids")});
  return 0;
}

void model_usage() {
  std::printf(
      "usage: dsx model plan --gpus N[,N...] (-m DIR | --release) [options]\n"
      "\n"
      "Prints where the weights and the session state of a V4.1 model live on N GPUs with expert\n"
      "parallelism (docs/multi-gpu.md): routed experts sharded in contiguous id ranges, everything\n"
      "else replicated, the Engram tables in host memory; bytes per GPU from the on-disk dtypes, the\n"
      "state per GPU, whether it fits, and the bytes one decoded token reads on the busiest rank.\n"
      "\n"
      "options:\n"
      "  --gpus N[,N...]     GPU counts to plan for (e.g. 2,4,8)\n"
      "  -m DIR              the model directory (its config.json)\n"
      "  --release           the V4.1 Flash release configuration (spec model-v41.md §1.2)\n"
      "  --gpu-mem BYTES     memory of one GPU (default 141G, an H200)\n"
      "  --reserve BYTES     kept free per GPU for the CUDA context, workspaces, NCCL (default 6G)\n"
      "  --ctx N             tokens of context per session, for the fit (default 65536)\n"
      "  --sessions N        resident sessions, for the fit (default 1)\n"
      "  --no-dspark         leave the DSpark stages out (they are resident by default)\n"
      "  -h, --help          this text\n");
}

int cmd_model(int argc, char** argv) {
  Args a(argc, argv, {"-m", "--gpus", "--gpu-mem", "--reserve", "--ctx", "--sessions"},
         {"--release", "--no-dspark", "-h", "--help"});
  if (a.has("-h") || a.has("--help") || a.positional().empty()) {
    model_usage();
    return a.positional().empty() && !(a.has("-h") || a.has("--help")) ? 2 : 0;
  }
  if (a.positional()[0] != "plan") fail("dsx model: unknown subcommand '", a.positional()[0], "' (known: plan)");
  if (a.positional().size() > 1) fail("dsx model plan: unexpected argument '", a.positional()[1], "'");
  if (a.has("-m") == a.has("--release")) fail("dsx model plan: give exactly one of -m DIR and --release");
  const ModelConfig cfg = a.has("--release") ? release_v41_flash_config() : load_model_config(a.require("-m"));
  const std::string title = a.has("--release") ? "the V4.1 Flash release" : a.require("-m");
  PlacementOptions po;
  if (a.has("--gpu-mem")) po.gpu_bytes = parse_byte_size(a.require("--gpu-mem"));
  if (a.has("--reserve")) po.reserve_bytes = parse_byte_size(a.require("--reserve"));
  po.context = a.get_int("--ctx", po.context);
  po.sessions = static_cast<int>(a.get_int("--sessions", po.sessions));
  po.dspark = !a.has("--no-dspark");
  if (po.context < 0) fail("--ctx must not be negative");
  if (po.sessions < 0) fail("--sessions must not be negative");
  std::vector<int> counts;
  {
    const std::string v = a.require("--gpus");
    size_t i = 0;
    while (i <= v.size()) {
      const size_t j = std::min(v.find(',', i), v.size());
      const std::string item = v.substr(i, j - i);
      char* end = nullptr;
      const long n = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || !end || *end) fail("--gpus: '", item, "' is not a number of GPUs");
      counts.push_back(static_cast<int>(std::max(-1L, std::min(n, 1L << 20))));
      i = j + 1;
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    const PlacementPlan p = plan_placement(cfg, counts[k], po);
    std::printf("%s%s", k ? "\n" : "", format_placement(p, title).c_str());
  }
  return 0;
}

}  // namespace

DSX_COMMAND("model", "model facts: plan (the multi-GPU placement: dsx model plan --gpus N -m DIR | --release)",
            cmd_model);
DSX_COMMAND("logits", "write the logits of every position of a prompt (safetensors)", cmd_logits);
DSX_COMMAND("generate", "continue a prompt of token ids, printing the new ids", cmd_generate);

}  // namespace dsx::cli
