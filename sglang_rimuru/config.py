"""The project's own command-line flags, in one frozen dataclass.

Plain Python: no SGLang import. The launcher adds these flags beside SGLang's
(``--help`` shows both) and hands the parsed config to every SGLang process
through :class:`rimuru_patches.context.ProcessContext`.
"""

from __future__ import annotations

import argparse
import dataclasses

MODES = ("off",)


@dataclasses.dataclass(frozen=True)
class RimuruConfig:
    #: how experts and KV cache share GPU memory; ``off`` is plain SGLang
    mode: str = "off"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--rimuru-mode: unknown mode {self.mode!r}; choose from {', '.join(MODES)}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sglang-rimuru options")
        group.add_argument(
            "--rimuru-mode",
            choices=MODES,
            default=RimuruConfig.mode,
            help="How expert weights and the KV cache share GPU memory. 'off': plain SGLang.",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "RimuruConfig":
        return cls(mode=args.rimuru_mode)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
