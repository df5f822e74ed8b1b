// The on-disk KV cache (cache/disk_cache.h) on the CPU engine over tiny random V4.1
// models: save / lookup / restore round trips equal the session; the longest stored
// prefix among several checkpoints of one conversation is chosen; LRU eviction to the
// byte budget (last use survives a reopen); truncated, bit-flipped, garbage, empty,
// renamed, foreign-model, other-layout, old- and new-version files and temporary files
// are refused with their reason and never loaded; 100 kill -9 at random moments of a
// saving child lose no committed entry and never leave a loadable partial one; the
// background writer; verify / prune; the `dsx cache` command.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "cache/disk_cache.h"
#include "cli/registry.h"
#include "model/make_tiny.h"
#include "model/v41_cpu.h"
#include "runtime/cpu_engine.h"
#include "test_util.h"
#include "util/error.h"
#include "util/snapshot_io.h"

using namespace dsx;
namespace fs = std::filesystem;

namespace {

constexpr int kVocab = 512;

// Two tiny models with the same state geometry and different identities (another
// config.json), narrower than the default tiny model so that 5000-token prefills are quick.
std::string write_model(const std::string& name, uint64_t seed, int moe_inter) {
  const std::string d = dsx_test::temp_dir(name);
  TinySpec s;
  s.vocab = kVocab;
  s.engram_compressed_vocab = kVocab;
  s.seed = seed;
  s.hidden = 128;
  s.heads = 2;
  s.experts = 8;
  s.experts_per_tok = 2;
  s.moe_inter = moe_inter;
  s.index_heads = 4;
  write_tiny_model(d, s, "");
  return d;
}

const std::string& model_dir(int which) {
  static const std::string dirs[2] = {write_model("disk_cache_model_a", 26, 32),
                                      write_model("disk_cache_model_b", 27, 64)};
  return dirs[which];
}

std::unique_ptr<Engine> engine(int which = 0, EngineOptions o = {}) {
  const std::string& dir = model_dir(which);
  ModelConfig cfg = load_model_config(dir);
  std::vector<int32_t> cmap(kVocab);
  for (int i = 0; i < kVocab; ++i) cmap[i] = i;
  return make_cpu_engine(std::make_unique<V41Cpu>(cfg, bind_weights(cfg, std::make_shared<ModelFiles>(dir)), cmap), o);
}

std::vector<int32_t> random_tokens(uint32_t seed, int64_t n) {
  std::vector<int32_t> t;
  uint32_t r = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    r = r * 1664525u + 1013904223u;
    t.push_back(3 + static_cast<int32_t>((r >> 8) % (kVocab - 3)));
  }
  return t;
}

std::vector<int32_t> prefix(const std::vector<int32_t>& t, int64_t n) {
  return std::vector<int32_t>(t.begin(), t.begin() + n);
}

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// Log lines of a cache, thread-safe (the background writer logs too).
struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  DiskCacheOptions options(int64_t budget = 0) {
    DiskCacheOptions o;
    o.budget_bytes = budget;
    o.log = [this](const std::string& s) {
      std::lock_guard<std::mutex> l(mu);
      lines.push_back(s);
    };
    return o;
  }
  std::string all() {
    std::lock_guard<std::mutex> l(mu);
    std::string s;
    for (const auto& x : lines) s += x + "\n";
    return s;
  }
};

std::vector<std::string> files_of(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != ".lock") v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// A session at `toks` (fed in one step).
std::unique_ptr<Session> session_at(Engine& e, const std::vector<int32_t>& toks) {
  auto s = e.new_session();
  s->sync(toks);
  return s;
}

// Entry header size H of a file (format in disk_cache.h).
size_t header_bytes(const std::vector<uint8_t>& f) {
  uint32_t ni;
  uint64_t n;
  std::memcpy(&ni, f.data() + 12, 4);
  std::memcpy(&n, f.data() + 16, 8);
  return 48 + ni + 4 * n + 8;
}

// Rewrites the entry header checksum after a deliberate change of the header.
void reseal(std::vector<uint8_t>& f) {
  const size_t h = header_bytes(f);
  const uint64_t d = XXH3_64bits(f.data(), h - 8);
  std::memcpy(f.data() + h - 8, &d, 8);
}

}  // namespace

