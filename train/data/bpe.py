"""Byte-level BPE of the DeepSeek V3 / V4.1 tokenizer.json family, in plain Python.

What is here:
  * the pre-tokenizer of tokenizer-v41.json (three regex Split steps, behaviour Isolated,
    then ByteLevel without regex), translated to Python's `re` with explicit Unicode
    classes (spec chat-and-serving.md §1.3): \\p{L} \\p{M} \\p{N} \\p{P} \\p{S} are built from
    `unicodedata` (Unicode 14.0, the version of the engine's PCRE2) plus the code points
    Unicode 16.0 added, which the engine reads from src/text/unicode_tables.cpp (parsed here,
    so both sides use one list); Oniguruma's \\s is U+0009..U+000D, U+0085 and category Z;
  * the GPT-2 byte <-> character map;
  * `Tokenizer`: loads a tokenizer.json and encodes (added tokens leftmost-longest, first
    those with normalized=false, then normalized=true ones in the gaps; pre-tokenizer; BPE
    by merge rank, leftmost on ties) and decodes (bytes);
  * `train_bpe`: BPE training on a Counter of pre-tokenized pieces with incremental pair
    counts (a max-heap with lazy deletion and a pair -> words index).

Only valid UTF-8 text (Python str) is handled; the engine's extra rule for ill-formed bytes
is not needed for the project's corpus, which is valid UTF-8 by construction.
"""
from __future__ import annotations

import heapq
import json
import os
import re
import unicodedata
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNICODE_TABLES_CPP = os.path.join(REPO, "src", "text", "unicode_tables.cpp")

# ---- byte map ---------------------------------------------------------------------------


def _byte_order() -> List[int]:
    """Bytes in the order GPT-2 lists them (identity bytes first, then the 68 others)."""
    ident = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    rest = [b for b in range(256) if b not in set(ident)]
    return ident + rest


BYTE_ORDER = _byte_order()


def _byte_to_char() -> List[str]:
    out = [""] * 256
    nxt = 0x100
    ident = set(BYTE_ORDER[:188])
    for b in range(256):
        if b in ident:
            out[b] = chr(b)
        else:
            out[b] = chr(nxt)
            nxt += 1
    return out


BYTE_TO_CHAR = _byte_to_char()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def bytes_to_symbols(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in data)


def symbols_to_bytes(s: str) -> Optional[bytes]:
    """Bytes spelled by a byte-level string; None if a character is outside the map."""
    out = bytearray()
    for c in s:
        b = CHAR_TO_BYTE.get(c)
        if b is None:
            return None
        out.append(b)
    return bytes(out)


# ---- Unicode classes ------------------------------------------------------------------------

_CLASS_CACHE: Dict[str, List[Tuple[int, int]]] = {}


def _unicode16_extra() -> Dict[str, List[Tuple[int, int]]]:
    """The Unicode 15.0-16.0 additions per category, as the engine lists them."""
    with open(UNICODE_TABLES_CPP, encoding="utf-8") as f:
        src = f.read()
    start = src.index("namespace dsx::text::unicode16")
    end = src.index("}  // namespace dsx::text::unicode16", start)
    section = src[start:end]
    out: Dict[str, List[Tuple[int, int]]] = {}
    for m in re.finditer(r"constexpr Range k(\w+)\[\] = \{(.*?)\};", section, re.S):
        ranges = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", m.group(2))]
        out[m.group(1)] = ranges
    for cat in ("L", "M", "N", "P", "S"):
        if not out.get(cat):
            raise RuntimeError(f"{UNICODE_TABLES_CPP}: no Unicode 16.0 additions found for category {cat}")
    return out


def _build_classes() -> None:
    if _CLASS_CACHE:
        return
    members: Dict[str, List[int]] = {k: [] for k in ("L", "M", "N", "P", "S", "Z")}
    for cp in range(0x110000):
        c = unicodedata.category(chr(cp))[0]
        if c in members:
            members[c].append(cp)
    extra = _unicode16_extra()
    for cat in ("L", "M", "N", "P", "S"):
        have = set(members[cat])
        for a, b in extra[cat]:
            for cp in range(a, b + 1):
                if cp not in have:
                    members[cat].append(cp)
        members[cat].sort()
    space = sorted(set([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85] + members["Z"]))
    members["WS"] = space
    for cat, cps in members.items():
        ranges: List[Tuple[int, int]] = []
        for cp in cps:
            if ranges and ranges[-1][1] + 1 == cp:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
        _CLASS_CACHE[cat] = ranges


def _esc(cp: int) -> str:
    return "\\U%08x" % cp


def class_items(cat: str) -> str:
    """Python `re` class items (no brackets) for one of L M N P S Z WS."""
    _build_classes()
    parts = []
    for a, b in _CLASS_CACHE[cat]:
        parts.append(_esc(a) if a == b else _esc(a) + "-" + _esc(b))
    return "".join(parts)


# ---- pre-tokenizer ------------------------------------------------------------------------

# The three Split patterns of tokenizer-v41.json (Oniguruma syntax), checked against the file
# when a tokenizer is loaded.
V41_SPLITS = [
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]

