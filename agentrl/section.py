"""`Section`, the base of every config model: each package's section (`agentrl/<package>/config.py`)
and the root model in agentrl/config.py. Its own module so the sections can import it without
importing agentrl.config, which imports them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config model: unknown keys fail, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
