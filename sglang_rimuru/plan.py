"""Sizing the unified pool for a model, and the checks that must pass before weights load.

Everything here reads a model's ``config.json`` and the project's flags; no
SGLang, no tensors. The launcher calls :func:`plan_pool` before SGLang loads
anything, so a dense model, an offload limit above the expert count or a pool
too small for one expert per layer plus one request is a one-line error. The
scheduler process builds the same plan again (with the real KV dtype and
TP shard) when it creates the pool.

Pool contents, in expert-page units (one routed expert = 3 expert pages:
W1, W3, W2 of one TP shard)::

    1                          page holding SGLang's dummy KV slot 0
    2 * buffer_slots * 3       the two load buffers (slots: the offload limit unless
                               --rimuru-load-buffer-slots says fewer)
    layers * resident * 3      resident experts
    the rest                   KV pages (and, later, experts restored by the adjuster)

The smallest workable pool holds the fewest residents the mode allows
(static: ``--rimuru-resident-experts``; elastic: ``experts - offload_limit``
per layer, since the adjuster can evict down to that) plus the KV of one
request. In elastic mode without ``--rimuru-resident-experts`` the experts
resident at start are as many as the pool holds (``residents_at_start``); the
adjuster then trades them for KV as load comes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from sglang_rimuru.config import RimuruConfig

GIB = 1 << 30


class PlanError(ValueError):
    """The model and the flags do not make a usable pool (message names the flag)."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the pool needs to know about a model, from its ``config.json``."""

    moe_layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    moe_inter: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_len: int

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelFacts":
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        if not experts or not config.get("moe_intermediate_size", config.get("intermediate_size")):
            raise PlanError(
                f"--rimuru-mode needs a Mixture-of-Experts model; {where} describes a dense model "
                f"({config.get('architectures', ['?'])[0]}: no routed experts)"
            )
        layers = int(config["num_hidden_layers"])
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense_layers = set(config.get("mlp_only_layers", []) or [])
        moe_layers = tuple(i for i in range(layers) if i not in dense_layers and (i + 1) % step == 0)
        if not moe_layers:
            raise PlanError(f"--rimuru-mode needs a Mixture-of-Experts model; {where} has no MoE layer")
        heads = int(config["num_attention_heads"])
        return cls(
            moe_layer_ids=moe_layers,
            num_experts=int(experts),
            top_k=int(config.get("num_experts_per_tok", 1)),
            hidden=int(config["hidden_size"]),
            moe_inter=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            num_layers=layers,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            context_len=int(config.get("max_position_embeddings", 4096)),
        )

    def routed_expert_bytes(self, dtype_bytes: int = 2) -> int:
        """Every routed expert of every MoE layer (W1, W3, W2), all TP ranks together."""
        return len(self.moe_layer_ids) * self.num_experts * 3 * self.moe_inter * self.hidden * dtype_bytes

    def moe_shape(self, *, tp_size: int = 1, dtype=None):
        """The :class:`~sglang_rimuru.experts.MoEShape` of one TP rank (bf16 by default)."""
        import torch

        from sglang_rimuru.experts import MoEShape

        return MoEShape(
            layer_ids=self.moe_layer_ids,
            num_experts=self.num_experts,
            hidden=self.hidden,
            inter=self.moe_inter // tp_size,
            top_k=self.top_k,
            dtype=dtype or torch.bfloat16,
        )

    @classmethod
    def from_model_path(cls, path: str | Path) -> "ModelFacts":
        file = Path(path) / "config.json"
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            raise PlanError(f"--rimuru-mode: {file} not found") from None
        except json.JSONDecodeError as exc:
            raise PlanError(f"--rimuru-mode: {file} is not valid JSON ({exc})") from None
        return cls.from_config(config, where=str(file))


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Page sizes and counts of one TP rank's pool."""

    num_moe_layers: int
    num_experts: int
    #: experts per layer resident at start; None: elastic, as many as fit (``residents_at_start``)
    resident_per_layer: int | None
    offload_limit: int
    expert_page_bytes: int
    kv_page_bytes: int
    token_bytes: int
    page_size: int
    request_tokens: int  # the "one request" every pool must be able to hold
    pool_bytes: int | None  # None: sized on the device from SGLang's KV budget
    mode: str = "static"
    #: experts per load buffer; None: the offload limit
    load_buffer_slots: int | None = None

    @property
    def buffer_slots(self) -> int:
        return self.offload_limit if self.load_buffer_slots is None else self.load_buffer_slots

    @property
    def kv_pages_per_expert_page(self) -> int:
        """KV pages that fit wholly in every expert page (the geometry's minimum)."""
        if self.expert_page_bytes % self.kv_page_bytes == 0:
            return self.expert_page_bytes // self.kv_page_bytes
        return self.expert_page_bytes // self.kv_page_bytes - 1

    @property
    def min_resident_per_layer(self) -> int:
        """The fewest experts per layer the pool must hold: static keeps its split;
        elastic can evict down to ``experts - offload_limit``."""
        if self.resident_per_layer is not None and not self.elastic:
            return self.resident_per_layer
        return self.num_experts - self.offload_limit

    @property
    def elastic(self) -> bool:
        return self.mode == "elastic"

    def fixed_expert_pages(self, resident_per_layer: int | None = None) -> int:
        """Pages that are not KV: dummy slot, load buffers, resident experts
        (``resident_per_layer`` of them, default the fewest the mode allows)."""
        resident = self.min_resident_per_layer if resident_per_layer is None else resident_per_layer
        return 1 + 2 * self.buffer_slots * 3 + self.num_moe_layers * resident * 3

    def expert_pages_for_tokens(self, tokens: int) -> int:
        kv_pages = math.ceil(tokens / self.page_size)
        return math.ceil(kv_pages / self.kv_pages_per_expert_page)

    def bytes_for(self, kv_tokens: int, resident_per_layer: int | None = None) -> int:
        return (self.fixed_expert_pages(resident_per_layer) + self.expert_pages_for_tokens(kv_tokens)) \
            * self.expert_page_bytes

    @property
    def min_pool_bytes(self) -> int:
        return self.bytes_for(self.request_tokens)

    def kv_tokens_beside(self, pool_bytes: int) -> int:
        """KV tokens a pool of ``pool_bytes`` holds in whole expert pages beside the
        fewest residents the mode allows and the load buffers (at least; holes aside)."""
        pages = pool_bytes // self.expert_page_bytes - self.fixed_expert_pages()
        return max(0, pages) * self.kv_pages_per_expert_page * self.page_size

    def check_pool_bytes(self, pool_bytes: int, flag: str = "--rimuru-pool-gb", like_sglang: bool = False) -> int:
        """The pool holds the fewest residents the mode allows and one request;
        in elastic mode with ``--rimuru-resident-experts``, those residents too.
        Returns the longest request it holds: ``request_tokens``, or fewer when
        ``like_sglang``.

        ``like_sglang`` (static mode sized from SGLang's own memory budget, the
        flags mode off runs with): as SGLang does without the pool, a KV cache
        shorter than the context caps requests (SGLang's ``max_req_input_len`` is
        its KV size - 1) instead of refusing the start, down to SGLang's own
        floor of two tokens. Elastic keeps the full request: evictions supply it.
        """
        resident = self.min_resident_per_layer
        if pool_bytes < self.min_pool_bytes and like_sglang and not self.elastic:
            capped = self.kv_tokens_beside(pool_bytes)
            if capped >= 2:
                return capped
        if pool_bytes < self.min_pool_bytes:
            experts = self.num_moe_layers * resident * 3 * self.expert_page_bytes
            buffers = 2 * self.buffer_slots * 3 * self.expert_page_bytes
            kv = self.bytes_for(self.request_tokens) - self.bytes_for(0)
            how = (f", the fewest --rimuru-expert-offload-limit {self.offload_limit} allows" if self.elastic
                   else "")
            raise PlanError(
                f"{flag}: a pool of {pool_bytes / GIB:.4g} GiB cannot hold {resident} resident "
                f"experts x {self.num_moe_layers} layers ({experts / GIB:.4g} GiB{how}), the load buffers "
                f"({buffers / GIB:.4g} GiB) and one request of {self.request_tokens} tokens "
                f"({kv / GIB:.4g} GiB); it needs at least {self.min_pool_bytes / GIB:.4g} GiB "
                f"(or a shorter --context-length: one request is {self.request_tokens} tokens now)"
            )
        if self.elastic and self.resident_per_layer is not None:
            need = self.bytes_for(0, self.resident_per_layer)
            if pool_bytes < need:
                raise PlanError(
                    f"--rimuru-resident-experts {self.resident_per_layer}: {flag} gives a pool of "
                    f"{pool_bytes / GIB:.4g} GiB, and {self.resident_per_layer} experts x {self.num_moe_layers} "
                    f"layers with the load buffers need {need / GIB:.4g} GiB at start; lower it, or leave it out "
                    "to start with as many experts as fit"
                )
        return self.request_tokens

    def start_buffer_slots(self, free_expert_pages: int, keep_free_pages: int) -> int:
        """Slots per load buffer, given the pool's free expert pages before the buffers.

        Static, or ``--rimuru-load-buffer-slots``: ``buffer_slots`` (the flag, or
        the offload limit). Elastic without the flag: as many as the most experts
        any layer has offloaded at start, at most the offload limit. The buffers
        hold their pages for the server's life, and at a budget that holds every
        expert (a 32 GB card for Qwen1.5-MoE) buffers sized to the limit took half
        of the KV plain SGLang has (3,267 tokens against 7,112 on the H200): the
        adjuster cannot take those pages back. Experts evicted later beyond the
        slots are read in place from host memory (same outputs; a prefill reads
        them once per block of tokens instead of copying them once).
        """
        if not self.elastic or self.load_buffer_slots is not None:
            return self.buffer_slots
        if self.resident_per_layer is not None:
            return min(self.offload_limit, self.num_experts - self.resident_per_layer)
        layers, slots = self.num_moe_layers, 0
        while True:  # more slots leave fewer residents: settle on slots >= the most out per layer
            out = layers * self.num_experts - self.residents_at_start(free_expert_pages - 2 * slots * 3,
                                                                      keep_free_pages)
            need = min(self.offload_limit, -(-out // layers))
            if need <= slots:
                return slots
            slots = need

    def residents_at_start(self, free_expert_pages: int, keep_free_pages: int) -> int:
        """Experts (all layers) to place at start, given the pool's free expert pages
        after the dummy slot and the load buffers.

        Fixed counts place ``resident_per_layer`` per layer. Elastic without one:
        as many as fit while ``keep_free_pages`` expert pages stay free (the
        adjuster's low water, so it does not evict at once), never fewer than the
        offload limit allows (``check_pool_bytes`` made sure those fit).
        """
        if self.resident_per_layer is not None:
            return self.num_moe_layers * self.resident_per_layer
        most = self.num_moe_layers * self.num_experts
        least = self.num_moe_layers * self.min_resident_per_layer
        return max(least, min(most, (free_expert_pages - keep_free_pages) // 3))


def default_offload_limit(config: RimuruConfig, experts: int) -> int:
    """``--rimuru-expert-offload-limit`` when not given.

    Static: half the experts (it fixes the split and sizes the load buffers).
    Elastic under the cost policy: all but one. There the limit only bounds the
    adjuster, whose every eviction must price as paying (``adjuster/cost.py``), and
    the host store holds every expert anyway; a lower limit stopped evictions that
    still paid (elastic24 on the H200, bench/RESULTS.md) and made a model whose
    experts outgrow the card (Qwen3-30B-A3B on 32 GB: 64 of 128 resident is 27 GiB)
    a start-up error unless the user found the flag. The paper's fixed thresholds
    price nothing: under them, half.
    """
    if config.mode == "elastic" and config.adjuster_policy_name == "cost":
        return experts - 1
    return experts // 2


def plan_pool(
    facts: ModelFacts,
    config: RimuruConfig,
    *,
    tp_size: int = 1,
    page_size: int = 1,
    dtype_bytes: int = 2,
    kv_dtype_bytes: int | None = None,
    max_total_tokens: int | None = None,
    context_len: int | None = None,
) -> PoolPlan:
    """Check the flags against the model and size one TP rank's pool."""
    experts = facts.num_experts
    limit = default_offload_limit(config, experts) if config.expert_offload_limit is None \
        else config.expert_offload_limit
    if limit > experts:
        raise PlanError(
            f"--rimuru-expert-offload-limit {limit} is above the {experts} routed experts of each MoE layer"
        )
    if config.load_buffer_slots is not None and config.load_buffer_slots > limit:
        raise PlanError(f"--rimuru-load-buffer-slots {config.load_buffer_slots} is above the offload limit "
                        f"{limit}: a layer never has more experts offloaded than that")
    if config.resident_experts is not None:
        resident = config.resident_experts
    elif config.mode == "elastic":  # as many as the pool holds at start; the adjuster moves it
        resident = None
    else:  # static: the fixed split
        resident = experts - limit
    if resident is None:
        if experts - limit < 1:
            raise PlanError(
                f"--rimuru-expert-offload-limit {limit} would let a layer offload all {experts} experts; "
                "each MoE layer must keep at least one expert resident"
            )
    elif resident < 1:
        raise PlanError(f"--rimuru-resident-experts {resident}: each MoE layer must keep at least one expert resident")
    if resident is not None and resident > experts:
        raise PlanError(f"--rimuru-resident-experts {resident} is above the {experts} routed experts of each MoE layer")
    if resident is not None and experts - resident > limit:
        raise PlanError(
            f"--rimuru-resident-experts {resident} offloads {experts - resident} experts per layer, "
            f"above --rimuru-expert-offload-limit {limit}"
        )
    if page_size != 1:
        raise PlanError(
            f"--page-size {page_size}: --rimuru-mode supports page size 1 only "
            "(SGLang 0.5.17's paged allocator is Triton-only and not pool-aware)"
        )
    if facts.moe_inter % tp_size:
        raise PlanError(f"--tp-size {tp_size} does not divide the expert intermediate size {facts.moe_inter}")
    inter = facts.moe_inter // tp_size
    kv_heads = max(1, facts.num_kv_heads // tp_size)
    token_bytes = facts.num_layers * 2 * kv_heads * facts.head_dim * (kv_dtype_bytes or dtype_bytes)
    plan = PoolPlan(
        num_moe_layers=len(facts.moe_layer_ids),
        num_experts=experts,
        resident_per_layer=resident,
        offload_limit=limit,
        load_buffer_slots=config.load_buffer_slots,
        expert_page_bytes=inter * facts.hidden * dtype_bytes,
        kv_page_bytes=page_size * token_bytes,
        token_bytes=token_bytes,
        page_size=page_size,
        request_tokens=min(context_len or facts.context_len, max_total_tokens or 1 << 62),
        pool_bytes=None,
        mode=config.mode,
    )
    if plan.kv_page_bytes > plan.expert_page_bytes:
        raise PlanError(
            f"a KV page ({plan.kv_page_bytes} B: {page_size} tokens of all layers) is larger than an expert "
            f"page ({plan.expert_page_bytes} B); the pool splits expert pages into KV pages"
        )
    if config.pool_gb is not None:
        pool_bytes = int(config.pool_gb * GIB)
        plan.check_pool_bytes(pool_bytes)
    elif max_total_tokens is not None:
        # every expert resident at start (or the given count), plus that much KV
        start = experts if resident is None else resident
        pool_bytes = plan.bytes_for(max(max_total_tokens, plan.request_tokens), start)
    else:
        pool_bytes = None
    return dataclasses.replace(plan, pool_bytes=pool_bytes)


def check_host_memory(facts: ModelFacts, available_bytes: int, dtype_bytes: int = 2) -> None:
    """On a GPU the pool modes keep every routed expert in page-locked host memory
    (the TP ranks of one machine hold one copy between them); that must fit in
    what the machine has available, or the load dies half-way, killed for memory."""
    need = facts.routed_expert_bytes(dtype_bytes)
    if need > available_bytes:
        raise PlanError(
            f"--rimuru-mode: the routed experts need {need / GIB:.1f} GiB of page-locked host memory "
            f"and this machine has {available_bytes / GIB:.1f} GiB available (MemAvailable)"
        )
