// The on-disk KV cache (issue 26): a directory of session snapshots that outlive the
// process, keyed by the exact token sequence they hold, so that a request whose prompt
// begins with a stored sequence restores the longest such prefix and prefills only
// the rest. Several checkpoints of one conversation (e.g. every 2048 tokens and its
// exact tail) are separate entries; lookup picks the longest.
//
// Matching is by token prefix only: the stored token ids must be a prefix of the
// request's. (The byte-prefix matching of chat-and-serving.md §5.1, which survives a
// different tokenization at the seam, is not done here: a caller that wants it decodes
// the stored tokens itself.)
//
// ---- Files ---------------------------------------------------------------------------
// DIR/<32 hex>.dsxkv    one entry; the name is the first 128 bits of SHA-256 over the
//                       entry's identity text and token bytes (the same token list of
//                       the same model state is always the same file)
// DIR/<name>.tmp.<pid>.<n>  an entry being written (removed on the next exclusive open)
// DIR/.lock             flock(2)ed by the process that owns the directory
// Files are created 0600 in a 0700 directory (they hold the prompt's tokens).
//
// An entry, all integers little-endian (format version kCacheFormatVersion = 1):
//
//   offset    size  field
//   0         8     magic "DSXKVC\r\n"
//   8         4     u32 format version (1)
//   12        4     u32 identity bytes I (at most 64 KiB)
//   16        8     u64 token count n (> 0)
//   24        8     u64 snapshot bytes S
//   32        8     i64 creation time, Unix nanoseconds
//   40        8     u64 reserved (0)
//   48        I     identity: JSON {"model","family","encoding","geometry"} of the
//                   engine's StateIdentity (geometry keys as in the snapshot header)
//   48+I      4n    the token ids (i32)
//   48+I+4n   8     u64 XXH3-64 of every byte above (the entry header checksum)
//   H=56+I+4n S     the session snapshot exactly as Session::save streams it
//                   (util/snapshot_io.h: its own header, sections, XXH3-64 trailer)
//   file size is exactly H + S.
//
// A published file is never modified: the last use is the file's mtime (set on every
// hit; losing it only changes the eviction order), hit counts live in memory. Writes go
// to a temporary file in the same directory, which is fsynced, renamed into place, and
// the directory fsynced: a process killed at any moment leaves either the whole entry
// or none of it (plus a temporary file that the next open removes).
//
// ---- Validation ------------------------------------------------------------------------
// open() scans every *.dsxkv file's header (cheap: the entry header, its checksum, the
// token list, the name, the file size, the inner snapshot's magic / version / header),
// with no index file: the directory is the index. Files that fail are refused with a
// log line naming the file and the reason, and never become candidates:
//   truncated, bit-flipped (header checksum), garbage, empty, renamed, old version
//     (entry or inner snapshot), a bare snapshot: deleted (when the directory is owned);
//   another model or another state layout (rollback depth, shape), a newer format
//     version: kept in place (they belong to someone else), not loaded, not counted in
//     the budget.
// restore() reads the whole file and checks everything again (both checksums, the
// snapshot against the engine, the restored token history against the entry); a
// failure of the file resets the session to position 0 (nothing of it stays loaded),
// drops the entry (deleting its file) and throws a dsx::Error naming the file. (A
// session too small for the entry, or of another model state, is refused before
// anything is read: the session and the entry stay.) verify() reads every file fully
// and checks its structure and both checksums without a model.
//
// ---- Lookup --------------------------------------------------------------------------------
// In memory, each entry is indexed by the chain hash of its whole 2048-token blocks
// (h_0 = seed, h_k+1 = XXH3-64(block k, seed h_k)) and the hash of its tail continued
// from there. A lookup hashes the request's blocks once, then from its longest block
// level down finds the entries of that level, compares tail hashes, and confirms the
// longest candidate against its stored token list (memcmp): O(request / 2048) probes.
//
// ---- Budget ------------------------------------------------------------------------------
// A byte budget over this model's entries: after each save, least recently used entries
// (ties: the larger first) are deleted until the total fits; the entry just written is
// kept, and an entry larger than 99 % of the budget is not stored at all.
//
// Thread safety: every member may be called from any thread. Restores and saves read
// and write files outside the internal lock, so a long restore does not block lookups.
// Session arguments follow the engine's rule (the engine's thread only).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/engine.h"

