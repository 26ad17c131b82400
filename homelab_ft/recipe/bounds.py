"""What each kind of numeric recipe value can be, named once (config.py uses these types).

Every float in a recipe is finite as well (`STRICT`'s `allow_inf_nan=False`): an infinite
learning rate, LoRA alpha or DPO beta validated and trained to NaN with exit 0 (issue 23).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
"""Every recipe section's pydantic config (config.py, objectives.py): an unknown key is an error, a
field's docstring is its help, and no float is infinite or NaN."""

MAX_INT64 = 2**63 - 1
"""Counts end up in torch int64 tensors and numpy int64 arrays (steps, rows, tokens); past this
they overflow there, long after the run directory exists."""

SEED_LIMIT = 2**32
"""numpy's legacy `seed()` takes [0, 2**32), the narrowest of torch, numpy and `random`; a seed past
64 bits passed validation and then failed in torch.manual_seed with a traceback (issue 23)."""

PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT64)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_INT64)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A share that must keep a remainder: dropout, held-out rows, memory headroom, and Adam's betas
(torch.optim.AdamW refuses a beta outside [0, 1): a moment's decay is a fraction below one)."""
Positive = Annotated[float, Field(gt=0)]
"""A scale, rate or size: zero or less means nothing (a zero learning rate never moves)."""
NonNegative = Annotated[float, Field(ge=0)]
"""A weight or threshold where 0 means off."""
LearningRate = Annotated[float, Field(gt=0, le=1.0)]
"""AdamW moves each weight by about lr per step whatever the gradient's size, so lr = 1 already
moves weights by their own magnitude every step (typical: 1e-5 to 1e-3); above 1 is a typo."""
