"""README snippets are tested data: every YAML pipeline in it (and in the pipeline file's page)
validates, and the plan it shows is what `dtrain plan` prints."""

from __future__ import annotations

import re

import pytest

import dtrain
from tests.helpers.paths import ROOT

README = (ROOT / "README.md").read_text()
SECURITY = (ROOT / "docs" / "security.md").read_text()
# The README's pipeline, and the pipeline file page's (a training pipeline and a graph pipeline):
# complete files, each validated and compiled.
YAML_BLOCKS = [
    (name, block)
    for name in ("README.md", "docs/pipeline-file.md")
    for block in re.findall(r"```yaml\n(.*?)```", (ROOT / name).read_text(), flags=re.S)
]


def test_readme_has_pipelines():
    assert [name for name, _ in YAML_BLOCKS].count("README.md") >= 1
    assert [name for name, _ in YAML_BLOCKS].count("docs/pipeline-file.md") >= 2


@pytest.mark.parametrize("name,block", YAML_BLOCKS, ids=[f"{n}-yaml{i}" for i, (n, _) in enumerate(YAML_BLOCKS)])
def test_readme_yaml_validates(name, block):
    spec = dtrain.loads(block, filename=name, base_dir=ROOT)
    dtrain.compile(spec)


def test_readme_plan_output_is_real():
    shown = re.search(r"```\n(plan digits-async:.*?)\n\.\.\.\n```", README, flags=re.S).group(1)
    real = dtrain.compile(dtrain.load(ROOT / "pipelines" / "digits_async.yaml")).format()
    assert real.startswith(shown)


def test_quickstart_is_two_make_commands():
    quick = README.split("## Quickstart", 1)[1].split("##", 1)[0]
    cmds = re.findall(r"^make (\w+)", quick, flags=re.M)
    assert cmds == ["run", "test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\nrun:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_states_the_trust_model():
    """A pipeline file is code; validate is safe, plan and run execute it; the data plane without
    TLS is authenticated only at its handshake. The README says the first and links the rest."""
    short = " ".join(README.split("## Security", 1)[1].split("\n## ", 1)[0].split())
    assert "A pipeline file is code" in short and "(docs/security.md)" in short
    section = " ".join(SECURITY.split("# Security", 1)[1].split())
    assert "A pipeline file is code" in section
    assert "`model.module`" in section and "`hooks[].type`" in section
    assert "`dtrain validate` never imports or executes them" in section
    assert "`dtrain plan` and `dtrain run` import and call them" in section
    assert "authenticated once, at its handshake" in section
    assert "no integrity or confidentiality" in section
    assert "Security.temporary()" in section and "without `--host` it listens on every interface" in section


def test_the_recommendation_guides_pipeline_validates_and_plans():
    """docs/recommendation.md's pipeline (with a table without a vocabulary) is a real one."""
    text = (ROOT / "docs" / "recommendation.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if "dlrm" in b]
    spec = dtrain.loads(block, filename="docs/recommendation.md", base_dir=ROOT / "pipelines")
    plan = dtrain.compile(spec)
    assert {t.name: t.partition for t in plan.tables} == {"tables.C1.weight": "mod", "tables.C2.weight": "hash"}
