"""tools/perplexity.py on a tiny random model: a window's scored tokens are what the model gives
position by position (each token a decode row after the ones before it), the second half of each
whole window is what counts, and the command line prints the figure."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_model import make_tiny_model

from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from perplexity import perplexity, window_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ppl"))


def position_by_position(runner: ModelRunner, window: list[int]) -> np.ndarray:
    """Each token's log-probability from one-token rows: a decode step a position."""
    table, out = list(range(runner.num_blocks)), []
    for p in range(len(window) - 1):
        logits = np.asarray(runner.logits(StepPlan([Row(p, [window[p]], p, table, sample=True)])), np.float64)[0]
        out.append(logits[window[p + 1]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
    return np.array(out)


def test_a_windows_scores_are_the_models_position_by_position(tiny):
    runner = ModelRunner.from_dir(tiny, num_blocks=8, ops=NumpyOps())
    window = list(np.random.default_rng(0).integers(0, 200, 40))
    np.testing.assert_allclose(window_logprobs(runner, window), position_by_position(runner, window), atol=1e-4)
    ids = list(np.random.default_rng(1).integers(0, 200, 90))  # two whole windows of 40, ten tokens left over
    value, _, count = perplexity(runner, ids, 40)
    halves = np.concatenate([window_logprobs(runner, ids[s:s + 40])[19:] for s in (0, 40)])
    assert count == 40 and value == pytest.approx(np.exp(-halves.mean()), rel=1e-9)


def test_the_command_prints_the_figure(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The weather in Paris is sunny today, and the cafes are full of people. " * 20)
    done = subprocess.run([sys.executable, "tools/perplexity.py", "--model", str(tiny), "--ctx", "64",
                           "--text", str(text)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "perplexity " in done.stdout and " over " in done.stdout
    q8 = subprocess.run([sys.executable, "tools/perplexity.py", "--model", str(tiny), "--ctx", "64", "--text",
                         str(text), "--cache-type", "q8_0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert q8.returncode == 0 and "K/V q8_0" in q8.stdout, q8.stderr
    figures = [float(out.split("perplexity ")[1].split()[0]) for out in (done.stdout, q8.stdout)]
    assert figures[0] != figures[1] and figures[1] == pytest.approx(figures[0], rel=0.05)
    odd = subprocess.run([sys.executable, "tools/perplexity.py", "--model", str(tiny), "--ctx", "63"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert odd.returncode == 2 and "--ctx must be an even number" in odd.stderr
