#!/usr/bin/python3
"""Synthetic coding-agent conversations and Python chats for the small model (issue 24, D).

Every conversation is generated from its own seeded random stream (seed, split, index),
so the output is deterministic. A conversation has tool schemas (JSON Schema; tool
families read / write / edit / shell / search / list / tests / python / ... whose names,
descriptions and parameter names vary per conversation so that the model has to read the
schema), an optional system prompt, a user request, reasoning (thinking mode), DSML tool
calls whose JSON arguments validate against the schema, tool results computed from a
simulated repository (files built from functions of the training corpus and from
classics.py; test outputs and program outputs computed by running the code), more calls,
and a final answer. Plain chats (no tools) ask to complete / explain / document Python
functions from the training corpus or from classics.py.

Rendering is dsx's own (build-cpu/dsx render), two processes at a time:
  --sample-text        render the first SETTINGS.sample_text_conversations training
                       conversations as text (no tokenizer needed) to agents/sample_text.txt,
                       for the tokenizer's training sample
  (default)            render all splits to ids with train/out/tokenizer.json:
                       agents/{train,val}.bin (uint16 LE, each conversation starts with BOS),
                       agents/{train,val}.jsonl (the conversation JSON + offset, length),
                       agent_eval.jsonl (held-out prompts: messages, tools, prompt_ids,
                       expected_tool, expected_calls, reference_completion = the rendered
                       target turn, which passes dsml_lite.check_completion), agents/stats.json.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import classics  # noqa: E402
import dsml_lite  # noqa: E402
import jsonschema_lite  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"

SETTINGS = {
    "seed": 24,
    "train_agents": 10000,
    "train_chats": 6000,
    "val_agents": 120,
    "val_chats": 80,
    "eval_prompts": 200,
    "eval_chats": 40,  # held-out plain chats (no tools): chat_eval.jsonl
    "eval_max_tokens": 1024,  # prompt + reference turn
    "thinking_fraction": 0.5,
    "follow_up_fraction": 0.2,
    "sample_text_conversations": 1500,
    "pool_files": 2500,
    "verify_every": 20,  # every 20th conversation is also rendered with `dsx render --ids` and compared
}


def log(msg: str) -> None:
    print(f"[agents {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# =============================================================================================
# Function pool from the training corpus


def docs_of(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [d for d in f.read().split(BOS) if d]


class Func:
    def __init__(self, name: str, src: str, sig: str, doc: Optional[str], args: List[str]):
        self.name, self.src, self.sig, self.doc, self.args = name, src, sig, doc, args

    def doc_line(self) -> Optional[str]:
        """The first sentence of the docstring's first paragraph, or None."""
        if not self.doc:
            return None
        para = " ".join(l.strip() for l in self.doc.strip().split("\n\n")[0].split("\n"))
        line = para.split(". ")[0].strip()
        if line and not line.endswith((".", "!", "?", ":")):
            line += "."
        return line if 8 <= len(line) <= 160 else None


def function_pool(data_dir: str, max_files: int, seed: int) -> List[Func]:
    docs = docs_of(os.path.join(data_dir, "docs", "train_code.txt"))
    docs.sort(key=lambda d: hashlib.sha256(f"{seed}:pool:".encode() + d.encode("utf-8")).digest())
    pool: List[Func] = []
    seen = set()
    for d in docs[:max_files]:
        try:
            tree = ast.parse(d)
        except (SyntaxError, ValueError, RecursionError):
            continue
        lines = d.split("\n")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            n = node.end_lineno - node.lineno + 1
            if not 3 <= n <= 28 or node.name in seen or node.name.startswith(("__", "test")):
                continue
            src_lines = lines[node.lineno - 1 : node.end_lineno]
            if not src_lines[0].startswith(f"def {node.name}("):
                continue
            if any(len(l) > 88 or "\t" in l for l in src_lines):
                continue
            src = "\n".join(src_lines) + "\n"
            if not src.isascii() or "</tool_result>" in src:
                continue
            body0 = node.body[0].lineno - node.lineno
            sig = "\n".join(src_lines[: max(1, body0)])
            if not sig.rstrip().endswith(":"):
                continue
            args = [a.arg for a in node.args.args]
            seen.add(node.name)
            pool.append(Func(node.name, src, sig, ast.get_docstring(node), args))
    return pool


# =============================================================================================
# Tool families


class Param:
    def __init__(self, sem: str, key: str, schema: Dict[str, Any], required: bool):
        self.sem, self.key, self.schema, self.required = sem, key, schema, required