TEST(DiskCache, SaveLookupRestoreRoundTrip) {
  auto eng = engine();
  const int64_t V = eng->config().vocab_size;
  const std::string dir = dsx_test::temp_dir("disk_cache_roundtrip") + "/cache";
  const auto conv = random_tokens(1, 160);
  auto a = session_at(*eng, prefix(conv, 100));
  Log log;
  auto c = DiskCache::open(dir, 0, eng->state_identity(), log.options());
  EXPECT_EQ(fs::status(dir).permissions() & fs::perms::all, fs::perms::owner_all);
  const SaveResult r = c->save(*a);
  EXPECT_EQ(r.outcome, SaveResult::kStored);
  EXPECT_EQ(r.tokens, 100);
  const std::string file = dir + "/" + r.name;
  ASSERT_TRUE(fs::exists(file));
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(file)), r.bytes);
  EXPECT_EQ(fs::status(file).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(files_of(dir), std::vector<std::string>{r.name});  // (no temporary file left)

  // another process cannot own the directory meanwhile
  try {
    DiskCache::open(dir, 0, eng->state_identity(), log.options());
    ADD_FAILURE() << "a second owner opened the directory";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "in use")) << e.what();
  }

  // a request that extends the stored tokens hits it
  const auto hit = c->lookup(prefix(conv, 130));
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->tokens, 100);
  EXPECT_EQ(hit->name, r.name);
  auto b = eng->new_session();
  b->sync(random_tokens(99, 7));  // (a restore replaces whatever the session held)
  const RestoreResult rr = c->restore(*hit, *b);
  EXPECT_EQ(rr.position, 100);
  EXPECT_GT(rr.seconds, 0);
  EXPECT_EQ(b->tokens(), a->tokens());
  EXPECT_EQ(b->save(), a->save());
  // continuing both gives the same logits
  std::vector<float> la(static_cast<size_t>(30 * V)), lb(la.size());
  a->feed(conv.data() + 100, 30, la.data(), true);
  b->feed(conv.data() + 100, 30, lb.data(), true);
  EXPECT_EQ(la, lb);

  // the same token list again is the same entry
  auto a2 = session_at(*eng, prefix(conv, 100));
  EXPECT_EQ(c->save(*a2).outcome, SaveResult::kExisting);
  EXPECT_EQ(c->save_snapshot(a2->save(), a2->tokens()).outcome, SaveResult::kExisting);
  EXPECT_EQ(c->entries().size(), 1u);

  // misses: shorter than the entry, another conversation, a change inside the prefix
  EXPECT_FALSE(c->lookup(prefix(conv, 99)));
  EXPECT_FALSE(c->lookup(random_tokens(2, 130)));
  auto changed = prefix(conv, 130);
  changed[57] = changed[57] == 5 ? 6 : 5;
  EXPECT_FALSE(c->lookup(changed));
  DiskCacheStats st = c->stats();
  EXPECT_EQ(st.entries, 1);
  EXPECT_EQ(st.bytes, r.bytes);
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.misses, 3);
  EXPECT_EQ(st.saves, 1);
  EXPECT_EQ(st.save_existing, 2);
  EXPECT_EQ(st.restores, 1);
  EXPECT_EQ(st.restored_bytes, r.bytes);
  EXPECT_GT(st.restore_seconds, 0);
  EXPECT_EQ(st.refused, 0);

  // a restore into a session too small for the entry fails and keeps the entry
  {
    EngineOptions small;
    small.max_context = 50;
    auto eng_small = engine(0, small);
    auto s = eng_small->new_session();
    EXPECT_THROW(c->restore(*hit, *s), Error);
    EXPECT_EQ(c->entries().size(), 1u);
  }

  // reopened: the index is rebuilt from the files
  c.reset();
  c = DiskCache::open(dir, 0, eng->state_identity(), log.options());
  ASSERT_EQ(c->entries().size(), 1u);
  const auto hit2 = c->lookup(prefix(conv, 101));
  ASSERT_TRUE(hit2);
  auto d = eng->new_session();
  c->restore(*hit2, *d);
  EXPECT_EQ(d->save(), session_at(*eng, prefix(conv, 100))->save());
  EXPECT_EQ(log.all(), "");  // nothing refused, nothing removed

  // the model-free view refuses model operations
  auto any = DiskCache::open_any(dir, [&] {
    auto o = log.options();
    o.exclusive = false;
    return o;
  }());
  EXPECT_EQ(any->entries().size(), 1u);
  EXPECT_EQ(any->entries()[0].model, eng->state_identity().model_id);
  EXPECT_THROW(any->lookup(conv), Error);
}

TEST(DiskCache, LongestPrefixAmongCheckpointsOfOneConversation) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_prefix");
  const auto conv = random_tokens(3, 5200);
  auto c = DiskCache::open(dir, 0, eng->state_identity());
  auto s = eng->new_session();
  std::map<int64_t, std::vector<uint8_t>> snaps;
  for (int64_t cut : {100, 2048, 4096, 5000}) {
    s->sync(prefix(conv, cut));
    snaps[cut] = s->save();
    EXPECT_EQ(c->save(*s).outcome, SaveResult::kStored);
  }
  // another conversation's entry, sharing nothing
  auto other = random_tokens(4, 2100);
  EXPECT_EQ(c->save(*session_at(*eng, other)).outcome, SaveResult::kStored);

  auto diverge = [&](int64_t shared, int64_t total) {
    auto t = prefix(conv, total);
    if (shared < total) t[static_cast<size_t>(shared)] = t[static_cast<size_t>(shared)] == 7 ? 8 : 7;
    return t;
  };
  auto found = [&](const std::vector<int32_t>& req) -> int64_t {
    const auto h = c->lookup(req);
    return h ? h->tokens : -1;
  };
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass ? "after a reopen" : "as saved");
    EXPECT_EQ(found(diverge(4500, 5200)), 4096);  // shares 4500 tokens
    EXPECT_EQ(found(prefix(conv, 5200)), 5000);
    EXPECT_EQ(found(prefix(conv, 5000)), 5000);  // (all of it)
    EXPECT_EQ(found(prefix(conv, 4999)), 4096);
    EXPECT_EQ(found(diverge(3000, 4600)), 2048);
    EXPECT_EQ(found(prefix(conv, 4096)), 4096);
    EXPECT_EQ(found(diverge(4095, 5200)), 2048);  // the change is in the 4096 entry's last block
    EXPECT_EQ(found(diverge(4096, 5200)), 4096);
    EXPECT_EQ(found(diverge(4999, 5200)), 4096);  // ... in the 5000 entry's tail
    EXPECT_EQ(found(prefix(conv, 2047)), 100);
    EXPECT_EQ(found(diverge(2000, 2100)), 100);
    EXPECT_EQ(found(prefix(conv, 99)), -1);
    EXPECT_EQ(found(diverge(50, 5200)), -1);
    EXPECT_EQ(found(random_tokens(5, 5200)), -1);
    EXPECT_EQ(found(other), 2100);
    c.reset();
    c = DiskCache::open(dir, 0, eng->state_identity());
  }
  // the 4096 checkpoint restores, and a prefix sync from it prefills only the rest
  const auto req = diverge(4500, 5200);
  const auto h = c->lookup(req);
  ASSERT_TRUE(h);
  auto b = eng->new_session();
  const RestoreResult rr = c->restore(*h, *b);
  EXPECT_EQ(rr.position, 4096);
  EXPECT_EQ(b->save(), snaps[4096]);
  const SyncResult sr = b->sync(req);
  EXPECT_EQ(sr.reused, 4096);
  EXPECT_EQ(sr.prefilled, 5200 - 4096);
  // (the same state as the live session reaches from its own checkpoint)
  s->sync(req);
  EXPECT_EQ(b->save(), s->save());
}

