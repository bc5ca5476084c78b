"""Lists every error graphed raises and the section of docs/troubleshooting.md
that explains it.

    python scripts/error_catalog.py            # every site, its key and its section
    python scripts/error_catalog.py --missing  # only the sites no section covers; exit 1 if any

An error site is a GRAPHED_CHECK / GRAPHED_CHECK_AS / GRAPHED_THROW / TORCH_CHECK
call in src/ or include/graphed/ (GRAPHED_INTERNAL_ASSERT is a bug in graphed, not
a user error, and has one section of its own), a GRAPHED_CHECK_CUDA call, or a
``raise`` of a new exception in python/graphed. Its key is the first fixed piece of
its message with at least three words, cut to eight words: for

    GRAPHED_CHECK(ok, "Expected at least one module to capture, got none. Pass ...")

the key is ``Expected at least one module to capture, got``. A site is covered when
its key occurs in docs/troubleshooting.md (backticks and runs of white space
ignored), so each section quotes the messages it explains as they begin in the
code. GRAPHED_CHECK_CUDA sites are covered by the section with the anchor
``cuda-error``. Sites whose message has no fixed piece of three words are listed
as ``(no fixed text)`` and are not required.
"""

import argparse
import ast
import dataclasses
import os
import re
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "troubleshooting.md")
MIN_WORDS = 3
KEY_WORDS = 8
CPP_MACROS = ("GRAPHED_CHECK_AS", "GRAPHED_CHECK", "GRAPHED_THROW", "TORCH_CHECK")
CUDA_ANCHOR = "cuda-error"


@dataclasses.dataclass
class Site:
    file: str              # relative to the repository root
    line: int
    kind: str              # the macro, or the Python exception type
    key: Optional[str]     # None: no fixed text
    anchor: Optional[str] = None  # a required anchor instead of a key

    @property
    def where(self):
        return f"{self.file}:{self.line}"


def normalize(text):
    text = text.replace("`", "")
    return re.sub(r"\s+", " ", text).strip()


def key_of(pieces):
    """The first fixed piece with MIN_WORDS words, cut to KEY_WORDS words."""
    for piece in pieces:
        piece = normalize(piece)
        piece = re.sub(r"^[^A-Za-z0-9]+", "", piece)
        words = piece.split(" ")
        if len([w for w in words if re.search(r"[A-Za-z]", w)]) >= MIN_WORDS:
            return " ".join(words[:KEY_WORDS])
    return None


# --- C++ ---------------------------------------------------------------------------

_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _balanced(text, start):
    """The text between the parenthesis at `start` and its match."""
    depth, i, in_string = 0, start, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return text[start + 1:]


def _message_pieces(args):
    """Fixed pieces of a message: adjacent string literals joined; anything
    else between them (a value, a comma) ends a piece."""
    pieces, current, last_end = [], None, None
    for m in _LITERAL.finditer(args):
        value = bytes(m.group(1), "utf-8").decode("unicode_escape")
        if current is not None and args[last_end:m.start()].strip() == "":
            current += value
        else:
            if current is not None:
                pieces.append(current)
            current = value
        last_end = m.end()
    if current is not None:
        pieces.append(current)
    return pieces


def _strip_cpp_comments(text):
    out, i, in_string = [], 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1])
                i += 2
                continue
            if c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif text.startswith("//", i):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i)
            out.append("\n" * text[i:end].count("\n"))
            i = end + 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def cpp_sites(path):
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        text = _strip_cpp_comments(f.read())
    sites = []
    pattern = re.compile(r"\b(GRAPHED_CHECK_CUDA|" + "|".join(CPP_MACROS) + r")\s*\(")
    for m in pattern.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        macro = m.group(1)
        if rel.startswith(os.path.join("include", "graphed", "check.h")):
            continue  # the macros' own definitions
        if macro == "GRAPHED_CHECK_CUDA":
            sites.append(Site(rel, line, macro, None, anchor=CUDA_ANCHOR))
            continue
        args = _balanced(text, m.end() - 1)
        sites.append(Site(rel, line, macro, key_of(_message_pieces(args))))
    return sites


# --- Python ------------------------------------------------------------------------

def _string_pieces(node):
    """Fixed pieces of a message expression, in source order; a formatted
    value or any other expression ends a piece."""
    pieces = []

    def visit(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            if pieces and pieces[-1] is not None:
                pieces[-1] += n.value
            else:
                pieces.append(n.value)
        elif isinstance(n, ast.JoinedStr):
            for v in n.values:
                visit(v)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            visit(n.left)
            visit(n.right)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr == "format":
            visit(n.func.value)
        else:
            pieces.append(None)  # a break
    visit(node)
    return [p for p in pieces if p]


def python_sites(path):
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    sites = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc
        if not isinstance(exc, ast.Call):
            continue  # re-raising an exception object
        kind = ast.unparse(exc.func)
        pieces = _string_pieces(exc.args[0]) if exc.args else []
        sites.append(Site(rel, node.lineno, kind, key_of(pieces)))
    return sites


def all_sites():
    sites = []
    for folder in ("src", os.path.join("include", "graphed")):
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if name.endswith((".cpp", ".h")):
                    sites += cpp_sites(os.path.join(directory, name))
    for directory, _, files in os.walk(os.path.join(ROOT, "python", "graphed")):
        for name in sorted(files):
            if name.endswith(".py"):
                sites += python_sites(os.path.join(directory, name))
    return sorted(sites, key=lambda s: (s.file, s.line))


# --- the document ------------------------------------------------------------------

@dataclasses.dataclass
class Section:
    anchor: str
    title: str
    start: int   # offset in the normalized text


def read_doc(path=DOC):
    with open(path, encoding="utf-8") as f:
        return f.read()


def sections(doc):
    """Sections with an explicit anchor (<a id="..."></a> before a heading)."""
    out = []
    norm = normalize(doc)
    for m in re.finditer(r'<a id="([a-z0-9-]+)"></a>\s*#+ ([^<]+?)(?= #|$| <a|\s*\n)', doc):
        anchor = m.group(1)
        marker = normalize(f'<a id="{anchor}"></a>')
        out.append(Section(anchor, m.group(2).strip(), norm.find(marker)))
    return out


def section_of(site, doc, doc_sections):
    """The anchor of the section that covers `site`, or None."""
    if site.anchor:
        return site.anchor if any(s.anchor == site.anchor for s in doc_sections) else None
    if site.key is None:
        return "(no fixed text)"
    norm = normalize(doc)
    at = norm.find(site.key)
    if at < 0:
        return None
    owner = None
    for s in doc_sections:
        if s.start <= at:
            owner = s.anchor
    return owner or "(before any section)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--missing", action="store_true",
                        help="list only the sites no section covers; exit 1 if any")
    args = parser.parse_args(argv)
    doc = read_doc() if os.path.exists(DOC) else ""
    doc_sections = sections(doc)
    missing = 0
    for site in all_sites():
        section = section_of(site, doc, doc_sections)
        if section is None:
            missing += 1
        if args.missing and section is not None:
            continue
        print(f"{site.where}\t{site.kind}\t{section or 'MISSING'}\t{site.key or site.anchor or ''}")
    if args.missing:
        return 1 if missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
