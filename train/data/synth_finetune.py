#!/usr/bin/python3
"""Fine-tune data that teaches the trained model to copy tool and parameter names from the
schema (issue 24: greedy tool calls on held-out agent prompts).

The first training run saw synth_agents.py's conversations, whose tool and parameter names
come from small pools per tool family (4-12 names): the model learned the pools' favourite
names and writes them whatever the schema says. Here every conversation is rendered once by
dsx with placeholder names (QQT<i>QQ for tools, QQK<i>x<j>QQ for parameters) and then
instantiated VARIANTS times with names drawn from large compositional pools (prefix + verb +
noun in snake / camel / Pascal / kebab case, invented words; never drawn from the original
pools, although the compositions often spell their names): the same conversation with
different names, so that only copying from the
schema predicts them. Substituting an identifier for a placeholder in the rendered text is
what dsx would render for the substituted conversation (identifiers need no escaping); every
VERIFY_EVERY-th variant is rendered again with `dsx render --ids` and compared id for id.

Conversations come from synth_agents.gen_agent (same scenarios, simulated repository and
tool results) with seeds "ft24:...", which none of synth_agents' splits use (train "24:train",
eval "24:eval"); agent_eval.jsonl stays the judge and is not read except to check that no
fine-tune prompt equals one of its prompts. CHATS plain chats without tools
(synth_agents.gen_chat, seeds "ft24:chat:<i>") go in beside them, so that the model keeps
answering in text when no tool is offered.

Layout (--out, default train/out/data/ft/):
  train.bin      uint16 ids in blocks of 1024 tokens; a block holds whole conversations (at
                 most 1024 tokens each), the rest filled with training-corpus text (BOS +
                 a piece of a document); CODE_BLOCK_FRACTION of the blocks are corpus text
                 only (Python, docs, JavaScript of the training corpus), so that the fine-tune
                 keeps seeing code
  train.classes.bin  uint8 per token: 0 corpus text, 1 conversation context (system, tools,
                 user, tool results), 2 assistant turn, 3 a tool or parameter name inside a
                 DSML call (with its closing quote); train_target.py --token-classes
  val.bin        the corpus's validation Python (val_code.txt), for the trainer's val loss
  stats.json     counts, settings, hashes
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe  # noqa: E402
import jsonschema_lite  # noqa: E402
import synth_agents as SA  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
SETTINGS = {
    "seed": "ft24",
    "base_conversations": 2600,
    "variants": 4,
    "block": 1024,
    "code_block_fraction": 0.4,
    "code_text_bytes": 14_000_000,  # training-corpus text tokenized for the fillers and code blocks
    "docs_text_bytes": 1_000_000,
    "js_text_bytes": 500_000,
    "verify_every": 25,
    "original_name_fraction": 0.0,
    "invented_name_fraction": 0.1,
    # plain chats without tools (synth_agents.gen_chat: complete / write / explain Python), so
    # that the fine-tune keeps answering in text when no tool is offered (a fine-tune on
    # agent conversations only taught the model to open a DSML call after every request,
    # the README demo's included)
    "chats": 3000,
}
BLOCK_CLASSES = {"corpus": 0, "context": 1, "assistant": 2, "name": 3}
PH_RE = re.compile(r"QQ[TK][0-9x]+QQ")
ASSISTANT = "<\uff5cAssistant\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"


def log(msg: str) -> None:
    print(f"[ft {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# =============================================================================================
# Name pools

PREFIXES = ["fs", "repo", "ws", "workspace", "local", "agent", "mcp", "dev", "proj", "code", "sandbox", "tool",
            "my", "sys", "io", "vfs", "host", "box", "env", "std", "core", "base", "ide", "editor", "project",
            "git", "remote", "cloud", "os", "util", "api", "default", "quick", "safe", "super", "x", "t", "k8"]
SUFFIXES = ["v2", "tool", "fn", "op", "cmd", "2", "ex", "safe", "now", "all", "plus", "lite", "raw", "async", "x"]
FAMILY_WORDS: Dict[str, Tuple[List[str], List[str]]] = {
    "read": (["read", "open", "view", "load", "get", "show", "cat", "peek", "inspect", "fetch", "print", "dump",
              "display", "retrieve", "browse", "examine", "look"],
             ["file", "text", "source", "contents", "content", "doc", "document", "blob", "page", "lines", "buffer",
              "code"]),
    "write": (["write", "create", "save", "put", "store", "make", "new", "emit", "output", "persist", "set", "add"],
              ["file", "text", "doc", "document", "contents", "blob", "source", "buffer", "page", "note"]),
    "edit": (["edit", "replace", "patch", "modify", "change", "update", "rewrite", "fix", "substitute", "amend",
              "swap", "alter"],
             ["file", "text", "in_file", "code", "source", "lines", "string", "str", "snippet", "block"]),
    "shell": (["run", "exec", "execute", "shell", "bash", "invoke", "launch", "spawn", "call", "do", "start"],
              ["command", "cmd", "shell", "bash", "terminal", "process", "script", "cli", "sh", "program"]),
    "search": (["search", "grep", "find", "lookup", "query", "scan", "match", "locate", "seek", "hunt"],
               ["code", "files", "text", "repo", "source", "pattern", "regex", "content", "codebase", "lines"]),
    "list": (["list", "ls", "show", "browse", "enumerate", "scan", "get", "view", "walk", "tree"],
             ["dir", "directory", "files", "folder", "entries", "tree", "paths", "contents", "children"]),
    "tests": (["run", "check", "exec", "execute", "launch", "verify", "start", "invoke"],
              ["tests", "test_suite", "pytest", "specs", "checks", "unit_tests", "suite", "testcases"]),
    "python": (["run", "exec", "execute", "eval", "evaluate", "interpret", "invoke"],
               ["python", "py", "code", "snippet", "script", "python_code", "source"]),
    "delete": (["delete", "remove", "rm", "unlink", "erase", "drop", "trash", "discard", "purge"],
               ["file", "path", "doc", "entry", "item", "blob"]),
    "move": (["move", "rename", "mv", "relocate", "transfer", "shift"], ["file", "path", "doc", "entry", "item"]),
    "weather": (["get", "lookup", "fetch", "check", "query", "read", "show"],
                ["weather", "forecast", "current_weather", "conditions", "climate", "temperature"]),
    "calc": (["calculate", "compute", "eval", "evaluate", "solve", "calc", "do"],
             ["math", "expression", "arithmetic", "sum", "formula", "numbers"]),
    "time": (["get", "current", "fetch", "lookup", "read", "show", "tell"],
             ["time", "clock", "datetime", "now", "date_time", "local_time"]),
    "fetch": (["fetch", "get", "download", "read", "load", "retrieve", "grab", "request"],
              ["url", "page", "web_page", "http", "webpage", "site", "resource", "link"]),
    "plan": (["update", "write", "set", "record", "save", "make", "edit"],
             ["plan", "todo", "todos", "todo_list", "steps", "tasks", "checklist", "roadmap"]),
}
SEM_WORDS: Dict[str, List[str]] = {
    "path": ["path", "file", "filename", "file_path", "filepath", "location", "target", "fname", "pathname", "name",
             "ref", "uri", "input", "dir", "folder"],
    "start": ["start", "start_line", "offset", "from", "begin", "first", "line", "from_line", "skip", "line_start",
              "begin_line", "start_at"],
    "limit": ["limit", "count", "max", "lines", "num_lines", "max_lines", "n", "length", "take", "size", "line_limit"],
    "content": ["content", "contents", "text", "data", "body", "file_text", "source", "payload", "value", "code"],
    "overwrite": ["overwrite", "force", "replace", "clobber", "allow_overwrite", "truncate"],
    "old": ["old", "old_string", "old_text", "search", "find", "before", "original", "match", "pattern", "from"],
    "new": ["new", "new_string", "new_text", "replacement", "replace", "after", "updated", "to", "with"],
    "all": ["all", "replace_all", "every", "global", "all_matches", "multiple"],
    "command": ["command", "cmd", "script", "line", "shell_command", "input", "run", "commandline", "exec"],
    "timeout": ["timeout", "timeout_s", "seconds", "time_limit", "deadline", "max_seconds", "timeout_sec"],
    "cwd": ["cwd", "dir", "workdir", "working_dir", "directory", "chdir", "root", "in_dir"],
    "pattern": ["pattern", "query", "regex", "search", "term", "expr", "needle", "text", "match"],
    "glob": ["glob", "include", "files", "file_glob", "filter", "mask", "only"],
    "ignore_case": ["ignore_case", "case_insensitive", "icase", "nocase", "insensitive"],
    "max_results": ["max_results", "limit", "max", "count", "top", "max_hits", "head"],
    "recursive": ["recursive", "recurse", "deep", "all", "walk", "nested"],
    "depth": ["depth", "max_depth", "levels", "level", "maxdepth"],
    "target": ["target", "path", "tests", "selector", "test_path", "suite", "spec", "where"],
    "keyword": ["keyword", "k", "filter", "match", "name_filter", "pattern", "only"],
    "verbose": ["verbose", "v", "detailed", "loud", "verbosity"],
    "fail_fast": ["fail_fast", "exitfirst", "stop_early", "x", "bail", "first_failure"],
    "code": ["code", "source", "script", "program", "snippet", "src", "python", "body"],
    "src": ["src", "source", "from", "old_path", "origin", "current", "path"],
    "dst": ["dst", "dest", "destination", "to", "new_path", "target", "new_name"],
    "location": ["location", "city", "place", "where", "town", "area", "query"],
    "unit": ["unit", "units", "scale", "temperature_unit", "system"],
    "expression": ["expression", "expr", "formula", "input", "math", "query", "equation"],
    "timezone": ["timezone", "tz", "zone", "time_zone", "region", "location"],
    "url": ["url", "uri", "address", "link", "href", "page", "target"],
    "max_bytes": ["max_bytes", "limit", "max_length", "max_size", "truncate", "bytes"],
    "steps": ["steps", "todos", "plan", "items", "tasks", "entries", "list"],
}
KEY_PREFIXES = ["file", "target", "input", "the", "src", "my", "arg", "p", "req", "opt", "in", "cfg"]
SYLL_C = "bdfgklmnprstvz"
SYLL_V = "aeiou"


def invented(rng: random.Random) -> str:
    s = "".join(rng.choice(SYLL_C) + rng.choice(SYLL_V) + (rng.choice("nrlx") if rng.random() < 0.25 else "")
                for _ in range(rng.randint(2, 3)))
    return s


def styled(rng: random.Random, parts: List[str], tool: bool) -> str:
    words = [w for p in parts for w in p.split("_") if w]
    r = rng.random()
    if r < 0.55 or len(words) == 1 and r < 0.8:
        return "_".join(words)
    if r < 0.75:
        return words[0] + "".join(w.capitalize() for w in words[1:])
    if r < (0.9 if tool else 0.85):
        return "".join(w.capitalize() for w in words)
    if r < 0.95:
        return "-".join(words)
    return "".join(words)


def draw_tool_name(rng: random.Random, family: str) -> str:
    r = rng.random()
    if r < SETTINGS["original_name_fraction"]:
        return rng.choice(SA.FAMILIES[family]["names"])
    if r < SETTINGS["original_name_fraction"] + SETTINGS["invented_name_fraction"]:
        parts = [invented(rng)]
        if rng.random() < 0.5:
            parts.append(rng.choice(FAMILY_WORDS[family][0]))
        return styled(rng, parts, True)
    verbs, nouns = FAMILY_WORDS[family]
    parts = []
    if rng.random() < 0.35:
        parts.append(rng.choice(PREFIXES))
    q = rng.random()
    if q < 0.15:
        parts.append(rng.choice(verbs))
    elif q < 0.25:
        parts += [rng.choice(nouns), rng.choice(verbs)]
    else:
        parts += [rng.choice(verbs), rng.choice(nouns)]
    if rng.random() < 0.1:
        parts.append(rng.choice(SUFFIXES))
    return styled(rng, parts, True)


def draw_key(rng: random.Random, sem: str, original: List[str]) -> str:
    r = rng.random()
    if r < SETTINGS["original_name_fraction"]:
        return rng.choice(original)
    if r < SETTINGS["original_name_fraction"] + 0.05:
        return invented(rng)
    w = rng.choice(SEM_WORDS.get(sem, original))
    parts = [rng.choice(KEY_PREFIXES), w] if rng.random() < 0.25 else [w]
    return styled(rng, parts, False) if rng.random() < 0.35 else "_".join(parts)


# =============================================================================================
# Conversations with placeholder names

_REGISTRY: Dict[str, Tuple[str, str, List[str]]] = {}  # placeholder -> (kind, family or sem, original pool)


def make_tool_placeholder(rng: random.Random, family: str, used_names: set) -> SA.Tool:
    """synth_agents.make_tool with placeholder tool and parameter names (same descriptions,
    optional parameters, flags and strictness rules)."""
    fam = SA.FAMILIES[family]
    ti = len(used_names)
    name = f"QQT{ti}QQ"
    used_names.add(name)
    _REGISTRY[name] = ("tool", family, fam["names"])
    desc = rng.choice(fam["descs"])
    flags: Dict[str, Any] = {}
    if family == "read" and rng.random() < 0.35:
        flags["line_numbers"] = True
        desc = desc.rstrip(".") + ", with line numbers."
    params: List[SA.Param] = []
    for pi, (sem, keys, typ, descs, required, extra) in enumerate(fam["params"]):
        if not required and rng.random() < 0.45:
            continue
        key = f"QQK{ti}x{pi}QQ"
        _REGISTRY[key] = ("key", sem, keys)
        sch: Dict[str, Any] = {"type": typ}
        if rng.random() < 0.75:
            sch["description"] = rng.choice(descs)
        sch.update(extra)
        req = required if family != "list" else (required and rng.random() < 0.7)
        params.append(SA.Param(sem, key, sch, req))
    return SA.Tool(family, name, desc, params, strict=rng.random() < 0.4, flags=flags)


def gen_base(i: int, pool) -> Tuple[Dict[str, Any], Dict[str, Tuple[str, str, List[str]]]]:
    _REGISTRY.clear()
    saved = SA.make_tool
    SA.make_tool = make_tool_placeholder
    try:
        c = SA.gen_agent(f"{SETTINGS['seed']}:agent:{i}", pool)
    finally:
        SA.make_tool = saved
    return c, dict(_REGISTRY)


def draw_names(rng: random.Random, reg: Dict[str, Tuple[str, str, List[str]]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    used_tools: set = set()
    used_keys: Dict[str, set] = {}
    for ph in sorted(reg):
        kind, what, orig = reg[ph]
        if kind == "tool":
            for _ in range(100):
                n = draw_tool_name(rng, what)
                if n not in used_tools:
                    break
            used_tools.add(n)
        else:
            tool = ph.split("x")[0].replace("QQK", "")
            used = used_keys.setdefault(tool, set())
            for _ in range(100):
                n = draw_key(rng, what, orig)
                if n not in used:
                    break
            used.add(n)
        if PH_RE.search(n):
            raise RuntimeError("a drawn name looks like a placeholder")
        out[ph] = n
    if len(set(v for k, v in out.items() if reg[k][0] == "tool")) != sum(1 for k in reg if reg[k][0] == "tool"):
        raise RuntimeError("tool names not unique")
    return out


def substitute(text: str, names: Dict[str, str]) -> str:
    return PH_RE.sub(lambda m: names[m.group(0)], text)


def check_conversation(conv: Dict[str, Any]) -> None:
    """The substituted conversation's calls still validate against its schemas."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in conv["tools"]}
    for m in conv["messages"]:
        for tc in m.get("tool_calls") or []:
            errs = jsonschema_lite.validate(json.loads(tc["function"]["arguments"]), schemas[tc["function"]["name"]])
            if errs:
                raise RuntimeError(f"substituted call invalid: {errs}")


