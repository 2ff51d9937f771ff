"""YAML -> PipelineSpec: every invalid pipeline names FILE:LINE: path: message (no cluster needed).

The corpus lives in tests/specs/invalid/: each file's first line is
``# expect: LINE: dotted.path: substring of the message`` (the path is empty for whole-file
problems), and the file must produce exactly that one problem.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dtrain
from dtrain.spec.errors import Problem, SpecError
from dtrain.spec.loading import load, loads
from tests.helpers.paths import ROOT, SPECS

INVALID = sorted((SPECS / "invalid").glob("*.yaml"))
VALID = sorted((SPECS / "valid").glob("*.yaml"))
GOLDEN = sorted((ROOT / "pipelines").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+): ([^ :]*): (.+)$")

MODEL = """\
cluster: {jobs: {ps: 1, worker: 2}}
model:
  input_shape: [4]
  layers:
    - {type: linear, out: 3}
"""


def expectation(path: Path) -> tuple[int, str, str]:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    m = EXPECT.match(first)
    assert m, f"{path.name}: the first line must be '# expect: LINE: path: message', got {first!r}"
    return int(m.group(1)), m.group(2), m.group(3)


def problems_of(path: Path, **kwargs: object) -> list[Problem]:
    with pytest.raises(SpecError) as info:
        load(path, **kwargs)  # type: ignore[arg-type]
    return info.value.problems


# ------------------------------------------------------------------------------ the invalid corpus


def test_the_corpus_covers_enough_cases():
    assert len(INVALID) >= 30
    assert len({expectation(p) for p in INVALID}) == len(INVALID)  # distinct expectations


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_pipeline_reports_the_offending_line(path: Path):
    line, dotted, fragment = expectation(path)
    problems = problems_of(path)
    # Exactly one problem per file: no duplicate lines from union branches, no knock-on errors.
    assert [(p.line, p.path) for p in problems] == [(line, dotted)], "\n".join(map(str, problems))
    problem = problems[0]
    assert fragment in problem.message
    assert problem.file == str(path)
    where = f"{path}:{line}: "
    assert str(problem) == where + (f"{dotted}: " if dotted else "") + problem.message


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_cli_validate_prints_one_line_per_problem(path: Path, capsys: pytest.CaptureFixture[str]):
    from dtrain.cli import main

    line, dotted, fragment = expectation(path)
    try:
        code = main(["validate", str(path)])
    except SystemExit as exc:  # pragma: no cover - main returns its code
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{path}:{line}: " + (f"{dotted}: " if dotted else ""))
    assert fragment in lines[0]


def test_cli_validate_in_a_subprocess_exits_2_without_traceback():
    """`python -m dtrain.cli validate` over the whole corpus and one good file: exit 2, a line per problem."""
    good = ROOT / "pipelines" / "pinning_graph.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "dtrain.cli", "validate", str(good), *map(str, INVALID)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(INVALID), proc.stderr
    for path in INVALID:
        line, dotted, fragment = expectation(path)
        prefix = f"{path}:{line}: " + (f"{dotted}: " if dotted else "")
        assert any(out.startswith(prefix) and fragment in out for out in lines), (path.name, proc.stderr)
    assert all(re.match(r"^.+\.yaml:\d+: ", out) for out in lines)


def test_cli_validate_accepts_a_good_file(capsys: pytest.CaptureFixture[str]):
    from dtrain.cli import main

    assert main(["validate", str(ROOT / "pipelines" / "hello_graph.yaml")]) == 0
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------ several problems


def test_several_problems_come_one_per_line_in_file_order(tmp_path: Path):
    path = tmp_path / "many.yaml"
    path.write_text(
        "name: many\n"                              # 1
        "data:\n"                                   # 2
        "  batch_size: 0\n"                         # 3
        + MODEL +                                   # 4-8
        "training: {stpes: 3, mode: asynch}\n"      # 9
        "optimizer: {name: sgd, lr: -1}\n"          # 10
    )
    problems = problems_of(path)
    assert [(p.line, p.path) for p in problems] == [
        (3, "data.batch_size"), (9, "training.stpes"), (9, "training.mode"), (10, "optimizer.lr"),
    ]
    with pytest.raises(SpecError) as info:
        load(path)
    text = str(info.value).splitlines()
    assert text == [str(p) for p in problems]
    assert text[0] == f"{path}:3: data.batch_size: must be >= 1, got 0"


def test_cross_field_problems_are_all_reported(tmp_path: Path):
    path = tmp_path / "cross.yaml"
    path.write_text(
        "cluster: {jobs: {ps: 1, worker: 2}}\n"       # 1
        "model:\n"                                     # 2
        "  input_shape: [4]\n"                         # 3
        "  layers:\n"                                  # 4
        "    - {type: linear, out: 3, device: /job:ps/task:3}\n"  # 5
        "training:\n"                                  # 6
        "  replicas_to_aggregate: 2\n"                 # 7 (mode: async, the default)
        "  total_num_replicas: 5\n"                    # 8
        "data: {source: missing.csv}\n"                # 9
    )
    problems = problems_of(path)
    assert [(p.line, p.path) for p in problems] == [
        (5, "model.layers[0].device"), (7, "training.replicas_to_aggregate"), (8, "training.total_num_replicas"),
        (9, "data.source"),
    ]


def test_duplicate_keys_are_reported_with_other_problems(tmp_path: Path):
    path = tmp_path / "dup.yaml"
    path.write_text(MODEL + "training: {steps: 0}\ndata: {batch_size: 4}\ndata: {batch_size: 8}\n")
    problems = problems_of(path)
    assert [(p.line, p.path) for p in problems] == [(6, "training.steps"), (8, "data")]
    assert "first at line 7" in problems[1].message


# ------------------------------------------------------------------------------ lines of nodes


@pytest.mark.parametrize(
    ("text", "line", "path"),
    [
        # a bad scalar below its key: the value's line
        ("training:\n  steps:\n    many\n", 8, "training.steps"),
        # an unknown key deep in a block list item: the key's line
        ("hooks:\n  - type: logging\n    evry_steps: 3\n", 8, "hooks[0].evry_steps"),
        # a missing key: the line of the mapping's key
        ("checkpoint: {keep: 2}\ncluster:\n  security:\n    ca_file: ca.pem\n", 8, "cluster.security.cert_file"),
        # a field named like its union tag (MomentumOptimizer.momentum): the tag is not part of the path
        ("optimizer:\n  name: momentum\n  momentum: 2\n", 8, "optimizer.momentum"),
    ],
)
def test_lines_point_at_the_offending_node(text: str, line: int, path: str):
    with pytest.raises(SpecError) as info:
        loads(MODEL.replace("cluster: {jobs: {ps: 1, worker: 2}}\n", "name: x\n") + text, "p.yaml")
    assert [(p.line, p.path) for p in info.value.problems] == [(line, path)], str(info.value)


def test_a_layer_named_like_a_layer_type():
    text = ("model:\n  input_shape: [4]\n  layers:\n"
            "    - {type: relu, name: linear}\n"
            "    - {type: linear, name: relu, outt: 3}\n")
    with pytest.raises(SpecError) as info:
        loads(text, "p.yaml")
    # Same line: ordered by column (the mapping that lacks 'out' opens before the unknown key).
    assert [(p.line, p.path) for p in info.value.problems] == [(5, "model.layers[1].out"), (5, "model.layers[1].outt")]
    assert info.value.problems[0].message.startswith("missing required key 'out'")
    assert "did you mean 'out'" in info.value.problems[1].message


def test_loads_without_a_file_names_the_string():
    with pytest.raises(SpecError) as info:
        loads("model: {input_shape: [4], layers: [{type: relu}], loss: mse}\ntraining: {mode: x}\n")
    assert str(info.value).startswith("<string>:2: training.mode: 'x' is not one of 'async', 'sync'")


def test_a_missing_file_is_a_spec_error(tmp_path: Path):
    problems = problems_of(tmp_path / "nope.yaml")
    assert problems[0].message == "file not found" and problems[0].line == 1


# ------------------------------------------------------------------------------ --set overrides


def test_overrides_apply(tmp_path: Path):
    path = tmp_path / "p.yaml"
    path.write_text(MODEL + "hooks:\n  - {type: logging, every_steps: 100}\n")
    spec = load(path, overrides=["training.steps=5", "model.layers.0.out=7", "hooks.0.every_steps=2",
                                 "training.mode=sync", "cluster.jobs={ps: 2, worker: 3}", "name=renamed"])
    assert spec.training.steps == 5
    assert spec.training.mode == "sync"
    assert spec.model is not None and spec.model.layers is not None and spec.model.layers[0].out == 7
    assert spec.hooks[0].every_steps == 2
    assert spec.cluster.jobs == {"ps": 2, "worker": 3}
    assert spec.name == "renamed"
    assert load(path).training.steps == 1000  # the file itself is untouched


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        ("training.steps=abc", "training.steps", "expected an integer, got 'abc' (from --set training.steps=abc)"),
        ("training.stepz=5", "training.stepz", "did you mean 'steps'"),
        ("training.replicas_to_aggregate=4", "training.replicas_to_aggregate", "--set"),
    ],
)
def test_an_invalid_override_names_the_set_option(tmp_path: Path, override: str, path: str, fragment: str):
    file = tmp_path / "p.yaml"
    file.write_text(MODEL + "training: {mode: sync}\n")
    problems = problems_of(file, overrides=[override])
    assert [p.path for p in problems] == [path]
    assert fragment in problems[0].message and "--set" in problems[0].message


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("training.steps", "write KEY=VALUE"),
        ("=5", "KEY must be a dotted path"),
        ("training..steps=5", "KEY must be a dotted path"),
        ("model.layers.3.out=2", "not an index"),
        ("training.steps=[1", "VALUE is not valid YAML"),
        ("model.layers.0.type.x=1", "not a section"),
        ("model.input_shape.x=1", "not an index"),
    ],
)
def test_a_malformed_override_is_a_spec_error(tmp_path: Path, override: str, fragment: str):
    file = tmp_path / "p.yaml"
    file.write_text(MODEL)
    problems = problems_of(file, overrides=[override])
    assert len(problems) == 1
    assert problems[0].message.startswith(f"--set {override!r}: ")
    assert fragment in problems[0].message


# ------------------------------------------------------------------------------ safety, paths


@pytest.mark.parametrize(
    "tagged",
    [
        "model: !!python/object/apply:os.system ['echo pwned']",
        "name: !!python/name:os.system",
        "model: !!python/object:collections.OrderedDict {}",
        "steps: !!binary aGVsbG8=\n",
    ],
)
def test_python_tags_are_refused_by_the_safe_loader(tmp_path: Path, tagged: str):
    path = tmp_path / "tagged.yaml"
    path.write_text("name: x\n" + tagged + "\n")
    problems = problems_of(path)
    assert problems[0].line == 2
    if "python" in tagged:
        assert "is not allowed" in problems[0].message and "safe loader" in problems[0].message


def test_relative_data_paths_resolve_against_the_pipeline_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from dtrain.data.sources import resolve_data_path

    sub = tmp_path / "project"
    (sub / "data").mkdir(parents=True)
    np.savez(sub / "data" / "train.npz", x=np.zeros((8, 4), np.float32), y=np.arange(8) % 3)
    (sub / "p.yaml").write_text(MODEL + "data: {source: data/train.npz}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load("../project/p.yaml")
    assert spec.base_dir == sub.resolve()
    assert resolve_data_path(spec.data.source, spec.base_dir) == sub.resolve() / "data" / "train.npz"

    (sub / "q.yaml").write_text(MODEL + "data: {source: data/other.npz}\n")
    problems = problems_of(Path("../project/q.yaml"))
    assert problems[0].path == "data.source"
    assert str(sub.resolve() / "data" / "other.npz") in problems[0].message


def test_absolute_data_paths_are_kept(tmp_path: Path):
    data = tmp_path / "t.csv"
    data.write_text("a,b,label\n1,2,0\n3,4,1\n")
    spec = loads(MODEL + f"data: {{source: '{data}'}}\n", "p.yaml", base_dir="/nonexistent")
    assert spec.data.source == str(data)


# ------------------------------------------------------------------------------ good pipelines


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_every_golden_pipeline_loads(path: Path):
    spec = dtrain.load(path)
    assert spec.base_dir == path.parent
    assert spec.is_graph == (spec.model is None)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_corpus_loads(path: Path):
    spec = load(path)
    assert spec.name == path.stem.replace("_", "-")
