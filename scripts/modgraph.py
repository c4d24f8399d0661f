#!/usr/bin/env python3
"""The module graph of the crate's source: which module imports which.

The library (src/lib.rs) and each binary (src/bin/NAME/main.rs, src/bin/NAME.rs) are
graphs of their own. Edges come from every `use` tree (groups, nesting, `self`, renames)
and every inline `crate::`, `super::` and `self::` path outside comments and
`#[cfg(test)]` modules (inline or in a file of their own), and from paths that start with the name of a child module; each
name is followed through `pub use` re-exports to the module that defines it.

Prints the number of modules, edges and circles (strongly connected components of more
than one module) and each circle; with `--floors`, each module's floor (the longest
chain of imports below it); with `-v`, every module's imports.

    python3 scripts/modgraph.py            # counts and circles
    python3 scripts/modgraph.py --floors   # and the floors
    python3 scripts/modgraph.py --check    # exit 1 on any circle, or on any module that
                                           # imports what its own ancestor defines
    python3 scripts/modgraph.py --chain guard::handle
                                           # the longest chain of imports below a module
"""
import functools
import os
import re
import sys

args = [a for i, a in enumerate(sys.argv[1:], 1)
        if not a.startswith('-') and sys.argv[i - 1] != '--chain']
root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src')


def crate_roots():
    """(crate name, root file) for the library and each binary."""
    roots = []
    if os.path.exists(os.path.join(root, 'lib.rs')):
        roots.append(('lib', 'lib.rs'))
    bin_dir = os.path.join(root, 'bin')
    if os.path.isdir(bin_dir):
        for entry in sorted(os.listdir(bin_dir)):
            if entry.endswith('.rs'):
                roots.append(('bin ' + entry[:-3], os.path.join('bin', entry)))
            elif os.path.exists(os.path.join(bin_dir, entry, 'main.rs')):
                roots.append(('bin ' + entry, os.path.join('bin', entry, 'main.rs')))
    return roots


