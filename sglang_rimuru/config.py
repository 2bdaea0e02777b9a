"""The project's own command-line flags, in one frozen dataclass.

Plain Python: no SGLang import. The launcher adds these flags beside SGLang's
(``--help`` shows both) and hands the parsed config to every SGLang process
through :class:`rimuru_patches.context.ProcessContext`. Checks that need the
model (expert counts, sizes) live in :mod:`sglang_rimuru.plan`.
"""

from __future__ import annotations

import argparse
import dataclasses

#: ``off``: plain SGLang. ``static``: experts and KV cache in one page pool,
#: split fixed at start (the paper's fixed-ratio baseline). ``elastic``: the
#: same pool, and the adjuster moves the split every scheduling round.
MODES = ("off", "static", "elastic")

#: the paged MoE kernel on CUDA. ``exact``: SGLang's launch configs, SiLU*up and
#: top-k sum, outputs bit-equal to ``--rimuru-mode off``. ``fast``: the kernel's
#: own tuned configs, SiLU*up fused into the gate/up GEMM, its Triton top-k sum.
#: ``auto``: one of the two per server (:func:`choose_moe_kernel`).
MOE_KERNELS = ("auto", "exact", "fast")
#: --rimuru-mix-decodes: "offloaded" = prefill passes carry the running decodes while any
#: routed expert is offloaded; "sglang" = SGLang's own --enable-mixed-chunk alone
MIX_DECODES = ("offloaded", "sglang")
#: how the host computes the CPU split's experts (``cpu_experts.ENGINES``)
CPU_ENGINES = ("forked", "threads")