# =============================================================================================
# Token classes


def token_classes(tok: bpe.Tokenizer, ids: List[int], text: str) -> np.ndarray:
    """Class of each token from byte spans of the rendered text (see the module docstring)."""
    raw = text.encode("utf-8")
    cls = np.full(len(raw), BLOCK_CLASSES["context"], dtype=np.uint8)
    a_open, eos = ASSISTANT.encode(), EOS.encode()
    pos = 0
    while True:
        s = raw.find(a_open, pos)
        if s < 0:
            break
        s += len(a_open)
        e = raw.find(eos, s)
        e = len(raw) if e < 0 else e + len(eos)
        cls[s:e] = BLOCK_CLASSES["assistant"]
        seg = raw[s:e]
        for m in re.finditer(rb'(?:invoke|parameter) name="([^"]*")', seg):
            cls[s + m.start(1):s + m.end(1)] = BLOCK_CLASSES["name"]
        pos = e
    out = np.empty(len(ids), dtype=np.uint8)
    off = 0
    for k, t in enumerate(ids):
        b = tok.id_to_bytes[t]
        out[k] = cls[off:off + len(b)].max() if b else BLOCK_CLASSES["context"]
        off += len(b)
    if off != len(raw):
        raise RuntimeError(f"token bytes {off} != text bytes {len(raw)}")
    return out


