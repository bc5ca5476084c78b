"""docs/architecture.md stays true to the code (CPU only): its Notes index is
current, every reference names a note that exists, and the tests and files it
names exist."""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "notes_index", os.path.join(ROOT, "scripts", "notes_index.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


notes = _load_script()


def _architecture():
    with open(notes.DOC, encoding="utf-8") as f:
        return f.read()


def test_notes_index_is_current():
    definitions, references = notes.scan()
    assert notes.current_index(_architecture()) == notes.render(definitions, references), (
        "The Notes index of docs/architecture.md is stale: run python scripts/notes_index.py")


def test_every_note_reference_names_a_note():
    definitions, references = notes.scan()
    assert not notes.dangling(definitions, references)


def test_files_and_tests_named_in_the_architecture_exist():
    doc = _architecture()
    missing = []
    for path in set(re.findall(r"`((?:tests|src|include|python|scripts)/[\w/.]+\.(?:py|cpp|h))", doc)):
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(path)
    for path, name in set(re.findall(r"`(tests/python/[\w/]+\.py)::(\w+)`", doc)):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            if f"def {name}(" not in f.read():
                missing.append(f"{path}::{name}")
    cpp_tests = ""
    for name in os.listdir(os.path.join(ROOT, "tests", "cpp")):
        with open(os.path.join(ROOT, "tests", "cpp", name), encoding="utf-8") as f:
            cpp_tests += f.read()
    for suite, name in set(re.findall(r"`([A-Z]\w+)\.([A-Z]\w+)`", doc)):
        if not re.search(rf"TEST(?:_F)?\({suite}, {name}\)", cpp_tests):
            missing.append(f"{suite}.{name}")
    assert not missing, "docs/architecture.md names what does not exist: " + ", ".join(sorted(missing))
