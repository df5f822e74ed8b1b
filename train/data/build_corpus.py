#!/usr/bin/python3
"""Builds the text corpus of the trained small model from permissively licensed material
shipped on this machine (issue 24, part D).

Sources (each file is recorded with its path relative to the source root, owning package,
license, SHA-256 and size in train/out/data/manifest.json):
  python-stdlib   /usr/lib/python3.11/**.py          Debian libpython3.11-* (CPython, PSF-2.0)
  python-dist     /usr/lib/python3/dist-packages/**.py  Debian python3-* packages whose
                  copyright file gives the file a permissive license (see license_of)
  docs            /usr/share/doc/<pkg>/** .md .rst .txt README (plain or .gz) of packages with
                  a permissive license (no changelogs / NEWS / copyright files)
  npm-js          /usr/lib/node_modules/**.js (Debian nodejs' bundled npm packages) whose
                  nearest package.json says MIT, ISC, BSD-2/3-Clause, Apache-2.0 or 0BSD

Filters: valid UTF-8, no NUL, 64 B .. 512 KiB, no line over 1000 characters (generated or
minified files), no text that would tokenize to an added token of the V4.1 tokenizer
(<think>, ｜DSML｜, ...), vendored copies (`_vendor/`) skipped. Identical files (same
SHA-256) are kept once. A per-package byte cap keeps one package (sympy) from dominating.

Split by file, from sha256(seed:file-sha256):
  heldout  1.5 % of the Python files: never in training; written raw to heldout_code/ and
           (a subset of ~400 KB) concatenated to heldout_code.txt for bits-per-byte.
           A candidate that shares more than 30 % of its 4-line shingles with the
           training files is a near-duplicate and goes to training instead.
  val      1 % of all files (validation tokens)
  train    the rest.
Documents are written to docs/<split>_<kind>.txt, each one preceded by the BOS string, so that
`dsx tokenize` of such a file gives the BOS-separated token stream directly.

Deterministic: the same machine gives the same bytes (sorted walks, hash-based choices).
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import gzip
import hashlib
import json
import os
import re
import sys
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN_TOKENIZER = os.path.join(_GOLDEN_ROOT, "tokenizer/tokenizer-v41.json")
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"

SETTINGS = {
    "seed": 24,
    "min_bytes": 64,
    "max_bytes": 512 * 1024,
    "max_line_chars": 1000,
    "package_cap_bytes": 20 * 1024 * 1024,
    "heldout_permille": 15,  # of Python files
    "val_permille": 10,  # of all files
    "heldout_txt_target_bytes": 400 * 1024,
    "heldout_txt_max_file_bytes": 48 * 1024,
    "near_dup_shingle_lines": 4,
    "near_dup_max_shared": 0.30,
}

SOURCES = [
    # name, root, kind, file patterns
    ("python-stdlib", "/usr/lib/python3.11", "code", ("*.py",)),
    ("python-dist", "/usr/lib/python3/dist-packages", "code", ("*.py",)),
    ("docs", "/usr/share/doc", "docs", ("*.md", "*.md.gz", "*.rst", "*.rst.gz", "*.txt", "*.txt.gz", "README", "README.gz")),
    ("npm-js", "/usr/lib/node_modules", "js", ("*.js", "*.mjs", "*.cjs")),
]
SKIP_DIRS = {"__pycache__", "_vendor", "site-packages", "dist-packages", "changelogs"}
DOC_SKIP = re.compile(r"(changelog|news|copyright|history|changes)", re.I)

# Debian packages whose copyright file is not in the machine-readable (DEP-5) format: the
# license read by hand from /usr/share/doc/<pkg>/copyright.
LICENSE_OVERRIDES = {
    "libpython3.11-stdlib": "PSF-2.0",  # "Python License" (PSF), CPython
    "libpython3.11-minimal": "PSF-2.0",
    "libpython3.11-dev": "PSF-2.0",
    "python3.11": "PSF-2.0",
    "python3.11-venv": "PSF-2.0",
    "python3-distutils": "PSF-2.0",
    "python3-lib2to3": "PSF-2.0",
    "python3-numpy": "BSD-3-Clause",  # "License:" followed by the 3-clause BSD text
    "python3-setuptools": "MIT",  # "re-licensed in 19.5 with a MIT license"
    "python3-pkg-resources": "MIT",
    "python3-yaml": "MIT",
    "nodejs": "MIT",  # "Node.js is licensed for use as follows:" + the MIT text (docs only; JS uses package.json)
}

PERMISSIVE = {
    "mit", "expat", "isc", "0bsd", "bsd", "bsd-2", "bsd-3", "bsd-2-clause", "bsd-3-clause", "apache", "apache-2",
    "apache-2.0", "psf", "psf-2", "psf-2.0", "python", "python-2.0", "zlib",
}
NPM_PERMISSIVE = {"mit", "isc", "bsd-2-clause", "bsd-3-clause", "apache-2.0", "0bsd"}


def log(msg: str) -> None:
    print(f"[corpus {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- licenses -------------------------------------------------------------------------------


def license_permissive(expr: str, allowed=PERMISSIVE) -> bool:
    """'A and B' needs all parts permissive, 'A or B' any; commas / parentheses ignored."""
    e = expr.strip().lower().replace("(", " ").replace(")", " ").replace(",", " ")
    if not e:
        return False
    ors = re.split(r"\s+or\s+", e)
    for alt in ors:
        parts = [p.strip() for p in re.split(r"\s+and\s+", alt) if p.strip()]
        if parts and all(p in allowed for p in parts):
            return True
    return False


def parse_dep5(path: str) -> Optional[List[Tuple[List[str], str]]]:
    """[(file patterns, license)] of a machine-readable copyright file, None if not DEP-5."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.startswith("Format:"):
        return None
    stanzas = []
    for block in re.split(r"\n\s*\n", text):
        files: List[str] = []
        lic = None
        lines = block.split("\n")
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("Files:"):
                files = line[6:].split()
                j = i + 1
                while j < len(lines) and lines[j].startswith((" ", "\t")) and lines[j].strip():
                    files += lines[j].split()
                    j += 1
                i = j
                continue
            if line.startswith("License:") and lic is None:
                lic = line[8:].strip()
            i += 1
        if files and lic is not None:
            stanzas.append((files, lic))
    return stanzas