TEST(DiskCache, LruEvictionToTheByteBudget) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_lru");
  std::vector<std::vector<int32_t>> t;
  std::vector<std::vector<uint8_t>> snap;
  for (uint32_t i = 0; i < 4; ++i) {
    t.push_back(random_tokens(10 + i, 64));
    snap.push_back(session_at(*eng, t.back())->save());
  }
  int64_t x;
  std::map<std::string, int> name_of;  // file -> index
  {
    auto probe = DiskCache::open(dir + "/probe", 0, eng->state_identity());
    x = probe->save_snapshot(snap[0], t[0]).bytes;
  }
  Log log;
  auto c = DiskCache::open(dir + "/c", x * 7 / 2, eng->state_identity(), log.options());  // room for 3
  auto save = [&](int i) {
    const SaveResult r = c->save_snapshot(snap[i], t[i]);
    EXPECT_EQ(r.outcome, SaveResult::kStored);
    EXPECT_EQ(r.bytes, x);
    name_of[r.name] = i;
  };
  auto present = [&] {
    std::set<int> s;
    for (const auto& e : c->entries()) s.insert(name_of.at(e.name));
    return s;
  };
  save(0);
  save(1);
  save(2);
  ASSERT_TRUE(c->lookup(t[0]));  // 0 is now the most recently used, 1 the least
  save(3);
  EXPECT_EQ(present(), (std::set<int>{0, 2, 3}));
  EXPECT_EQ(c->stats().evictions, 1);
  EXPECT_EQ(c->stats().bytes, 3 * x);
  EXPECT_EQ(files_of(dir + "/c").size(), 3u);
  EXPECT_FALSE(c->lookup(t[1]));
  ASSERT_TRUE(c->lookup(t[2]));  // order of use now: 0, 3, 2
  // the last use is the file's mtime: a reopen with a smaller budget evicts the least
  // recently used first
  c.reset();
  c = DiskCache::open(dir + "/c", x * 5 / 2, eng->state_identity(), log.options());
  EXPECT_EQ(present(), (std::set<int>{3, 2}));
  // an entry that cannot fit is not stored
  c.reset();
  c = DiskCache::open(dir + "/c", x / 2, eng->state_identity(), log.options());
  EXPECT_TRUE(present().empty());
  EXPECT_EQ(c->save_snapshot(snap[1], t[1]).outcome, SaveResult::kTooLarge);
  EXPECT_EQ(c->save(*session_at(*eng, t[1])).outcome, SaveResult::kTooLarge);
  EXPECT_TRUE(files_of(dir + "/c").empty());
  EXPECT_TRUE(contains(log.all(), "not stored")) << log.all();
  // prune: least recently used first, to the target
  c.reset();
  c = DiskCache::open(dir + "/c", 0, eng->state_identity(), log.options());
  for (int i : {0, 1, 2, 3}) save(i);
  ASSERT_TRUE(c->lookup(t[1]));
  EXPECT_EQ(c->prune(2 * x), 2 * x);
  EXPECT_EQ(present(), (std::set<int>{3, 1}));
  EXPECT_EQ(c->prune(0), 2 * x);
  EXPECT_TRUE(present().empty());
  EXPECT_TRUE(files_of(dir + "/c").empty());
}

