#!/usr/bin/env python3
"""Import circles between the modules of each crate, and integration-test binaries per crate.

For every crate in crates/*, reads the Rust files under src/ and collects each path that
names another module of the crate: `use crate::...`, `use super::...`, `use self::...` and the
same paths written inline (`crate::device::lock(..)`). Comments, strings and `#[cfg(test)]`
modules are left out (unit tests may reach anywhere). A name imported through a re-export
(`crate::Error`, re-exported by lib.rs from `error`) counts as an import of the module that
defines it.

Prints, per crate, the strongly connected components with more than one member of two graphs (the crate root,
lib.rs, is the top: it re-exports and wires, so its own imports are not edges; an import of
the root from a module is):
  - top:  one node per top-level module of src/ (a folder and everything in it is one node);
          a circle here spans two folders or files of src/;
  - file: one node per file (`cm::attempt`, `verbs::qp::pump`).
and the number of integration-test binaries (tests/*.rs and tests/*/main.rs).

Usage: scripts/import-circles.py [REPO_ROOT]    (default: the repository of this script)
"""

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """Removes comments, string and char literals (keeps line structure roughly)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            i = n if j < 0 else j + len(end)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'":
            # char literal or lifetime
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:
                i += len(m.group(0))
                out.append("' '")
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_test_mods(code):
    """Removes `#[cfg(test)] mod x { ... }` blocks (brace matched)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+" + IDENT + r"\s*\{", code)
        if not m:
            return code
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        code = code[: m.start()] + code[i:]


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("lib", "main") and len(parts) == 1:
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def expand_use_tree(tree):
    """`a::{b, c::{d, e as f}, self}` -> [['a','b'], ['a','c','d'], ['a','c','e'], ['a']]"""
    tree = re.sub(r"\s+", "", tree)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(s, prefix):
        s = re.sub(r"as" + IDENT + "$", "", s) if re.search(r"[A-Za-z0-9_]as" + IDENT + "$", s) else s
        i = s.find("{")
        if i < 0:
            segs = [x for x in s.split("::") if x]
            if segs and segs[-1] == "self":
                segs = segs[:-1]
            return [prefix + segs]
        head = [x for x in s[:i].split("::") if x]
        inner = s[i + 1 : s.rfind("}")]
        res = []
        for part in split_top(inner):
            res += walk(part, prefix + head)
        return res

    return walk(tree, [])


class Crate:
    def __init__(self, root):
        self.root = root
        self.src = root / "src"
        self.files = {}  # module path -> code
        for p in sorted(self.src.rglob("*.rs")):
            code = strip_test_mods(strip_code(p.read_text()))
            self.files[module_of(self.src, p)] = code
        self.uses = {m: self.parse_uses(m, c) for m, c in self.files.items()}

    def absolute(self, mod, segs):
        """Path relative to `mod` (crate::/super::/self::/a submodule name) -> absolute."""
        segs = list(segs)
        if not segs:
            return None
        if segs[0] == "crate":
            return segs[1:]
        base = list(mod)
        if segs[0] in ("super", "self"):
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    base = base[:-1]
                segs = segs[1:]
            return base + segs
        if tuple(base + segs[:1]) in self.files:  # `use qp::X` in a parent of `qp`
            return base + segs
        return None

    def parse_uses(self, mod, code):
        uses = {}
        for m in re.finditer(r"\buse\s+([^;]+);", code):
            tree = m.group(1)
            renamed = {}
            for a in re.finditer(r"(" + IDENT + r")\s+as\s+(" + IDENT + ")", tree):
                renamed[a.group(1)] = a.group(2)
            for path in expand_use_tree(re.sub(r"\s+as\s+" + IDENT, "", tree)):
                if path:
                    # None: a name from another crate (`pub use softwarp_engine::cq::CqId`)
                    uses[renamed.get(path[-1], path[-1])] = self.absolute(mod, path)
        return uses

    def resolve(self, path, depth=0):
        """Absolute path -> the file module that defines its first non-module segment (None:
        another crate's, re-exported)."""
        k = len(path)
        while k > 0 and tuple(path[:k]) not in self.files:
            k -= 1
        mod = tuple(path[:k])
        if mod not in self.files:
            mod = ()
        rest = path[k:]
        if rest and depth < 8 and rest[0] in self.uses.get(mod, {}):
            via = self.uses[mod][rest[0]]
            return None if via is None else self.resolve(via + rest[1:], depth + 1)
        return mod

    def edges(self):
        edges = set()
        for mod, code in self.files.items():
            if mod == ():
                # The crate root re-exports the API and wires the layers (softwarp installs
                # its RAS hooks there): it is the top of the graph, its imports no edges.
                continue
            paths = []
            for m in re.finditer(r"\buse\s+([^;]+);", code):
                paths += expand_use_tree(re.sub(r"\s+as\s+" + IDENT, "", m.group(1)))
            for m in re.finditer(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)", code):
                paths.append(re.sub(r"\s+", "", m.group(1)).split("::"))
            for p in paths:
                ab = self.absolute(mod, p)
                if ab is None:
                    continue
                target = self.resolve(ab)
                if target is not None and target != mod:
                    edges.add((mod, target))
        return edges


def sccs(nodes, edges):
    adj = {n: [] for n in nodes}
    for a, b in edges:
        adj.setdefault(a, []).append(b)
        adj.setdefault(b, [])
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return [sorted(c) for c in out if len(c) > 1]


def name(mod):
    return "::".join(mod) if mod else "(lib)"


def test_binaries(root):
    t = root / "tests"
    if not t.is_dir():
        return 0
    return len(list(t.glob("*.rs"))) + len(list(t.glob("*/main.rs")))


def main():
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    total = 0
    for root in sorted((repo / "crates").iterdir()):
        if not (root / "src").is_dir():
            continue
        c = Crate(root)
        fe = c.edges()
        top = {(a[:1], b[:1]) for a, b in fe if a[:1] != b[:1]}
        tops = {m[:1] for m in c.files}
        top_c = sccs(tops, top)
        file_c = sccs(set(c.files), fe)
        tb = test_binaries(root)
        total += tb
        print(f"{root.name}: {len(tops)} top-level modules, {len(c.files)} files, "
              f"{tb} integration-test binaries")
        for label, comps in (("top", top_c), ("file", file_c)):
            if not comps:
                print(f"  {label}: no circles")
            for comp in sorted(comps, key=len, reverse=True):
                print(f"  {label} circle ({len(comp)}): {', '.join(name(m) for m in comp)}")
    print(f"integration-test binaries in all: {total}")


if __name__ == "__main__":
    main()
