"""Logs and dumps: AOTFORGE_LOG topics (unknown ones warned about, every one documented),
recompiles saying what changed, one dump folder per process and compile, TORCH_TRACE."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import aotforge
from aotforge import debug

PACKAGE = os.path.dirname(os.path.abspath(aotforge.__file__))
REPO = os.path.dirname(PACKAGE)


@pytest.fixture
def fresh_log(monkeypatch):
    """AOTFORGE_LOG parsed anew (the parse is cached per value)."""
    monkeypatch.setattr(debug, "_parsed", {})
    return monkeypatch


def test_unknown_topic_warns_and_lists_the_valid_ones(fresh_log):
    fresh_log.setenv("AOTFORGE_LOG", "graph,partition")
    with pytest.warns(UserWarning, match=r"unknown topic\(s\) \['graph'\] \(did you mean 'graphs'\?\); valid topics: all, .*graphs"):
        assert debug.enabled("partition")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per value, not at every artifact
        assert not debug.enabled("graphs")


def test_unknown_topic_warns_at_import():
    env = dict(os.environ, AOTFORGE_LOG="graph", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", "import aotforge"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    assert "unknown topic(s) ['graph'] (did you mean 'graphs'?)" in result.stderr


def test_unknown_topics_each_get_a_suggestion(fresh_log):
    fresh_log.setenv("AOTFORGE_LOG", "graph,verfy,nonsense_xyz")
    with pytest.warns(UserWarning, match=r"did you mean 'graphs' for 'graph', 'verify' for 'verfy'\?"):
        debug.enabled("graphs")


def _topics_used_in_the_package() -> set[str]:
    used = set()
    pattern = re.compile(r"debug\.(?:graph_artifact|artifact|log_once)\(\s*\"([a-z_]+)\"")
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        with open(path) as handle:
            used |= set(pattern.findall(handle.read()))
    return used


def test_every_topic_the_package_logs_is_known_and_documented():
    used = _topics_used_in_the_package()
    assert {"graphs", "metadata", "partition", "output_code", "compile_time", "recompiles"} <= used
    assert used <= set(debug.TOPICS), f"logged but not in debug.TOPICS: {used - set(debug.TOPICS)}"
    with open(os.path.join(REPO, "README.md")) as handle:
        readme = handle.read()
    undocumented = [t for t in debug.TOPICS if f"`{t}`" not in readme]
    assert not undocumented, f"topics missing from README.md: {undocumented}"


def test_recompiles_say_which_part_of_the_signature_changed(fresh_log, capfd):
    fresh_log.setenv("AOTFORGE_LOG", "recompiles")

    def f(x):
        return x.sin().sum()

    compiled = aotforge.aot_function(f, aotforge.nop)
    compiled(torch.randn(3, requires_grad=True)).backward()
    compiled(torch.randn(4, requires_grad=True)).backward()
    compiled(torch.randn(4, dtype=torch.float64, requires_grad=True)).backward()
    compiled(torch.randn(4, dtype=torch.float64))
    err = capfd.readouterr().err
    assert "input 0 shape (3,) -> (4,)" in err, err
    assert "input 0 dtype torch.float32 -> torch.float64" in err, err
    assert "training -> inference graph" in err, err
    records = aotforge.inspect(compiled).records
    assert [r.recompile_reason.split(";")[0] for r in records[1:]] == [
        "input 0 shape (3,) -> (4,)", "input 0 dtype torch.float32 -> torch.float64",
        "training -> inference graph (grad mode or requires_grad changed)"]


def test_cache_limit_error_points_at_the_recompile_log():
    compiled = aotforge.aot_function(lambda x: x * 2, aotforge.nop)
    with aotforge.config.patch(cache_size_limit=2):
        compiled(torch.randn(1))
        compiled(torch.randn(2))
        with pytest.raises(RuntimeError, match="cache_size_limit.*AOTFORGE_LOG=recompiles"):
            compiled(torch.randn(3))


def test_dump_dir_has_one_folder_per_process_and_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))

    def first(x):
        return x.cos() * 2

    def second(x):
        return x.exp()

    for fn in (first, second, first):  # `first` twice: a new compile object, a new folder
        aotforge.aot_function(fn, aotforge.nop)(torch.randn(3, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    model = torch.nn.Linear(3, 2)
    torch.compile(model, backend="aotforge")(torch.randn(2, 3)).sum().backward()

    process = tmp_path / str(os.getpid())
    assert [p.name for p in tmp_path.iterdir()] == [process.name]
    folders = sorted(p.name for p in process.iterdir())
    assert len(folders) == 4 and len(set(folders)) == 4
    assert [re.sub(r"^\d+_", "", f) for f in folders[:3]] == ["first", "second", "first"]
    assert re.fullmatch(r"\d+_Linear_dynamo0-0", folders[3]), folders
    for folder in folders:
        files = sorted(p.name for p in (process / folder).iterdir())
        assert files[0].startswith("000_") and any("joint" in f for f in files), files
        assert not any("dynamo_graph" in f for f in files), files  # the folder names the model
    joint = next((process / folders[3]).glob("*_joint.py")).read_text()
    assert "tangents_1" in joint


def test_dump_folder_left_by_an_earlier_process_is_never_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    scope = debug.CompileScope("model")
    # An earlier process with the same pid left the folder this compile would get.
    stale = tmp_path / str(os.getpid()) / f"{scope.index:03d}_model"
    stale.mkdir(parents=True)
    (stale / "000_joint.py").write_text("old")
    path = scope.write("joint", "new", ".py")
    assert os.path.dirname(path) != str(stale)
    assert (stale / "000_joint.py").read_text() == "old"
    assert open(path).read() == "new"


def test_torch_trace_has_aotforges_graphs_code_and_metrics(tmp_path):
    """What tlparse reads: TORCH_TRACE's log holds aotforge's artifacts beside Dynamo's."""
    trace_dir = tmp_path / "trace"
    script = textwrap.dedent("""
        import torch, aotforge
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        compiled = torch.compile(model, backend="aotforge")
        compiled(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            compiled(torch.randn(4, 8))
    """)
    env = dict(os.environ, TORCH_TRACE=str(trace_dir), PYTHONPATH=REPO,
               TRITON_INTERPRET="1", AOTFORGE_TRITON_ON_CPU="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    names, dynamo_entries = set(), 0
    for path in trace_dir.iterdir():
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("\t"):
                continue  # payload lines are tab-indented
            entry = json.loads(line[line.index("{"):])
            for kind in ("artifact", "graph_dump"):
                name = entry.get(kind, {}).get("name", "") if isinstance(entry.get(kind), dict) else ""
                if name.startswith("aotforge_"):
                    names.add(name[len("aotforge_"):])
                    assert "frame_id" in entry  # tlparse files it under Dynamo's compile id
            dynamo_entries += "dynamo_output_graph" in entry
    assert dynamo_entries >= 2
    for expected in ("dynamo_graph_metadata", "dynamo_graph_joint", "dynamo_graph_forward",
                     "dynamo_graph_backward", "dynamo_graph_inference",
                     "forward_lowered", "forward_kernel_plan", "forward_kernels", "forward_wrapper",
                     "backward_lowered", "backward_kernels", "backward_wrapper",
                     "inference_kernels", "inference_wrapper",
                     "forward_compile_time", "backward_compile_time"):
        assert expected in names, f"{expected} not in the trace: {sorted(names)}"