TEST(DiskCache, BadFilesAreRefusedAndNeverLoaded) {
  auto eng = engine();
  const std::string base = dsx_test::temp_dir("disk_cache_bad");
  const auto toks = random_tokens(20, 40);
  auto a = session_at(*eng, toks);
  const std::vector<uint8_t> snap = a->save();
  std::string name;
  std::vector<uint8_t> good;
  {
    auto c = DiskCache::open(base + "/good", 0, eng->state_identity());
    name = c->save(*a).name;
    good = read_bytes(base + "/good/" + name);
  }
  const size_t H = header_bytes(good);
  ASSERT_EQ(good.size(), H + snap.size());
  ASSERT_EQ(std::vector<uint8_t>(good.begin() + static_cast<long>(H), good.end()), snap);

  int n_case = 0;
  // Writes `bytes` as `file` into a fresh directory, opens a cache there: the file must be
  // refused at open (reason containing `needle`) or, when its header is intact, at
  // restore; it is never loaded. Returns the reason.
  auto check = [&](const std::vector<uint8_t>& bytes, const std::string& file, const std::string& needle,
                   bool kept = false) -> std::string {
    const std::string dir = base + "/case" + std::to_string(n_case++);
    fs::create_directories(dir);
    write_bytes(dir + "/" + file, bytes);
    Log log;
    auto c = DiskCache::open(dir, 0, eng->state_identity(), log.options());
    std::string reason;
    if (c->entries().empty()) {
      const auto refused = c->refused_files();
      EXPECT_EQ(refused.size(), 1u) << file;
      if (refused.empty()) return "";
      reason = refused[0].reason;
      EXPECT_EQ(refused[0].name, file);
      EXPECT_EQ(refused[0].deleted, !kept) << reason;
      EXPECT_EQ(fs::exists(dir + "/" + file), kept) << reason;
      EXPECT_TRUE(contains(log.all(), dir + "/" + file)) << log.all();
      EXPECT_TRUE(contains(log.all(), reason)) << log.all();
      EXPECT_FALSE(c->lookup(toks));
    } else {
      // (an intact header: the payload is checked as it is read)
      EXPECT_FALSE(kept);
      const auto h = c->lookup(toks);
      EXPECT_TRUE(h);
      if (!h) return "";
      auto b = eng->new_session();
      b->sync(random_tokens(21, 5));
      try {
        c->restore(*h, *b);
        ADD_FAILURE() << "restored a bad entry (" << needle << ")";
      } catch (const Error& e) {
        reason = e.what();
        EXPECT_TRUE(contains(reason, dir + "/" + file)) << reason;
      }
      EXPECT_EQ(b->position(), 0);  // nothing of it was loaded
      EXPECT_TRUE(c->entries().empty());
      EXPECT_FALSE(fs::exists(dir + "/" + file));
      EXPECT_FALSE(c->lookup(toks));
      EXPECT_EQ(c->stats().restore_failures, 1);
    }
    EXPECT_TRUE(contains(reason, needle)) << "case " << n_case - 1 << ": " << reason;
    EXPECT_GE(c->stats().refused, 1);
    return reason;
  };

  // truncated anywhere
  check({}, name, "empty file");
  for (size_t cut : {size_t{5}, size_t{30}, size_t{60}, H - 1, H + 10, H + snap.size() / 2, good.size() - 1})
    check(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<long>(cut)), name, "truncated");
  // trailing bytes
  {
    auto longer = good;
    longer.push_back(0);
    check(longer, name, "trailing bytes");
  }
  // a bit flipped: every byte of the entry header and the snapshot's header, then a
  // sample of the payload (each refused at open or at restore)
  {
    uint32_t hn;
    std::memcpy(&hn, good.data() + H + 12, 4);
    std::vector<size_t> at;
    for (size_t i = 0; i < H + 16 + hn; ++i) at.push_back(i);
    std::mt19937 rng(26);
    for (int i = 0; i < 48; ++i) at.push_back(H + 16 + hn + rng() % (good.size() - H - 16 - hn));
    at.push_back(good.size() - 1);
    at.push_back(good.size() - 12);
    int at_open = 0, at_restore = 0;
    for (size_t i : at) {
      auto f = good;
      f[i] ^= static_cast<uint8_t>(1u << (i * 5 % 8));
      // (a flipped version field, of the entry or of its snapshot, may read as newer:
      // refused and kept)
      uint32_t v_entry, v_snap;
      std::memcpy(&v_entry, f.data() + 8, 4);
      std::memcpy(&v_snap, f.data() + H + 8, 4);
      const bool version = v_entry > kCacheFormatVersion || v_snap > kSnapshotVersion;
      const std::string r = check(f, name, "", version);
      EXPECT_FALSE(r.empty()) << "byte " << i;
      (contains(r, "refused") ? at_restore : at_open)++;
    }
    EXPECT_GT(at_open, 0);
    EXPECT_GT(at_restore, 0);
    std::printf("[ bit flips ] %zu files: %d refused at open, %d at restore\n", at.size(), at_open, at_restore);
  }
  // garbage, a bare snapshot, a renamed entry
  {
    std::vector<uint8_t> junk(5000);
    std::mt19937 rng(1);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    check(junk, name, "bad magic");
    check(snap, name, "bare session snapshot");
    check(good, "0123456789abcdef0123456789abcdef.dsxkv", "name does not match");
  }
  // old and newer versions of the entry format and of its snapshot
  {
    auto v0 = good;
    v0[8] = 0;
    reseal(v0);
    check(v0, name, "old kv cache format version 0");
    auto v2 = good;
    v2[8] = 2;
    reseal(v2);
    check(v2, name, "newer", true);
    auto s1 = good;
    s1[H + 8] = 1;
    check(s1, name, "old format version 1");
    auto s9 = good;
    s9[H + 8] = 9;
    check(s9, name, "newer", true);
    auto k1 = good;
    std::memcpy(k1.data() + H, "DSXKVS01", 8);
    check(k1, name, "old dsx snapshot format");
  }
  // another model's entry (kept: it is not ours), another state layout of this model
  // (a rollback depth of 4), and an entry whose header claims this model but whose
  // snapshot is another model's
  {
    auto eng_b = engine(1);
    ASSERT_NE(eng_b->state_identity().model_id, eng->state_identity().model_id);
    auto b = session_at(*eng_b, toks);
    std::string name_b;
    std::vector<uint8_t> file_b;
    {
      auto cb = DiskCache::open(base + "/model_b", 0, eng_b->state_identity());
      name_b = cb->save(*b).name;
      file_b = read_bytes(base + "/model_b/" + name_b);
    }
    EXPECT_NE(name_b, name);
    check(file_b, name_b, "belongs to another model", true);
    EngineOptions o4;
    o4.rollback_depth = 4;
    auto eng4 = engine(0, o4);
    std::string name4;
    std::vector<uint8_t> file4;
    {
      auto c4 = DiskCache::open(base + "/depth4", 0, eng4->state_identity());
      name4 = c4->save(*session_at(*eng4, toks)).name;
      file4 = read_bytes(base + "/depth4/" + name4);
    }
    check(file4, name4, "another state layout", true);
    const std::vector<uint8_t> snap_b = b->save();
    ASSERT_EQ(snap_b.size(), snap.size());
    auto mixed = good;
    std::copy(snap_b.begin(), snap_b.end(), mixed.begin() + static_cast<long>(H));
    check(mixed, name, "differs from the entry's");
    // the wrapper's own check: a snapshot of model B is not saved into A's cache
    auto ca = DiskCache::open(base + "/mixed_save", 0, eng->state_identity());
    EXPECT_THROW(ca->save_snapshot(snap_b, toks), Error);
    EXPECT_THROW(ca->save(*b), Error);
    EXPECT_THROW(ca->save_snapshot(snap, random_tokens(22, 40)), Error);  // not its tokens
    auto cut = snap;
    cut.pop_back();
    EXPECT_THROW(ca->save_snapshot(cut, toks), Error);
    EXPECT_TRUE(ca->entries().empty());
    EXPECT_TRUE(files_of(base + "/mixed_save").empty());
  }
  // temporary files of interrupted saves: removed, never loaded
  {
    const std::string dir = base + "/tmp";
    fs::create_directories(dir);
    write_bytes(dir + "/" + name + ".tmp.4242.0", std::vector<uint8_t>(good.begin(), good.begin() + 100));
    write_bytes(dir + "/" + name + ".tmp.4243.7", good);  // (complete, never renamed)
    write_bytes(dir + "/notes.txt", {'h', 'i'});           // (not the cache's: left alone)
    Log log;
    auto c = DiskCache::open(dir, 0, eng->state_identity(), log.options());
    EXPECT_TRUE(c->entries().empty());
    EXPECT_FALSE(c->lookup(toks));
    EXPECT_EQ(c->stats().temp_files_removed, 2);
    EXPECT_EQ(files_of(dir), std::vector<std::string>{"notes.txt"});
    EXPECT_TRUE(contains(log.all(), "temporary file left by an interrupted save")) << log.all();
  }
  // a read-only view reports bad files but deletes nothing
  {
    const std::string dir = base + "/readonly";
    fs::create_directories(dir);
    write_bytes(dir + "/" + name, std::vector<uint8_t>(good.begin(), good.begin() + 100));
    write_bytes(dir + "/" + name + ".tmp.1.0", good);
    Log log;
    auto o = log.options();
    o.exclusive = false;
    auto c = DiskCache::open(dir, 0, eng->state_identity(), o);
    EXPECT_TRUE(c->entries().empty());
    ASSERT_EQ(c->refused_files().size(), 1u);
    EXPECT_TRUE(contains(c->refused_files()[0].reason, "truncated"));
    EXPECT_EQ(files_of(dir).size(), 2u);
  }
}