def _share_or_auto(text: str) -> float | str:
    """``--rimuru-cpu-experts``: a share, or ``auto`` (argparse names the flag on error)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) or auto, got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class RimuruConfig:
    #: how experts and KV cache share GPU memory
    mode: str = "off"
    #: most experts a MoE layer may have offloaded; sizes the load buffers
    #: (default: half the layer's experts)
    expert_offload_limit: int | None = None
    #: experts each of the two load buffers holds (default: the offload limit). Fewer
    #: keep more of the pool for KV; offloaded experts a pass routes beyond them are
    #: read in place from pinned host memory (a slower prefill, never a wrong one)
    load_buffer_slots: int | None = None
    #: static mode: experts per MoE layer kept resident in the pool
    #: (default: all but the offload limit)
    resident_experts: int | None = None
    #: bytes of the unified pool, in GiB (default: from --max-total-tokens on
    #: CPU, or the memory SGLang would give its KV cache on a GPU)
    pool_gb: float | None = None
    #: the hot-expert ranking file (default: expert index order)
    expert_ranking: str | None = None
    #: write a ranking file of the routing this server sees (any mode)
    record_routing: str | None = None
    #: elastic mode: the adjuster's thresholds (sglang_rimuru.adjuster.policy)
    adjuster_evict_low_water: int = 2
    adjuster_restore_high_water: int = 9
    adjuster_max_restores: int = 5
    #: elastic mode: append one JSON line per round in which the split changed
    adjuster_trace: str | None = None
    #: elastic mode: "paper" = the fixed thresholds alone; "cost" = an eviction must
    #: also pay for its PCIe time (sglang_rimuru/adjuster/cost.py)
    adjuster_policy_name: str = "cost"
    #: batches of at most this many tokens read offloaded experts in place from
    #: pinned host memory (zero-copy, no host sync); larger ones copy them into the
    #: load buffers first. CUDA graphs always read in place.
    zero_copy_max_tokens: int = 128
    #: the paged MoE kernel's arithmetic on CUDA (MOE_KERNELS); the CPU path is torch either way
    moe_kernel: str = "auto"
    #: when a prefill pass also advances the running decode requests (MIX_DECODES)
    mix_decodes: str = "offloaded"
    #: the CPU split: this share of each layer's offloaded experts is computed by the
    #: host's CPUs in passes of cpu_min_tokens..cpu_max_tokens tokens (0: off; "auto":
    #: the count that balances host and GPU; sglang_rimuru/experts/cpu_split.py)
    cpu_experts: float | str = 0.0
    #: host threads computing the CPU split's experts (default: the process's cores less two)
    cpu_threads: int | None = None
    #: how the host runs the split's experts (CPU_ENGINES; sglang_rimuru/experts/cpu_experts.py)
    cpu_engine: str = "forked"
    cpu_min_tokens: int = 16
    cpu_max_tokens: int = 128

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--rimuru-mode: unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"--rimuru-moe-kernel: unknown kernel {self.moe_kernel!r}; choose from "
                             f"{', '.join(MOE_KERNELS)}")
        if self.mix_decodes not in MIX_DECODES:
            raise ValueError(f"--rimuru-mix-decodes: unknown choice {self.mix_decodes!r}; choose from "
                             f"{', '.join(MIX_DECODES)}")
        for flag, value in (
            ("--rimuru-expert-offload-limit", self.expert_offload_limit),
            ("--rimuru-resident-experts", self.resident_experts),
            ("--rimuru-zero-copy-max-tokens", self.zero_copy_max_tokens),
            ("--rimuru-load-buffer-slots", self.load_buffer_slots),
            ("--rimuru-cpu-min-tokens", self.cpu_min_tokens),
            ("--rimuru-cpu-max-tokens", self.cpu_max_tokens),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if (self.load_buffer_slots is not None and self.expert_offload_limit is not None
                and self.load_buffer_slots > self.expert_offload_limit):
            raise ValueError(f"--rimuru-load-buffer-slots {self.load_buffer_slots} is above "
                             f"--rimuru-expert-offload-limit {self.expert_offload_limit}: a layer never has "
                             "more experts offloaded than the limit")
        if self.cpu_experts != "auto" and (isinstance(self.cpu_experts, str) or not 0 <= self.cpu_experts < 1):
            raise ValueError(f"--rimuru-cpu-experts is a share of each layer's offloaded experts, in [0, 1), "
                             f"or auto; got {self.cpu_experts}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--rimuru-cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_engine not in CPU_ENGINES:
            raise ValueError(f"--rimuru-cpu-engine: unknown engine {self.cpu_engine!r}; choose from "
                             f"{', '.join(CPU_ENGINES)}")
        if not 1 <= self.cpu_min_tokens <= self.cpu_max_tokens:
            raise ValueError(f"--rimuru-cpu-min-tokens {self.cpu_min_tokens} and --rimuru-cpu-max-tokens "
                             f"{self.cpu_max_tokens}: need 1 <= min <= max")
        if self.pool_gb is not None and not self.pool_gb > 0:
            raise ValueError(f"--rimuru-pool-gb must be > 0, got {self.pool_gb}")
        if self.mode == "off":
            given = [f for f, v in self._pool_flags().items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need --rimuru-mode static or elastic")
        if self.mode != "elastic":
            given = [f for f, v in self._elastic_flags().items() if v != self._default(f)]
            if given:
                raise ValueError(f"{', '.join(given)} need --rimuru-mode elastic")
        else:
            self.adjuster_policy()  # the policy checks its thresholds (one-line errors)

    def cpu_split_problems(self, device: str, tp_size: int, deterministic: bool) -> list[str]:
        """Why ``--rimuru-cpu-experts`` cannot serve on this device, TP size and determinism
        setting (empty where it can): asked by the launcher before any weight loads and by
        the worker at build."""
        problems = []
        if device != "cuda":
            problems.append(f"it needs a CUDA device (--device {device})")
        if tp_size != 1:
            problems.append(f"it runs at TP 1 only (--tp-size {tp_size})")
        if deterministic:
            problems.append("its outputs are not bit-equal to the GPU's (--enable-deterministic-inference)")
        return problems

    def _elastic_flags(self) -> dict[str, object]:
        return {
            "--rimuru-adjuster-evict-low-water": self.adjuster_evict_low_water,
            "--rimuru-adjuster-restore-high-water": self.adjuster_restore_high_water,
            "--rimuru-adjuster-max-restores": self.adjuster_max_restores,
            "--rimuru-adjuster-trace": self.adjuster_trace,
            "--rimuru-adjuster-policy": self.adjuster_policy_name,
        }

    @staticmethod
    def _default(flag: str) -> object:
        field = flag.removeprefix("--rimuru-").replace("-", "_")
        field = {"adjuster_policy": "adjuster_policy_name"}.get(field, field)  # (adjuster_policy() is the method)
        return RimuruConfig.__dataclass_fields__[field].default

    def adjuster_policy(self):
        """The elastic adjuster's ``AdjusterPolicy`` from these flags."""
        from sglang_rimuru.adjuster.policy import AdjusterPolicy

        return AdjusterPolicy(
            evict_low_water=self.adjuster_evict_low_water,
            restore_high_water=self.adjuster_restore_high_water,
            max_restores_per_round=self.adjuster_max_restores,
        )

    def _pool_flags(self) -> dict[str, object]:
        return {
            "--rimuru-expert-offload-limit": self.expert_offload_limit,
            "--rimuru-resident-experts": self.resident_experts,
            "--rimuru-pool-gb": self.pool_gb,
            "--rimuru-expert-ranking": self.expert_ranking,
            "--rimuru-load-buffer-slots": self.load_buffer_slots,
            "--rimuru-zero-copy-max-tokens": (None if self.zero_copy_max_tokens == self._default(
                "--rimuru-zero-copy-max-tokens") else self.zero_copy_max_tokens),
            "--rimuru-moe-kernel": None if self.moe_kernel == self._default("--rimuru-moe-kernel") else self.moe_kernel,
            "--rimuru-mix-decodes": None if self.mix_decodes == self._default("--rimuru-mix-decodes") else self.mix_decodes,
            **{flag: None if value == self._default(flag) else value for flag, value in (
                ("--rimuru-cpu-experts", self.cpu_experts), ("--rimuru-cpu-threads", self.cpu_threads),
                ("--rimuru-cpu-engine", self.cpu_engine),
                ("--rimuru-cpu-min-tokens", self.cpu_min_tokens), ("--rimuru-cpu-max-tokens", self.cpu_max_tokens))},
        }

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def cpu_share(self) -> float | None:
        """The CPU split's share of each layer's offloaded experts; None for ``auto``."""
        return None if self.cpu_experts == "auto" else float(self.cpu_experts)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sglang-rimuru options")
        group.add_argument(
            "--rimuru-mode",
            choices=MODES,
            default=RimuruConfig.mode,
            help="How expert weights and the KV cache share GPU memory. 'off': plain SGLang. "
            "'static': one page pool holds both, with a fixed number of resident experts per layer. "
            "'elastic': the same pool; under load cold experts go to host memory to make room for "
            "KV, and come back when load falls.",
        )
        group.add_argument(
            "--rimuru-expert-offload-limit",
            type=int,
            default=None,
            metavar="N",
            help="Most experts a MoE layer may have offloaded to host memory; in static mode it also "
            "sizes the two load buffers (see --rimuru-load-buffer-slots). Default: static, and elastic with "
            "--rimuru-adjuster-policy paper: half of the layer's experts; elastic with the cost policy: all but "
            "one (each eviction must price as paying).",
        )
        group.add_argument(
            "--rimuru-resident-experts",
            type=int,
            default=None,
            metavar="N",
            help="Routed experts per MoE layer kept in the pool (the highest ranked); in elastic mode "
            "the number at start. Default: static: all but --rimuru-expert-offload-limit; elastic: all.",
        )
        group.add_argument(
            "--rimuru-pool-gb",
            type=float,
            default=None,
            metavar="GIB",
            help="Size of the unified expert/KV page pool per GPU. Default: resident experts + load "
            "buffers + --max-total-tokens of KV when that is given, else what SGLang would give its KV cache.",
        )
        group.add_argument(
            "--rimuru-load-buffer-slots",
            type=int,
            default=None,
            metavar="N",
            help="Experts each of the two load buffers holds (default: static, the offload limit; elastic, "
            "the most experts a layer has offloaded at start, 0 where every expert fits). The buffers "
            "take 2 x N x 3 expert pages for the server's life; fewer keep more of the pool for KV. "
            "Offloaded experts a prefill routes beyond N are read in place from pinned host memory "
            "(slower, same outputs). 0: no load buffers.",
        )
        group.add_argument(
            "--rimuru-zero-copy-max-tokens",
            type=int,
            default=RimuruConfig.zero_copy_max_tokens,
            metavar="N",
            help="Forward passes of at most N tokens read offloaded experts in place from pinned host "
            "memory over PCIe (no copy, no host sync); larger ones copy the routed offloaded experts "
            "into load buffers first. N is for uniform routing: with a ranking file whose offloaded "
            "experts are colder, longer passes read in place while each expects at most N*top_k/E "
            "tokens (and captured prefill graphs replay). CUDA graphs always read in place. "
            "0: always copy outside graphs.",
        )
        group.add_argument(
            "--rimuru-moe-kernel",
            choices=MOE_KERNELS,
            default=RimuruConfig.moe_kernel,
            help="The paged MoE kernel's arithmetic on a GPU. 'exact': SGLang's launch configs, SiLU*up "
            "and top-k sum (outputs bit-equal to --rimuru-mode off). 'fast': the kernel's own tuned "
            "configs (H200 tables for Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B, a default table elsewhere), "
            "SiLU*up fused into the gate/up GEMM and its Triton top-k sum (same math, other rounding order). "
            "'auto' (default): static mode exact (its outputs equal mode off's); elastic mode fast where "
            "the kernel has a tuned table for the model's shape on this GPU, exact otherwise and under "
            "--enable-deterministic-inference (the start line says which and why).",
        )
        group.add_argument(
            "--rimuru-mix-decodes",
            choices=MIX_DECODES,
            default=RimuruConfig.mix_decodes,
            help="When a prefill pass also advances the running decode requests (SGLang's mixed "
            "chunked prefill). 'offloaded' (default): on a GPU, while any routed expert is offloaded, since "
            "every pass then reads each offloaded expert over PCIe once, and a prefill pass that "
            "carries the decodes saves them a pass of their own; with every expert resident, as "
            "SGLang's --enable-mixed-chunk says. Not under --enable-deterministic-inference. "
            "'sglang': --enable-mixed-chunk alone.",
        )
        group.add_argument(
            "--rimuru-cpu-experts",
            type=_share_or_auto,
            default=RimuruConfig.cpu_experts,
            metavar="SHARE|auto",
            help="The CPU split (GPU only, TP 1): in forward passes of --rimuru-cpu-min-tokens to "
            "--rimuru-cpu-max-tokens tokens (the decode graphs, and eager passes up to that size), this share of each MoE layer's offloaded "
            "experts (the most often routed) is computed by the host's CPUs from host memory while the GPU "
            "reads the rest over PCIe; only hidden states and routing cross the link for them. Outputs "
            "are not bit-equal to the GPU's. 0 (default): off. auto: each layer's count balances the "
            "host's measured time against the GPU's reads of the rest, at the batch the split serves "
            "(starting from 0.25 until the host is measured).",
        )
        group.add_argument(
            "--rimuru-cpu-threads",
            type=int,
            default=None,
            metavar="N",
            help="Host threads computing the CPU split's experts (default: this process's cores less two).",
        )
        group.add_argument(
            "--rimuru-cpu-engine",
            choices=CPU_ENGINES,
            default=RimuruConfig.cpu_engine,
            help="How the host computes the CPU split's experts: forked (default: TorchScript tasks on "
            "torch's inter-op pool, without the GIL) or threads (Python threads, each expert's matmuls "
            "taking the GIL between calls).",
        )
        group.add_argument(
            "--rimuru-cpu-min-tokens",
            type=int,
            default=RimuruConfig.cpu_min_tokens,
            metavar="N",
            help="Smallest pass (tokens) the CPU split takes part in (default %(default)s: below it a "
            "step is short and the host's fixed cost a layer would show).",
        )
        group.add_argument(
            "--rimuru-cpu-max-tokens",
            type=int,
            default=RimuruConfig.cpu_max_tokens,
            metavar="N",
            help="Largest pass (tokens) the CPU split takes part in (default %(default)s: the host's "
            "matmuls grow with the tokens routed to its experts). Passes past --rimuru-zero-copy-max-tokens "
            "copy the GPU's offloaded experts and leave the host's uncopied.",
        )
        group.add_argument(
            "--rimuru-record-routing",
            default=None,
            metavar="PATH",
            help="Count each MoE layer's expert selections and keep PATH updated as a ranking file "
            "(what python -m sglang_rimuru.rank uses). Works in every mode.",
        )
        group.add_argument(
            "--rimuru-expert-ranking",
            default=None,
            metavar="PATH",
            help="Hot-expert ranking file (JSON); the highest ranked experts stay resident. "
            "Default: expert index order.",
        )

        group.add_argument(
            "--rimuru-adjuster-evict-low-water",
            type=int,
            default=RimuruConfig.adjuster_evict_low_water,
            metavar="PAGES",
            help="elastic: evict one expert pre-emptively when fewer free expert pages than this remain.",
        )
        group.add_argument(
            "--rimuru-adjuster-restore-high-water",
            type=int,
            default=RimuruConfig.adjuster_restore_high_water,
            metavar="PAGES",
            help="elastic: restore experts while more free expert pages than this remain.",
        )
        group.add_argument(
            "--rimuru-adjuster-max-restores",
            type=int,
            default=RimuruConfig.adjuster_max_restores,
            metavar="N",
            help="elastic: most experts restored in one scheduling round (0: never restore).",
        )
        group.add_argument(
            "--rimuru-adjuster-policy",
            choices=("paper", "cost"),
            default=RimuruConfig.adjuster_policy_name,
            help="elastic: 'cost' (default): an eviction must also pay for itself: the offloaded "
            "experts' expected PCIe time per decode step (from their routing frequency and the batch "
            "size) against the requests it admits; 'paper': evict and restore by the free-page "
            "thresholds alone.",
        )
        group.add_argument(
            "--rimuru-adjuster-trace",
            default=None,
            metavar="PATH",
            help="elastic: append one JSON line per scheduling round in which the split changed "
            "(PATH gets a .tpN suffix per TP rank above 0); under the cost policy the decode steps it "
            "timed go beside it (PATH less .jsonl, plus .steps.jsonl).",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "RimuruConfig":
        return cls(
            mode=args.rimuru_mode,
            expert_offload_limit=args.rimuru_expert_offload_limit,
            resident_experts=args.rimuru_resident_experts,
            pool_gb=args.rimuru_pool_gb,
            expert_ranking=args.rimuru_expert_ranking,
            record_routing=args.rimuru_record_routing,
            adjuster_evict_low_water=args.rimuru_adjuster_evict_low_water,
            adjuster_restore_high_water=args.rimuru_adjuster_restore_high_water,
            adjuster_max_restores=args.rimuru_adjuster_max_restores,
            adjuster_trace=args.rimuru_adjuster_trace,
            adjuster_policy_name=args.rimuru_adjuster_policy,
            zero_copy_max_tokens=args.rimuru_zero_copy_max_tokens,
            load_buffer_slots=args.rimuru_load_buffer_slots,
            moe_kernel=args.rimuru_moe_kernel,
            mix_decodes=args.rimuru_mix_decodes,
            cpu_experts=args.rimuru_cpu_experts,
            cpu_threads=args.rimuru_cpu_threads,
            cpu_engine=args.rimuru_cpu_engine,
            cpu_min_tokens=args.rimuru_cpu_min_tokens,
            cpu_max_tokens=args.rimuru_cpu_max_tokens,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RimuruConfig":
        return cls(**data)


def choose_moe_kernel(choice: str, mode: str, *, deterministic: bool, tuned_table: str | None,
                      routed_scaling_factor: float | None, table_fits: bool = True,
                      sglang_tuned: bool = False) -> tuple[str, str]:
    """The paged kernel a server runs for ``--rimuru-moe-kernel choice``, and why.

    ``exact`` and ``fast`` are taken as given. ``auto``:

    * static: ``exact``. Its outputs equal mode off's, and a layer that keeps every
      expert runs SGLang's own MoE on the pool's pages (as fast as plain SGLang).
    * elastic: ``fast`` with the kernel's tuned table for the shape on this GPU
      (``tuned_table``). Elastic's residency moves, so it always runs the paged
      kernel; at SGLang's launch configs that kernel took 1.052x plain SGLang's decode
      step at Qwen1.5-MoE batch 8, with its own tables 0.987x (and 0.941-1.012x at
      Qwen3-30B-A3B, bench/RESULTS.md, thirteenth session). With experts offloaded the
      two read host memory at the same rate where SGLang's configs are tuned (747.8 vs
      753.6 ms a Qwen3 step).
    * elastic without a tuned table of the kernel: ``exact`` where SGLang has one
      (``sglang_tuned``: tuned tiles either way, and outputs equal mode off's), else
      ``fast`` on the kernel's default table. SGLang's default config above E tokens
      (BLOCK_K 32) reads each weight row in 64 B pieces: on an H100 with neither table
      for Qwen1.5-MoE (E = 60) elastic's decode step read its offloaded experts at
      35 GB/s at graph batch 56 and at 19 GB/s from batch 57 (the graph of 64) on
      (bench/RESULTS.md, thirty-first session). The default table reads 128-256 B
      pieces (BLOCK_K 64-128).
    * ``exact`` otherwise: under ``--enable-deterministic-inference`` (elastic's
      outputs equal mode off's there, which needs SGLang's arithmetic), for layers
      with a ``routed_scaling_factor`` other than 1 (the fast top-k sum does not
      apply it), or where the fast kernel's table has a tile that may not fit the GPU's
      shared memory (``table_fits`` False: ``rimuru_kernels.moe_config.table_fits``).
    """
    if choice != "auto":
        return choice, "given"
    if mode != "elastic":
        return "exact", f"{mode} mode: outputs equal --rimuru-mode off"
    if deterministic:
        return "exact", "--enable-deterministic-inference: SGLang's arithmetic, outputs equal --rimuru-mode off"
    if routed_scaling_factor not in (None, 1.0):
        return "exact", f"routed_scaling_factor {routed_scaling_factor}, which the fast top-k sum does not apply"
    if tuned_table is None and sglang_tuned:
        return "exact", "no tuned table of the fast kernel for this shape on this GPU; SGLang has one"
    table = tuned_table or "the default table"
    if not table_fits:
        return "exact", f"the fast kernel's table ({table}) has tiles larger than this GPU's shared memory"
    if tuned_table is None:
        return "fast", ("no tuned table for this shape on this GPU, here or in SGLang: the kernel's default "
                        "table (BLOCK_K >= 64, where SGLang's default config reads host pages in 64 B rows)")
    return "fast", f"elastic mode with a tuned table ({tuned_table})"
