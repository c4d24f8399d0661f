#!/usr/bin/env python3
"""The fill engine's exit criteria, counted in the guard's source (src/guard, outside
`#[cfg(test)]` modules and tests' own files):

* the places that ask for a lease (`.try_acquire_fill(`);
* the modules that judge whether an answer may be stored (that call `storable(`);
* the places that ask the origin conditionally (`ask_if_changed(`);
* the functions that map how a body read ended to how a fill ends (a `match` with a
  `Read::Stalled` arm);
* the functions whose arguments are packed into a tuple (a parameter such as
  `(a, b): (A, B)`);
* the longest chain of imports below the guard's top (`scripts/modgraph.py --chain`);
* the pure decisions with unit tests of their own, and those without.

    python3 scripts/engine.py              # this checkout
    python3 scripts/engine.py OTHER/src    # another's (an earlier commit's, say)
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = next((a for a in sys.argv[1:] if not a.startswith('-')), os.path.join(HERE, '..', 'src'))
GUARD = os.path.join(SRC, 'guard')
TEST_MOD = re.compile(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{')
FN = re.compile(r'\bfn\s+(\w+)')

# The guard's pure decisions, by the names the engine issue gives them, each with the
# functions that have made it (before and after the engine's redesign): each should be
# unit-tested without Redis.
DECISIONS = {
    'sharing (who may have an answer)': ['sharing', 'judge'],
    'answer_* (what a caller of a fill gets)': ['answer_landed', 'answer_entry',
                                                'answer_shared', 'reply'],
    'marked (what a key\'s mark says)': ['marked', 'says'],
}


def source(path):
    """The file without comments and `#[cfg(test)]` modules."""
    src = open(path).read()
    src = re.sub(r'//[^\n]*', '', src)
    out, i = [], 0
    for m in TEST_MOD.finditer(src):
        if m.start() < i:
            continue
        out.append(src[i:m.start()])
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {'{': 1, '}': -1}.get(src[j], 0)
            j += 1
        i = j
    out.append(src[i:])
    return ''.join(out)


def functions(src):
    """(name, body) of each function in `src`."""
    for m in FN.finditer(src):
        j = src.find('{', m.end())
        semi = src.find(';', m.end())
        if j < 0 or (0 <= semi < j):
            continue
        depth, k = 1, j + 1
        while k < len(src) and depth:
            depth += {'{': 1, '}': -1}.get(src[k], 0)
            k += 1
        yield m.group(1), src[m.start():k]


files = []
for dirpath, _, names in os.walk(GUARD):
    for n in sorted(names):
        if n.endswith('.rs') and n != 'tests.rs' and not n.endswith('_tests.rs'):
            files.append(os.path.join(dirpath, n))
files.sort()

def rel(path):
    return os.path.relpath(path, os.path.join(SRC, '..'))

leases, storable, conditional, mappings, packed = [], [], [], [], []
tested = set()
for path in files:
    src = source(path)
    for m in re.finditer(r'\.try_acquire_fill\(', src):
        leases.append(f"{rel(path)}:{src[:m.start()].count(chr(10)) + 1}")
    for m in re.finditer(r'\bask_if_changed\(', src):
        conditional.append(f"{rel(path)}:{src[:m.start()].count(chr(10)) + 1}")
    calls = [src[:m.start()].count(chr(10)) + 1 for m in re.finditer(r'(?<!fn )\bstorable\(', src)]
    if calls:
        storable.append(f"{rel(path)} (line {', '.join(map(str, calls))})")
    for name, body in functions(src):
        if 'Read::Stalled' in body and name != 'read_body':
            mappings.append(f"{rel(path)}: {name}")
        head = body[:body.find('{')]
        if re.search(r'\(\s*\w+(?:\s*,\s*\w+)+\s*\)\s*:\s*\(', head):
            packed.append(f"{rel(path)}: {name}")
# Unit tests: every test module or test file under src/guard.
for dirpath, _, names in os.walk(GUARD):
    for n in names:
        if not n.endswith('.rs'):
            continue
        text = open(os.path.join(dirpath, n)).read()
        names = [f for fns in DECISIONS.values() for f in fns]
        for m in TEST_MOD.finditer(text):
            tests = text[m.start():]
            tested.update(f for f in names if re.search(r'\b' + f + r'\(', tests))
        if n == 'tests.rs' or n.endswith('_tests.rs'):
            tested.update(f for f in names if re.search(r'\b' + f + r'\(', text))

defined = set()
for path in files:
    for name, _ in functions(source(path)):
        defined.add(name)
decided = {d: [f for f in fns if f in defined] for d, fns in DECISIONS.items()}
with_tests = [f"{d}: {', '.join(f for f in fns if f in tested)}"
              for d, fns in decided.items() if any(f in tested for f in fns)]
without = [f"{d}: {', '.join(fns)}" for d, fns in decided.items()
           if not any(f in tested for f in fns)]

chain = subprocess.run([sys.executable, os.path.join(HERE, 'modgraph.py'), SRC, '--chain',
                        'guard::handle'], capture_output=True, text=True).stdout
chain = next((line for line in chain.splitlines() if 'imports deep' in line), '?')

def show(title, items):
    print(f"{title}: {len(items)}")
    for item in items:
        print(f"    {item}")

show("places that ask for a lease", leases)
show("modules that call `storable`", storable)
show("places that ask the origin conditionally", conditional)
show("mappings from a body read's ending to a fill's ending", mappings)
show("functions with arguments packed into a tuple", packed)
print(f"longest import chain below guard::handle: {chain}")
show("pure decisions with unit tests", with_tests)
show("pure decisions without", without)
