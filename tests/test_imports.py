"""Imports in the library sit at module top (CONTRIBUTING.md, "Checking the layers").

An import inside a function is how an import cycle gets hidden at run time; import-linter still sees
it (``lint-imports`` fails on the cycle), and this test names any such import directly. The only
exceptions are optional third-party packages, imported where they are used on purpose.
"""

import ast
import pathlib

import meshtorch

SRC = pathlib.Path(meshtorch.__file__).parent
#: optional packages (extras) imported lazily on purpose, with an error naming the extra
OPTIONAL = {"sentencepiece", "tokenizers"}


def _imports_in_functions(tree: ast.Module):
    seen = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in seen:
                seen.add(id(node))
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                yield node.lineno, names


def test_no_imports_inside_functions_except_optional_packages():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for line, names in _imports_in_functions(ast.parse(path.read_text(), str(path))):
            if not all(n.split(".")[0] in OPTIONAL for n in names):
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {', '.join(names)}")
    assert not found, "imports below module top (move them up; break a cycle by moving code):\n" + "\n".join(found)