class Tool:
    def __init__(self, family: str, name: str, description: str, params: List[Param], strict: bool, flags: Dict[str, Any]):
        self.family, self.name, self.description, self.params, self.strict, self.flags = (
            family, name, description, params, strict, flags)

    def schema(self) -> Dict[str, Any]:
        s: Dict[str, Any] = {"type": "object", "properties": {p.key: p.schema for p in self.params}}
        req = [p.key for p in self.params if p.required]
        if req:
            s["required"] = req
        if self.strict:
            s["additionalProperties"] = False
        return s

    def to_json(self) -> Dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema()}}

    def has(self, sem: str) -> bool:
        return any(p.sem == sem for p in self.params)

    def key(self, sem: str) -> str:
        return next(p.key for p in self.params if p.sem == sem)

    def args(self, **vals: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for p in self.params:
            v = vals.get(p.sem)
            if v is None:
                if p.required:
                    raise ValueError(f"{self.name}: required {p.sem} missing")
                continue
            out[p.key] = v
        errs = jsonschema_lite.validate(out, self.schema())
        if errs:
            raise ValueError(f"{self.name}: generated arguments invalid: {errs}")
        return out


def P(sem, keys, typ, descs, required=False, extra=None):
    return (sem, keys, typ, descs, required, extra or {})


FAMILIES: Dict[str, Dict[str, Any]] = {
    "read": {
        "names": ["read_file", "open_file", "view_file", "cat", "read", "fs_read", "get_file", "file_read",
                  "ReadFile", "readFile", "load_file", "show_file"],
        "descs": ["Read the contents of a file.", "Return the text of a file in the workspace.",
                  "Open a file and return its content.", "Reads a file from the local filesystem.",
                  "Read a text file from the repository and return it."],
        "params": [
            P("path", ["path", "file_path", "filename", "file", "filepath", "target_file"], "string",
              ["Path of the file to read", "Relative path to the file", "The file to open", "File path relative to the project root"], True),
            P("start", ["start_line", "offset", "line_start", "from_line", "first_line"], "integer",
              ["First line to return (1-based)", "Line number to start reading from"]),
            P("limit", ["limit", "max_lines", "num_lines", "line_count"], "integer",
              ["Maximum number of lines to return", "How many lines to read"]),
        ],
    },
    "write": {
        "names": ["write_file", "create_file", "save_file", "fs_write", "put_file", "WriteFile", "writeFile", "write"],
        "descs": ["Write text to a file, creating it if needed.", "Create or overwrite a file with the given content.",
                  "Save content to a file in the workspace.", "Writes a file to the local filesystem."],
        "params": [
            P("path", ["path", "file_path", "filename", "file", "filepath"], "string",
              ["Path of the file to write", "Destination file path", "Where to save the file"], True),
            P("content", ["content", "contents", "text", "data", "body", "file_text"], "string",
              ["The full text to write", "Content of the file", "Text to store in the file"], True),
            P("overwrite", ["overwrite", "force", "replace_existing"], "boolean",
              ["Overwrite the file if it exists", "Replace an existing file"]),
        ],
    },
    "edit": {
        "names": ["edit_file", "replace_in_file", "apply_edit", "str_replace", "patch_file", "EditFile",
                  "modify_file", "edit"],
        "descs": ["Replace an exact string in a file with another string.",
                  "Edit a file by replacing old text with new text.",
                  "Performs an exact string replacement in a file.",
                  "Apply a search-and-replace edit to one file."],
        "params": [
            P("path", ["path", "file_path", "filename", "file"], "string", ["File to edit", "Path of the file to modify"], True),
            P("old", ["old_string", "old_text", "search", "find", "old_str", "target"], "string",
              ["Exact text to replace", "The text to search for", "Existing text (must match exactly)"], True),
            P("new", ["new_string", "new_text", "replace", "replacement", "new_str"], "string",
              ["Text to insert instead", "The replacement text", "New text"], True),
            P("all", ["replace_all", "all_occurrences", "global"], "boolean",
              ["Replace every occurrence instead of the first one", "Replace all matches"]),
        ],
    },
    "shell": {
        "names": ["run_shell", "bash", "shell", "exec_command", "run_command", "terminal", "execute", "sh",
                  "run_bash", "Bash"],
        "descs": ["Run a shell command and return its output.", "Execute a bash command in the project directory.",
                  "Runs a command in a terminal and returns stdout, stderr and the exit code.",
                  "Execute a command line in the sandbox."],
        "params": [
            P("command", ["command", "cmd", "script", "shell_command"], "string",
              ["The command to run", "Shell command line", "Bash command to execute"], True),
            P("timeout", ["timeout", "timeout_seconds", "time_limit"], "integer",
              ["Timeout in seconds", "Kill the command after this many seconds"], False, {"minimum": 1}),
            P("cwd", ["cwd", "workdir", "directory", "working_dir"], "string",
              ["Working directory", "Directory to run the command in"]),
        ],
    },
    "search": {
        "names": ["search", "grep", "search_code", "find_in_files", "rg", "code_search", "grep_search",
                  "search_files", "Grep"],
        "descs": ["Search the files of the project for a regular expression.",
                  "Find lines matching a pattern in the codebase.",
                  "Search file contents and return matching lines with their file and line number.",
                  "A grep-like search over the repository."],
        "params": [
            P("pattern", ["pattern", "query", "regex", "search_term", "text"], "string",
              ["Regular expression to search for", "Text or regex to find", "The search pattern"], True),
            P("path", ["path", "dir", "directory", "root"], "string", ["Directory to search in", "Where to search"]),
            P("glob", ["glob", "include", "file_pattern"], "string", ["Only search files matching this glob", "File name filter such as *.py"]),
            P("ignore_case", ["ignore_case", "case_insensitive"], "boolean", ["Case-insensitive search"]),
            P("max_results", ["max_results", "max_count", "head_limit"], "integer", ["Maximum number of matches"], False, {"minimum": 1}),
        ],
    },
    "list": {
        "names": ["list_dir", "ls", "list_files", "list_directory", "tree", "LS", "listDir", "dir_list", "glob_files"],
        "descs": ["List the files and directories at a path.", "Show the entries of a directory.",
                  "Lists files in a folder of the workspace.", "Return the directory listing of a path."],
        "params": [
            P("path", ["path", "directory", "dir", "folder", "root"], "string",
              ["Directory to list", "Path of the folder", "Directory path (default: project root)"], True),
            P("recursive", ["recursive", "all", "deep"], "boolean", ["List subdirectories too", "Recurse into subdirectories"]),
            P("depth", ["depth", "max_depth", "levels"], "integer", ["How many levels to descend"], False, {"minimum": 1}),
        ],
    },
    "tests": {
        "names": ["run_tests", "pytest", "test", "run_test_suite", "check_tests", "run_pytest"],
        "descs": ["Run the project's test suite with pytest and return the report.",
                  "Run tests and report failures.", "Execute pytest on the given path."],
        "params": [
            P("target", ["path", "target", "tests", "test_path", "selector"], "string",
              ["Test file or directory", "Which tests to run (default: all)"]),
            P("keyword", ["keyword", "k", "filter", "match"], "string", ["Only run tests whose name matches"]),
            P("verbose", ["verbose", "v"], "boolean", ["Verbose output"]),
            P("fail_fast", ["fail_fast", "exitfirst", "stop_on_failure"], "boolean", ["Stop after the first failure"]),
        ],
    },
    "python": {
        "names": ["python", "run_python", "exec_python", "python_exec", "eval_python", "code_interpreter"],
        "descs": ["Execute Python code and return what it prints.", "Run a Python snippet in a fresh interpreter.",
                  "Evaluates Python source code and returns stdout."],
        "params": [
            P("code", ["code", "source", "script", "program"], "string", ["Python source to run", "The code to execute"], True),
            P("timeout", ["timeout", "time_limit"], "integer", ["Timeout in seconds"], False, {"minimum": 1}),
        ],
    },
    "delete": {
        "names": ["delete_file", "remove_file", "rm", "unlink_file"],
        "descs": ["Delete a file.", "Remove a file from the workspace."],
        "params": [P("path", ["path", "file_path", "filename"], "string", ["File to delete"], True)],
    },
    "move": {
        "names": ["move_file", "rename_file", "mv"],
        "descs": ["Move or rename a file.", "Rename a file or move it to another directory."],
        "params": [
            P("src", ["source", "src", "from_path", "old_path"], "string", ["Current path"], True),
            P("dst", ["destination", "dest", "to_path", "new_path"], "string", ["New path"], True),
        ],
    },
    "weather": {
        "names": ["get_weather", "weather", "current_weather", "lookup_weather"],
        "descs": ["Get the current weather for a location.", "Look up today's weather in a city."],
        "params": [
            P("location", ["location", "city", "place"], "string", ["City name", "The city to look up"], True),
            P("unit", ["unit", "units", "temperature_unit"], "string", ["Temperature unit"], False, {"enum": ["celsius", "fahrenheit"]}),
        ],
    },
    "calc": {
        "names": ["calculator", "calculate", "eval_math", "compute"],
        "descs": ["Evaluate an arithmetic expression.", "Compute the value of a math expression."],
        "params": [P("expression", ["expression", "expr", "formula", "input"], "string", ["Arithmetic expression such as 2 * (3 + 4)"], True)],
    },
    "time": {
        "names": ["get_time", "current_time", "now", "get_current_time"],
        "descs": ["Return the current date and time.", "Get the current time in a time zone."],
        "params": [P("timezone", ["timezone", "tz", "zone"], "string", ["IANA time zone such as Europe/Paris"], True)],
    },
    "fetch": {
        "names": ["fetch_url", "http_get", "web_fetch", "get_url"],
        "descs": ["Fetch a URL and return the response body as text.", "Download a web page."],
        "params": [
            P("url", ["url", "uri", "address"], "string", ["The URL to fetch"], True),
            P("max_bytes", ["max_bytes", "max_length", "limit"], "integer", ["Truncate the body after this many bytes"], False, {"minimum": 1}),
        ],
    },
    "plan": {
        "names": ["update_plan", "todo_write", "set_plan", "plan"],
        "descs": ["Record the plan for the task as a list of steps with a status.", "Write the todo list for the current task."],
        "params": [
            P("steps", ["steps", "todos", "plan", "items"], "array", ["The steps, in order"], True,
              {"items": {"type": "object", "properties": {"step": {"type": "string"},
                                                         "status": {"type": "string", "enum": ["pending", "in_progress", "done"]}},
                         "required": ["step", "status"]}}),
        ],
    },
}


def make_tool(rng: random.Random, family: str, used_names: set) -> Tool:
    fam = FAMILIES[family]
    names = [n for n in fam["names"] if n not in used_names]
    name = rng.choice(names)
    used_names.add(name)
    desc = rng.choice(fam["descs"])
    flags: Dict[str, Any] = {}
    if family == "read" and rng.random() < 0.35:
        flags["line_numbers"] = True
        desc = desc.rstrip(".") + ", with line numbers."
    params: List[Param] = []
    used_keys = set()
    for sem, keys, typ, descs, required, extra in fam["params"]:
        if not required and rng.random() < 0.45:
            continue
        key = rng.choice([k for k in keys if k not in used_keys])
        used_keys.add(key)
        sch: Dict[str, Any] = {"type": typ}
        if rng.random() < 0.75:
            sch["description"] = rng.choice(descs)
        sch.update(extra)
        req = required if family != "list" else (required and rng.random() < 0.7)
        params.append(Param(sem, key, sch, req))
    return Tool(family, name, desc, params, strict=rng.random() < 0.4, flags=flags)


# =============================================================================================
# Simulated repository

PROJECTS = ["inventory", "weatherbot", "tinyhttp", "mdparse", "taskq", "ledger", "photon", "quill", "orbit",
            "sprout", "beacon", "atlas", "cinder", "harbor", "lumen", "mosaic", "nimbus", "pylon", "relay",
            "sable", "tally", "vector", "willow", "zephyr", "acorn", "bramble", "canopy", "delta", "ember",
            "fable", "garnet", "hollow", "iris", "juniper", "kestrel", "lattice", "meadow", "nectar", "onyx",
            "pebble", "quartz", "ripple", "summit", "thicket", "umber", "velvet", "wren", "yarrow", "zinc",
            "datakit", "logshipper", "csvtool", "imgresize", "chatops", "budget", "recipes", "scheduler",
            "notes", "shortener", "scraper", "billing", "metrics", "gateway", "auth_service", "report_gen"]
MODULES = ["utils", "parser", "config", "models", "cli", "server", "db", "cache", "helpers", "metrics",
           "auth", "scheduler", "storage", "client", "api", "core", "io_utils", "formatting", "validation",
           "handlers", "tasks", "report", "loader", "geometry", "text", "stats", "mathutils", "routes", "jobs"]
CITIES = ["Paris", "Berlin", "Tokyo", "Lisbon", "Nairobi", "Toronto", "Sydney", "Madrid", "Oslo", "Lima",
          "Seoul", "Cairo", "Denver", "Dublin", "Prague", "Hanoi", "Austin", "Zurich", "Mumbai", "Quito"]
TIMEZONES = {"Paris": "Europe/Paris", "Berlin": "Europe/Berlin", "Tokyo": "Asia/Tokyo", "Lisbon": "Europe/Lisbon",
             "Nairobi": "Africa/Nairobi", "Toronto": "America/Toronto", "Sydney": "Australia/Sydney",
             "Madrid": "Europe/Madrid", "Oslo": "Europe/Oslo", "Lima": "America/Lima", "Seoul": "Asia/Seoul",
             "Cairo": "Africa/Cairo", "Denver": "America/Denver", "Dublin": "Europe/Dublin",
             "Prague": "Europe/Prague", "Hanoi": "Asia/Bangkok", "Austin": "America/Chicago",
             "Zurich": "Europe/Zurich", "Mumbai": "Asia/Kolkata", "Quito": "America/Guayaquil"}
UTC_OFFSETS = {"Europe/Paris": 1, "Europe/Berlin": 1, "Asia/Tokyo": 9, "Europe/Lisbon": 0, "Africa/Nairobi": 3,
               "America/Toronto": -5, "Australia/Sydney": 11, "Europe/Madrid": 1, "Europe/Oslo": 1,
               "America/Lima": -5, "Asia/Seoul": 9, "Africa/Cairo": 2, "America/Denver": -7, "Europe/Dublin": 0,
               "Europe/Prague": 1, "Asia/Bangkok": 7, "America/Chicago": -6, "Europe/Zurich": 1,
               "Asia/Kolkata": 5.5, "America/Guayaquil": -5}
IMPORTS = [("os.", "import os"), ("re.", "import re"), ("sys.", "import sys"), ("json.", "import json"),
           ("math.", "import math"), ("time.", "import time"), ("itertools.", "import itertools"),
           ("collections.", "import collections"), ("functools.", "import functools")]


class Classic:
    """A classic function instantiated in one repository (name chosen, implementation chosen)."""

    def __init__(self, rng: random.Random, entry: Dict[str, Any]):
        self.entry = entry
        base = entry["impls"][0].split("(")[0][4:]
        self.name = rng.choice(entry["names"])
        self.impl_index = rng.randrange(len(entry["impls"]))
        self.src = classics.renamed(entry["impls"][self.impl_index], base, self.name)
        self.calls = [classics.renamed(c, base, self.name) for c in entry["calls"]]
        self.task = entry["task"]
        self.sig = self.src.split("\n")[0]
        self.doc = ast.get_docstring(ast.parse(self.src).body[0])
        self.bugs = [(classics.renamed(a, base, self.name), classics.renamed(b, base, self.name)) for a, b in entry["bugs"]]


class Repo:
    def __init__(self, rng: random.Random, pool: List[Func]):
        self.rng = rng
        self.project = rng.choice(PROJECTS)
        self.pkg = rng.choice([self.project, self.project, "src/" + self.project, "app", "lib"])
        self.files: Dict[str, str] = {}
        self.funcs: Dict[str, List[Any]] = {}  # path -> Func / Classic objects
        mods = rng.sample(MODULES, rng.randint(2, 4))
        for m in mods:
            fs = rng.sample(pool, rng.randint(1, 3))
            path = f"{self.pkg}/{m}.py"
            self.files[path] = self._module(fs)
            self.funcs[path] = fs
        # a module of classics, with tests
        entries = rng.sample(classics.CLASSICS, rng.randint(2, 3))
        self.classics = [Classic(rng, e) for e in entries]
        cmod = rng.choice([m for m in ["utils", "helpers", "mathutils", "core", "tools", "algorithms"] if m not in mods])
        self.classic_path = f"{self.pkg}/{cmod}.py"
        self.classic_module = cmod
        self.files[self.classic_path] = "\n\n".join(c.src for c in self.classics)
        self.funcs[self.classic_path] = self.classics
        self.test_path = f"tests/test_{cmod}.py"
        self.files[self.test_path] = self._tests()
        self.files[f"{self.pkg}/__init__.py"] = f'"""{self.project}: {rng.choice(["a small toolkit", "utilities", "the service code", "helpers and models"])}."""\n'
        self.files["README.md"] = (f"# {self.project}\n\n{rng.choice(['A small Python project.', 'Tools for everyday tasks.', 'Experimental code.', 'Internal service.'])}\n\n"
                                   f"## Development\n\n```\npython -m pytest -q\n```\n")
        self.files[rng.choice(["requirements.txt", "requirements-dev.txt"])] = "\n".join(
            sorted(rng.sample(["pytest", "requests", "click", "pyyaml", "numpy", "attrs", "rich", "httpx"], 3))) + "\n"
        if rng.random() < 0.6:
            self.files["pyproject.toml"] = (f'[project]\nname = "{self.project}"\nversion = "0.{rng.randint(1, 9)}.{rng.randint(0, 20)}"\n'
                                            f'requires-python = ">=3.{rng.choice([8, 9, 10, 11])}"\n')

    def module_import(self) -> str:
        return self.classic_path[:-3].replace("src/", "").replace("/", ".")

    def _module(self, fs: List[Func]) -> str:
        body = "\n\n".join(f.src for f in fs)
        imports = [imp for key, imp in IMPORTS if key in body]
        head = "\n".join(imports) + "\n\n\n" if imports else ""
        return head + body

    def _tests(self) -> str:
        lines = [f"from {self.module_import()} import {', '.join(c.name for c in self.classics)}", ""]
        self.test_cases: List[Tuple[str, str, str, int]] = []  # (test name, call, expected repr, line)
        for c in self.classics:
            lines += ["", f"def test_{c.name}():"]
            for call in c.calls[:3]:
                exp = classics.run_call(c.src, c.name, call)
                lines.append(f"    assert {call} == {exp}")
                self.test_cases.append((f"test_{c.name}", call, exp, len(lines)))
        return "\n".join(lines) + "\n"

    def listing(self, d: str, recursive: bool) -> List[str]:
        d = d.strip("/").strip(".").strip("/")
        out = set()
        for p in self.files:
            if d and not p.startswith(d + "/"):
                continue
            rest = p[len(d) + 1 :] if d else p
            if recursive:
                out.add(rest)
            else:
                out.add(rest.split("/")[0] + ("/" if "/" in rest else ""))
        return sorted(out)

    def dirs(self) -> List[str]:
        ds = {""}
        for p in self.files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                ds.add("/".join(parts[:i]))
        return sorted(ds)

    def grep(self, pattern: str) -> List[Tuple[str, int, str]]:
        rx = re.compile(pattern)
        hits = []
        for p, text in sorted(self.files.items()):
            for i, line in enumerate(text.split("\n"), 1):
                if rx.search(line):
                    hits.append((p, i, line))
        return hits


# =============================================================================================
# Conversation building


def jdump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


class Dialog:
    def __init__(self, rng: random.Random, tools: Dict[str, Tool], thinking: bool, repo: Optional[Repo]):
        self.rng, self.tools, self.thinking, self.repo = rng, tools, thinking, repo
        self.messages: List[Dict[str, Any]] = []
        self.call_points: List[Tuple[int, str]] = []  # (message index of an assistant turn with calls, first tool)
        self.n = 0
        style = rng.random()
        self.result_style = "plain" if style < 0.6 else ("json" if style < 0.8 else "exit")

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def call(self, reasoning: str, calls: List[Tuple[Tool, Dict[str, Any]]], results: List[str], content: str = "") -> None:
        tcs = []
        for tool, args in calls:
            self.n += 1
            cid = "call_%s" % hashlib.sha256(f"{self.rng.random()}".encode()).hexdigest()[:12]
            tcs.append({"id": cid, "type": "function", "function": {"name": tool.name, "arguments": jdump(args)}})
        if not content and self.rng.random() < 0.12:
            content = pick(self.rng, ["Let me check.", "I'll take a look.", "Let me look at that.", "Checking now."])
        msg: Dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tcs}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        self.call_points.append((len(self.messages), calls[0][0].name))
        self.messages.append(msg)
        for tc, res in zip(tcs, results):
            self.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": res})

    def answer(self, reasoning: str, content: str) -> None:
        msg: Dict[str, Any] = {"role": "assistant", "content": content}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        self.messages.append(msg)

    # -- tool result formatting --

    def shell_result(self, stdout: str, code: int = 0, stderr: str = "") -> str:
        if self.result_style == "json":
            return jdump({"exit_code": code, "stdout": stdout, "stderr": stderr})
        if self.result_style == "exit":
            s = f"exit code: {code}\n"
            if stdout:
                s += stdout if stdout.endswith("\n") else stdout + "\n"
            if stderr:
                s += "stderr:\n" + stderr
            return s.rstrip("\n")
        text = stdout + (("\n" if stdout and not stdout.endswith("\n") else "") + stderr if stderr else "")
        if code:
            text = text.rstrip("\n") + f"\n(exit code {code})"
        return text.rstrip("\n") or "(no output)"

    def file_result(self, tool: Tool, text: str, start: Optional[int] = None, limit: Optional[int] = None) -> str:
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines = lines[:-1]
        s = (start or 1) - 1
        e = len(lines) if limit is None else min(len(lines), s + limit)
        chosen = lines[s:e]
        if tool.flags.get("line_numbers"):
            out = "\n".join(f"{i + 1:>4}\t{l}" for i, l in zip(range(s, e), chosen))
        else:
            out = "\n".join(chosen)
        if e < len(lines):
            out += f"\n... ({len(lines) - e} more lines)"
        return out


