"""Every error graphed raises has a section in docs/troubleshooting.md (CPU only,
no import of graphed). ``python scripts/error_catalog.py`` lists each raising
place with its section; ``--missing`` lists the uncovered ones."""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "error_catalog", os.path.join(ROOT, "scripts", "error_catalog.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


catalog = _load_script()


def test_every_error_message_has_a_section():
    doc = catalog.read_doc()
    doc_sections = catalog.sections(doc)
    missing = [f"{s.where} ({s.kind}): {s.key or s.anchor}" for s in catalog.all_sites()
               if catalog.section_of(s, doc, doc_sections) is None]
    assert not missing, (
        "Errors without a section in docs/troubleshooting.md. Quote each message as it "
        "begins in the code in the section that explains it (why, and the fix):\n  "
        + "\n  ".join(missing))


def test_the_catalog_sees_the_errors_of_every_layer():
    sites = catalog.all_sites()
    files = {s.file.split(os.sep)[0] for s in sites}
    assert {"src", "python"} <= files
    assert len(sites) > 150, f"only {len(sites)} error sites found: is the scanner broken?"
    assert sum(1 for s in sites if s.key is None and s.anchor is None) < 0.1 * len(sites)


def test_anchors_are_unique_and_links_resolve():
    doc = catalog.read_doc()
    anchors = re.findall(r'<a id="([^"]+)"></a>', doc)
    assert len(anchors) == len(set(anchors)), "duplicate anchors in troubleshooting.md"
    links = set(re.findall(r"\]\(#([^)]+)\)", doc))
    assert links <= set(anchors), f"links to missing anchors: {sorted(links - set(anchors))}"
    assert "cuda-error" in anchors


def test_keys_come_from_the_fixed_text_of_a_message(tmp_path):
    source = tmp_path / "sample.cpp"
    source.write_text(
        'void f(int n) {\n'
        '  GRAPHED_CHECK(n > 0, "Expected n > 0 for "\n'
        '                "the sample, got ", n, ".");\n'
        '  GRAPHED_CHECK(n < 9, name, " is far too large: ", n);\n'
        '  GRAPHED_CHECK_CUDA(cudaDeviceSynchronize());\n'
        '  // GRAPHED_CHECK(false, "commented out entirely");\n'
        '}\n')
    sites = catalog.cpp_sites(str(source))
    assert [(s.line, s.key, s.anchor) for s in sites] == [
        (2, "Expected n > 0 for the sample, got", None),
        (4, "is far too large:", None),
        (5, None, "cuda-error"),
    ]
    doc = "<a id=\"big\"></a>\n## Big\n\n`… is far  too large: …`\n"
    assert catalog.section_of(sites[1], doc, catalog.sections(doc)) == "big"
    assert catalog.section_of(sites[0], doc, catalog.sections(doc)) is None


def test_python_raises_are_read_with_their_fstrings(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "def f(x):\n"
        "    raise ValueError(f'{x!r} cannot be captured: ' 'pass another one')\n"
        "def g(error):\n"
        "    raise error\n")
    sites = catalog.python_sites(str(source))
    assert [(s.line, s.key) for s in sites] == [(2, "cannot be captured: pass another one")]
