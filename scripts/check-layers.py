#!/usr/bin/env python3
"""The crate's floors and its import graph (ARCHITECTURE.md, "Floors").

Reads every file under src/ (test modules left out: a `#[cfg(test)]` item and all after it at the
same depth), collects the `crate::` and `super::` paths it names, resolves each to the file that
defines the item (following `pub use` re-exports), and checks:
  - no module imports a floor above its own;
  - no cycle between top-level modules, none between files.
Exits 1 and says what is wrong; `--graph` prints the file graph.
"""
import os
import re
import sys

# Bottom first. A module may import only modules on a lower floor (or its own).
FLOORS = [
    ["untrusted", "tensor", "fetch", "hub"],
    ["kv"],
    ["sched"],
    ["tokenizer"],
    ["sampling"],
    ["quant"],
    ["backend"],
    ["parallel"],
    ["models"],
    ["engine"],
    ["server", "bench"],
    ["lib", "main"],
]
FLOOR = {m: i for i, ms in enumerate(FLOORS) for m in ms}

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def strip_comments_and_strings(text):
    """The code alone: comments dropped, string and char literals emptied (one pass, so that a
    `//` inside a string or a quote inside a comment is read as what it is)."""
    out, i, n = [], 0, len(text)
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
        elif c == "r" and re.match(r'r#*"', text[i : i + 10]) and not re.match(r"\w", text[i - 1 : i] or " "):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            i = n if j < 0 else j + len(end)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", text[i : i + 12]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i : i + 12])
            i += m.end()
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_tests(text):
    """Removes `#[cfg(test)]` items: the attribute and the item after it (to its closing brace,
    or its semicolon for `mod tests;`)."""
    out = []
    i = 0
    while True:
        j = text.find("#[cfg(test)]", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        k = j + len("#[cfg(test)]")
        # the item ends at its first top-level `;` or at the brace matching its first `{`
        depth = 0
        while k < len(text):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
                if depth < 0:  # a field or variant, last in its braces
                    break
            elif c in ";," and depth == 0:  # `mod tests;`, a field or a variant
                k += 1
                break
            k += 1
        i = k
    return "".join(out)


def test_only_files():
    """Files declared as `#[cfg(test)] mod x;`: test modules, left out."""
    out = set()
    for root, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".rs"):
                with open(os.path.join(root, f)) as fh:
                    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub\s+)?mod\s+(\w+)\s*;", fh.read()):
                        d = root if f in ("mod.rs", "lib.rs", "main.rs") else os.path.join(root, f[:-3])
                        out.add(os.path.join(d, m.group(1) + ".rs"))
                        out.add(os.path.join(d, m.group(1), "mod.rs"))
    return out


def inline_modules(text):
    """The spans of `mod name { ... }` blocks in a file."""
    spans = []
    for m in re.finditer(r"\bmod\s+\w+\s*\{", text):
        depth, k = 0, m.end() - 1
        while k < len(text):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        spans.append((m.end(), k))
    return spans


def module_files():
    """module path (tuple) -> file, for every .rs under src/ but test modules."""
    tests = test_only_files()
    mods = {}
    for root, _, files in os.walk(SRC):
        for f in files:
            if not f.endswith(".rs"):
                continue
            full = os.path.join(root, f)
            if full in tests:
                continue
            rel = os.path.relpath(full, SRC)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"],):
                rel = []
            mods[tuple(rel)] = full
    return mods