def A(*xs: str) -> str:
    return "".join(xs)


def pick(rng: random.Random, xs):
    return xs[rng.randrange(len(xs))]


def fn_summary(f: Any) -> str:
    sig = f.sig.strip().split("\n")[0]
    sig = sig[4:].rstrip(":").strip() if sig.startswith("def ") else sig
    if sig.endswith("("):
        sig = sig + "...)"
    d = f.doc_line() if isinstance(f, Func) else (f.doc or "").split("\n")[0]
    return f"- `{sig}`" + (f": {d}" if d else "")


def path_args(tool: Tool, path: str, rng: random.Random, nlines: int) -> Dict[str, Any]:
    vals: Dict[str, Any] = {"path": path}
    if tool.has("start") and rng.random() < 0.3:
        vals["start"] = 1
    if tool.has("limit") and rng.random() < 0.4:
        vals["limit"] = max(50, ((nlines + 49) // 50) * 50)
    return vals


# ---- scenarios (each appends to a Dialog; needs the families it lists) ----------------------


def sc_read_explain(d: Dialog, rng: random.Random) -> None:
    repo, t = d.repo, d.tools["read"]
    path = pick(rng, [p for p in repo.funcs])
    d.user(pick(rng, [f"What does {path} do?", f"Show me {path}.", f"Summarize the functions in {path}.",
                      f"Can you read {path} and tell me what's in it?", f"Give me an overview of `{path}`.",
                      f"open {path}", f"What functions are defined in {path}?"]))
    text = repo.files[path]
    args = t.args(**path_args(t, path, rng, text.count("\n") + 1))
    d.call(A(f"The user wants to know what {path} contains. ",
             f"The `{t.name}` tool reads a file; I will call it with {t.key('path')}=\"{path}\"."),
           [(t, args)], [d.file_result(t, text, args.get(t.key("start")) if t.has("start") else None,
                                       args.get(t.key("limit")) if t.has("limit") else None)])
    fs = repo.funcs[path]
    names = ", ".join(f"`{f.name}`" for f in fs)
    d.answer(f"The file defines {len(fs)} function(s): {names}. I will list them with their docstrings.",
             f"`{path}` defines {len(fs)} function{'s' if len(fs) != 1 else ''}:\n" + "\n".join(fn_summary(f) for f in fs))


def sc_find_definition(d: Dialog, rng: random.Random) -> None:
    repo, s = d.repo, d.tools["search"]
    path = pick(rng, list(repo.funcs))
    f = pick(rng, repo.funcs[path])
    d.user(pick(rng, [f"Where is `{f.name}` defined?", f"Find the definition of {f.name}.",
                      f"In which file is the function {f.name} implemented?", f"where's {f.name} defined",
                      f"Locate `{f.name}` in the code base and show me its signature."]))
    pattern = f"def {f.name}\\("
    vals: Dict[str, Any] = {"pattern": pattern}
    if s.has("path") and rng.random() < 0.5:
        vals["path"] = repo.pkg.split("/")[0]
    if s.has("glob") and rng.random() < 0.5:
        vals["glob"] = "*.py"
    if s.has("max_results") and rng.random() < 0.4:
        vals["max_results"] = pick(rng, [10, 20, 50])
    hits = [h for h in repo.grep(pattern) if "path" not in vals or h[0].startswith(vals["path"])]
    res = "\n".join(f"{p}:{n}:{l}" for p, n, l in hits) or "No matches found."
    d.call(A(f"I need to find where {f.name} is defined. ",
             f"I'll search for the pattern `def {f.name}(` with `{s.name}`."), [(s, s.args(**vals))], [res])
    p, n, l = next(h for h in hits if h[0] == path)
    others = sorted({h[0] for h in hits if h[0] != path})
    if "read" in d.tools and rng.random() < 0.5:
        t = d.tools["read"]
        vals2: Dict[str, Any] = {"path": p}
        if t.has("start"):
            vals2["start"] = n
        if t.has("limit"):
            vals2["limit"] = 30
        args = t.args(**vals2)
        start = args.get(t.key("start")) if t.has("start") else None
        lim = args.get(t.key("limit")) if t.has("limit") else None
        d.call(f"It is in {p} at line {n}. I'll open that file to read the function.", [(t, args)],
               [d.file_result(t, repo.files[p], start, lim)])
    doc = f.doc_line() if isinstance(f, Func) else (f.doc or "")
    d.answer(f"The search found `{f.name}` in {p} on line {n}.",
             f"`{f.name}` is defined in `{p}` at line {n}:\n\n```python\n{f.sig.strip()}\n```" +
             (f"\n\nIts docstring says: {doc}" if doc else "") +
             (f"\n\nA function with the same name is also defined in " + ", ".join(f"`{o}`" for o in others) + "." if others else ""))


def sc_fix_tests(d: Dialog, rng: random.Random) -> None:
    repo = d.repo
    runner = d.tools.get("tests") or d.tools["shell"]
    read, edit = d.tools["read"], d.tools["edit"]
    cands = []
    for c in repo.classics:
        for old, new in c.bugs:
            if old in c.src:
                cands.append((c, old, new))
    rng.shuffle(cands)
    bug = None
    for c, old, new in cands:
        buggy = c.src.replace(old, new, 1)
        fails = [(tn, call, exp, ln) for tn, call, exp, ln in repo.test_cases
                 if tn == f"test_{c.name}" and classics.run_call(buggy, c.name, call) != exp]
        if fails:
            bug = (c, old, new, buggy, fails)
            break
    if bug is None:
        return sc_read_explain(d, rng)
    c, old, new, buggy, fails = bug
    repo.files[repo.classic_path] = repo.files[repo.classic_path].replace(c.src, buggy)
    d.user(pick(rng, ["The tests are failing, can you fix them?", "Run the test suite and fix whatever is broken.",
                      f"`{repo.test_path}` fails. Please find the bug and fix it.", "tests fail, fix pls",
                      f"Something is wrong with `{c.name}`; the tests don't pass. Can you fix it?"]))

    def report(failing):
        names = sorted({tn for tn, _, _, _ in repo.test_cases})
        bad = {}
        for tn, call, exp, ln in failing:
            bad.setdefault(tn, (call, exp, ln))
        dots = "".join("F" if n in bad else "." for n in names)
        pad = " " * max(1, 70 - len(dots))
        if not bad:
            return f"{dots}{pad}[100%]\n{len(names)} passed in 0.0{rng.randint(1, 9)}s"
        out = [f"{dots}{pad}[100%]", "=" * 30 + " FAILURES " + "=" * 30]
        short = {}
        for tn, (call, exp, ln) in sorted(bad.items()):
            ok, got = classics.evaluate(buggy, call)
            out += [f"_____ {tn} _____", f">       assert {call} == {exp}"]
            if not ok:
                out += [f"E       {got}"]
                short[tn] = got
            else:
                out += [f"E       assert {got} == {exp}", f"E        +  where {got} = {call}"]
                short[tn] = f"assert {got} == {exp}"
            out += ["", f"{repo.test_path}:{ln}: {'AssertionError' if ok else got.split(':')[0]}"]
        out += ["=" * 20 + " short test summary info " + "=" * 20]
        for tn in sorted(bad):
            out.append(f"FAILED {repo.test_path}::{tn} - {short[tn]}")
        out.append(f"{len(bad)} failed, {len(names) - len(bad)} passed in 0.0{rng.randint(1, 9)}s")
        return "\n".join(out)

    def run_tests(reason: str, after_fix: bool):
        text = report([] if after_fix else fails)
        if runner.family == "tests":
            vals: Dict[str, Any] = {}
            if runner.has("target") and rng.random() < 0.5:
                vals["target"] = repo.test_path
            if runner.has("verbose") and rng.random() < 0.3:
                vals["verbose"] = False
            d.call(reason, [(runner, runner.args(**vals))], [text])
        else:
            cmd = pick(rng, ["python -m pytest -q", f"pytest -q {repo.test_path}", "pytest -q"])
            vals = {"command": cmd}
            if runner.has("timeout") and rng.random() < 0.4:
                vals["timeout"] = pick(rng, [60, 120, 300])
            d.call(reason, [(runner, runner.args(**vals))], [d.shell_result(text, 0 if after_fix else 1)])

    run_tests(f"First I will run the tests with `{runner.name}` to see what fails.", False)
    tn, call, exp, ln = fails[0]
    got = classics.run_call(buggy, c.name, call)
    text = repo.files[repo.classic_path]
    rargs = read.args(**path_args(read, repo.classic_path, rng, text.count("\n") + 1))
    d.call(f"{tn} fails: {call} gives {got} but {exp} is expected. `{c.name}` lives in {repo.classic_path}; I'll read it.",
           [(read, rargs)], [d.file_result(read, text, rargs.get(read.key("start")) if read.has("start") else None,
                                           rargs.get(read.key("limit")) if read.has("limit") else None)])
    # the edit: the lines that differ (with one line of context for a deleted line), widened
    # upwards until the old text occurs once in the file
    ol, bl = c.src.rstrip("\n").split("\n"), buggy.rstrip("\n").split("\n")
    i = 0
    while i < min(len(ol), len(bl)) and ol[i] == bl[i]:
        i += 1
    j = 0
    while j < min(len(ol), len(bl)) - i and ol[len(ol) - 1 - j] == bl[len(bl) - 1 - j]:
        j += 1
    lo = i if len(bl) - j > i else i - 1
    ftext = repo.files[repo.classic_path]
    while True:
        old_s = "\n".join(bl[lo:len(bl) - j])
        new_s = "\n".join(ol[lo:len(ol) - j])
        if ftext.count(old_s) == 1 or lo == 0:
            break
        lo -= 1
    vals = {"path": repo.classic_path, "old": old_s, "new": new_s}
    d.call(f"The bug is `{old_s.strip()}`; it should be `{new_s.strip()}`. I'll fix it with `{edit.name}`.",
           [(edit, edit.args(**vals))], [pick(rng, ["OK", f"Replaced 1 occurrence in {repo.classic_path}", f"Edited {repo.classic_path}", jdump({"ok": True, "replacements": 1})])])
    repo.files[repo.classic_path] = repo.files[repo.classic_path].replace(buggy, c.src)
    run_tests("Now I'll run the tests again to check the fix.", True)
    n = len({t for t, _, _, _ in repo.test_cases})
    d.answer("All tests pass after the fix.",
             f"Fixed the bug in `{c.name}` ({repo.classic_path}): `{old_s.strip()}` was changed to `{new_s.strip()}`. "
             f"All {n} tests pass now.")


def sc_create_file(d: Dialog, rng: random.Random) -> None:
    repo, w = d.repo, d.tools["write"]
    entry = pick(rng, classics.CLASSICS)
    c = Classic(rng, entry)
    mod = pick(rng, [c.name, "solution", "algo", "snippets", "extra", c.name + "_impl"])
    path = pick(rng, [f"{repo.pkg}/{mod}.py", f"{mod}.py", f"scripts/{mod}.py"])
    demo = rng.random() < 0.5
    code = c.src + (f'\n\nif __name__ == "__main__":\n    print({c.calls[-1]})\n' if demo else "")
    d.user(pick(rng, [f"Create {path} with a function `{c.name}` that should {c.task}.",
                      f"Write a Python function {c.name} to {c.task} and save it in {path}.",
                      f"Add a new file {path} containing `{c.sig[4:].rstrip(':')}` that will {c.task}.",
                      f"I need a helper to {c.task}. Put it in {path} and call it {c.name}."]))
    if "plan" in d.tools and rng.random() < 0.5:
        pl = d.tools["plan"]
        steps = [{"step": f"Write {c.name} in {path}", "status": "in_progress"},
                 {"step": "Check it on an example", "status": "pending"}]
        d.call("This is a small task with two steps; I'll record the plan first.", [(pl, pl.args(steps=steps))],
               [pick(rng, ["Plan updated.", "OK", jdump({"ok": True})])])
    vals: Dict[str, Any] = {"path": path, "content": code}
    if w.has("overwrite") and rng.random() < 0.5:
        vals["overwrite"] = False
    nbytes = len(code.encode())
    d.call(f"I'll write {path} with an implementation of {c.name} using `{w.name}`.", [(w, w.args(**vals))],
           [pick(rng, [f"Wrote {nbytes} bytes to {path}", "File written.", jdump({"ok": True, "bytes": nbytes}), f"Created {path}"])])
    repo.files[path] = code
    out = classics.run_call(c.src, c.name, c.calls[-1])
    if "shell" in d.tools and rng.random() < 0.7:
        sh = d.tools["shell"]
        if demo:
            cmd = f"python {path}"
            stdout = (out if not out.startswith("'") else out[1:-1]) + "\n"
        else:
            modname = path[:-3].replace("src/", "").replace("/", ".")
            cmd = f"python -c \"from {modname} import {c.name}; print({c.calls[-1]})\""
            stdout = (out if not out.startswith("'") else out[1:-1]) + "\n"
        d.call(f"Let me run it once to check: {c.calls[-1]} should give {out}.", [(sh, sh.args(command=cmd))],
               [d.shell_result(stdout)])
        check = f" Running it prints `{stdout.strip()}` for `{c.calls[-1]}`."
    else:
        check = ""
    d.answer(f"{path} is written.", f"Created `{path}` with `{c.sig[4:].rstrip(':')}`, which will {c.task}.{check}")


def sc_rename(d: Dialog, rng: random.Random) -> None:
    repo, e = d.repo, d.tools["edit"]
    path = pick(rng, list(repo.funcs))
    f = pick(rng, repo.funcs[path])
    new = pick(rng, [f.name + "_v2", "new_" + f.name, f.name.rstrip("_") + "_impl", "do_" + f.name.lstrip("_"), f.name + "2"])
    d.user(pick(rng, [f"In {path}, rename the function `{f.name}` to `{new}`.", f"Rename {f.name} to {new} in {path}.",
                      f"please rename `{f.name}` -> `{new}` ({path})"]))
    text = repo.files[path]
    if "read" in d.tools and rng.random() < 0.5:
        t = d.tools["read"]
        a = t.args(**path_args(t, path, rng, text.count("\n") + 1))
        d.call(f"I'll look at {path} first.", [(t, a)], [d.file_result(t, text, a.get(t.key("start")) if t.has("start") else None,
                                                                         a.get(t.key("limit")) if t.has("limit") else None)])
    old_s, new_s = f"def {f.name}(", f"def {new}("
    count = text.count(f.name)
    vals: Dict[str, Any] = {"path": path, "old": old_s, "new": new_s}
    if count > 1 and e.has("all"):
        vals = {"path": path, "old": f.name, "new": new, "all": True}
    d.call(f"I'll replace `{vals['old']}` with `{vals['new']}` in {path} using `{e.name}`.", [(e, e.args(**vals))],
           [pick(rng, ["OK", f"Replaced {count if vals.get('all') else 1} occurrence(s) in {path}", jdump({"ok": True})])])
    note = "" if vals.get("all") or count <= 1 else f" Other references to `{f.name}` in the file were not changed."
    d.answer("Done.", f"Renamed `{f.name}` to `{new}` in `{path}`.{note}")


def sc_list(d: Dialog, rng: random.Random) -> None:
    repo, ls = d.repo, d.tools["list"]
    dd = pick(rng, [x for x in repo.dirs()])
    shown = dd or "."
    d.user(pick(rng, [f"What's in the {shown} directory?", f"List the files in {shown}.", f"ls {shown}",
                      f"Which files are there under `{shown}`?", "What files does this project have?" if not dd else f"show me {shown}"]))
    vals: Dict[str, Any] = {"path": shown}
    rec = ls.has("recursive") and rng.random() < 0.4
    if rec:
        vals["recursive"] = True
    if ls.has("depth") and rng.random() < 0.3:
        vals["depth"] = 2 if not rec else 3
        rec = True
    entries = repo.listing(dd, rec)
    d.call(f"I'll list {shown} with `{ls.name}`.", [(ls, ls.args(**vals))], ["\n".join(entries)])
    pys = [x for x in entries if x.endswith(".py")]
    if "read" in d.tools and pys and rng.random() < 0.4:
        t = d.tools["read"]
        p = (dd + "/" if dd else "") + pick(rng, pys)
        text = repo.files[p]
        a = t.args(**path_args(t, p, rng, text.count("\n") + 1))
        d.call(f"Let me also open {p}.", [(t, a)], [d.file_result(t, text, a.get(t.key("start")) if t.has("start") else None,
                                                                    a.get(t.key("limit")) if t.has("limit") else None)])
        fs = repo.funcs.get(p, [])
        extra = (f"\n\n`{p}` defines " + ", ".join(f"`{f.name}`" for f in fs) + ".") if fs else ""
    else:
        extra = ""
    d.answer(f"The listing has {len(entries)} entries.",
             f"`{shown}` contains {len(entries)} entr{'ies' if len(entries) != 1 else 'y'}:\n" + "\n".join(f"- {x}" for x in entries) + extra)


def sc_shell_info(d: Dialog, rng: random.Random) -> None:
    repo, sh = d.repo, d.tools["shell"]
    kind = rng.randrange(5)
    if kind == 0:
        p = pick(rng, list(repo.files))
        n = repo.files[p].count("\n")
        d.user(pick(rng, [f"How many lines does {p} have?", f"count the lines in {p}", f"What's the line count of `{p}`?"]))
        cmd, out = f"wc -l {p}", f"{n} {p}\n"
        ans = f"`{p}` has {n} lines."
    elif kind == 1:
        mod = [p for p in repo.funcs if p != repo.classic_path]
        changed = rng.sample(mod, 1) + ([repo.test_path] if rng.random() < 0.4 else [])
        new = pick(rng, [[], ["notes.txt"], ["scratch.py"]])
        d.user(pick(rng, ["What's the git status?", "Are there uncommitted changes?", "show git status", "Which files did I modify?"]))
        cmd = pick(rng, ["git status --short", "git status -s"])
        out = "".join(f" M {p}\n" for p in changed) + "".join(f"?? {p}\n" for p in new)
        ans = (f"{len(changed)} modified file{'s' if len(changed) > 1 else ''}: " + ", ".join(f"`{p}`" for p in changed) + "." +
               (f" One untracked file: `{new[0]}`." if new else ""))
    elif kind == 2:
        v = pick(rng, ["3.11.2", "3.10.12", "3.12.3", "3.9.18"])
        d.user(pick(rng, ["Which Python version is installed?", "what python do we have here?", "Check the Python version."]))
        cmd, out = pick(rng, ["python3 --version", "python --version"]), f"Python {v}\n"
        ans = f"Python {v} is installed."
    elif kind == 3:
        c = pick(rng, repo.classics)
        call = pick(rng, c.calls)
        res = classics.run_call(c.src, c.name, call)
        d.user(pick(rng, [f"What does `{call}` return?", f"Run {call} and tell me the result.", f"evaluate {call} using our code"]))
        cmd = f"python -c \"from {repo.module_import()} import {c.name}; print({call})\""
        out = (res[1:-1] if res.startswith("'") else res) + "\n"
        ans = f"`{call}` returns `{res}`."
    else:
        h = hashlib.sha256(repo.project.encode()).hexdigest()[:7]
        msg = pick(rng, ["Fix parser edge case", "Add tests for utils", "Refactor config loading", "Initial commit", "Update README"])
        d.user(pick(rng, ["What was the last commit?", "Show me the latest commit message.", "git log -1"]))
        cmd, out = "git log -1 --oneline", f"{h} {msg}\n"
        ans = f"The last commit is `{h}`: \"{msg}\"."
    vals: Dict[str, Any] = {"command": cmd}
    if sh.has("timeout") and rng.random() < 0.3:
        vals["timeout"] = pick(rng, [10, 30, 60])
    if sh.has("cwd") and rng.random() < 0.3:
        vals["cwd"] = "."
    d.call(f"I can answer this by running `{cmd}` with `{sh.name}`.", [(sh, sh.args(**vals))], [d.shell_result(out)])
    d.answer("The output answers the question.", ans)


def sc_parallel_read(d: Dialog, rng: random.Random) -> None:
    repo, t = d.repo, d.tools["read"]
    paths = rng.sample(list(repo.funcs) + [repo.test_path], 2)
    d.user(pick(rng, [f"Show me {paths[0]} and {paths[1]}.", f"Read both {paths[0]} and {paths[1]}.",
                      f"Compare {paths[0]} with {paths[1]}: what functions does each define?"]))
    calls, res = [], []
    for p in paths:
        a = t.args(path=p)
        calls.append((t, a))
        res.append(d.file_result(t, repo.files[p]))
    d.call(f"I need both files; I'll read them in parallel with two `{t.name}` calls.", calls, res)
    parts = []
    for p in paths:
        fs = repo.funcs.get(p)
        if fs:
            parts.append(f"`{p}` defines " + ", ".join(f"`{f.name}`" for f in fs) + ".")
        else:
            parts.append(f"`{p}` has the tests: " + ", ".join(sorted({f"`{tn}`" for tn, _, _, _ in repo.test_cases})) + ".")
    d.answer("I have both files now.", "\n\n".join(parts))


def sc_python(d: Dialog, rng: random.Random) -> None:
    py = d.tools["python"]
    c = Classic(rng, pick(rng, classics.CLASSICS))
    call = pick(rng, c.calls)
    res = classics.run_call(c.src, c.name, call)
    d.user(pick(rng, [f"Write a function to {c.task} and compute {call} with it.",
                      f"Use Python to find {call}, where {c.name} should {c.task}.",
                      f"Can you run some Python to tell me the value of {call} ({c.name}: {c.task})?"]))
    code = c.src + f"\nprint({call})\n"
    vals: Dict[str, Any] = {"code": code}
    if py.has("timeout") and rng.random() < 0.3:
        vals["timeout"] = 10
    out = res[1:-1] if res.startswith("'") else res
    d.call(f"I'll define {c.name} and print {call} with `{py.name}`.", [(py, py.args(**vals))],
           [d.shell_result(out + "\n") if rng.random() < 0.5 else out])
    d.answer(f"The result is {res}.", f"`{call}` is `{res}`.\n\n```python\n{c.src.rstrip()}\n```")


def sc_misc(d: Dialog, rng: random.Random) -> None:
    fam = pick(rng, [f for f in ("weather", "calc", "time", "fetch") if f in d.tools])
    t = d.tools[fam]
    if fam == "weather":
        city = pick(rng, CITIES)
        d.user(pick(rng, [f"What's the weather in {city}?", f"Is it cold in {city} right now?", f"weather {city}"]))
        vals: Dict[str, Any] = {"location": city}
        unit = pick(rng, ["celsius", "fahrenheit"])
        if t.has("unit") and rng.random() < 0.6:
            vals["unit"] = unit
        else:
            unit = "celsius"
        temp = rng.randint(-5, 32)
        if unit == "fahrenheit":
            temp = round(temp * 9 / 5 + 32)
        cond = pick(rng, ["sunny", "cloudy", "light rain", "windy", "clear", "snow"])
        d.call(f"I'll look up the weather in {city} with `{t.name}`.", [(t, t.args(**vals))],
               [jdump({"location": city, "temperature": temp, "unit": unit, "condition": cond})])
        d.answer("I have the weather.", f"It is {temp}°{'F' if unit == 'fahrenheit' else 'C'} and {cond} in {city}.")
    elif fam == "calc":
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 9)
        expr = pick(rng, [f"{a} * {b}", f"({a} + {b}) * {c}", f"{a} ** 2 - {b}", f"{a * b} / {c}", f"{a} + {b} + {c}"])
        val = eval(expr, {"__builtins__": {}})  # noqa: S307 - arithmetic of generated integers
        val = int(val) if isinstance(val, float) and val.is_integer() else (round(val, 6) if isinstance(val, float) else val)
        d.user(pick(rng, [f"What is {expr}?", f"Compute {expr}.", f"calculate {expr} please"]))
        d.call(f"I'll evaluate {expr} with `{t.name}`.", [(t, t.args(expression=expr))], [str(val)])
        d.answer("Got the value.", f"{expr} = {val}")
    elif fam == "time":
        city = pick(rng, CITIES)
        tz = TIMEZONES[city]
        d.user(pick(rng, [f"What time is it in {city}?", f"current time in {city}?", f"Tell me the time in {city}."]))
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        off = UTC_OFFSETS[tz]
        offs = f"{'+' if off >= 0 else '-'}{int(abs(off)):02d}:{int(abs(off) % 1 * 60):02d}"
        stamp = f"2026-0{rng.randint(1, 9)}-{rng.randint(10, 28)}T{hh:02d}:{mm:02d}:{rng.randint(10, 59)}{offs}"
        d.call(f"{city} is in the {tz} time zone; I'll ask `{t.name}`.", [(t, t.args(timezone=tz))], [stamp])
        d.answer("I have the time.", f"It is {hh:02d}:{mm:02d} in {city} ({tz}).")
    else:
        name = d.repo.project if d.repo else "example"
        url = pick(rng, [f"https://example.com/{name}", f"https://docs.example.org/{name}/index.html", f"https://api.example.net/{name}/status"])
        d.user(pick(rng, [f"Fetch {url} and tell me what it says.", f"What does the page {url} contain?"]))
        vals = {"url": url}
        if t.has("max_bytes") and rng.random() < 0.5:
            vals["max_bytes"] = 4096
        status = pick(rng, ["ok", "degraded", "maintenance"])
        body = jdump({"service": name, "status": status, "version": f"1.{rng.randint(0, 9)}.{rng.randint(0, 9)}"}) if "api." in url else \
            f"<html><head><title>{name} documentation</title></head><body><h1>{name}</h1><p>Welcome to the {name} docs.</p></body></html>"
        d.call(f"I'll fetch {url} with `{t.name}`.", [(t, t.args(**vals))], [body])
        if "api." in url:
            d.answer("The API returned JSON.", f"The endpoint reports that `{name}` is **{status}** (version {json.loads(body)['version']}).")
        else:
            d.answer("It is an HTML page.", f"It is the documentation start page of {name}: a heading \"{name}\" and the text \"Welcome to the {name} docs.\"")


QA = [
    ("What does the `enumerate` builtin do?", "`enumerate(iterable, start=0)` yields pairs `(index, item)`, so `for i, x in enumerate(items):` gives each item with its position."),
    ("What is the difference between a list and a tuple in Python?", "A list is mutable (you can append, remove or change items), a tuple is immutable. Tuples can be dictionary keys; lists cannot."),
    ("How do I reverse a list in Python?", "Use `items.reverse()` to reverse in place, or `items[::-1]` / `list(reversed(items))` for a reversed copy."),
    ("What does `if __name__ == \"__main__\":` mean?", "The block runs only when the file is executed as a script, not when it is imported as a module."),
    ("How do I read a file line by line?", "```python\nwith open(path) as f:\n    for line in f:\n        print(line.rstrip())\n```"),
    ("What is a list comprehension?", "A compact way to build a list: `[x * x for x in range(5) if x % 2 == 0]` gives `[0, 4, 16]`."),
    ("What does `*args` mean in a function definition?", "It collects extra positional arguments into a tuple; `**kwargs` collects extra keyword arguments into a dict."),
    ("How can I merge two dicts?", "In Python 3.9+: `merged = a | b`. Before that: `merged = {**a, **b}`. Keys of `b` win."),
    ("What is the difference between `==` and `is`?", "`==` compares values, `is` checks whether both names refer to the same object."),
    ("How do I sort a list of dicts by a key?", "`sorted(rows, key=lambda r: r[\"age\"])`; add `reverse=True` for descending order."),
    ("What does `git stash` do?", "It saves your uncommitted changes and restores a clean working tree; `git stash pop` brings the changes back."),
    ("Explain what a Python generator is.", "A function that uses `yield` returns a generator: it produces values lazily, one per iteration, keeping its state between them."),
    ("How do I check if a key exists in a dict?", "Use `if key in d:`; `d.get(key)` returns `None` (or a default) when the key is missing."),
    ("What's the time complexity of binary search?", "O(log n): every step halves the remaining range."),
    ("What is a virtual environment?", "An isolated Python installation for one project: `python -m venv .venv`, then `source .venv/bin/activate`."),
]


def sc_no_tool(d: Dialog, rng: random.Random) -> None:
    q, a = pick(rng, QA)
    d.user(q)
    d.answer("This is a general question; no tool is needed.", a)


def sc_recover(d: Dialog, rng: random.Random) -> None:
    repo, t = d.repo, d.tools["read"]
    path = pick(rng, list(repo.funcs))
    short = path.split("/")[-1]
    d.user(pick(rng, [f"Open {short}.", f"show me {short}", f"What's in {short}?"]))
    d.call(f"The user asks for {short}. I'll try to read it directly.", [(t, t.args(path=short))],
           [pick(rng, [f"Error: file not found: {short}", f"FileNotFoundError: [Errno 2] No such file or directory: '{short}'",
                       jdump({"error": f"{short} does not exist"})])])
    if "search" in d.tools and ("list" not in d.tools or rng.random() < 0.5):
        s = d.tools["search"]
        fname = repo.funcs[path][0].name
        pat = f"def {fname}\\("
        hits = repo.grep(pat)
        d.call(f"{short} is not at the top level. It should define `{fname}`; I'll search for that definition.",
               [(s, s.args(pattern=pat))], ["\n".join(f"{p}:{n}:{l}" for p, n, l in hits)])
    elif "list" in d.tools:
        ls = d.tools["list"]
        dd = path.rsplit("/", 1)[0]
        vals: Dict[str, Any] = {"path": dd}
        d.call(f"{short} is not at the top level; the package directory is probably {dd}. I'll list it.",
               [(ls, ls.args(**vals))], ["\n".join(repo.listing(dd, False))])
    text = repo.files[path]
    d.call(f"The file is {path}.", [(t, t.args(path=path))], [d.file_result(t, text)])
    fs = repo.funcs[path]
    d.answer("Found it.", f"The file is `{path}`. It defines:\n" + "\n".join(fn_summary(f) for f in fs))


SCENARIOS = [
    # name, function, required families, weight
    ("read_explain", sc_read_explain, ("read",), 13),
    ("find_definition", sc_find_definition, ("search",), 11),
    ("fix_tests", sc_fix_tests, ("read", "edit"), 11),
    ("create_file", sc_create_file, ("write",), 10),
    ("rename", sc_rename, ("edit",), 7),
    ("list", sc_list, ("list",), 8),
    ("shell_info", sc_shell_info, ("shell",), 10),
    ("parallel_read", sc_parallel_read, ("read",), 6),
    ("python", sc_python, ("python",), 6),
    ("misc", sc_misc, (), 6),
    ("no_tool", sc_no_tool, (), 4),
    ("recover", sc_recover, ("read", "list"), 5),
]
CODING_FAMILIES = ["read", "write", "edit", "shell", "search", "list", "tests", "python", "delete", "move", "plan"]
MISC_FAMILIES = ["weather", "calc", "time", "fetch"]

SYSTEMS = [
    None, None,
    "You are a coding agent working in a local repository. Use the tools to inspect and change files.",
    "You are a helpful assistant.",
    "You are an expert Python developer. Be concise.",
    "You are an AI programming assistant with access to the user's workspace.",
    "You help with software tasks. Prefer reading files before changing them.",
    "Answer briefly. Use tools when you need information from the project.",
]


def gen_agent(seed_key: str, pool: List[Func]) -> Dict[str, Any]:
    rng = random.Random(seed_key)
    thinking = rng.random() < SETTINGS["thinking_fraction"]
    repo = Repo(rng, pool)
    names = [s[0] for s in SCENARIOS]
    weights = [s[3] for s in SCENARIOS]
    scen = rng.choices(range(len(SCENARIOS)), weights)[0]
    chosen = [scen]
    if rng.random() < SETTINGS["follow_up_fraction"]:
        chosen.append(rng.choices(range(len(SCENARIOS)), weights)[0])
    fams = set()
    for i in chosen:
        fams |= set(SCENARIOS[i][2])
        if names[i] == "fix_tests":
            fams.add(rng.choice(["tests", "shell"]))
        if names[i] == "misc":
            fams.add(rng.choice(MISC_FAMILIES))
    extra_pool = [f for f in CODING_FAMILIES if f not in fams]
    fams |= set(rng.sample(extra_pool, rng.randint(1, 4)))
    if rng.random() < 0.15:
        fams.add(rng.choice(MISC_FAMILIES))
    fam_list = sorted(fams)
    rng.shuffle(fam_list)
    used: set = set()
    tools = {f: make_tool(rng, f, used) for f in fam_list}
    d = Dialog(rng, tools, thinking, repo)
    sysmsg = rng.choice(SYSTEMS)
    if sysmsg:
        d.messages.append({"role": "system", "content": sysmsg})
    for i in chosen:
        SCENARIOS[i][1](d, rng)
    effort = rng.choice([None, None, None, "low", "max"]) if thinking else None
    return {"kind": "agent", "scenario": "+".join(names[i] for i in chosen), "thinking": thinking, "effort": effort,
            "messages": d.messages, "tools": [tools[f].to_json() for f in fam_list], "call_points": d.call_points}


# ---- plain chats -------------------------------------------------------------------------------


CHAT_WEIGHTS = {"fib": 4, "factorial": 2, "is_prime": 2, "gcd": 2, "reverse_string": 2, "is_palindrome": 2}


def complete_prompt(rng: random.Random, sig: str, partial: str) -> str:
    one_line = "\n" not in partial.strip()
    if one_line and rng.random() < 0.45:
        return pick(rng, ["Complete this Python function: ", "Complete this Python function: ", "Complete this function: ",
                          "Finish this Python function: ", "Implement this Python function: "]) + partial.strip()
    block = f"```python\n{partial.rstrip()}\n```"
    return pick(rng, [f"Complete this Python function:\n\n{block}", f"Finish the implementation:\n\n{block}",
                      f"Can you complete this code?\n\n{block}", f"Fill in the body of this function.\n\n{block}",
                      f"Complete the following Python function.\n{block}"])


def partial_of(src: str, rng: random.Random, sig_lines: int) -> str:
    lines = src.rstrip("\n").split("\n")
    tree = ast.parse(src).body[0]
    has_doc = ast.get_docstring(tree) is not None
    doc_end = tree.body[0].end_lineno if has_doc else sig_lines
    mode = rng.random()
    if mode < 0.45 or not has_doc:
        return "\n".join(lines[:sig_lines])
    return "\n".join(lines[:doc_end])


def gen_chat(seed_key: str, pool: List[Func]) -> Dict[str, Any]:
    rng = random.Random(seed_key)
    thinking = rng.random() < 0.2
    msgs: List[Dict[str, Any]] = []
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": pick(rng, [s for s in SYSTEMS if s])})
    kind = rng.random()
    if kind < 0.45:  # classic completion or write-from-description (the README demo completes fib)
        c = Classic(rng, rng.choices(classics.CLASSICS, [CHAT_WEIGHTS.get(e["names"][0], 1) for e in classics.CLASSICS])[0])
        if rng.random() < 0.75:
            msgs.append({"role": "user", "content": complete_prompt(rng, c.sig, partial_of(c.src, rng, 1))})
            sc = "complete_classic"
        else:
            msgs.append({"role": "user", "content": pick(rng, [f"Write a Python function `{c.name}` to {c.task}.",
                                                               f"Write a Python function that will {c.task}.",
                                                               f"How do I {c.task} in Python?"])})
            sc = "write_classic"
        ans = f"```python\n{c.src.rstrip()}\n```"
        if rng.random() < 0.4:
            call = pick(rng, c.calls)
            ans += f"\n\nFor example, `{call}` returns `{classics.run_call(c.src, c.name, call)}`."
        reasoning = f"The function should {c.task}. A straightforward implementation is enough."
    elif kind < 0.85:  # corpus function completion (mostly documented functions)
        f = pick(rng, [x for x in rng.sample(pool, 8) if x.doc_line()] or pool) if rng.random() < 0.7 else pick(rng, pool)
        sig_lines = f.sig.count("\n") + 1
        msgs.append({"role": "user", "content": complete_prompt(rng, f.sig, partial_of(f.src, rng, sig_lines))})
        ans = f"```python\n{f.src.rstrip()}\n```"
        d = f.doc_line()
        if d and rng.random() < 0.4:
            ans += f"\n\n`{f.name}`: {d}"
        reasoning = f"I need to write the body of {f.name}" + (f", which should: {d}" if d else ".")
        sc = "complete_corpus"
    elif kind < 0.95:  # explain
        cands = [f for f in rng.sample(pool, 20) if f.doc_line()]
        f = cands[0] if cands else pick(rng, pool)
        d = f.doc_line() or "It has no docstring; the code is shown above."
        msgs.append({"role": "user", "content": pick(rng, ["What does this function do?\n\n", "Explain this code:\n\n", "Briefly, what is this for?\n\n"]) +
                     f"```python\n{f.src.rstrip()}\n```"})
        args = ", ".join(f"`{a}`" for a in f.args if a not in ("self", "cls"))
        ans = f"`{f.name}`" + (f" takes {args}." if args else " takes no arguments.") + f" {d}"
        reasoning = f"The function is {f.name}; its docstring explains its purpose."
        sc = "explain"
    else:  # docstring
        cands = [f for f in rng.sample(pool, 20) if f.doc_line()]
        f = cands[0] if cands else None
        if f is None:
            return gen_chat(seed_key + ":retry", pool)
        tree = ast.parse(f.src).body[0]
        lines = f.src.rstrip("\n").split("\n")
        nodoc = "\n".join(lines[: tree.body[0].lineno - 1] + lines[tree.body[0].end_lineno:]) if len(tree.body) > 1 else None
        if not nodoc:
            return gen_chat(seed_key + ":retry", pool)
        msgs.append({"role": "user", "content": f"Write a one-line docstring for this function.\n\n```python\n{nodoc}\n```"})
        ans = f'"""{f.doc_line()}"""'
        reasoning = f"I'll summarize what {f.name} does in one line."
        sc = "docstring"
    msg: Dict[str, Any] = {"role": "assistant", "content": ans}
    if thinking:
        msg["reasoning_content"] = reasoning
    msgs.append(msg)
    return {"kind": "chat", "scenario": sc, "thinking": thinking, "effort": None, "messages": msgs, "tools": [], "call_points": []}


# =============================================================================================
# Rendering through dsx


def dsx_bin() -> str:
    return os.environ.get("DSX", os.path.join(REPO, "build-cpu", "dsx"))


def request_json(conv: Dict[str, Any], messages: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    r: Dict[str, Any] = {"messages": messages if messages is not None else conv["messages"],
                         "thinking_mode": "thinking" if conv["thinking"] else "chat"}
    if conv["tools"]:
        r["tools"] = conv["tools"]
    if conv.get("effort"):
        r["reasoning_effort"] = conv["effort"]
    return r


def render_all(reqs: List[Dict[str, Any]], tokenizer: Optional[str], workers: int = 2) -> List[Any]:
    """dsx render of each request (ids when a tokenizer is given, else text)."""
    exe = dsx_bin()
    with tempfile.TemporaryDirectory(prefix="dsx-render-") as td:
        def one(i: int):
            p = os.path.join(td, f"{i}.json")
            with open(p, "w", encoding="utf-8") as f:
                json.dump(reqs[i], f, ensure_ascii=False)
            cmd = [exe, "render", "--profile", "v41", "--messages", p]
            if tokenizer:
                cmd += ["--tokenizer", tokenizer, "--ids"]
            r = subprocess.run(cmd, capture_output=True)
            os.remove(p)
            if r.returncode != 0:
                raise RuntimeError(f"dsx render failed on request {i}: {r.stderr.decode(errors='replace')[:500]}")
            if tokenizer:
                return [int(x) for x in r.stdout.split()]
            return r.stdout.decode("utf-8")

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            return list(ex.map(one, range(len(reqs)), chunksize=16))


def render_ids(reqs: List[Dict[str, Any]], tokenizer: str, workers: int, verify_every: int) -> Tuple[List[List[int]], int]:
    """Token ids of the rendered requests: dsx render (text) of every request, then one
    `dsx tokenize` of the concatenation (each prompt starts with the BOS added token, so the
    encodings cannot interact), split at the BOS ids. Equal to `dsx render --ids` whenever no
    client text contains an added-token string (the generator never writes one); checked by
    rendering every verify_every-th request with --ids. Returns (ids, number verified)."""
    import numpy as np

    texts = render_all(reqs, None, workers)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False, newline="") as f:
        f.write("".join(texts))
        path = f.name
    try:
        r = subprocess.run([dsx_bin(), "tokenize", "--tokenizer", tokenizer, "-f", path], capture_output=True, check=True)
    finally:
        os.remove(path)
    flat = np.fromstring(r.stdout, dtype=np.int64, sep=" ")
    starts = list(np.flatnonzero(flat == 0)) + [len(flat)]
    if len(starts) - 1 != len(reqs) or starts[0] != 0:
        raise SystemExit(f"tokenized {len(starts) - 1} BOS-separated prompts, expected {len(reqs)}")
    ids = [flat[starts[i]:starts[i + 1]].tolist() for i in range(len(reqs))]
    check = list(range(0, len(reqs), verify_every))
    direct = render_all([reqs[i] for i in check], tokenizer, workers)
    for i, d in zip(check, direct):
        if d != ids[i]:
            raise SystemExit(f"request {i}: dsx render --ids differs from render + tokenize")
    return ids, len(check)


def gen_split(split: str, n_agents: int, n_chats: int, pool: List[Func]) -> List[Dict[str, Any]]:
    s = SETTINGS["seed"]
    convs = []
    for i in range(max(n_agents, n_chats)):
        if i < n_agents:
            convs.append(gen_agent(f"{s}:{split}:agent:{i}", pool))
        if i < n_chats:
            convs.append(gen_chat(f"{s}:{split}:chat:{i}", pool))
    return convs


def prefix_key(conv: Dict[str, Any], k: int) -> str:
    return hashlib.sha256(jdump([conv["tools"], conv["thinking"], conv["messages"][:k]]).encode()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(REPO, "train", "out", "data"))
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "train", "out", "tokenizer.json"))
    ap.add_argument("--sample-text", action="store_true", help="render training conversations as text for the tokenizer sample")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--eval-only", action="store_true",
                    help="only agent_eval.jsonl: the splits are generated (for the prefix check), not rendered")
    args = ap.parse_args()
    t0 = time.time()
    out = os.path.join(args.data, "agents")
    os.makedirs(out, exist_ok=True)
    pool = function_pool(args.data, SETTINGS["pool_files"], SETTINGS["seed"])
    log(f"function pool: {len(pool)} functions from the training corpus ({time.time() - t0:.1f} s)")
    if args.sample_text:
        n = SETTINGS["sample_text_conversations"]
        convs = gen_split("train", min(n, SETTINGS["train_agents"]), min(n // 2, SETTINGS["train_chats"]), pool)[:n]
        texts = render_all([request_json(c) for c in convs], None, args.workers)
        with open(os.path.join(out, "sample_text.txt"), "w", encoding="utf-8", newline="") as f:
            f.write("".join(texts))
        log(f"sample_text.txt: {len(texts)} conversations, {sum(len(t.encode()) for t in texts) / 1e6:.2f} MB ({time.time() - t0:.1f} s)")
        return 0

    import numpy as np  # noqa: E402 - only the id stage needs numpy

    stats: Dict[str, Any] = {"settings": SETTINGS, "pool_functions": len(pool)}
    train_prefixes = set()
    for split, na, nc in (("train", SETTINGS["train_agents"], SETTINGS["train_chats"]),
                          ("val", SETTINGS["val_agents"], SETTINGS["val_chats"])):
        convs = gen_split(split, na, nc, pool)
        if args.eval_only:  # the same prompts as a full run: only the training prefixes matter
            if split == "train":
                for c in convs:
                    for j in range(1, len(c["messages"]) + 1):
                        train_prefixes.add(prefix_key(c, j))
            log(f"{split}: generated {len(convs)} conversations ({time.time() - t0:.1f} s), not rendered (--eval-only)")
            continue
        log(f"{split}: generated {len(convs)} conversations ({time.time() - t0:.1f} s); rendering")
        ids, n_verified = render_ids([request_json(c) for c in convs], args.tokenizer, args.workers, SETTINGS["verify_every"])
        log(f"{split}: rendered; {n_verified} conversations checked against dsx render --ids")
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
        if flat.max() >= 65536 or flat.min() < 0:
            raise SystemExit("token id outside uint16")
        flat.astype("<u2").tofile(os.path.join(out, f"{split}.bin"))
        off = 0
        by_kind: Dict[str, Dict[str, int]] = {}
        with open(os.path.join(out, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for c, x in zip(convs, ids):
                if x[0] != 0:
                    raise SystemExit("a rendered conversation does not start with BOS (id 0)")
                rec = dict(c)
                rec["offset"], rec["length"] = off, len(x)
                off += len(x)
                f.write(jdump(rec) + "\n")
                k = by_kind.setdefault(c["kind"], {"conversations": 0, "tokens": 0, "max_tokens": 0})
                k["conversations"] += 1
                k["tokens"] += len(x)
                k["max_tokens"] = max(k["max_tokens"], len(x))
                if split == "train":
                    for j in range(1, len(c["messages"]) + 1):
                        train_prefixes.add(prefix_key(c, j))
        lengths = sorted(len(x) for x in ids)
        stats[split] = {"by_kind": by_kind, "tokens": int(off), "verified_with_render_ids": n_verified,
                        "length_percentiles": {p: lengths[min(len(lengths) - 1, len(lengths) * p // 100)] for p in (10, 50, 90, 99)}}
        log(f"{split}: {off} tokens; {json.dumps(by_kind)} ({time.time() - t0:.1f} s)")

    # ---- held-out agent prompts ----
    # Candidates from their own seeds, cut before an assistant turn with tool calls (70 % the
    # first one); kept when the prompt is no prefix of a training conversation and prompt +
    # reference turn fit in eval_max_tokens (the trainer's window).
    evals, i = [], 0
    s = SETTINGS["seed"]
    rejected = {"in_training": 0, "too_long": 0}
    while len(evals) < SETTINGS["eval_prompts"]:
        cands = []
        while len(cands) < SETTINGS["eval_prompts"] - len(evals) + 16:
            c = gen_agent(f"{s}:eval:agent:{i}", pool)
            i += 1
            if not c["call_points"]:
                continue
            rng = random.Random(f"{s}:eval:cut:{i}")
            k, tool = c["call_points"][0] if rng.random() < 0.7 else rng.choice(c["call_points"])
            if prefix_key(c, k) in train_prefixes:
                rejected["in_training"] += 1
                continue
            cands.append((c, k, tool))
        preqs = [request_json(c, c["messages"][:k]) for c, k, _ in cands]
        freqs = [request_json(c, c["messages"][:k + 1]) for c, k, _ in cands]
        pids = render_all(preqs, args.tokenizer, args.workers)
        fids = render_all(freqs, args.tokenizer, args.workers)
        ptexts = render_all(preqs, None, args.workers)
        ftexts = render_all(freqs, None, args.workers)
        for (c, k, tool), p, fi, pt, ft in zip(cands, pids, fids, ptexts, ftexts):
            if len(evals) >= SETTINGS["eval_prompts"]:
                break
            if len(fi) > SETTINGS["eval_max_tokens"]:
                rejected["too_long"] += 1
                continue
            # The reference completion: the rendered target turn (full render minus the
            # prompt); it must pass the same check the trained model's completions get.
            if not ft.startswith(pt) or fi[:len(p)] != p:
                raise SystemExit("eval: the prompt is not a prefix of the rendered conversation")
            ref = ft[len(pt):]
            ok, detail = dsml_lite.check_completion(ref, c["tools"], c["thinking"])
            if not ok:
                raise SystemExit(f"eval: the reference completion fails the check: {detail}")
            evals.append((c, k, tool, p, ref, len(fi) - len(p)))
    with open(os.path.join(args.data, "agent_eval.jsonl"), "w", encoding="utf-8") as f:
        for c, k, tool, p, ref, nref in evals:
            target = c["messages"][k]
            f.write(jdump({"messages": c["messages"][:k], "tools": c["tools"], "thinking": c["thinking"],
                           "reasoning_effort": c["effort"], "prompt_ids": p, "expected_tool": tool,
                           "expected_calls": [{"name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}
                                              for tc in target["tool_calls"]],
                           "reference_completion": ref, "reference_tokens": nref, "scenario": c["scenario"]}) + "\n")
    # ---- held-out plain chats (no tools): the answer must be text, never a DSML call ----
    chat_evals, i = [], 0
    while len(chat_evals) < SETTINGS["eval_chats"]:
        c = gen_chat(f"{s}:eval:chat:{i}", pool)
        i += 1
        k = max(j for j, m in enumerate(c["messages"]) if m["role"] == "user") + 1
        if prefix_key(c, k) in train_prefixes:
            rejected["in_training"] += 1
            continue
        chat_evals.append((c, k))
    cids = render_all([request_json(c, c["messages"][:k]) for c, k in chat_evals], args.tokenizer, args.workers)
    with open(os.path.join(args.data, "chat_eval.jsonl"), "w", encoding="utf-8") as f:
        for (c, k), p in zip(chat_evals, cids):
            f.write(jdump({"messages": c["messages"][:k], "tools": [], "thinking": c["thinking"],
                           "reasoning_effort": None, "prompt_ids": p, "expected_tool": None,
                           "scenario": "chat:" + c["scenario"]}) + "\n")
    stats["eval"] = {"prompts": len(evals), "chats": len(chat_evals), "rejected": rejected,
                     "thinking": sum(1 for e in evals if e[0]["thinking"]),
                     "first_call": sum(1 for e in evals if e[0]["call_points"][0][0] == e[1]),
                     "max_prompt_tokens": max(len(e[3]) for e in evals)}
    with open(os.path.join(out, "eval_stats.json" if args.eval_only else "stats.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    log(f"agent_eval.jsonl: {len(evals)} prompts, chat_eval.jsonl: {len(chat_evals)} chats (rejected: "
        f"{json.dumps(rejected)}); done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
