"""The decision the launching machine hands every torchrun worker, on this node or any other.

`homelab-ft train` (one machine) and `homelab-ft launch` (several) plan once, check the inputs once
and pass the result to the workers in one environment variable, `HOMELAB_FT_HANDOFF`: set in the
environment torchrun inherits on one machine, written on each node's command line by `launch`.
The workers then neither plan, nor probe the hardware (`plan.hardware.detect`, nvidia-smi), nor
re-run the preflight checks, nor read config.json to learn what the planner read off the model
(`ModelFacts`: blocks, fused experts, vocabulary, tying), so every rank on every node trains the
same rung of the same model.

The text is base64 of zlib-compressed compact JSON: one shell word with no quoting, and a few KB
for a whole plan (every option priced) where the JSON itself would be ~20 KB. The model folder and
resume point are paths on the launching machine; the other nodes are expected to hold the model at
the same path and to see the run directory at the same path (docs/multi-node.md), as before.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import zlib
from dataclasses import dataclass

from homelab_ft.errors import UserError
from homelab_ft.model_facts import ModelFacts
from homelab_ft.rung import Rung

HANDOFF_VAR = "HOMELAB_FT_HANDOFF"
"""Where a torchrun worker finds the launching process's Handoff (`Handoff.encode`)."""
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def under_torchrun(environ=os.environ) -> bool:
    return any(v in environ for v in _TORCHRUN_VARS)


@dataclass(frozen=True)
class Handoff:
    """What the launching process decided and checked: its workers train this rung with this plan
    and model folder instead of planning and probing again."""

    rung: Rung
    plan: dict
    """`Plan.to_dict()`: stored in the run directory, and priced the shutdown timeout."""
    facts: ModelFacts
    """The plan's shape's `facts`: what the builder asks of the model."""
    model_dir: str
    resume_from: str | None = None
    """The checkpoint the launching process verified (manifest and hashes) and chose to resume from."""

    def to_dict(self) -> dict:
        return {"rung": self.rung.to_dict(), "plan": self.plan, "facts": self.facts.to_dict(),
                "model_dir": self.model_dir, "resume_from": self.resume_from}

    def encode(self) -> str:
        compact = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)
        return base64.urlsafe_b64encode(zlib.compress(compact.encode("utf-8"), 9)).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> Handoff:
        """The inverse of `encode`; a damaged text (a command line cut short when pasted) is a
        user error naming the variable, not a traceback."""
        try:
            data = json.loads(zlib.decompress(base64.urlsafe_b64decode(text.encode("ascii"))))
        except (binascii.Error, zlib.error, ValueError, UnicodeError):
            raise UserError(f"{HANDOFF_VAR} is damaged (was the command line cut short?); run `homelab-ft "
                            "launch` again and paste each node's whole command") from None
        return cls(rung=Rung.from_dict(data["rung"]), plan=data["plan"], facts=ModelFacts.from_dict(data["facts"]),
                   model_dir=data["model_dir"], resume_from=data.get("resume_from"))


def received(environ=os.environ) -> Handoff | None:
    """The launching process's Handoff in a torchrun worker, else None (also in that process itself)."""
    text = environ.get(HANDOFF_VAR)
    if not text or not under_torchrun(environ):
        return None
    return Handoff.decode(text)
