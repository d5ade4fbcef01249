"""The device-side measurement scripts (scripts/energy_per_call.py, scripts/kernel_times.py) load
and parse their arguments here, without a GPU, so that a renamed function of mok.bench they
import, or a broken argument, shows up in CI rather than in scarce device time."""

from __future__ import annotations

import sys

import pytest
from repo_scripts import load_script


@pytest.mark.parametrize("name", ["energy_per_call", "kernel_times"])
def test_device_scripts_load_and_take_help(name, monkeypatch, capsys):
    script = load_script(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 0
    assert "--shape" in capsys.readouterr().out


def test_energy_reasons_summarized_as_shares_of_the_samples():
    energy = load_script("energy_per_call")
    sampler = energy.ReasonSampler(nvml=None)
    assert sampler.summary() == "none"
    sampler.samples = 4
    sampler.counts[0x4] = 3
    sampler.counts[0x80] = 1
    assert sampler.summary() == "sw power cap 75%, hw power brake 25%"
