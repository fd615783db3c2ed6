"""The agent's own settings: the part of the config agent/ reads, taken from the whole one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.settings import AgentSettings, parse_config


def test_agent_settings_carry_every_section_the_agent_reads_from_the_config() -> None:
    cfg = parse_config(
        {
            "agent_name": "Iris",
            "llm": {"model": "m1", "context_length": 8192},
            "auxiliary": {"review": {"model": "small"}},
            "compression": {"threshold": 0.6},
            "memory": {"nudge_interval": 3},
            "skills": {"enabled": False},
            "reminders": {"max_per_tenant": 7},
            "limits": {"max_tool_iterations": 2},
        }
    )
    s = AgentSettings.from_config(cfg)
    assert s.agent_name == "Iris"
    assert s.max_tool_iterations == 2
    # the validated sections themselves, not copies
    assert s.llm is cfg.llm and s.auxiliary is cfg.auxiliary and s.compression is cfg.compression
    assert s.memory is cfg.memory and s.skills is cfg.skills and s.reminders is cfg.reminders
    assert (s.llm.model, s.auxiliary.review.model, s.compression.threshold) == ("m1", "small", 0.6)
    assert (s.memory.nudge_interval, s.skills.enabled, s.reminders.max_per_tenant) == (3, False, 7)


def test_agent_settings_defaults_match_the_config_defaults_and_are_frozen() -> None:
    assert AgentSettings() == AgentSettings.from_config(parse_config({}))
    s = AgentSettings()
    with pytest.raises(ValidationError):
        s.max_tool_iterations = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        AgentSettings(storage={})  # type: ignore[call-arg]  # only what the agent reads
