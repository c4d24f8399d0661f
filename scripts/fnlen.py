#!/usr/bin/env python3
"""The length of every function in the crate's source, in lines from its `fn` to its
closing brace, outside `#[cfg(test)]` modules (inline or in files of their own).

    python3 scripts/fnlen.py               # the ten longest
    python3 scripts/fnlen.py --top 30      # the thirty longest
    python3 scripts/fnlen.py --check       # exit 1 if one is over the limit (80 lines)

Functions are found by their `fn` and measured by matching braces, with comments,
strings, raw strings and character literals blanked out first, so that a brace in
text is not counted.
"""
import os
import re
import sys

LIMIT = 80
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src')

FN = re.compile(r'\b(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+"[^"]*"\s+)?fn\s+(\w+)')
TEST_MOD = re.compile(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{')


def blank(src):
    """`src` with comments, strings and character literals replaced by spaces (line
    breaks kept, so that line numbers stay)."""
    out = []
    i, n = 0, len(src)
    keep = lambda text: re.sub(r'[^\n]', ' ', text)
    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            out.append(keep(src[i:j]))
            i = j
        elif src.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith('/*', j):
                    depth, j = depth + 1, j + 2
                elif src.startswith('*/', j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(keep(src[i:j]))
            i = j
        elif re.match(r'b?r#*"', src[i:i + 8]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == '_')):
            m = re.match(r'b?r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(keep(src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == '\\' else 1
            out.append(keep(src[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^'\\\n])'", src[i:])
            if m:
                out.append(keep(m.group(0)))
                i += m.end()
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def without_tests(code):
    """`code` (blanked) with its `#[cfg(test)]` modules blanked too."""
    out, i = [], 0
    for m in TEST_MOD.finditer(code):
        if m.start() < i:
            continue
        out.append(code[i:m.start()])
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {'{': 1, '}': -1}.get(code[j], 0)
            j += 1
        out.append(re.sub(r'[^\n]', ' ', code[m.start():j]))
        i = j
    out.append(code[i:])
    return ''.join(out)


def test_files(root):
    """The files of test modules declared `#[cfg(test)] mod NAME;`."""
    found = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith('.rs'):
                continue
            path = os.path.join(folder, name)
            code = blank(open(path, encoding='utf-8').read())
            stem = name[:-3]
            here = folder if stem in ('mod', 'lib', 'main') else os.path.join(folder, stem)
            for m in re.finditer(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', code):
                found.add(os.path.normpath(os.path.join(here, m.group(1) + '.rs')))
                found.add(os.path.normpath(os.path.join(here, m.group(1), 'mod.rs')))
    return found


def functions(root):
    """(lines, file:line, name) of every function with a body."""
    skip = test_files(root)
    found = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            path = os.path.normpath(os.path.join(folder, name))
            if not name.endswith('.rs') or path in skip:
                continue
            code = without_tests(blank(open(path, encoding='utf-8').read()))
            for m in FN.finditer(code):
                # The body: the first `{` before any `;` (a declaration has none).
                j = m.end()
                while j < len(code) and code[j] not in '{;':
                    j += 1
                if j >= len(code) or code[j] == ';':
                    continue
                depth, k = 0, j
                while k < len(code):
                    depth += {'{': 1, '}': -1}.get(code[k], 0)
                    if depth == 0:
                        break
                    k += 1
                first = code.count('\n', 0, m.start()) + 1
                last = code.count('\n', 0, k) + 1
                where = f"{os.path.relpath(path, root)}:{first}"
                found.append((last - first + 1, where, m.group(1)))
    return sorted(found, key=lambda f: (-f[0], f[1]))


def main():
    args = sys.argv[1:]
    found = functions(ROOT)
    if '--check' in args:
        over = [f for f in found if f[0] > LIMIT]
        for lines, where, name in over:
            print(f"{where}: `{name}` is {lines} lines, over {LIMIT}")
        print(f"{len(found)} functions, the longest {found[0][0]} lines; {len(over)} over {LIMIT}")
        sys.exit(1 if over else 0)
    top = int(args[args.index('--top') + 1]) if '--top' in args else 10
    for lines, where, name in found[:top]:
        print(lines, where, name)
    print("over 60:", sum(f[0] > 60 for f in found), f"over {LIMIT}:", sum(f[0] > LIMIT for f in found))


if __name__ == '__main__':
    main()