namespace dsx {

constexpr uint32_t kCacheFormatVersion = 1;
constexpr int64_t kCacheBlockTokens = 2048;  // block-hash granularity of lookups

struct DiskCacheOptions {
  int64_t budget_bytes = 0;  // 0: no limit
  // Own the directory: take its lock (failing when another process holds it), remove
  // temporary files and entries that fail validation. Off: read only (dsx cache ls).
  bool exclusive = true;
  bool create = true;  // create a missing directory (else: an error)
  // The background writer's queue bound (save_async): entries and bytes waiting (one
  // job larger than queue_bytes is taken when the queue is empty).
  size_t queue_entries = 4;
  int64_t queue_bytes = int64_t{8} << 30;
  size_t io_buffer_bytes = size_t{8} << 20;  // read / write buffer
  // Log lines (refused files, evictions of note, write errors); default: stderr.
  std::function<void(const std::string&)> log;
};

// A lookup hit: the entry's file name and its token count (the restorable prefix).
struct CacheHit {
  std::string name;
  int64_t tokens = 0;
  int64_t bytes = 0;
};

struct RestoreResult {
  int64_t position = 0;  // the session's position after the restore (= hit.tokens)
  double seconds = 0;
  int64_t bytes = 0;  // read from disk
};

struct SaveResult {
  enum Outcome { kStored, kExisting, kTooLarge } outcome = kStored;
  std::string name;
  int64_t tokens = 0;
  int64_t bytes = 0;  // the entry's file size
  double seconds = 0;
};

struct CacheEntryInfo {
  std::string name;  // file name
  std::string model;  // model id (of the identity)
  int64_t tokens = 0;
  int64_t bytes = 0;
  int64_t created_ns = 0;
  int64_t last_use_ns = 0;
  int64_t hits = 0;  // this process's
};

// A file that open() or verify() refused, and why.
struct RefusedFile {
  std::string name;
  std::string reason;
  bool deleted = false;
  bool foreign = false;  // another model / layout / newer version (kept)
};

struct DiskCacheStats {
  int64_t entries = 0, bytes = 0, budget_bytes = 0;
  int64_t hits = 0, misses = 0;
  int64_t restores = 0, restore_failures = 0, restored_bytes = 0;
  double restore_seconds = 0;  // total
  int64_t saves = 0, save_existing = 0, save_too_large = 0, written_bytes = 0;
  double save_seconds = 0;  // total (the file writes)
  int64_t evictions = 0, evicted_bytes = 0;
  int64_t refused = 0;  // files refused (open, restore, verify)
  int64_t foreign_files = 0, foreign_bytes = 0;  // kept, not ours
  int64_t temp_files_removed = 0;
  // the background writer: jobs accepted, refused (queue full), failed, waiting now
  int64_t queued = 0, queue_full = 0, write_errors = 0, pending = 0;
};

struct VerifyReport {
  struct File {
    std::string name;
    bool ok = false;
    // not this cache's (not a failure): another model's or layout's entry, intact (ok),
    // or a newer format version (not ok, kept)
    bool foreign = false;
    std::string reason;    // empty when ok
    int64_t bytes = 0;
  };
  std::vector<File> files;
  int64_t bad = 0;
  double seconds = 0;
};

class DiskCache {
 public:
  // The cache of one model state (the engine's state_identity()) in `dir`, created when
  // missing. Throws dsx::Error when the directory cannot be made / read or is owned by
  // another process.
  static std::unique_ptr<DiskCache> open(const std::string& dir, int64_t budget_bytes, const StateIdentity& id,
                                         DiskCacheOptions o = {});
  // Model-free (dsx cache ls / stats / verify / prune): the intact entries of every
  // model; lookup, restore and save are refused.
  static std::unique_ptr<DiskCache> open_any(const std::string& dir, DiskCacheOptions o = {});
  ~DiskCache();  // flushes the background writer
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  const std::string& dir() const { return dir_; }