TEST(DiskCache, VerifyReadsEveryFileFully) {
  auto eng = engine();
  auto eng_b = engine(1);
  const std::string dir = dsx_test::temp_dir("disk_cache_verify");
  std::vector<std::string> names;
  {
    auto c = DiskCache::open(dir, 0, eng->state_identity());
    for (uint32_t i = 0; i < 3; ++i) names.push_back(c->save(*session_at(*eng, random_tokens(30 + i, 50 + i))).name);
    const VerifyReport r = c->verify();
    ASSERT_EQ(r.files.size(), 3u);
    EXPECT_EQ(r.bad, 0);
    for (const auto& f : r.files) EXPECT_TRUE(f.ok && !f.foreign) << f.name << ": " << f.reason;
  }
  // another model's entry in the same directory (A's are foreign to it, and kept)
  std::string name_b;
  {
    Log log;
    auto cb = DiskCache::open(dir, 0, eng_b->state_identity(), log.options());
    EXPECT_TRUE(cb->entries().empty());
    EXPECT_EQ(cb->stats().foreign_files, 3);
    name_b = cb->save(*session_at(*eng_b, random_tokens(33, 20))).name;
  }
  // a flipped payload byte passes the open-time header checks; verify finds it
  auto f = read_bytes(dir + "/" + names[1]);
  f[f.size() - 100] ^= 0x10;
  write_bytes(dir + "/" + names[1], f);
  {
    Log log;
    auto o = log.options();
    o.exclusive = false;
    auto any = DiskCache::open_any(dir, o);
    EXPECT_EQ(any->entries().size(), 4u);  // (every model's)
    const VerifyReport r = any->verify();
    EXPECT_EQ(r.bad, 1);
    ASSERT_EQ(r.files.size(), 4u);
    for (const auto& x : r.files) {
      EXPECT_EQ(x.ok, x.name != names[1]) << x.name;
      EXPECT_FALSE(x.foreign);
      if (x.name == names[1]) EXPECT_TRUE(contains(x.reason, "checksum")) << x.reason;
    }
    EXPECT_TRUE(fs::exists(dir + "/" + names[1]));  // (read only: nothing deleted)
  }
  {
    Log log;
    auto c = DiskCache::open(dir, 0, eng->state_identity(), log.options());
    EXPECT_EQ(c->entries().size(), 3u);
    const VerifyReport r = c->verify();  // owned: the bad file is dropped and deleted
    EXPECT_EQ(r.bad, 1);
    for (const auto& x : r.files) {
      if (x.name == name_b) EXPECT_TRUE(x.ok && x.foreign) << x.reason;
      else EXPECT_EQ(x.ok, x.name != names[1]);
    }
    EXPECT_FALSE(fs::exists(dir + "/" + names[1]));
    EXPECT_TRUE(fs::exists(dir + "/" + name_b));
    EXPECT_EQ(c->entries().size(), 2u);
    EXPECT_TRUE(contains(log.all(), "checksum")) << log.all();
  }
}