def strip(src):
    """The source without comments, strings and `#[cfg(test)]` modules."""
    src = re.sub(r'/\*.*?\*/', '', src, flags=re.S)
    src = re.sub(r'//[^\n]*', '', src)
    # Character literals first: `'"'` would open a string.
    src = re.sub(r"b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^'\\\n])'", "' '", src)
    src = re.sub(r'"(?:\\.|[^"\\])*"', '""', src)
    out, i = [], 0
    for m in re.finditer(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{', src):
        if m.start() < i:
            continue
        out.append(src[i:m.start()])
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {'{': 1, '}': -1}.get(src[j], 0)
            j += 1
        i = j
    out.append(src[i:])
    # A test module in a file of its own (`#[cfg(test)] mod tests;`) is one too.
    return re.sub(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*;', '', ''.join(out))


def expand(tree):
    """The paths of a `use` tree: `a::{b, c::{d as e, self}}` gives a::b, a::c::d, a::c."""
    tree = tree.strip()
    if tree.startswith('::'):
        tree = tree[2:]
    depth, brace = 0, None
    for i, ch in enumerate(tree):
        if ch == '{':
            if depth == 0:
                brace = i
            depth += 1
        elif ch == '}':
            depth -= 1
    if brace is None:
        path = re.split(r'\s+as\s+', tree)[0].strip()
        return [path.split('::')] if path else []
    prefix = tree[:brace].rstrip(':').strip()
    inner = tree[brace + 1:tree.rindex('}')]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += {'{': 1, '}': -1}.get(ch, 0)
        if ch == ',' and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    base = prefix.split('::') if prefix else []
    paths = []
    for part in parts:
        for sub in expand(part):
            paths.append(base if sub == ['self'] else base + sub)
    return paths


mods = {}      # (crate, path tuple) -> file
children = {}  # module -> names of its child modules
for crate, root_file in crate_roots():
    def walk(module, file):
        mods[module] = file
        children[module] = set()
        src = strip(open(os.path.join(root, file)).read())
        here = os.path.dirname(file)
        stem = os.path.basename(file)[:-3]
        folder = here if stem in ('mod', 'lib', 'main') else os.path.join(here, stem)
        for m in re.finditer(r'^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', src, re.M):
            name = m.group(1)
            for candidate in (os.path.join(folder, name + '.rs'), os.path.join(folder, name, 'mod.rs')):
                if os.path.exists(os.path.join(root, candidate)):
                    children[module].add(name)
                    walk((module[0], module[1] + (name,)), candidate)
                    break
    walk((crate, ()), root_file)

sources = {m: strip(open(os.path.join(root, f)).read()) for m, f in mods.items()}


def absolute(module, segs):
    """The crate path that `segs`, written in `module`, starts from; None if external."""
    crate, here = module
    if not segs:
        return None
    head = segs[0]
    if head == 'crate':
        return list(segs[1:])
    if head in ('super', 'self'):
        base = list(here)
        while segs and segs[0] in ('super', 'self'):
            if segs[0] == 'super':
                base = base[:-1]
            segs = segs[1:]
        return base + list(segs)
    if head in children.get(module, ()):
        return list(here) + list(segs)
    return None


reexports = {}  # (module, name) -> absolute path
for module, src in sources.items():
    for m in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+([^;]+);', src):
        for path in expand(m.group(1)):
            target = absolute(module, path)
            if target:
                alias = re.search(r'\bas\s+(\w+)', m.group(1))
                reexports[(module, path[-1])] = target
    # `pub use x as y` inside groups: map the alias too.
    for m in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+[^;]*?(\w+(?:::\w+)*)\s+as\s+(\w+)', src):
        target = absolute(module, m.group(1).split('::'))
        if target:
            reexports[(module, m.group(2))] = target


def resolve(crate, path, depth=0):
    """The module that defines what `path` (from the crate root) names."""
    for i in range(len(path), -1, -1):
        module = (crate, tuple(path[:i]))
        if module in mods:
            if i < len(path) and (module, path[i]) in reexports and depth < 16:
                return resolve(crate, reexports[(module, path[i])] + list(path[i + 1:]), depth + 1)
            return module
    return None


edges = {m: set() for m in mods}
for module, src in sources.items():
    paths = []
    for m in re.finditer(r'\buse\s+([^;]+);', src):
        paths.extend(expand(m.group(1)))
    # Inline paths outside `use` items: the prefix of a group (`crate::cache` in
    # `use crate::cache::{L1, Stored}`) names no import of its own.
    inline = re.sub(r'\buse\s+[^;]+;', '', src)
    for m in re.finditer(r'(?<![\w:])((?:crate|super|self|\w+)(?:::\w+)+)', inline):
        paths.append(m.group(1).split('::'))
    for segs in paths:
        target = absolute(module, segs)
        if target is None:
            continue
        found = resolve(module[0], target)
        if found and found != module and found[1] != ():
            edges[module].add(found)
        elif found and found != module and found[1] == () and module[1] != ():
            edges[module].add(found)

# Circles: Tarjan's strongly connected components.
sys.setrecursionlimit(10000)
index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]


def connect(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            connect(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop()
            on.discard(w)
            component.append(w)
            if w == v:
                break
        if len(component) > 1:
            circles.append(component)


for v in mods:
    if v not in index:
        connect(v)


def name(module):
    crate, path = module
    return (crate + ':' if crate != 'lib' else '') + ('::'.join(path) or 'crate')


up = sorted((name(m), name(w)) for m in mods for w in edges[m]
            if w[0] == m[0] and len(w[1]) < len(m[1]) and m[1][:len(w[1])] == w[1])
print(f"{len(mods)} modules, {sum(len(e) for e in edges.values())} edges, {len(circles)} circles")
for circle in circles:
    print("circle:", ', '.join(sorted(name(m) for m in circle)))
if up:
    print("imports up to an ancestor:", ', '.join(f"{a} -> {b}" for a, b in up))
if '-v' in sys.argv:
    for m in sorted(mods):
        print(name(m), '->', ', '.join(sorted(name(w) for w in edges[m])))
if '--floors' in sys.argv and not circles:
    @functools.lru_cache(None)
    def floor(m):
        return 1 + max((floor(w) for w in edges[m]), default=-1)
    by = {}
    for m in mods:
        by.setdefault((m[0], floor(m)), []).append(name(m))
    for (crate, f) in sorted(by):
        print(f"{crate} floor {f}: {', '.join(sorted(by[(crate, f)]))}")
if '--chain' in sys.argv and not circles:
    wanted = sys.argv[sys.argv.index('--chain') + 1]
    start = [m for m in mods if name(m) == wanted]
    if not start:
        sys.exit(f"no module {wanted}")

    @functools.lru_cache(None)
    def chain(m):
        below = [chain(w) for w in edges[m]]
        return [m] + max(below, key=len, default=[])
    path = chain(start[0])
    print(f"{len(path) - 1} imports deep: " + ' -> '.join(name(m) for m in path))
if '--check' in sys.argv and (circles or up):
    sys.exit(1)
