"""What every SGLang process of a rimuru server needs to know to patch itself.

The launcher builds one :class:`ProcessContext` and publishes it in the
environment (``SGLANG_RIMURU_CONTEXT``, JSON), which spawned schedulers and
detokenizers inherit; they read it back in :mod:`rimuru_patches.bootstrap`.
"""

from __future__ import annotations

import dataclasses
import json
import os

ENV_VAR = "SGLANG_RIMURU_CONTEXT"


@dataclasses.dataclass(frozen=True)
class ProcessContext:
    device: str  # "cpu", "cuda", ...
    tp_size: int = 1
    rimuru: dict = dataclasses.field(default_factory=dict)  # RimuruConfig as a dict

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ProcessContext":
        return cls(**json.loads(text))

    def publish(self) -> None:
        os.environ[ENV_VAR] = self.to_json()

    @classmethod
    def from_env(cls) -> "ProcessContext | None":
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else None
