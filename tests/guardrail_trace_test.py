"""benchmarks/guardrail_trace.py: the detector replay on a sequence of energies, its flags, and a
short trace of the small char-LM."""

import json
import os
import sys

import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import guardrail_trace  # noqa: E402


def test_the_replay_triggers_on_a_lone_spike_only_without_patience():
    energies = np.full(200, 10.0)
    energies[40] = 1e4  # one step 1000x the mean
    energies[150:152] = 1e4  # two in a row, after patience 1's window of 50 steps
    assert guardrail_trace.detect(energies, 1)[0] == [40, 150]
    assert guardrail_trace.detect(energies, 2)[0] == [151]
    assert guardrail_trace.detect(energies, 3)[0] == []
    _, means = guardrail_trace.detect(energies, 2)
    np.testing.assert_allclose(means[30], 10.0, rtol=1e-6)  # the running mean before step 30


@pytest.mark.slow  # a training run of its own
def test_a_short_trace_writes_its_rows_and_triggers(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert guardrail_trace.main(["--model", "small", "--steps", "27", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "small" and len(result["rows"]) == 27
    for loss, energy, shards in result["rows"]:
        assert len(shards) == 8 and np.isfinite(loss)
        np.testing.assert_allclose(energy, sum(shards), rtol=1e-9)
    assert set(result["triggers"]) == {"1", "2", "3"}
    assert "patience 2: triggers at steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["--steps", "10"], "warm-up"), (["--devices", "5"], "divide")],
)
def test_bad_flags_are_refused_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        guardrail_trace.main(argv)
    assert message in capsys.readouterr().err