def _pattern_variants(pat: str) -> List[str]:
    """The pattern and its forms without up to two leading directories (source-tree prefixes
    such as src/ that the installed path lacks), while a literal directory remains."""
    out = [pat]
    parts = pat.split("/")
    for k in (1, 2):
        rest = parts[k:]
        if len(rest) >= 2 and not any(ch in rest[0] for ch in "*?[") and rest[0]:
            out.append("/".join(rest))
    return out


def _dep5_match(pat: str, rel: str) -> bool:
    if pat.endswith("/"):
        pat += "*"
    for v in _pattern_variants(pat):
        if fnmatch.fnmatchcase(rel, v):
            return True
    return False


class Licenses:
    def __init__(self) -> None:
        self.dep5: Dict[str, Optional[List[Tuple[List[str], str]]]] = {}

    def _stanzas(self, pkg: str):
        if pkg not in self.dep5:
            cf = f"/usr/share/doc/{pkg}/copyright"
            self.dep5[pkg] = parse_dep5(cf) if os.path.exists(cf) else None
        return self.dep5[pkg]

    def license_of(self, pkg: str, rel: str) -> Tuple[Optional[str], str]:
        """(license, why) of an installed file (path `rel` relative to its source root);
        license None when the file is not permissively licensed or unknown."""
        if pkg in LICENSE_OVERRIDES:
            return LICENSE_OVERRIDES[pkg], "override"
        st = self._stanzas(pkg)
        if st is None:
            return None, "no machine-readable copyright file and no override"
        main = None
        others = []
        for files, lic in st:
            if "*" in files:
                main = lic
            elif any(_dep5_match(p, rel) for p in files):
                others.append(lic)
        if main is None:
            return None, "copyright file has no 'Files: *' stanza"
        # Conservative: every stanza that matches the file must be permissive.
        for lic in [main] + others:
            if not license_permissive(lic):
                return None, f"license '{lic}'"
        return (others[-1] if others else main), "dep5"


