// The runtime's view of a loaded model: an Engine owns the weights and everything the
// forward pass shares (device workspaces, streams, captured graphs); a Session owns only
// one sequence's state (window rings, compressed caches, compressor rings, token
// history). Many sessions live on one engine under a memory budget. One call,
// Engine::step, advances any number of sessions by any number of rows each, with all
// rows sharing one weight stream; Session adds what every user of a sequence needs on
// top of the backend: prefix sync with checkpoints, rollback, streamed snapshots.
//
// Backends implement Engine and Session::Backend (the CPU reference in
// runtime/cpu_engine.cpp, CUDA in runtime/cuda_engine.cpp over src/backend/cuda).
// Thread safety: an engine and its sessions are used from one thread at a time, except
// Session::cancel-style flags of the generation loop (runtime/generate.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/kv_state.h"
#include "util/byte_stream.h"

namespace dsx {

class Session;

struct EngineOptions {
  std::string backend = "cpu";     // cpu | cuda
  std::string precision = "fp32";  // fp32 | bf16 (CUDA production precision)
  int rollback_depth = 16;         // tokens a session rolls back without a checkpoint
  int64_t max_context = 0;         // tokens per session (0: backend default; CUDA preallocates)
  int64_t state_budget = 0;        // bytes of session state for all sessions (0: backend default)
  int64_t checkpoint_every = 4096; // prefix sync keeps a checkpoint about every this many tokens (0: off)
  int max_checkpoints = 8;         // per session
  // Expert parallelism over this many ranks (`--gpus N`; docs/multi-gpu.md). The CPU
  // engine computes the ranks' MoE math in one process; the CUDA engine runs 1 only.
  int expert_ranks = 1;
  // Loading progress (optional): the fraction of the model in place, from 0 to 1.
  std::function<void(double)> progress;
};

// What one session contributes to a step: n rows (tokens ids[0..n)) at positions
// session->position() ... Outputs (any may be null):
//   logits: [n, vocab] (Step::all_rows) or [vocab] (the last row);
//   taps:   [n, tap_width()] DSpark taps of every row (model-v41.md §1.5);
//   pick:   the greedy id (argmax, ties to the lowest id) of the last row;
//   picks:  [n] the greedy id of every row (a speculative verify).
// Rows of a feed that asks for none of logits, pick and picks skip the head.
struct Feed {
  Session* session = nullptr;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  float* logits = nullptr;
  float* taps = nullptr;
  int32_t* pick = nullptr;
  int32_t* picks = nullptr;
};

struct Step {
  std::vector<Feed> feeds;  // at most one feed per session
  bool all_rows = false;    // logits of every row instead of the last
};

// What a snapshot carries to say whose state it is: the model identity (SHA-256 over
// config.json and the tensor index, every shard's safetensors header:
// ModelFiles::fingerprint; synthetic engines use their own tag), the family, whether the
// state is in the compact V4.1 sections, and its geometry.
struct StateIdentity {
  std::string model_id;
  std::string family;  // deepseek_v41 | deepseek_v4
  bool compact = true;
  KVGeometry geometry;
};

// Bytes of session state: the fixed part (window and compressor rings), per token
// (compressed rows, index keys, token id), and what one session holds now / at most.
struct StateFootprint {
  int64_t fixed_bytes = 0;
  double bytes_per_token = 0;
  int64_t session_bytes = 0;   // allocated for one session (its capacity)
  int64_t budget_bytes = 0;    // the engine's budget for all sessions
  int64_t used_bytes = 0;      // held by the live sessions (state and checkpoints)
  int sessions = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string describe() const = 0;  // backend, precision, memory
  // A new empty session. Throws dsx::Error when its state would exceed the budget.
  // The engine must outlive its sessions.
  virtual std::unique_ptr<Session> new_session() = 0;
  // Advances every feed's session by its rows in one forward pass per chunk (rows of
  // all sessions share the weight stream); each row's result equals the one-row path.
  // Ids are checked first (nothing runs on a bad id); a feed beyond its session's
  // capacity is an error naming it. Sessions keep their checkpoints as they advance.
  void step(const Step& s);
  virtual StateFootprint footprint() const = 0;
  virtual const StateIdentity& state_identity() const = 0;
  virtual std::string backend_name() const = 0;
  int64_t tap_width() const;  // len(dspark_target_layer_ids) * hidden
  const EngineOptions& options() const { return opts_; }
  // The live sessions (in creation order).
  const std::vector<Session*>& sessions() const { return sessions_; }

 protected:
  explicit Engine(EngineOptions o) : opts_(std::move(o)) {}
  virtual void run(const Step& s) = 0;  // step() without the checkpoint bookkeeping
  // Checks a step's feeds (sessions of this engine, one feed each, ids in the vocabulary,
  // capacity); throws dsx::Error naming the problem.
  void check_step(const Step& s) const;
  // Fails with a clear error when one more session of `session_bytes` (what every
  // session of this engine reserves) would exceed the budget (0: none).
  void check_budget(int64_t session_bytes, int64_t budget) const;
  EngineOptions opts_;