# =============================================================================================
# Corpus text


def corpus_tokens(data: str, name: str, budget: int, rng: random.Random, tokenizer: str) -> List[np.ndarray]:
    docs = SA.docs_of(os.path.join(data, "docs", name))
    rng.shuffle(docs)
    chosen, n = [], 0
    for d in docs:
        if n >= budget:
            break
        chosen.append(d)
        n += len(d.encode("utf-8"))
    return tokenize_at_bos([SA.BOS + d for d in chosen], tokenizer)


def tokenize_at_bos(texts: List[str], tokenizer: str) -> List[np.ndarray]:
    """`dsx tokenize` of the joined texts (each starts with BOS), split before every BOS id."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False, newline="") as f:
        f.write("".join(texts))
        path = f.name
    try:
        r = subprocess.run([SA.dsx_bin(), "tokenize", "--tokenizer", tokenizer, "-f", path], capture_output=True, check=True)
    finally:
        os.remove(path)
    flat = np.fromstring(r.stdout, dtype=np.int64, sep=" ")
    starts = list(np.flatnonzero(flat == 0)) + [len(flat)]
    return [flat[starts[k]:starts[k + 1]] for k in range(len(starts) - 1)]


def tokenize_conversations(texts: List[str], tokenizer: str) -> List[np.ndarray]:
    """Rendered conversations -> one id array each."""
    ids = tokenize_at_bos(texts, tokenizer)
    if len(ids) != len(texts):
        raise SystemExit(f"tokenized {len(ids)} conversations, expected {len(texts)}")
    return ids


def verify_renders(what: str, convs: List[Dict[str, Any]], ids: List[np.ndarray], workers: int, tokenizer: str) -> int:
    """Every VERIFY_EVERY-th conversation rendered again with `dsx render --ids`: equal ids."""
    check = list(range(0, len(convs), SETTINGS["verify_every"]))
    direct = SA.render_all([SA.request_json(convs[k]) for k in check], tokenizer, workers)
    for k, d in zip(check, direct):
        if d != ids[k].tolist():
            raise SystemExit(f"{what} {k}: render + tokenize differs from dsx render --ids")
    return len(check)


class CorpusStream:
    """Pieces of corpus documents (each starting with BOS) in a seeded order, endlessly."""

    def __init__(self, docs: List[np.ndarray], rng: random.Random):
        self.docs, self.rng, self.cur, self.k = docs, rng, None, 0
        self.order: List[int] = []

    def take(self, n: int) -> np.ndarray:
        out = []
        while n > 0:
            if self.cur is None or len(self.cur) == 0:
                if not self.order:
                    self.order = list(range(len(self.docs)))
                    self.rng.shuffle(self.order)
                self.cur = self.docs[self.order.pop()]
            piece = self.cur[:n] if self.cur[0] == 0 else np.concatenate([[0], self.cur[:n - 1]])
            used = len(piece) if self.cur[0] == 0 else len(piece) - 1
            self.cur = self.cur[used:]
            out.append(piece)
            n -= len(piece)
        return np.concatenate(out)


# =============================================================================================


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(REPO, "train", "out", "data"))
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "train", "out", "tokenizer.json"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--base", type=int, default=SETTINGS["base_conversations"])
    args = ap.parse_args()
    SETTINGS["base_conversations"] = args.base
    out = args.out or os.path.join(args.data, "ft")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    tok = bpe.Tokenizer(args.tokenizer)
    pool = SA.function_pool(args.data, SA.SETTINGS["pool_files"], SA.SETTINGS["seed"])
    log(f"function pool: {len(pool)} functions")

    eval_prompts = set()
    ev_path = os.path.join(args.data, "agent_eval.jsonl")
    if os.path.exists(ev_path):
        with open(ev_path, encoding="utf-8") as f:
            for line in f:
                e = json.loads(line)
                eval_prompts.add(SA.jdump([e["tools"], e["thinking"], e["messages"]]))

    bases = [gen_base(i, pool) for i in range(SETTINGS["base_conversations"])]
    log(f"{len(bases)} base conversations ({time.time() - t0:.1f} s); rendering with placeholders")
    # The renders with placeholders depend only on the base conversations: cached by their hash.
    reqs = [SA.request_json(c) for c, _ in bases]
    key = hashlib.sha256(SA.jdump(reqs).encode() + open(SA.dsx_bin(), "rb").read(1 << 20)).hexdigest()
    cache = os.path.join(out, "base_renders.json")
    texts = None
    if os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            c = json.load(f)
        texts = c["texts"] if c.get("key") == key else None
    if texts is None:
        texts = SA.render_all(reqs, None, args.workers)
        with open(cache, "w", encoding="utf-8") as f:
            json.dump({"key": key, "texts": texts}, f, ensure_ascii=False)
    log(f"rendered ({time.time() - t0:.1f} s)")

    variants = []  # (conversation, text)
    for i, ((c, reg), text) in enumerate(zip(bases, texts)):
        if set(PH_RE.findall(text)) - set(reg):
            raise SystemExit(f"conversation {i}: unknown placeholder in the rendered text")
        for v in range(SETTINGS["variants"]):
            names = draw_names(random.Random(f"{SETTINGS['seed']}:names:{i}:{v}"), reg)
            conv = json.loads(substitute(SA.jdump(c), names))
            check_conversation(conv)
            for k in range(1, len(conv["messages"]) + 1):
                if SA.jdump([conv["tools"], conv["thinking"], conv["messages"][:k]]) in eval_prompts:
                    raise SystemExit(f"conversation {i} variant {v}: a prefix equals a held-out eval prompt")
            variants.append((conv, substitute(text, names)))

    ids = tokenize_conversations([t for _, t in variants], args.tokenizer)
    n_checked = verify_renders("variant", [c for c, _ in variants], ids, args.workers, args.tokenizer)
    log(f"{len(variants)} variants tokenized; {n_checked} checked against dsx render --ids ({time.time() - t0:.1f} s)")

    chats = [SA.gen_chat(f"{SETTINGS['seed']}:chat:{i}", pool) for i in range(SETTINGS["chats"])]
    chat_texts = SA.render_all([SA.request_json(c) for c in chats], None, args.workers)
    chat_ids = tokenize_conversations(chat_texts, args.tokenizer)
    verify_renders("chat", chats, chat_ids, args.workers, args.tokenizer)
    log(f"{len(chats)} plain chats rendered and tokenized ({time.time() - t0:.1f} s)")

    B = SETTINGS["block"]
    convs = [(x, token_classes(tok, x.tolist(), t)) for x, (_, t) in zip(ids, variants) if len(x) <= B]
    n_agent_convs = len(convs)
    convs += [(x, token_classes(tok, x.tolist(), t)) for x, t in zip(chat_ids, chat_texts) if len(x) <= B]
    dropped = len(variants) + len(chats) - len(convs)
    rng = random.Random(f"{SETTINGS['seed']}:pack")
    rng.shuffle(convs)
    crng = random.Random(f"{SETTINGS['seed']}:corpus")
    code = corpus_tokens(args.data, "train_code.txt", SETTINGS["code_text_bytes"], crng, args.tokenizer)
    code += corpus_tokens(args.data, "train_docs.txt", SETTINGS["docs_text_bytes"], crng, args.tokenizer)
    code += corpus_tokens(args.data, "train_js.txt", SETTINGS["js_text_bytes"], crng, args.tokenizer)
    stream = CorpusStream(code, crng)
    log(f"corpus text: {len(code)} documents, {sum(len(d) for d in code)} tokens ({time.time() - t0:.1f} s)")

    blocks_ids, blocks_cls = [], []
    counts = {k: 0 for k in BLOCK_CLASSES}
    n_code_blocks = 0
    q = 0
    while q < len(convs):
        if rng.random() < SETTINGS["code_block_fraction"]:
            blocks_ids.append(stream.take(B))
            blocks_cls.append(np.zeros(B, dtype=np.uint8))
            n_code_blocks += 1
            continue
        bi, bc, n = [], [], 0
        while q < len(convs) and n + len(convs[q][0]) <= B:
            bi.append(convs[q][0])
            bc.append(convs[q][1])
            n += len(convs[q][0])
            q += 1
        if n < B:
            bi.append(stream.take(B - n))
            bc.append(np.zeros(B - n, dtype=np.uint8))
        blocks_ids.append(np.concatenate(bi))
        blocks_cls.append(np.concatenate(bc))
    all_ids = np.concatenate(blocks_ids)
    all_cls = np.concatenate(blocks_cls)
    if len(all_ids) != len(all_cls) or len(all_ids) % B:
        raise SystemExit("packing error")
    if all_ids.max() >= 65536:
        raise SystemExit("id outside uint16")
    for name, v in BLOCK_CLASSES.items():
        counts[name] = int((all_cls == v).sum())
    all_ids.astype("<u2").tofile(os.path.join(out, "train.bin"))
    all_cls.tofile(os.path.join(out, "train.classes.bin"))

    val = corpus_tokens(args.data, "val_code.txt", 1 << 40, random.Random(0), args.tokenizer)
    np.concatenate(val).astype("<u2").tofile(os.path.join(out, "val.bin"))
    stats = {"settings": SETTINGS, "variants": len(variants), "agent_conversations": n_agent_convs,
             "chats": len(convs) - n_agent_convs, "dropped_over_block": dropped,
             "verified_with_render_ids": n_checked, "blocks": len(blocks_ids), "code_only_blocks": n_code_blocks,
             "tokens": int(len(all_ids)), "tokens_by_class": counts,
             "val_tokens": int(sum(len(v) for v in val)),
             "sha256": {f: hashlib.sha256(open(os.path.join(out, f), "rb").read()).hexdigest()
                        for f in ("train.bin", "train.classes.bin", "val.bin")},
             "tokenizer_sha256": hashlib.sha256(open(args.tokenizer, "rb").read()).hexdigest()}
    with open(os.path.join(out, "stats.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    log(f"train.bin: {len(all_ids)} tokens in {len(blocks_ids)} blocks ({n_code_blocks} corpus only); classes "
        f"{json.dumps(counts)}; done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
