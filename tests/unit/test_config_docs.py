"""docs/configuration.md is generated from the settings dataclasses and the CLIs' parsers."""

from __future__ import annotations

import dataclasses

from coordinator.config import CoordinatorConfig
from devtools import gen_config_docs
from rollout_agent.config import RolloutConfig
from trainer_agent.config import TrainerConfig


def test_the_configuration_page_is_generated_from_the_settings() -> None:
    committed = gen_config_docs.TARGET.read_text()
    assert committed == gen_config_docs.render(), "docs/configuration.md is stale: run `make config-docs`"


def test_every_flag_of_every_service_is_on_the_page_with_its_variable() -> None:
    page = gen_config_docs.render()
    for cls, component in ((CoordinatorConfig, "COORDINATOR"), (TrainerConfig, "TRAINER"), (RolloutConfig, "ROLLOUT")):
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert f"| `{flag}` | `WEIGHTSYNC_{component}_{f.name.upper()}` |" in page, (cls.__name__, f.name)
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text for the page"