  // The entry with the longest token list that is a prefix of tokens[0..n) (possibly
  // all n: callers that need the next token's logits pass n - 1, a snapshot carries
  // none). Counts a hit or a miss; a hit becomes the most recently used entry.
  std::optional<CacheHit> lookup(const int32_t* tokens, int64_t n);
  std::optional<CacheHit> lookup(const std::vector<int32_t>& t) {
    return lookup(t.data(), static_cast<int64_t>(t.size()));
  }

  // Streams the entry into the session (large sequential reads through an
  // io_buffer_bytes buffer; sections larger than it are read straight into place). A
  // bad file (corrupt, truncated, another model's snapshot): the session is reset to
  // position 0, the entry dropped, and a dsx::Error naming the file thrown.
  RestoreResult restore(const CacheHit& hit, Session& s);

  // Writes the session's state as an entry (engine thread). The same token list saved
  // again is the same entry (kExisting: not rewritten, marked used).
  SaveResult save(const Session& s);
  // The same from a snapshot already serialized (Session::save) and its token list;
  // the snapshot's header and token history are checked against them.
  SaveResult save_snapshot(const std::vector<uint8_t>& snapshot, const std::vector<int32_t>& tokens);
  // Hands the write to the background writer thread: returns false (and writes
  // nothing) when its queue is full; a later error is logged and counted.
  bool save_async(std::vector<uint8_t> snapshot, std::vector<int32_t> tokens);
  // Waits until the background writer has written everything queued before the call.
  void flush();

  DiskCacheStats stats() const;
  std::vector<CacheEntryInfo> entries() const;  // most recently used first
  std::vector<RefusedFile> refused_files() const;  // since open
  // Reads every entry file fully and checks its headers, sections and checksums (no
  // model needed); with an owned directory, bad files are dropped and deleted.
  VerifyReport verify();
  // Evicts least recently used entries until at most target_bytes remain; returns the
  // bytes freed.
  int64_t prune(int64_t target_bytes);

 private:
  struct Entry;
  struct Job {
    std::vector<uint8_t> snapshot;
    std::vector<int32_t> tokens;
  };
  DiskCache(std::string dir, std::optional<StateIdentity> id, DiskCacheOptions o);
  void scan();
  void log(const std::string& line) const;
  void refuse(const std::string& name, const std::string& reason, bool remove, bool foreign, int64_t bytes);
  void insert_locked(std::shared_ptr<Entry> e);
  void erase_locked(const std::string& name, bool delete_file);
  void evict_locked(const std::string& protect, int64_t limit);  // limit < 0: none
  int64_t budget() const { return opt_.budget_bytes > 0 ? opt_.budget_bytes : -1; }
  bool too_large(uint64_t bytes) const;
  void drop(const std::string& name, const std::string& reason);
  void touch_locked(Entry& e);
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  void require_model(const char* what) const;
  void require_owner(const char* what) const;
  // write an entry: the header and tokens, then `body` streams the snapshot (of
  // body_bytes bytes when known, else -1)
  SaveResult write_entry(const std::vector<int32_t>& tokens, int64_t body_bytes,
                         const std::function<void(ByteSink&)>& body);
  void writer_loop();

  std::string dir_;
  std::optional<StateIdentity> id_;
  std::string identity_text_;  // ours (JSON), when id_
  DiskCacheOptions opt_;
  int lock_fd_ = -1;

  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Entry>> entries_;
  std::unordered_multimap<uint64_t, std::shared_ptr<Entry>> by_block_;  // last whole-block chain hash
  std::vector<RefusedFile> refused_;
  DiskCacheStats st_;
  int64_t last_stamp_ = 0;
  uint64_t tmp_seq_ = 0;

  // the background writer
  std::thread writer_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Job> queue_;
  int64_t queue_bytes_ = 0;
  bool busy_ = false, stop_ = false;
};

// The identity text an entry records for a model state (canonical JSON).
std::string cache_identity_text(const StateIdentity& id);

// "8G", "512MiB", "1.5GB", "1000000": bytes (K/M/G/T are powers of 1024, KB/MB/... of
// 1000). Throws dsx::Error naming the text.
int64_t parse_byte_size(const std::string& text);

}  // namespace dsx