_PRE_RES: Optional[List["re.Pattern[str]"]] = None


def _pre_regexes() -> List["re.Pattern[str]"]:
    global _PRE_RES
    if _PRE_RES is None:
        L, M, N, P, S, WS = (class_items(c) for c in ("L", "M", "N", "P", "S", "WS"))
        r1 = "[" + N + "]{1,3}"
        r2 = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
        r3 = "|".join(
            [
                "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+",
                "[^\r\n" + L + P + S + "]?[" + L + M + "]+",
                " ?[" + P + S + "]+[\r\n]*",
                "[" + WS + "]*[\r\n]+",
                "[" + WS + "]+(?![^" + WS + "])",
                "[" + WS + "]+",
            ]
        )
        _PRE_RES = [re.compile(r1), re.compile(r2), re.compile(r3)]
    return _PRE_RES


def pretokenize(text: str) -> List[str]:
    """Pieces of `text` (no added tokens inside) after the three Isolated Split steps."""
    pieces = [text] if text else []
    for rx in _pre_regexes():
        nxt: List[str] = []
        for p in pieces:
            pos = 0
            for m in rx.finditer(p):
                b, e = m.span()
                if b > pos:
                    nxt.append(p[pos:b])
                if e > b:
                    nxt.append(p[b:e])
                pos = e
            if pos < len(p):
                nxt.append(p[pos:])
        pieces = nxt
    return pieces


# ---- tokenizer ------------------------------------------------------------------------------


