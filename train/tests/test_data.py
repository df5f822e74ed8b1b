"""Tests of the data side of the small trained model (issue 24, part D): the Python BPE
encoder, the project tokenizer, dsx agreement, the synthetic agent conversations and the
corpus manifest.

    /usr/bin/python3 -m unittest discover -s train/tests

Tests that need built outputs (train/out/, from train/data/build_all.sh) or the dsx binary
(build-cpu/dsx, or $DSX) skip when those are missing.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DATA_CODE = os.path.join(REPO, "train", "data")
sys.path.insert(0, DATA_CODE)

import bpe  # noqa: E402
import classics  # noqa: E402
import dsml_lite  # noqa: E402
import jsonschema_lite  # noqa: E402

_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN_DIR = os.path.join(_GOLDEN_ROOT, "tokenizer")
GOLDEN_V41 = os.path.join(GOLDEN_DIR, "tokenizer-v41.json")
GOLDEN_V3 = os.path.join(GOLDEN_DIR, "tokenizer-v3-base.json")
GOLDEN_CASES = os.path.join(GOLDEN_DIR, "cases.jsonl")
OUT = os.path.join(REPO, "train", "out")
TOK = os.path.join(OUT, "tokenizer.json")
DATA = os.path.join(OUT, "data")
DSX = os.environ.get("DSX", os.path.join(REPO, "build-cpu", "dsx"))
BAR = "\uff5c"

_TOKS = {}


def tokenizer(path):
    if path not in _TOKS:
        _TOKS[path] = bpe.Tokenizer(path)
    return _TOKS[path]


def need(*paths):
    for p in paths:
        if not os.path.exists(p):
            raise unittest.SkipTest(f"{os.path.relpath(p, REPO) if p.startswith(REPO) else p} missing")


def dsx(*args, input_text=None):
    need(DSX)
    r = subprocess.run([DSX, *args], capture_output=True, input=input_text)
    if r.returncode != 0:
        raise AssertionError(f"dsx {' '.join(args)} failed: {r.stderr.decode(errors='replace')[:400]}")
    return r.stdout


def dsx_ids(text: str, tok: str):
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False, newline="") as f:
        f.write(text)
    try:
        return [int(x) for x in dsx("tokenize", "--tokenizer", tok, "-f", f.name).split()]
    finally:
        os.remove(f.name)


def golden_cases():
    need(GOLDEN_CASES)
    with open(GOLDEN_CASES, encoding="utf-8") as f:
        return [json.loads(l) for l in f]


# ---------------------------------------------------------------------------------------------


class TestEncoderAgainstGoldens(unittest.TestCase):
    """The Python encoder reproduces the HF `tokenizers` goldens (independent of the engine)."""

    def test_golden_cases_v3_base(self):
        need(GOLDEN_V3)
        tok = tokenizer(GOLDEN_V3)
        for c in golden_cases():
            with self.subTest(text=c["text"][:40]):
                ids = tok.encode(c["text"])
                self.assertEqual(ids, c["ids"], bpe.ids_equal_report(ids, c["ids"]))
                self.assertEqual(tok.decode_bytes(ids), c["text"].encode("utf-8"))

    def test_pretokenizer_examples(self):
        # spec chat-and-serving.md §1.3
        self.assertEqual(bpe.pretokenize("1234567"), ["123", "456", "7"])
        self.assertEqual(bpe.pretokenize("   abc"), ["  ", " abc"])
        self.assertEqual(bpe.pretokenize("x = foo.bar(1)\n"), ["x", " =", " foo", ".bar", "(", "1", ")\n"])


class TestBpeTraining(unittest.TestCase):
    def test_merges_reproduce_counts(self):
        # Property: the first merge is the most frequent pair; the learned merges encode the
        # training pieces to fewer symbols; deterministic for equal input.
        counts = {b"hello": 5, b"help": 3, b"yellow": 2, b"hell": 1}
        m1 = bpe.train_bpe(counts, 6)
        m2 = bpe.train_bpe(dict(reversed(list(counts.items()))), 6)
        self.assertEqual(m1, m2)
        pairs = {}
        for w, c in counts.items():
            for a, b in zip(w, w[1:]):
                pairs[(bytes([a]), bytes([b]))] = pairs.get((bytes([a]), bytes([b])), 0) + c
        best = max(pairs.values())
        self.assertEqual(pairs[m1[0]], best)
        self.assertIn(m1[0], [p for p, c in pairs.items() if c == best])
        self.assertEqual(m1[0], (b"e", b"l"))  # e-l occurs 11 times, l-l 8


class TestTokenizerFile(unittest.TestCase):
    def setUp(self):
        need(TOK, GOLDEN_V41)
        with open(TOK, encoding="utf-8") as f:
            self.tj = json.load(f)
        with open(GOLDEN_V41, encoding="utf-8") as f:
            self.gold = json.load(f)

    def test_added_tokens_kept(self):
        mine = {a["content"]: a for a in self.tj["added_tokens"]}
        self.assertEqual(len(mine), len(self.gold["added_tokens"]))
        for g in self.gold["added_tokens"]:
            a = mine.get(g["content"])
            self.assertIsNotNone(a, g["content"])
            for k in ("special", "normalized", "lstrip", "rstrip", "single_word"):
                self.assertEqual(a[k], g[k], f"{g['content']} {k}")
        ids = [a["id"] for a in self.tj["added_tokens"]]
        self.assertEqual(len(set(ids)), len(ids))
        by = {a["content"]: a["id"] for a in self.tj["added_tokens"]}
        self.assertEqual(by["<\uff5cbegin\u2581of\u2581sentence\uff5c>"], 0)
        self.assertEqual(by["<\uff5cend\u2581of\u2581sentence\uff5c>"], 1)
        self.assertEqual(by["<\uff5c\u2581pad\u2581\uff5c>"], 2)

    def test_config_sections_equal_v41(self):
        for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            self.assertEqual(self.tj[k], self.gold[k], k)

    def test_vocab_and_size(self):
        tok = tokenizer(TOK)
        self.assertEqual(tok.size % 32, 0)
        self.assertLess(tok.size, 65536)
        for b in range(256):
            self.assertIn(bpe.BYTE_TO_CHAR[b], tok.vocab)
        ids = sorted(list(tok.vocab.values()) + [a["id"] for a in tok.added if a["content"] not in tok.vocab])
        self.assertEqual(ids, list(range(tok.size)))  # dense
        for r, (a, b) in enumerate(tok.merges):
            self.assertIn(a, tok.vocab)
            self.assertIn(b, tok.vocab)
            self.assertEqual(tok.vocab[a + b], 259 + r)

    def test_round_trip(self):
        tok = tokenizer(TOK)
        texts = [c["text"] for c in golden_cases()]
        texts.append("def f(x):\n\treturn x ** 2  # \u00e9\u00e8 \u4e2d\u6587 \U0001f600\r\n")
        for t in texts:
            self.assertEqual(tok.decode_bytes(tok.encode(t)), t.encode("utf-8"), t[:40])
            self.assertEqual(tok.decode_bytes(tok.encode(t, allow_added=False)), t.encode("utf-8"), t[:40])

    def test_special_tokens_are_single_ids(self):
        tok = tokenizer(TOK)
        for a in tok.added:
            self.assertEqual(tok.encode("x" + a["content"] + "y")[1:-1], [a["id"]], a["content"])


class TestDsxAgreement(unittest.TestCase):
    """build-cpu/dsx encodes exactly like the Python encoder with the project tokenizer."""

    def setUp(self):
        need(TOK, DSX)

    def test_heldout_code(self):
        p = os.path.join(DATA, "heldout_code.txt")
        need(p)
        with open(p, encoding="utf-8") as f:
            text = f.read()
        py = tokenizer(TOK).encode(text)
        self.assertEqual(dsx_ids(text, TOK), py)
        self.assertEqual(tokenizer(TOK).decode_bytes(py), text.encode("utf-8"))

    def test_golden_case_texts_and_markers(self):
        text = "\n\n".join(c["text"] for c in golden_cases())
        text += "\n<think>x</think><\uff5cUser\uff5c>y<\uff5cAssistant\uff5c>" + BAR + "DSML" + BAR + " calls>"
        self.assertEqual(dsx_ids(text, TOK), tokenizer(TOK).encode(text))

    def test_detokenize(self):
        tok = tokenizer(TOK)
        ids = tok.encode("Complete this Python function: def fib(n):\n    return n")
        out = dsx("detokenize", "--tokenizer", TOK, "--ids", " ".join(map(str, ids)))
        self.assertEqual(out.rstrip(b"\n"), tok.decode_bytes(ids))

    def test_render(self):
        tok = tokenizer(TOK)
        conv = {"messages": [{"role": "system", "content": "You are a coding agent."},
                             {"role": "user", "content": "Show a.txt"},
                             {"role": "assistant", "reasoning_content": "Read it.", "content": "",
                              "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\", \"limit\": 10}"}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "hello"}],
                "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
                    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]}}}],
                "thinking_mode": "thinking"}
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".json", delete=False) as f:
            json.dump(conv, f)
        try:
            text = dsx("render", "--profile", "v41", "--messages", f.name).decode("utf-8")
            ids = [int(x) for x in dsx("render", "--profile", "v41", "--messages", f.name, "--tokenizer", TOK, "--ids").split()]
        finally:
            os.remove(f.name)
        self.assertEqual(tok.decode_bytes(ids), text.encode("utf-8"))
        self.assertEqual(ids, tok.encode(text))
        self.assertEqual(ids[0], 0)
        for marker in ("<\uff5cSystem\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "</think>", BAR + "DSML" + BAR,
                       "<\uff5cend\u2581of\u2581sentence\uff5c>"):
            self.assertIn(tok.token_to_id(marker), ids, marker)
        self.assertEqual(ids[-1], tok.token_to_id("<think>"))
        # the DSML block in the rendered prompt parses back to the call
        k = text.index(dsml_lite.OPEN, text.index("<\uff5cUser\uff5c>"))  # after the tools block's example
        calls, _ = dsml_lite.parse_block(text, k)
        self.assertEqual(calls, [{"name": "read_file", "arguments": {"path": "a.txt", "limit": 10}}])


# ---------------------------------------------------------------------------------------------


class TestSchemaValidatorAndDsml(unittest.TestCase):
    def test_validator(self):
        s = {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer", "minimum": 1},
                                              "tags": {"type": "array", "items": {"type": "string"}},
                                              "mode": {"type": "string", "enum": ["a", "b"]}},
             "required": ["path"], "additionalProperties": False}
        self.assertEqual(jsonschema_lite.validate({"path": "x", "n": 2, "tags": ["a"], "mode": "b"}, s), [])
        for bad in ({}, {"path": 1}, {"path": "x", "n": 0}, {"path": "x", "n": True}, {"path": "x", "n": 1.5},
                    {"path": "x", "tags": ["a", 2]}, {"path": "x", "mode": "c"}, {"path": "x", "extra": 1}, []):
            self.assertNotEqual(jsonschema_lite.validate(bad, s), [], bad)

    def test_dsml_parser(self):
        D = BAR + "DSML" + BAR
        text = ("I will read it.</think>\n\n<" + D + " calls>\n<" + D + ' invoke name="read_file">\n<' + D +
                ' parameter name="path" string="true">a b.txt</' + D + " parameter>\n<" + D +
                ' parameter name="limit" string="false">10</' + D + " parameter>\n</" + D + " invoke>\n</" + D + " calls>")
        r = dsml_lite.parse_completion(text, thinking=True)
        self.assertIsNone(r["error"])
        self.assertEqual(r["reasoning"], "I will read it.")
        self.assertEqual(r["calls"], [{"name": "read_file", "arguments": {"path": "a b.txt", "limit": 10}}])
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]}}}]
        self.assertEqual(dsml_lite.check_completion(text, tools, True), (True, "read_file"))
        self.assertFalse(dsml_lite.check_completion(text.replace('"false">10', '"false">ten'), tools, True)[0])
        self.assertFalse(dsml_lite.check_completion(text.replace("read_file", "cat"), tools, True)[0])
        self.assertFalse(dsml_lite.check_completion(text.split("</" + D + " calls>")[0], tools, True)[0])
        self.assertFalse(dsml_lite.check_completion("no call", tools, False)[0])


class TestClassics(unittest.TestCase):
    def test_implementations_agree_and_bugs_change_results(self):
        for e in classics.CLASSICS:
            base = e["impls"][0].split("(")[0][4:]
            ref = {c: classics.run_call(e["impls"][0], base, c) for c in e["calls"]}
            for im in e["impls"][1:]:
                for c in e["calls"]:
                    self.assertEqual(classics.run_call(im, base, c), ref[c], (base, c))
            for old, new in e["bugs"]:
                self.assertIn(old, e["impls"][0], base)
                buggy = e["impls"][0].replace(old, new, 1)
                self.assertTrue(any(classics.run_call(buggy, base, c) != ref[c] for c in e["calls"][:3]), (base, old))


def load_convs(split, limit=None):
    p = os.path.join(DATA, "agents", f"{split}.jsonl")
    need(p)
    out = []
    with open(p, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if limit and len(out) >= limit:
                break
    return out


class TestAgentConversations(unittest.TestCase):
    def setUp(self):
        need(TOK, os.path.join(DATA, "agents", "train.bin"))

    def test_tool_calls_validate_in_json(self):
        n = 0
        for c in load_convs("train"):
            schemas = dsml_lite.tool_schemas(c["tools"])
            for m in c["messages"]:
                for tc in m.get("tool_calls") or []:
                    fn = tc["function"]
                    self.assertIn(fn["name"], schemas)
                    errs = jsonschema_lite.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
                    self.assertEqual(errs, [], (c["scenario"], fn))
                    n += 1
        self.assertGreater(n, 1000)

    def test_rendered_ids_parse_and_validate(self):
        # Decode what the model trains on and parse it independently of the generator.
        import numpy as np

        tok = tokenizer(TOK)
        ids = np.fromfile(os.path.join(DATA, "agents", "train.bin"), dtype="<u2")
        n_calls = 0
        for c in load_convs("train", limit=400):
            seq = ids[c["offset"]:c["offset"] + c["length"]].tolist()
            self.assertEqual(seq[0], 0)
            text = tok.decode_bytes(seq).decode("utf-8")
            want = [{"name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}
                    for m in c["messages"] if m["role"] == "assistant" for tc in (m.get("tool_calls") or [])]
            got, i = [], text.find("<\uff5cUser\uff5c>")  # after the tools block's example
            while True:
                k = text.find(dsml_lite.OPEN, i)
                if k < 0:
                    break
                calls, i = dsml_lite.parse_block(text, k)
                got += calls
            self.assertEqual(got, want, c["scenario"])
            schemas = dsml_lite.tool_schemas(c["tools"])
            for call in got:
                self.assertEqual(jsonschema_lite.validate(call["arguments"], schemas[call["name"]]), [])
            n_calls += len(got)
            self.assertEqual(text.count("<\uff5cend\u2581of\u2581sentence\uff5c>"),
                             sum(1 for m in c["messages"] if m["role"] == "assistant"))
        self.assertGreater(n_calls, 300)

    def test_eval_set(self):
        p = os.path.join(DATA, "agent_eval.jsonl")
        need(p)
        tok = tokenizer(TOK)
        think, think_end, asst = tok.token_to_id("<think>"), tok.token_to_id("</think>"), tok.token_to_id("<\uff5cAssistant\uff5c>")
        with open(p, encoding="utf-8") as f:
            evals = [json.loads(l) for l in f]
        self.assertGreaterEqual(len(evals), 150)
        train_keys = set()
        for c in load_convs("train"):
            for j in range(1, len(c["messages"]) + 1):
                train_keys.add(hashlib.sha256(json.dumps([c["tools"], c["thinking"], c["messages"][:j]],
                                                         ensure_ascii=False).encode()).digest())
        for e in evals:
            self.assertEqual(e["prompt_ids"][0], 0)
            self.assertEqual(e["prompt_ids"][-2], asst)
            self.assertEqual(e["prompt_ids"][-1], think if e["thinking"] else think_end)
            names = [t["function"]["name"] for t in e["tools"]]
            self.assertIn(e["expected_tool"], names)
            schemas = dsml_lite.tool_schemas(e["tools"])
            for call in e["expected_calls"]:
                self.assertEqual(jsonschema_lite.validate(call["arguments"], schemas[call["name"]]), [])
            key = hashlib.sha256(json.dumps([e["tools"], e["thinking"], e["messages"]], ensure_ascii=False).encode()).digest()
            self.assertNotIn(key, train_keys)
            self.assertEqual(dsml_lite.check_completion(e["reference_completion"], e["tools"], e["thinking"]),
                             (True, ",".join(c["name"] for c in e["expected_calls"])))
            self.assertEqual(dsml_lite.parse_completion(e["reference_completion"], e["thinking"])["calls"], e["expected_calls"])


class TestCheckerOnRenderedTurns(unittest.TestCase):
    """Positive control of the completion checker against dsx's renderer: the assistant turns
    with tool calls of training conversations, as dsx renders them after their prompt, pass."""

    def test_rendered_call_turns_pass(self):
        need(DSX)
        n = 0
        for c in load_convs("train", limit=60):
            for m_index, m in enumerate(c["messages"]):
                if m["role"] != "assistant" or not m.get("tool_calls") or n >= 40:
                    continue
                texts = []
                for msgs in (c["messages"][:m_index], c["messages"][:m_index + 1]):
                    req = {"messages": msgs, "tools": c["tools"], "thinking_mode": "thinking" if c["thinking"] else "chat"}
                    if c.get("effort"):
                        req["reasoning_effort"] = c["effort"]
                    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".json", delete=False) as f:
                        json.dump(req, f, ensure_ascii=False)
                    try:
                        texts.append(dsx("render", "--profile", "v41", "--messages", f.name).decode("utf-8"))
                    finally:
                        os.remove(f.name)
                prompt, full = texts
                self.assertTrue(full.startswith(prompt))
                ok, detail = dsml_lite.check_completion(full[len(prompt):], c["tools"], c["thinking"])
                self.assertTrue(ok, detail)
                n += 1
        self.assertGreater(n, 10)


class TestManifestAndTokenFiles(unittest.TestCase):
    def setUp(self):
        need(os.path.join(DATA, "manifest.json"))
        with open(os.path.join(DATA, "manifest.json"), encoding="utf-8") as f:
            self.m = json.load(f)

    def test_file_hashes(self):
        roots = {s["name"]: s["root"] for s in self.m["sources"]}
        checked = 0
        kept = [r for r in self.m["files"] if r["status"] in ("train", "val", "heldout")]
        self.assertGreater(len(kept), 1000)
        for r in kept:
            p = os.path.join(roots[r["source"]], r["path"])
            if not os.path.exists(p):
                continue  # another machine
            with open(p, "rb") as f:
                data = f.read()
            if p.endswith(".gz"):
                data = gzip.decompress(data)
            self.assertEqual(hashlib.sha256(data).hexdigest(), r["sha256"], p)
            self.assertEqual(len(data), r["bytes"], p)
            self.assertTrue(r.get("license"), p)
            checked += 1
        if checked == 0:
            self.skipTest("source files not on this machine")

    def test_heldout_is_disjoint(self):
        held = {r["sha256"] for r in self.m["files"] if r["status"] == "heldout"}
        other = {r["sha256"] for r in self.m["files"] if r["status"] in ("train", "val")}
        self.assertTrue(held)
        self.assertFalse(held & other)
        hdir = os.path.join(DATA, "heldout_code")
        on_disk = set()
        for d, _, fs in os.walk(hdir):
            for fn in fs:
                with open(os.path.join(d, fn), "rb") as f:
                    on_disk.add(hashlib.sha256(f.read()).hexdigest())
        self.assertEqual(on_disk, held)
        with open(os.path.join(DATA, "heldout_code.txt"), "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), self.m["heldout_code_txt"]["sha256"])
        for k, v in self.m["documents"].items():
            with open(os.path.join(DATA, v["file"]), "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), v["sha256"], k)

    def test_token_files(self):
        import numpy as np

        need(TOK, os.path.join(DATA, "tokens.json"))
        with open(os.path.join(DATA, "tokens.json"), encoding="utf-8") as f:
            t = json.load(f)
        size = tokenizer(TOK).size
        for split in ("train", "val"):
            path = os.path.join(DATA, f"{split}.bin")
            with open(path, "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), t[split]["sha256"])
            ids = np.fromfile(path, dtype="<u2")
            off = np.fromfile(os.path.join(DATA, f"{split}.offsets.bin"), dtype="<u8")
            kinds = np.fromfile(os.path.join(DATA, f"{split}.kinds.bin"), dtype=np.uint8)
            self.assertEqual(len(ids), t[split]["tokens"])
            self.assertEqual(len(off), len(kinds))
            self.assertEqual(int(off[0]), 0)
            self.assertTrue((np.diff(off.astype(np.int64)) > 0).all())
            self.assertTrue((ids[off.astype(np.int64)] == 0).all())
            self.assertEqual(int((ids == 0).sum()), len(off))  # BOS only at document starts
            self.assertLess(int(ids.max()), size)


if __name__ == "__main__":
    unittest.main()