# ---- package ownership ----------------------------------------------------------------------


def dpkg_owners() -> Dict[str, str]:
    own: Dict[str, str] = {}
    for f in sorted(glob.glob("/var/lib/dpkg/info/*.list")):
        pkg = os.path.basename(f)[:-5].split(":")[0]
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                p = line.rstrip("\n")
                if p:
                    own.setdefault(p, pkg)
    return own


def npm_license(path: str, root: str) -> Tuple[Optional[str], Optional[str]]:
    """(package name@version, license string) from the nearest package.json with a name."""
    d = os.path.dirname(path)
    while d.startswith(root) and d != root:
        pj = os.path.join(d, "package.json")
        if os.path.exists(pj):
            try:
                with open(pj, encoding="utf-8") as f:
                    j = json.load(f)
            except (ValueError, OSError):
                j = {}
            if isinstance(j, dict) and j.get("name"):
                lic = j.get("license")
                if isinstance(lic, dict):
                    lic = lic.get("type")
                if lic is None and isinstance(j.get("licenses"), list) and j["licenses"]:
                    x = j["licenses"][0]
                    lic = x.get("type") if isinstance(x, dict) else x
                return f"{j['name']}@{j.get('version', '?')}", lic if isinstance(lic, str) else None
        d = os.path.dirname(d)
    return None, None


# ---- filters --------------------------------------------------------------------------------


def added_token_strings() -> List[str]:
    with open(GOLDEN_TOKENIZER, encoding="utf-8") as f:
        return [a["content"] for a in json.load(f)["added_tokens"]]


class AddedTokenScan:
    def __init__(self) -> None:
        toks = added_token_strings()
        self.rx = re.compile("|".join(re.escape(t) for t in sorted(toks, key=len, reverse=True)))
        # Every added token contains one of these; a cheap prefilter.
        self.keys = sorted({("\uff5c" if "\uff5c" in t else t[:3]) for t in toks})

    def found(self, text: str) -> bool:
        if not any(k in text for k in self.keys):
            return False
        return self.rx.search(text) is not None