TEST(DiskCache, CrashSafetyUnderKill9) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_crash") + "/cache";
  const std::string commit_log = fs::path(dir).parent_path().string() + "/committed";
  // genuine snapshots of many token lists (a common start, distinct tails), and a few
  // long ones so that kills land inside large writes too
  const auto base = random_tokens(40, 24);
  const auto t0 = std::chrono::steady_clock::now();
  constexpr uint32_t kShort = 400;
  std::vector<std::vector<int32_t>> toks;
  std::vector<std::vector<uint8_t>> snaps;
  {
    auto s = eng->new_session();
    for (uint32_t i = 0; i < kShort; ++i) {
      auto t = base;
      for (int32_t x : random_tokens(1000 + i, 8)) t.push_back(x);
      s->sync(t);
      toks.push_back(t);
      snaps.push_back(s->save());
    }
    const auto longc = random_tokens(41, 3000);
    for (int64_t cut : {1000, 1500, 2000, 2500, 3000}) {
      s->sync(prefix(longc, cut));
      toks.push_back(prefix(longc, cut));
      snaps.push_back(s->save());
    }
  }
  const StateIdentity id = eng->state_identity();
  // kills at random moments within a few saves (as fast as this disk syncs)
  int wait_max_us;
  {
    const auto t = std::chrono::steady_clock::now();
    auto probe = DiskCache::open(dir + "_probe", 0, id);
    probe->save_snapshot(snaps.back(), toks.back());
    probe->save_snapshot(snaps[0], toks[0]);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
    wait_max_us = static_cast<int>(std::min(60000.0, 20000 + 2 * us));
  }
  const int kKills = 100;
  std::mt19937 rng(2026);
  int interrupted = 0, signaled = 0, tmp_left = 0;
  // entries whose save returned before a kill (and that the test did not prune since):
  // index -> file
  std::map<size_t, std::string> committed;
  size_t lines_read = 0, commits = 0;
  int64_t pruned = 0;
  DiskCacheOptions quiet;
  quiet.log = [](const std::string&) {};
  const auto t1 = std::chrono::steady_clock::now();
  fs::create_directories(dir);
  for (int k = 0; k < kKills; ++k) {
    const size_t start = (static_cast<size_t>(k) * 37) % snaps.size();
    const bool async = k % 2 == 1;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // the child: saves until it is killed (no test assertions here)
      int rc = 0;
      try {
        DiskCacheOptions o;
        o.log = [](const std::string&) {};
        o.queue_entries = 4;
        auto c = DiskCache::open(dir, 0, id, o);
        const int fd = ::open(commit_log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        std::vector<size_t> batch;
        auto commit = [&](size_t i) {
          const std::string line = std::to_string(i) + "\n";
          if (::write(fd, line.data(), line.size()) < 0) std::_Exit(4);
        };
        // the long snapshots first on some rounds, so that large writes are interrupted
        std::vector<size_t> order;
        if (k % 5 == 0)
          for (size_t i = kShort; i < snaps.size(); ++i) order.push_back(i);
        for (size_t j = 0; j < snaps.size(); ++j) order.push_back((start + j) % snaps.size());
        for (;;) {
          for (size_t i : order) {
            if (!async) {
              if (c->save_snapshot(snaps[i], toks[i]).outcome == SaveResult::kStored) commit(i);
              continue;
            }
            const auto h = c->lookup(toks[i]);
            if (h && h->tokens == static_cast<int64_t>(toks[i].size())) continue;  // (there already)
            if (c->save_async(snaps[i], toks[i])) batch.push_back(i);
            if (batch.size() == 4) {
              c->flush();
              for (size_t b : batch) commit(b);
              batch.clear();
            }
          }
        }
      } catch (...) {
        rc = 3;
      }
      std::_Exit(rc);
    }
    std::uniform_int_distribution<int> wait_us(0, wait_max_us);
    ::usleep(static_cast<useconds_t>(wait_us(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++signaled;
    else ADD_FAILURE() << "the saving child ended by itself (status " << status << ")";
    // what the child committed
    std::vector<size_t> fresh;
    {
      std::ifstream in(commit_log);
      size_t n = 0;
      for (std::string line; std::getline(in, line); ++n)
        if (n >= lines_read && !line.empty()) fresh.push_back(std::stoul(line));
      lines_read = n;
    }
    commits += fresh.size();
    // (every open removes the temporary files of the child before; a child writes one
    // file at a time)
    int tmp = 0;
    for (const auto& f : files_of(dir)) tmp += contains(f, ".tmp.");
    EXPECT_LE(tmp, 1) << "after kill " << k;
    interrupted += tmp > 0;
    tmp_left = tmp;
    // a read-only look: nothing is refused, every committed entry is there
    {
      DiskCacheOptions o = quiet;
      o.exclusive = false;
      auto view = DiskCache::open(dir, 0, id, o);
      EXPECT_TRUE(view->refused_files().empty()) << "after kill " << k << ": " << view->refused_files()[0].reason;
      for (size_t i : fresh) {
        const auto h = view->lookup(toks[i]);
        EXPECT_TRUE(h && h->tokens == static_cast<int64_t>(toks[i].size()))
            << "committed entry " << i << " lost after kill " << k;
        if (h) committed[i] = h->name;
      }
      std::set<std::string> present;
      for (const auto& e : view->entries()) present.insert(e.name);
      for (const auto& [i, name] : committed)
        EXPECT_TRUE(present.count(name)) << "committed entry " << i << " lost after kill " << k;
      if (k % 20 == 19) EXPECT_EQ(view->verify().bad, 0) << "after kill " << k;
    }
    // keep the children writing: the test evicts a quarter of the entries itself (its
    // own removals, no longer expected)
    if (k + 1 < kKills) {
      auto owner = DiskCache::open(dir, 0, id, quiet);
      EXPECT_EQ(owner->stats().refused, 0);
      const int64_t before = owner->stats().entries;
      owner->prune(owner->stats().bytes * 3 / 4);
      pruned += before - owner->stats().entries;
      std::set<std::string> left;
      for (const auto& e : owner->entries()) left.insert(e.name);
      for (auto it = committed.begin(); it != committed.end();)
        it = left.count(it->second) ? std::next(it) : committed.erase(it);
    }
  }
  // the owner's open: temporary files go, every entry restores to its exact snapshot
  Log log;
  auto c = DiskCache::open(dir, 0, id, log.options());
  EXPECT_EQ(c->stats().refused, 0) << log.all();
  EXPECT_EQ(c->stats().temp_files_removed, tmp_left);
  for (const auto& f : files_of(dir)) EXPECT_FALSE(contains(f, ".tmp.")) << f;
  const int64_t n_entries = c->stats().entries;
  int64_t restored = 0;
  auto s = eng->new_session();
  for (size_t i = 0; i < snaps.size(); ++i) {
    const auto h = c->lookup(toks[i]);
    if (!h) {
      EXPECT_EQ(committed.count(i), 0u) << "committed entry " << i << " lost";
      continue;
    }
    ASSERT_EQ(h->tokens, static_cast<int64_t>(toks[i].size()));
    c->restore(*h, *s);
    EXPECT_EQ(s->save(), snaps[i]) << "entry " << i;
    ++restored;
  }
  EXPECT_EQ(restored, n_entries);
  EXPECT_GE(restored, static_cast<int64_t>(committed.size()));
  EXPECT_EQ(c->verify().bad, 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const double prep = std::chrono::duration<double>(t1 - t0).count();
  std::printf("[ crash test ] %d kill -9 at 0..%d ms (%d by the signal), %d during a write (a temporary file "
              "left); %zu saves committed, %lld pruned by the test, %lld entries on disk at the end, all restored "
              "exactly; %.1f s (and %.1f s making snapshots)\n",
              kKills, wait_max_us / 1000, signaled, interrupted, commits, static_cast<long long>(pruned),
              static_cast<long long>(n_entries), secs, prep);
  EXPECT_GE(commits, 50u);  // (the children did save)
  EXPECT_GE(interrupted, 5);         // (and were killed in the middle of writes)
  c.reset();
  if (!HasFailure()) fs::remove_all(fs::path(dir).parent_path());  // (some 20 MB)
}

TEST(DiskCache, BackgroundWriter) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_async");
  std::vector<std::vector<int32_t>> t;
  std::vector<std::vector<uint8_t>> snap;
  {
    auto s = eng->new_session();
    const auto base = random_tokens(50, 30);
    for (uint32_t i = 0; i < 40; ++i) {
      auto x = base;
      for (int32_t y : random_tokens(60 + i, 6)) x.push_back(y);
      s->sync(x);
      t.push_back(x);
      snap.push_back(s->save());
    }
  }
  Log log;
  {
    auto o = log.options();
    o.queue_entries = 64;
    auto c = DiskCache::open(dir + "/a", 0, eng->state_identity(), o);
    for (size_t i = 0; i < 40; ++i) EXPECT_TRUE(c->save_async(snap[i], t[i]));
    c->flush();
    EXPECT_EQ(c->stats().saves, 40);
    EXPECT_EQ(c->entries().size(), 40u);
    for (size_t i = 0; i < 40; ++i) EXPECT_TRUE(c->lookup(t[i])) << i;
    auto s = eng->new_session();
    c->restore(*c->lookup(t[17]), *s);
    EXPECT_EQ(s->save(), snap[17]);
    // again: existing entries are not queued
    EXPECT_TRUE(c->save_async(snap[3], t[3]));
    c->flush();
    EXPECT_EQ(c->stats().saves, 40);
    // a bad job is logged and counted, not thrown
    EXPECT_TRUE(c->save_async(snap[0], random_tokens(70, 36)));
    c->flush();
    EXPECT_EQ(c->stats().write_errors, 1);
    EXPECT_TRUE(contains(log.all(), "background save failed")) << log.all();
  }
  // a bounded queue: what does not fit is refused (and not written); what was accepted
  // is all there after the flush
  {
    auto o = log.options();
    o.queue_entries = 1;
    auto c = DiskCache::open(dir + "/b", 0, eng->state_identity(), o);
    std::vector<size_t> accepted;
    for (size_t i = 0; i < 40; ++i)
      if (c->save_async(snap[i], t[i])) accepted.push_back(i);
    c->flush();
    const DiskCacheStats st = c->stats();
    EXPECT_EQ(static_cast<int64_t>(accepted.size()) + st.queue_full, 40);
    EXPECT_GT(st.queue_full, 0);
    EXPECT_EQ(st.entries, static_cast<int64_t>(accepted.size()));
    for (size_t i : accepted) EXPECT_TRUE(c->lookup(t[i])) << i;
  }
  // the destructor writes what is queued
  {
    auto o = log.options();
    o.queue_entries = 64;
    auto c = DiskCache::open(dir + "/c", 0, eng->state_identity(), o);
    for (size_t i = 0; i < 10; ++i) EXPECT_TRUE(c->save_async(snap[i], t[i]));
  }
  auto c = DiskCache::open(dir + "/c", 0, eng->state_identity(), log.options());
  EXPECT_EQ(c->entries().size(), 10u);
}

TEST(DiskCache, ConcurrentUseKeepsTheIndexAndTheDirectoryInStep) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_threads");
  std::vector<std::vector<int32_t>> t;
  std::vector<std::vector<uint8_t>> snap;
  {
    auto s = eng->new_session();
    const auto base = random_tokens(90, 20);
    for (uint32_t i = 0; i < 48; ++i) {
      auto x = base;
      for (int32_t y : random_tokens(100 + i, 4)) x.push_back(y);
      s->sync(x);
      t.push_back(x);
      snap.push_back(s->save());
    }
  }
  const int64_t x = static_cast<int64_t>(snap[0].size()) + 1000;
  auto o = Log().options(x * 12);  // (room for about 11: evictions all along)
  o.log = [](const std::string&) {};
  o.queue_entries = 8;
  auto c = DiskCache::open(dir, o.budget_bytes, eng->state_identity(), o);
  std::vector<std::thread> th;
  for (int w = 0; w < 2; ++w)
    th.emplace_back([&, w] {
      for (size_t i = static_cast<size_t>(w); i < t.size(); i += 2) c->save_snapshot(snap[i], t[i]);
    });
  th.emplace_back([&] {
    for (size_t i = 0; i < t.size(); ++i) c->save_async(snap[t.size() - 1 - i], t[t.size() - 1 - i]);
  });
  std::atomic<bool> done{false};
  std::atomic<int> hits{0}, lookups{0};
  std::thread reader([&] {
    for (size_t k = 0; !done; ++k, ++lookups)
      if (c->lookup(t[k % t.size()])) ++hits;
  });
  std::thread watcher([&] {
    while (!done) {
      EXPECT_LE(c->stats().bytes, 12 * x);  // (an entry and its evictions are one step)
      (void)c->entries();
    }
  });
  for (auto& w : th) w.join();
  c->flush();
  done = true;
  reader.join();
  watcher.join();
  const DiskCacheStats st = c->stats();
  EXPECT_GT(st.evictions, 0);
  EXPECT_LE(st.bytes, 12 * x);
  EXPECT_GT(hits.load(), 0);
  EXPECT_EQ(st.hits + st.misses, lookups.load());
  // the index is the directory
  std::set<std::string> index, disk;
  int64_t sum = 0;
  for (const auto& e : c->entries()) index.insert(e.name), sum += e.bytes;
  for (const auto& f : files_of(dir)) disk.insert(f);
  EXPECT_EQ(index, disk);
  EXPECT_EQ(sum, st.bytes);
  EXPECT_EQ(c->verify().bad, 0);
}

TEST(DiskCache, CacheCommand) {
  auto eng = engine();
  const std::string dir = dsx_test::temp_dir("disk_cache_cli");
  std::vector<std::string> names;
  {
    auto c = DiskCache::open(dir, 0, eng->state_identity());
    for (uint32_t i = 0; i < 3; ++i) names.push_back(c->save(*session_at(*eng, random_tokens(80 + i, 40))).name);
  }
  const cli::Command* cmd = nullptr;
  for (const auto& c : cli::commands())
    if (c.name == "cache") cmd = &c;
  ASSERT_NE(cmd, nullptr);
  auto run = [&](std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), "cache");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    testing::internal::CaptureStdout();
    int rc;
    try {
      rc = cmd->fn(static_cast<int>(args.size()), argv.data());
    } catch (const Error& e) {
      testing::internal::GetCapturedStdout();
      *out = e.what();
      return -1;
    }
    std::fflush(stdout);
    *out = testing::internal::GetCapturedStdout();
    return rc;
  };
  std::string out;
  EXPECT_EQ(run({"--help"}, &out), 0);
  EXPECT_TRUE(contains(out, "ls|stats|verify|prune") && contains(out, "--kv-cache") && contains(out, "--size")) << out;
  EXPECT_EQ(run({"ls", "--kv-cache", dir}, &out), 0);
  for (const auto& n : names) EXPECT_TRUE(contains(out, n)) << out;
  EXPECT_TRUE(contains(out, "3 entries")) << out;
  EXPECT_EQ(run({"stats", "--kv-cache", dir, "--json"}, &out), 0);
  EXPECT_TRUE(contains(out, "\"entries\": 3")) << out;
  EXPECT_EQ(run({"verify", "--kv-cache", dir}, &out), 0);
  EXPECT_TRUE(contains(out, "0 bad")) << out;
  auto f = read_bytes(dir + "/" + names[0]);
  f[f.size() - 30] ^= 1;
  write_bytes(dir + "/" + names[0], f);
  EXPECT_EQ(run({"verify", "--kv-cache", dir}, &out), 1);
  EXPECT_TRUE(contains(out, "BAD") && contains(out, "checksum")) << out;
  EXPECT_TRUE(fs::exists(dir + "/" + names[0]));
  EXPECT_EQ(run({"verify", "--kv-cache", dir, "--delete"}, &out), 1);
  EXPECT_FALSE(fs::exists(dir + "/" + names[0]));
  EXPECT_EQ(run({"verify", "--kv-cache", dir}, &out), 0);
  // prune needs the directory: not while an owner holds it
  {
    auto owner = DiskCache::open(dir, 0, eng->state_identity());
    EXPECT_EQ(run({"prune", "--kv-cache", dir, "--size", "0"}, &out), -1);
    EXPECT_TRUE(contains(out, "in use")) << out;
  }
  EXPECT_EQ(run({"prune", "--kv-cache", dir, "--size", "1G"}, &out), 0);
  EXPECT_EQ(files_of(dir).size(), 2u);
  EXPECT_EQ(run({"prune", "--kv-cache", dir, "--size", "0"}, &out), 0);
  EXPECT_TRUE(contains(out, "pruned 2 entries")) << out;
  EXPECT_TRUE(files_of(dir).empty());
  EXPECT_EQ(run({"frobnicate", "--kv-cache", dir}, &out), -1);
  EXPECT_EQ(run({"prune", "--kv-cache", dir}, &out), -1);  // (no --size)
  EXPECT_TRUE(contains(out, "--size")) << out;
}

TEST(DiskCache, ParseByteSize) {
  EXPECT_EQ(parse_byte_size("1000000"), 1000000);
  EXPECT_EQ(parse_byte_size("8G"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("1.5GB"), 1500000000);
  EXPECT_EQ(parse_byte_size("4k"), 4096);
  EXPECT_EQ(parse_byte_size("0"), 0);
  EXPECT_THROW(parse_byte_size("lots"), Error);
  EXPECT_THROW(parse_byte_size("8Q"), Error);
  EXPECT_THROW(parse_byte_size(""), Error);
}
