"""`Section`, the base of every config model (agentrl/config.py and the sections that live beside
their package: agentrl/learner/config.py, agentrl/rewards/config.py). Its own module so those
can import it without importing agentrl.config, which imports them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config model: unknown keys fail, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