class Tokenizer:
    """A tokenizer.json of the V3/V4.1 layout (normalizer none, the V4.1 pre-tokenizer, BPE)."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        self.json = j
        norm = j.get("normalizer")
        if norm is not None and not (norm.get("type") == "Sequence" and norm.get("normalizers") == []):
            raise ValueError(f"{path}: unsupported normalizer")
        pts = j["pre_tokenizer"]["pretokenizers"]
        pats = [p["pattern"]["Regex"] for p in pts if p["type"] == "Split"]
        if pats != V41_SPLITS or [p["behavior"] for p in pts if p["type"] == "Split"] != ["Isolated"] * 3:
            raise ValueError(f"{path}: pre-tokenizer differs from the V4.1 one this encoder implements")
        if pts[-1]["type"] != "ByteLevel" or pts[-1].get("use_regex") or pts[-1].get("add_prefix_space"):
            raise ValueError(f"{path}: last pre-tokenizer step must be ByteLevel without regex / prefix space")
        m = j["model"]
        self.vocab: Dict[str, int] = dict(m["vocab"])
        self.merges: List[Tuple[str, str]] = []
        for x in m["merges"]:
            a, b = x.split(" ") if isinstance(x, str) else x
            self.merges.append((a, b))
        self.ranks = {pair: r for r, pair in enumerate(self.merges)}
        self.added = list(j.get("added_tokens") or [])
        self.id_to_bytes: Dict[int, bytes] = {}
        for s, i in self.vocab.items():
            bs = symbols_to_bytes(s)
            self.id_to_bytes[i] = bs if bs is not None else s.encode("utf-8")
        self.added_ids = set()
        self.special_ids = set()
        for a in self.added:
            bs = symbols_to_bytes(a["content"])
            self.id_to_bytes[a["id"]] = bs if bs is not None else a["content"].encode("utf-8")
            self.added_ids.add(a["id"])
            if a.get("special"):
                self.special_ids.add(a["id"])
        self.content_to_id = {a["content"]: a["id"] for a in self.added}
        raw = sorted((a["content"] for a in self.added if not a.get("normalized", True)), key=lambda s: (-len(s), s))
        nrm = sorted((a["content"] for a in self.added if a.get("normalized", True)), key=lambda s: (-len(s), s))
        # Alternatives longest first: at the leftmost position the longest token wins.
        self._raw_re = re.compile("|".join(re.escape(s) for s in raw)) if raw else None
        self._norm_re = re.compile("|".join(re.escape(s) for s in nrm)) if nrm else None
        self._cache: Dict[str, List[int]] = {}
        self.size = max(self.id_to_bytes) + 1

    # -- encoding --

    def _bpe(self, piece: str) -> List[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        syms = [BYTE_TO_CHAR[b] for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(syms) > 1:
            best = None
            best_rank = None
            for i in range(len(syms) - 1):
                r = ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            syms[best : best + 2] = [syms[best] + syms[best + 1]]
        ids = [self.vocab[s] for s in syms]
        if len(self._cache) > 500000:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def encode_plain(self, text: str) -> List[int]:
        """Text without added-token matching."""
        out: List[int] = []
        for p in pretokenize(text):
            out.extend(self._bpe(p))
        return out

    def split_added(self, text: str) -> List[Tuple[bool, str]]:
        """(is_added, text) parts of `text`, as encoding cuts it."""
        parts: List[Tuple[bool, str]] = []

        def gap(g: str) -> None:
            if not g:
                return
            if self._norm_re is None:
                parts.append((False, g))
                return
            q = 0
            for m in self._norm_re.finditer(g):
                if m.start() > q:
                    parts.append((False, g[q : m.start()]))
                parts.append((True, m.group(0)))
                q = m.end()
            if q < len(g):
                parts.append((False, g[q:]))

        if self._raw_re is None:
            gap(text)
            return parts
        pos = 0
        for m in self._raw_re.finditer(text):
            gap(text[pos : m.start()])
            parts.append((True, m.group(0)))
            pos = m.end()
        gap(text[pos:])
        return parts

    def encode(self, text: str, allow_added: bool = True) -> List[int]:
        if not allow_added:
            return self.encode_plain(text)
        out: List[int] = []
        for is_added, s in self.split_added(text):
            if is_added:
                out.append(self.content_to_id[s])
            else:
                out.extend(self.encode_plain(s))
        return out

    # -- decoding --

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.id_to_bytes[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, s: str) -> Optional[int]:
        if s in self.content_to_id:
            return self.content_to_id[s]
        return self.vocab.get(s)


# ---- training -------------------------------------------------------------------------------


def train_bpe(piece_counts: Dict[bytes, int], num_merges: int, progress=None) -> List[Tuple[bytes, bytes]]:
    """Learns `num_merges` merges from pieces (UTF-8 bytes) with their counts.

    Each step merges the most frequent adjacent pair of symbols, counted over all pieces
    weighted by their counts; ties go to the pair whose (left bytes, right bytes) is
    smallest, so the result is deterministic. Returns the merges as byte-string pairs.
    """
    # Symbols: ids; sym_bytes[id] = its bytes. Ids 0..255 are the bytes.
    sym_bytes: List[bytes] = [bytes([b]) for b in range(256)]
    words: List[List[int]] = []
    counts: List[int] = []
    for piece in sorted(piece_counts):
        if len(piece) < 2:
            continue
        words.append(list(piece))
        counts.append(piece_counts[piece])
    pair_count: Dict[Tuple[int, int], int] = {}
    pair_words: Dict[Tuple[int, int], set] = {}
    for wi, w in enumerate(words):
        c = counts[wi]
        for i in range(len(w) - 1):
            p = (w[i], w[i + 1])
            pair_count[p] = pair_count.get(p, 0) + c
            pair_words.setdefault(p, set()).add(wi)

    heap: List[Tuple[int, bytes, bytes, Tuple[int, int]]] = []

    def push(p: Tuple[int, int]) -> None:
        c = pair_count.get(p, 0)
        if c > 0:
            heapq.heappush(heap, (-c, sym_bytes[p[0]], sym_bytes[p[1]], p))

    for p in pair_count:
        push(p)

    merges: List[Tuple[bytes, bytes]] = []
    while len(merges) < num_merges and heap:
        negc, _, _, p = heapq.heappop(heap)
        if pair_count.get(p, 0) != -negc or -negc <= 0:
            continue  # stale entry
        a, b = p
        new_id = len(sym_bytes)
        sym_bytes.append(sym_bytes[a] + sym_bytes[b])
        merges.append((sym_bytes[a], sym_bytes[b]))
        changed: set = set()
        for wi in sorted(pair_words.pop(p, ())):
            w = words[wi]
            c = counts[wi]
            # old pairs out
            for i in range(len(w) - 1):
                q = (w[i], w[i + 1])
                pair_count[q] -= c
                changed.add(q)
            # merge left to right, non-overlapping
            nw: List[int] = []
            i = 0
            n = len(w)
            while i < n:
                if i + 1 < n and w[i] == a and w[i + 1] == b:
                    nw.append(new_id)
                    i += 2
                else:
                    nw.append(w[i])
                    i += 1
            words[wi] = nw
            old_pairs = set((w[i], w[i + 1]) for i in range(len(w) - 1))
            new_pairs = set((nw[i], nw[i + 1]) for i in range(len(nw) - 1))
            for i in range(len(nw) - 1):
                q = (nw[i], nw[i + 1])
                pair_count[q] = pair_count.get(q, 0) + c
                changed.add(q)
            for q in old_pairs - new_pairs:
                s = pair_words.get(q)
                if s is not None:
                    s.discard(wi)
            for q in new_pairs:
                pair_words.setdefault(q, set()).add(wi)
        pair_count.pop(p, None)
        for q in changed:
            if q != p:
                push(q)
        if progress is not None and len(merges) % 500 == 0:
            progress(len(merges), -negc)
    return merges


def count_pieces(texts: Iterable[str], counter: Optional[Counter] = None) -> Counter:
    """Counter of pre-tokenized pieces (UTF-8 bytes) over texts free of added tokens."""
    if counter is None:
        counter = Counter()
    for t in texts:
        counter.update(p.encode("utf-8") for p in pretokenize(t))
    return counter


def ids_equal_report(a: Sequence[int], b: Sequence[int]) -> str:
    """A short description of the first difference of two id lists ('' when equal)."""
    if list(a) == list(b):
        return ""
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), n)
    return f"first difference at {i}: {list(a[max(0, i - 3):i + 5])} vs {list(b[max(0, i - 3):i + 5])} (lengths {len(a)}, {len(b)})"