def read_source(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    return data


def check_text(data: bytes, scan: AddedTokenScan) -> Tuple[Optional[str], str]:
    """(text, '') if usable, else (None, reason)."""
    if len(data) < SETTINGS["min_bytes"]:
        return None, "too small"
    if len(data) > SETTINGS["max_bytes"]:
        return None, "too large"
    if b"\0" in data:
        return None, "NUL byte"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if text.startswith("\ufeff"):
        return None, "byte-order mark"
    if max((len(l) for l in text.split("\n")), default=0) > SETTINGS["max_line_chars"]:
        return None, "line over max_line_chars (generated/minified)"
    if scan.found(text):
        return None, "contains an added-token string"
    return text, ""


# ---- walking --------------------------------------------------------------------------------


def walk(root: str, patterns) -> List[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not os.path.islink(os.path.join(d, x)))
        for fn in sorted(files):
            if any(fnmatch.fnmatchcase(fn, p) for p in patterns):
                p = os.path.join(d, fn)
                if os.path.isfile(p) and not os.path.islink(p):
                    out.append(p)
    return out


def shingles(text: str, k: int) -> set:
    lines = [l.strip() for l in text.split("\n")]
    lines = [l for l in lines if l]
    return {hashlib.blake2b("\n".join(lines[i : i + k]).encode("utf-8"), digest_size=8).digest()
            for i in range(max(0, len(lines) - k + 1))}


def split_key(sha: str) -> int:
    h = hashlib.sha256(f"{SETTINGS['seed']}:{sha}".encode()).hexdigest()
    return int(h[:16], 16) % 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "train", "out", "data"))
    args = ap.parse_args()
    out = args.out
    t0 = time.time()
    owners = dpkg_owners()
    lic = Licenses()
    scan = AddedTokenScan()
    records: List[dict] = []
    kept: List[dict] = []  # records with "text"
    seen_sha: Dict[str, str] = {}
    pkg_bytes: Dict[str, int] = {}

    for name, root, kind, patterns in SOURCES:
        files = walk(root, patterns)
        if name == "docs":
            files = [p for p in files if not DOC_SKIP.search(os.path.relpath(p, root))]
        log(f"{name}: {len(files)} candidate files under {root}")
        cands = []
        for p in files:
            rel = os.path.relpath(p, root)
            rec = {"source": name, "path": rel, "kind": kind}
            real = os.path.realpath(p)
            pkg = owners.get(p) or owners.get(real)
            if name == "npm-js":
                npkg, nlic = npm_license(p, root)
                rec["package"] = f"{pkg or '?'}:{npkg or '?'}"
                if pkg is None:
                    rec["status"] = "excluded: not shipped by a Debian package"
                elif nlic is None or not license_permissive(nlic, NPM_PERMISSIVE):
                    rec["status"] = f"excluded: npm license {nlic!r}"
                    rec["license"] = nlic
                else:
                    rec["license"] = nlic
            else:
                rec["package"] = pkg
                if pkg is None:
                    rec["status"] = "excluded: not shipped by a Debian package"
                else:
                    if name == "docs":
                        l, why = lic.license_of(pkg, "*")
                    else:
                        l, why = lic.license_of(pkg, rel)
                    if l is None:
                        rec["status"] = f"excluded: {why}"
                    else:
                        rec["license"] = l
            data = read_source(p)
            rec["sha256"] = hashlib.sha256(data).hexdigest()
            rec["bytes"] = len(data)
            records.append(rec)
            if "status" in rec:
                continue
            text, why = check_text(data, scan)
            if text is None:
                rec["status"] = f"excluded: {why}"
                continue
            if rec["sha256"] in seen_sha:
                rec["status"] = f"duplicate of {seen_sha[rec['sha256']]}"
                continue
            seen_sha[rec["sha256"]] = f"{name}/{rel}"
            cands.append((rec, text))
        # Per-package cap, files taken in hash order.
        by_pkg: Dict[str, List[Tuple[dict, str]]] = {}
        for rec, text in cands:
            by_pkg.setdefault(rec["package"], []).append((rec, text))
        for pkg, lst in sorted(by_pkg.items()):
            lst.sort(key=lambda x: x[0]["sha256"])
            total = 0
            for rec, text in lst:
                if total + rec["bytes"] > SETTINGS["package_cap_bytes"]:
                    rec["status"] = "excluded: package byte cap"
                    continue
                total += rec["bytes"]
                rec["text"] = text
                kept.append(rec)
            pkg_bytes[f"{name}:{pkg}"] = total

    # ---- split ----
    for rec in kept:
        k = split_key(rec["sha256"])
        if rec["kind"] == "code" and k < SETTINGS["heldout_permille"]:
            rec["status"] = "heldout"
        elif SETTINGS["heldout_permille"] <= k < SETTINGS["heldout_permille"] + SETTINGS["val_permille"]:
            rec["status"] = "val"
        else:
            rec["status"] = "train"
    sk = SETTINGS["near_dup_shingle_lines"]
    train_sh: set = set()
    for rec in kept:
        if rec["status"] == "train":
            train_sh |= shingles(rec["text"], sk)
    n_demoted = 0
    for rec in kept:
        if rec["status"] != "heldout":
            continue
        sh = shingles(rec["text"], sk)
        shared = len(sh & train_sh) / len(sh) if sh else 1.0
        rec["shared_shingles"] = round(shared, 3)
        if shared > SETTINGS["near_dup_max_shared"]:
            rec["status"] = "train"
            rec["note"] = "held-out candidate demoted: near-duplicate of training files"
            n_demoted += 1
    log(f"held-out near-duplicates moved to training: {n_demoted}")

    # ---- write ----
    os.makedirs(out, exist_ok=True)
    hdir = os.path.join(out, "heldout_code")
    ddir = os.path.join(out, "docs")
    for d in (hdir, ddir):
        if os.path.isdir(d):
            for dp, dn, fn in os.walk(d, topdown=False):
                for x in fn:
                    os.remove(os.path.join(dp, x))
                for x in dn:
                    os.rmdir(os.path.join(dp, x))
        os.makedirs(d, exist_ok=True)
    streams: Dict[str, list] = {}
    for rec in kept:
        st = rec["status"]
        if st == "heldout":
            p = os.path.join(hdir, rec["source"], rec["path"])
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8", newline="") as f:
                f.write(rec["text"])
            continue
        streams.setdefault(f"{st}_{rec['kind']}", []).append(rec)
    doc_files = {}
    for key, lst in sorted(streams.items()):
        p = os.path.join(ddir, key + ".txt")
        with open(p, "w", encoding="utf-8", newline="") as f:
            for rec in lst:
                f.write(BOS)
                f.write(rec["text"])
        doc_files[key] = {"file": os.path.relpath(p, out), "documents": len(lst), "bytes": os.path.getsize(p),
                          "sha256": sha256_file(p)}
    # heldout_code.txt: held-out files in hash order, each at most max_file_bytes, to ~target.
    held = sorted((r for r in kept if r["status"] == "heldout"), key=lambda r: split_key(r["sha256"] + ":txt"))
    parts, total, used = [], 0, []
    for rec in held:
        if rec["bytes"] > SETTINGS["heldout_txt_max_file_bytes"]:
            continue
        if total >= SETTINGS["heldout_txt_target_bytes"]:
            break
        parts.append(rec["text"])
        used.append(f"{rec['source']}/{rec['path']}")
        total += len(rec["text"].encode("utf-8")) + 2
    htxt = os.path.join(out, "heldout_code.txt")
    with open(htxt, "w", encoding="utf-8", newline="") as f:
        f.write("\n\n".join(parts))

    for rec in kept:
        rec.pop("text", None)
    summary: Dict[str, dict] = {}
    for rec in records:
        st = rec.get("status", "?")
        st = st if not st.startswith(("excluded", "duplicate")) else st.split(":")[0].split(" ")[0]
        key = f"{rec['source']}/{st}"
        s = summary.setdefault(key, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += rec["bytes"]
    manifest = {
        "what": "dsx small-model corpus (issue 24): files, licenses, hashes, split",
        "script": "train/data/build_corpus.py",
        "settings": SETTINGS,
        "sources": [{"name": n, "root": r, "kind": k, "patterns": list(p)} for n, r, k, p in SOURCES],
        "license_overrides": LICENSE_OVERRIDES,
        "totals": summary,
        "package_bytes": dict(sorted(pkg_bytes.items())),
        "documents": doc_files,
        "heldout_code_txt": {"file": "heldout_code.txt", "bytes": os.path.getsize(htxt), "sha256": sha256_file(htxt),
                             "files": used},
        "files": records,
    }
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    for k, v in sorted(summary.items()):
        log(f"  {k:40s} {v['files']:6d} files {v['bytes'] / 1e6:8.2f} MB")
    for k, v in doc_files.items():
        log(f"  docs/{k}.txt: {v['documents']} documents, {v['bytes'] / 1e6:.2f} MB")
    log(f"heldout_code.txt: {len(used)} files, {os.path.getsize(htxt) / 1e3:.0f} KB")
    log(f"done in {time.time() - t0:.1f} s")
    return 0


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