def expand_use(body):
    """`a::{b, c::{d, e as f}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    body = re.sub(r"\s+as\s+[A-Za-z_]\w*", "", body)
    body = re.sub(r"\s+", "", body)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def go(s):
        i = s.find("{")
        if i < 0:
            return [s]
        prefix, inner = s[:i], s[i + 1 : s.rfind("}")]
        res = []
        for part in split_top(inner):
            for e in go(part):
                res.append(prefix.rstrip(":") if e == "self" else prefix + e)
        return res

    return go(body)


class Crate:
    def __init__(self):
        self.files = module_files()
        self.text = {}
        self.defs = {}
        self.reexports = {}
        for mod, f in self.files.items():
            with open(f) as fh:
                t = strip_tests(strip_comments_and_strings(fh.read()))
            self.text[mod] = t
            self.defs[mod] = set(
                re.findall(
                    r"\b(?:fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+([A-Za-z_]\w*)", t
                )
            )
            # pub use: name -> absolute path
            rex = {}
            globs = []
            for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", t):
                for p in expand_use(m.group(1)):
                    segs = p.split("::")
                    absolute = self.absolute(mod, segs)
                    if absolute is None:
                        continue
                    if segs[-1] == "*":
                        globs.append(absolute[:-1])
                    else:
                        rex[segs[-1]] = absolute
            self.reexports[mod] = (rex, globs)

    def absolute(self, mod, segs, inline=0):
        """`segs` as named in `mod`, `inline` modules deep (`mod x86 { ... }`), from the crate's
        root; None where it names something of the same file or outside the crate."""
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] == "super":
            base = list(mod) + [None] * inline
            while segs and segs[0] == "super":
                base = base[:-1]
                segs = segs[1:]
            if None in base:
                return None
            return base + segs
        if segs[0] == "self":
            return list(mod) + segs[1:]
        # a child module of this one
        if tuple(list(mod) + [segs[0]]) in self.files:
            return list(mod) + segs
        return None

    def resolve(self, path, seen=None):
        """absolute path (list) -> the file module that defines it."""
        seen = seen or set()
        key = tuple(path)
        if key in seen:
            return None
        seen.add(key)
        # longest module prefix
        for n in range(len(path), -1, -1):
            mod = tuple(path[:n])
            if mod in self.files:
                rest = path[n:]
                if not rest or rest[0] == "*":
                    return mod
                name = rest[0]
                if name in self.defs[mod]:
                    return mod
                rex, globs = self.reexports[mod]
                if name in rex:
                    r = self.resolve(rex[name], seen)
                    return r if r is not None else mod
                for g in globs:
                    r = self.resolve(g + rest, seen)
                    if r is not None and name in self.defs.get(r, ()):
                        return r
                return mod
        return None

    def edges(self):
        graph = {m: set() for m in self.files}
        for mod, t in self.text.items():
            paths = []
            # NOTE: a `pub use` of a module's own descendants is that module's interface, not an
            # import: `backend/mod.rs` naming `cpu::CpuBackend` for its users is no cycle with
            # `cpu/` importing the trait from `super`. Every other path counts, `pub use` of
            # anything else included.
            inline = inline_modules(t)
            for m in re.finditer(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", t):
                depth = sum(a <= m.start() < b for a, b in inline)
                for p in expand_use(m.group(2)):
                    absolute = self.absolute(mod, p.split("::"), depth)
                    if m.group(1) and absolute is not None and tuple(absolute[: len(mod)]) == mod:
                        continue
                    paths.append((p, depth))
            t_nouse = re.sub(r"\buse\s+[^;]+;", lambda m: " " * len(m.group(0)), t)
            # NOTE: a path in code names a module by `crate::`, `super::` or a child module's
            # name (`routes::router(..)` in `server/mod.rs`).
            for m in re.finditer(r"(?<![\w:])((?:[a-z_][a-z0-9_]*)(?:::[A-Za-z_]\w*)+)", t_nouse):
                first = m.group(1).split("::")[0]
                if first in ("crate", "super") or tuple(list(mod) + [first]) in self.files:
                    paths.append((m.group(1), sum(a <= m.start() < b for a, b in inline)))
            for p, depth in paths:
                segs = p.split("::")
                absolute = self.absolute(mod, segs, depth)
                if absolute is None:
                    continue
                target = self.resolve(absolute)
                if target is None or target == mod:
                    continue
                graph[mod].add(target)
        return graph


def name(mod):
    return "src/" + ("/".join(mod) if mod else "lib") + (
        "/mod.rs" if os.path.basename(Crate_files[mod]) == "mod.rs" else ".rs"
    )


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def top(mod):
    return mod[0] if mod else "lib"


def main():
    global Crate_files
    crate = Crate()
    Crate_files = crate.files
    graph = crate.edges()
    if "--graph" in sys.argv:
        for m in sorted(graph):
            for t in sorted(graph[m]):
                print(f"{name(m)} -> {name(t)}")
    problems = []
    for m, ts in graph.items():
        for t in ts:
            a, b = top(m), top(t)
            if a == b:
                continue
            if a not in FLOOR or b not in FLOOR:
                problems.append(f"{name(m)}: module `{a if a not in FLOOR else b}` has no floor")
            elif FLOOR[b] > FLOOR[a]:
                problems.append(f"{name(m)} (floor `{a}`) imports {name(t)} (floor `{b}`, above it)")
    modgraph = {}
    for m, ts in graph.items():
        for t in ts:
            if top(m) != top(t):
                modgraph.setdefault(top(m), set()).add(top(t))
    for comp in sccs(modgraph):
        problems.append("cycle between modules: " + " <-> ".join(sorted(comp)))
    for comp in sccs(graph):
        problems.append("cycle between files: " + " <-> ".join(sorted(name(m) for m in comp)))
    for p in sorted(set(problems)):
        print(p)
    if problems:
        print(f"{len(set(problems))} layering problems (scripts/check-layers.py)")
        return 1
    print(f"layers: {len(graph)} files, {sum(len(v) for v in graph.values())} imports, no cycle, every floor holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
