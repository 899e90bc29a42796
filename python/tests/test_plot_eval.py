"""examples/plot_eval.py on the JSON of `kvcompress eval`: both protocols give a PNG with one panel per
recall setting, and input that is not the eval's JSON is refused. Run by ctest (python_tests) with
KVC_TOOL and KVC_SOURCE_DIR; skipped without matplotlib or the model files."""
import json
import os
import subprocess
import sys

import pytest

TOOL = os.environ.get("KVC_TOOL")
SOURCE = os.environ.get("KVC_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
PLOT = os.path.join(SOURCE, "examples", "plot_eval.py")


def model_dir():
    for d in (os.environ.get("KVC_MODEL_DIR"), os.path.join(SOURCE, "models"), os.path.join(SOURCE, "..", "shared", "models")):
        if d and os.path.isfile(os.path.join(d, "stories260K.bin")):
            return d
    return None


@pytest.fixture
def tool_and_model():
    pytest.importorskip("matplotlib")
    if TOOL is None:
        pytest.skip("KVC_TOOL is not set (ctest sets it to the kvcompress tool)")
    d = model_dir()
    if d is None:
        pytest.skip("TinyStories-260K not found (set KVC_MODEL_DIR)")
    return TOOL, os.path.join(d, "stories260K.bin")


def run_plot(src, out):
    return subprocess.run([sys.executable, PLOT, str(src), "-o", str(out)], capture_output=True, text=True)


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_recall_and_kl_json_plot(tool_and_model, tmp_path):
    tool, story = tool_and_model
    # The story model stands in for the recall model: the plot's input shape is what is tested.
    recall = subprocess.run([tool, "eval", "--task", "recall", "--model", story, "--filler-model", story, "--length", "256",
                             "--samples", "2", "--methods", "snapkv,streaming", "--ratios", "0.25,0.5", "--json", "--quiet"],
                            capture_output=True, text=True, check=True).stdout
    rows = json.loads(recall)
    assert {r["setting"] for r in rows} == {"question-last", "question-later"}
    assert len(rows) == 2 * (1 + 2 * 2)
    (tmp_path / "recall.json").write_text(recall)
    r = run_plot(tmp_path / "recall.json", tmp_path / "recall.png")
    assert r.returncode == 0, r.stderr
    assert is_png(tmp_path / "recall.png")
    kl = subprocess.run([tool, "eval", "--model", story, "--samples", "2", "--length", "160", "--prefix", "128",
                         "--methods", "snapkv", "--ratios", "0.25,0.5", "--json", "--quiet"],
                        capture_output=True, text=True, check=True).stdout
    (tmp_path / "kl.json").write_text(kl)
    r = run_plot(tmp_path / "kl.json", tmp_path / "kl.png")
    assert r.returncode == 0, r.stderr
    assert is_png(tmp_path / "kl.png")


def test_plot_refuses_other_json(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "empty.json").write_text("[]")
    r = run_plot(tmp_path / "empty.json", tmp_path / "x.png")
    assert r.returncode != 0
    assert "expected the non-empty JSON list" in r.stderr
    assert not (tmp_path / "x.png").exists()
