#!/usr/bin/env python3
"""The module graph of the library (src/, without src/bin): which module imports which.

Edges come from every `crate::`, `super::` and `self::` path outside comments and
`#[cfg(test)] mod tests`, each name followed through `pub use` re-exports to the module
that defines it. Prints the number of modules, edges and circles (strongly connected
components of more than one module), each circle, and with `--floors` each module's
floor (the longest chain of imports below it). `-v` lists every module's imports.

    python3 scripts/modgraph.py            # counts and circles
    python3 scripts/modgraph.py --floors   # and the floors
    python3 scripts/modgraph.py --check    # exit 1 if any circle, or any module imports
                                           # what its own ancestor module defines
"""
import os, re, sys, itertools
args = [a for a in sys.argv[1:] if not a.startswith('-')]
root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src')
mods = {}  # module path tuple -> file
for dp, dn, fn in os.walk(root):
    if 'bin' in dp.split(os.sep): continue
    for f in fn:
        if not f.endswith('.rs'): continue
        p = os.path.relpath(os.path.join(dp, f), root)
        parts = p[:-3].split(os.sep)
        if parts[-1] in ('mod', 'lib'): parts = parts[:-1]
        mods[tuple(parts)] = p
reexp = {}
def load_reexports():
    for m, f in mods.items():
        src = re.sub(r'//[^\n]*', '', open(os.path.join(root, f)).read())
        for mt in re.finditer(r'pub(?:\([^)]*\))?\s+use\s+([^;]+);', src):
            body = mt.group(1).replace('\n', ' ')
            mg = re.match(r'(.*?)::\{(.*)\}$', body.strip())
            items = []
            if mg:
                pre = mg.group(1).strip()
                for it in mg.group(2).split(','):
                    it = it.strip()
                    if not it: continue
                    items.append((pre + '::' + it.split(' as ')[0].strip(), it.split(' as ')[-1].strip().split('::')[-1]))
            else:
                items.append((body.strip().split(' as ')[0].strip(), body.strip().split(' as ')[-1].strip().split('::')[-1]))
            for path, name in items:
                segs = path.split('::')
                if segs[0] == 'self': start = list(m); segs = segs[1:]
                elif segs[0] == 'crate': start = []; segs = segs[1:]
                elif segs[0] == 'super': start = list(m[:-1]); segs = segs[1:]
                else: start = list(m)
                reexp[(m, name)] = start + segs
def resolve(path, depth=0):
    for i in range(len(path), -1, -1):
        if tuple(path[:i]) in mods:
            m = tuple(path[:i])
            if i < len(path) and (m, path[i]) in reexp and depth < 10:
                return resolve(reexp[(m, path[i])] + path[i+1:], depth+1)
            return m
    return ()
def strip_comments(s):
    s = re.sub(r'//[^\n]*', '', s)
    return s
load_reexports()
edges = {m: set() for m in mods}
for m, f in mods.items():
    src = strip_comments(open(os.path.join(root, f)).read())
    # cut #[cfg(test)] mod tests { ... } roughly: everything after '#[cfg(test)]\nmod tests'
    i = re.search(r'#\[cfg\(test\)\]\s*mod tests', src)
    if i: src = src[:i.start()]
    # expand use groups crudely: collect paths
    here = list(m) if not f.endswith(('mod.rs','lib.rs')) else list(m)
    parent = list(m[:-1]) if not (f.endswith('mod.rs') or f.endswith('lib.rs')) else list(m[:-1])
    # super relative to module m: parent of m
    for mt in re.finditer(r'\b(crate|super|self)((?:::\w+)+)(::\{[^;]*?\})?', src):
        base, rest, group = mt.group(1), mt.group(2), mt.group(3)
        segs = rest.strip(':').split('::')
        if base == 'crate': start = []
        elif base == 'super': start = list(m[:-1])
        else: start = list(m)
        while segs and segs[0] == 'super':
            start = start[:-1]; segs = segs[1:]
        full = start + segs
        targets = [full]
        if group:
            for g in re.findall(r'\b(\w+)(?:::(\w+))?', group[3:]):
                targets.append(full + [x for x in g if x])
        for t in targets:
            r = resolve(t)
            if r != m and r != () and not (len(r) < len(m) and m[:len(r)] == r and r != ()) :
                edges[m].add(r)
            elif r != m and r != () and len(r) < len(m) and m[:len(r)] == r:
                # importing from an ancestor module (its re-exports): resolve the name further via pub use? record as edge to ancestor
                edges[m].add(r)
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); sccs = []; c = [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(comp)
for v in mods:
    if v not in idx: sc(v)
n = lambda m: '::'.join(m) or 'crate'
cyc = [s for s in sccs if len(s) > 1]
print(f"{len(mods)} modules, {sum(len(e) for e in edges.values())} edges, {len(cyc)} circles")
for s in cyc:
    print("circle:", ', '.join(sorted(n(x) for x in s)))
if '-v' in sys.argv:
    for m in sorted(mods):
        print(n(m), '->', ', '.join(sorted(n(x) for x in edges[m])))
if '--floors' in sys.argv and not cyc:
    import functools
    @functools.lru_cache(None)
    def floor(m):
        return 1 + max((floor(w) for w in edges[m]), default=-1)
    by = {}
    for m in mods: by.setdefault(floor(m), []).append(n(m))
    for f in sorted(by): print(f"floor {f}: {', '.join(sorted(by[f]))}")
    # imports of a module's own ancestors (a child reaching up to its parent's items)
    up = [(n(m), n(w)) for m in mods for w in edges[m] if len(w) < len(m) and m[:len(w)] == w]
    print("imports up to an ancestor:", up or "none")

if '--check' in sys.argv:
    up = [(n(m), n(w)) for m in mods for w in edges[m] if len(w) < len(m) and m[:len(w)] == w]
    if cyc or up:
        print("module graph: circles or imports up to an ancestor", file=sys.stderr)
        sys.exit(1)
