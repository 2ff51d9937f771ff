"""The documentation holds together: the README stays short, every relative link in it and in
docs/ reaches a file (and a heading, for an anchor), the site's nav lists every page, the pipeline
reference is its generator's output, and no page carries the project's issue numbers."""

from __future__ import annotations

import importlib.util
import re
import unicodedata

import pytest
import yaml

from tests.helpers.paths import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FILES = [ROOT / "README.md", *PAGES]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _rel(path):
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slugs(heading: str) -> set[str]:
    """A heading's anchor as MkDocs (python-markdown's toc) and GitHub write it."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip()
    ascii_ = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_).strip().lower())
    github = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
    return {mkdocs, github}


def _anchors(path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", text, flags=re.M):
        for slug in _slugs(heading):
            found.add(slug)
            if slug in seen:  # a repeated heading's anchor gets a suffix
                found.add(f"{slug}-{seen[slug]}")
                found.add(f"{slug}_{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    found.update(re.findall(r"""id=["']([^"']+)["']""", text))
    return found


def _links(path):
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines: move detail into docs/ (at most 249)"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_every_relative_link_resolves(path):
    broken = []
    for target in _links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {_rel(dest)}")
    assert not broken, f"{_rel(path)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", PAGES, ids=_rel)
def test_pages_link_only_inside_docs(path):
    """The site is built from docs/ alone: a link out of it is a broken link there. Files elsewhere
    in the repository are named as paths (`examples/deploy_local.sh`)."""
    outside = [t for t in _links(path) if not (path.parent / t.partition("#")[0]).resolve().is_relative_to(DOCS)]
    assert not outside, f"{_rel(path)} links out of docs/: {outside}"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_repository_paths_named_in_the_docs_exist(path):
    named = re.findall(
        r"`((?:examples|pipelines|benchmarks|tests|dtrain|docs)/[\w./-]+\.(?:py|yaml|md|sh|sbatch|txt))`",
        path.read_text(),
    )
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert not missing, f"{_rel(path)} names files that do not exist: {missing}"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_issue_numbers(path):
    """User documentation describes dtrain as it is, not the tracker's history. Upstream references
    (`tensorflow#5022`) are fine."""
    found = re.findall(r"(?i)\bissues? #?\d+(?: and \d+)?|(?<![\w/])#\d+\b", _prose(path.read_text()))
    assert not found, f"{_rel(path)} mentions {found}"


def test_nav_lists_every_page():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entry):
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, list):
            for item in entry:
                yield from pages(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from pages(value)

    listed = list(pages(nav))
    assert sorted(listed) == sorted(p.name for p in PAGES)
    assert len(set(listed)) == len(listed)


def test_reference_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "reference.md").read_text() == gen.render(), (
        "docs/reference.md is stale: run python docs/gen_reference.py"
    )


def test_reference_covers_every_field():
    import dtrain

    text = (DOCS / "reference.md").read_text()
    schema = dtrain.PipelineSpec.model_json_schema()
    for name, model in [("PipelineSpec", schema), *schema["$defs"].items()]:
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for field in model.get("properties", {}):
            assert f"| `{field}` |" in section, f"{name}.{field} is missing from docs/reference.md"


def test_readme_concept_map_is_the_concepts_page():
    """The README's concept map is docs/concepts.md's, word for word (links aside: the README's
    point into docs/)."""

    def table(text):
        return text.split("## The concepts, mapped", 1)[1].split("\n## ", 1)[0].strip().replace("](docs/", "](")

    assert table((ROOT / "README.md").read_text()) == table((DOCS / "concepts.md").read_text())


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's table: each package's row names every module in it (a module added
    without a word of what it is for fails this)."""
    text = (DOCS / "architecture.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `dtrain/(\w+)/` \|.*$", text, re.M)}
    missing = []
    for package in sorted(p for p in (ROOT / "dtrain").iterdir() if (p / "__init__.py").exists()):
        row = rows.get(package.name, "")
        missing += [f"dtrain/{package.name}/{m.name}" for m in sorted(package.glob("*.py"))
                    if m.name != "__init__.py" and f"`{m.name}`" not in row]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_results_tables_are_generated_from_the_benchmarks_outputs():
    """docs/performance.md's and docs/lab.md's latest-results tables are what docs/gen_results.py renders from
    benchmarks/results/*.json (a hand-edited figure, or a result file without its table, fails)."""
    spec = importlib.util.spec_from_file_location("gen_results", DOCS / "gen_results.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    texts = {page.name: page.read_text() for page in gen.PAGES}
    for name, text in texts.items():
        assert text == gen.render(text), f"docs/{name} is stale: run python docs/gen_results.py"
    for name in gen.TABLES:
        assert any(f"<!-- results:{name} -->" in text for text in texts.values()), name
        assert (ROOT / "benchmarks" / "results" / f"{name}.json").exists(), name