 private:
  friend class Session;
  std::vector<Session*> sessions_;
};

// What Session::sync did.
struct SyncResult {
  int64_t reused = 0;       // tokens whose state was kept (not computed again)
  int64_t prefilled = 0;    // tokens fed (a replay from a checkpoint counts here)
  int64_t checkpoint = -1;  // position of the checkpoint restored (-1: none)
};

class Session {
 public:
  // The backend's part of a session: its state and the operations on it.
  class Backend {
   public:
    virtual ~Backend() = default;
    virtual int64_t position() const = 0;
    virtual const std::vector<int32_t>& tokens() const = 0;
    virtual int64_t capacity() const = 0;  // tokens
    virtual void rollback(int64_t pos) = 0;  // within the rollback depth
    virtual void reset() = 0;                // to position 0
    // The fixed part of the state at the current position (a checkpoint) and back to it.
    struct Checkpoint {
      virtual ~Checkpoint() = default;
      int64_t pos = 0;
      int64_t bytes = 0;
    };
    virtual std::unique_ptr<Checkpoint> checkpoint() const = 0;
    virtual void restore(const Checkpoint& c) = 0;
    // Snapshot payload (util/snapshot_io.h sections after the header).
    virtual void save(class SnapshotWriter& w) const = 0;
    // Reads a payload for position pos. On error: throws, and the state is either
    // untouched or reset to position 0 (the message says which).
    virtual void restore(class SnapshotReader& r, int64_t pos) = 0;
    virtual int64_t state_bytes() const = 0;   // held now
    // Benchmarks only: jump forward n tokens with random valid cache contents.
    virtual bool synthetic_fill(int64_t n, uint64_t seed) { return false; }
  };

  Session(Engine& e, std::unique_ptr<Backend> b);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  Engine& engine() const { return eng_; }
  Backend& backend() const { return *b_; }
  int64_t position() const { return b_->position(); }
  const std::vector<int32_t>& tokens() const { return b_->tokens(); }
  int64_t capacity() const { return b_->capacity(); }

  // One-session steps (Engine::step with one feed).
  void feed(const int32_t* ids, int64_t n, float* logits, bool all_rows);
  int32_t feed_greedy(const int32_t* ids, int64_t n);

  // Makes the state that of `ids[0..n)`: keeps the longest common prefix of tokens()
  // and ids, goes back to it within the rollback depth or from the nearest checkpoint
  // at or before it, and prefills the rest, keeping checkpoints as it goes
  // (EngineOptions::checkpoint_every). With `logits` ([vocab]) the last token is always
  // fed (at most n - 1 tokens are kept), so that its logits choose the next token.
  SyncResult sync(const int32_t* ids, int64_t n, float* logits = nullptr);
  SyncResult sync(const std::vector<int32_t>& ids, float* logits = nullptr) {
    return sync(ids.data(), static_cast<int64_t>(ids.size()), logits);
  }
  // Back to any earlier position: within the rollback depth directly, else from the
  // nearest checkpoint and a replay of the token history.
  void rollback(int64_t pos);
  // Keeps a checkpoint at the current position (the prefix sync also keeps its own).
  void checkpoint();
  std::vector<int64_t> checkpoints() const;  // their positions, ascending
  // The end of the prefill piece from position q toward n that sync() feeds in one step:
  // where the next checkpoint is due (checkpoint_every tokens after the last one, at
  // least q + 1), else n. A prefill that must compute the numbers sync's would (the same
  // rows in the same passes) feeds the same pieces.
  int64_t piece_end(int64_t q, int64_t n) const;

  // Snapshots: a header (model identity, geometry, position) and the state sections,
  // streamed (util/snapshot_io.h). restore refuses foreign-model, other-geometry,
  // old-version, truncated and corrupt snapshots with an error naming the problem.
  void save(ByteSink& out) const;
  void restore(ByteSource& in);
  std::vector<uint8_t> save() const;
  void restore(const std::vector<uint8_t>& bytes);

  int64_t state_bytes() const;  // state and checkpoints

 private:
  friend class Engine;
  void take_checkpoint();
  void maybe_checkpoint();
  void drop_checkpoints_after(int64_t pos);
  void go_back(int64_t pos, SyncResult* r);
  Engine& eng_;
  std::unique_ptr<Backend> b_;
  std::vector<std::unique_ptr<Backend::Checkpoint>> cps_;  // ascending positions
};

// Loads a model directory on the chosen backend. Throws dsx::Error naming the
// problem (missing / corrupt files, unsupported configuration, no GPU, ...).
std::unique_ptr<Engine> load_engine(const std::string& model_dir, const EngineOptions& opts = {});

// Backends register a factory (the CUDA backend does so when compiled in).
using EngineFactory = std::function<std::unique_ptr<Engine>(const std::string&, const EngineOptions&)>;
void register_engine_backend(const std::string& name, EngineFactory f);

// The Engram compressed token map of a model directory (derived from its
// tokenizer.json by the text layer, which registers the provider), checked against
// the config's engram_compressed_vocab_size. Empty when the model has no Engram layers.
using EngramMapProvider = std::function<std::vector<int32_t>(const std::string& model_dir, const ModelConfig& cfg)>;
void register_engram_map_provider(EngramMapProvider f);
std::vector<int32_t> load_engram_token_map(const std::string& model_dir, const ModelConfig& cfg);

}  // namespace dsx
