"""The owner hook's configuration: what a Megatron training config carries to enable DCR.

`DCRConfig` (frozen, keyword-only) is validated when constructed: every later reader may take
its fields as typed (``mode`` is a `ConstructionMode`, ``overwrite_only`` a frozenset,
``force_residual`` a tuple). `ConstructionMode` names the paper's three ways to construct a
delta (Table 3).

Limitations:
1. Nothing here checks the values against the model (an ``architecture`` no bridge registers,
   an ``overwrite_only`` name that is no canonical tensor): the hook's constructor resolves
   them and raises there.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shared_codec.buckets import DEFAULT_BUCKET_BYTES, BucketConfig
from shared_codec.stream import Sink


class ConstructionMode(StrEnum):
    """How a build constructs its delta (paper Table 3). String-valued, so ``mode="X"`` in a
    training config keeps working and the value prints as its letter."""

    X = "X"  # projection + mixed XOR/overwrite records
    P = "P"  # projection + overwrites only
    F = "F"  # full conversion of every tensor through the bridge + overwrites


@dataclass(frozen=True, kw_only=True)
class DCRConfig:
    """What a Megatron training config carries to enable DCR (frozen, keyword-only).

    `architecture`: the HF architecture whose megatron-bridge bridge converts the model
    (``bridge_registry.architecture_of(config.json)``, e.g. "LlamaForCausalLM"); a
    ``model_type`` that exactly one bridge registers ("qwen3") also resolves.
    `hf_config`: the model's HF config (config.json as a dict), handed to the bridge when it
    builds its mapping registry from the config (megatron-bridge 0.6: DeepSeek-V3 and others;
    without it such a bridge raises `CompatibilityError` naming it). When given, the tasks
    resolve the bridge from it (its ``architectures``, as `architecture` is derived), so the
    two must describe the same model.
    `mode`: `ConstructionMode` or its letter "X" (default), "P" or "F" (converted here; any
    other value raises ValueError). `bucket_bytes`: raw record bytes per payload.
    `min_bucket_bytes`: the buckets shrink towards the end of a build, halving down to this
    size, so a pipelined receiver has little left to move and apply once the build ends
    (`shared_codec.buckets`); set it to `bucket_bytes` for equal buckets throughout.
    `key`: shared secret for keyed payload digests. `paper_codec`: the paper's plain streams.
    `overwrite_only`: canonical tensors receivers cannot take XOR for (union of the receivers'
    prewarm reports; any iterable of names, stored as a frozenset). `force_residual`: mapping
    class names treated as residual.
    `queue_depth`: payloads buffered between construction and the sink (back-pressure).
    `wrap_step`: wrap ``optimizer.step``. `sink`: callable receiving each payload (bytes); the
    default keeps payloads in ``hook.payloads``. `candidate_guard` (default on): verify before
    commit and retry that the shards still hold what the build recorded (`guard`); it costs
    one detection scan per verify (a whole-shard hash per build in mode F), so a trainer that
    provably never steps between build and commit may turn it off.
    `detect_chunk_bytes`: bytes of the host baseline streamed to the device per chunk when
    parameters live on a GPU (detection.py `DeviceScan`: two pinned host buffers of this size).
    `quantization`: the quantized checkpoint format the engines serve (a
    `shared_codec.quantized.FORMATS` name such as "int8-channel" or "fp8-channel"; None: the
    engines serve the BF16 weights). Quantized weights then go as quantized deltas from their
    group owners (quantized.py).
    """

    architecture: str = "Qwen3ForCausalLM"
    mode: ConstructionMode | str = ConstructionMode.X  # a ConstructionMode after __post_init__
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_bucket_bytes: int = 256 << 10
    key: bytes | None = None
    paper_codec: bool = False
    overwrite_only: AbstractSet[str] = frozenset()  # a frozenset after __post_init__
    force_residual: tuple[str, ...] = ()
    queue_depth: int = 8
    wrap_step: bool = True
    encode_threads: int = 2
    sink: Sink | None = None
    candidate_guard: bool = True
    hf_config: Mapping[str, Any] | None = None
    detect_chunk_bytes: int = 64 << 20
    quantization: str | None = None

    def __post_init__(self) -> None:
        try:
            mode = ConstructionMode(self.mode)
        except ValueError:
            valid = ", ".join(m.value for m in ConstructionMode)
            raise ValueError(f"DCRConfig.mode must be one of {valid}, not {self.mode!r}") from None
        if isinstance(self.overwrite_only, str):
            raise ValueError("DCRConfig.overwrite_only is a collection of tensor names, not a str")
        if isinstance(self.force_residual, str):
            raise ValueError("DCRConfig.force_residual is a tuple of class names, not a str")
        if self.quantization is not None:
            from shared_codec.quantized import format_of

            format_of(self.quantization)  # ArgumentError naming the known formats
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "overwrite_only", frozenset(self.overwrite_only))
        object.__setattr__(self, "force_residual", tuple(self.force_residual))

    def buckets(self) -> BucketConfig:
        """The payload bucket settings of this config (`shared_codec.buckets`)."""
        return BucketConfig(
            bucket_bytes=self.bucket_bytes,
            min_bucket_bytes=self.min_bucket_bytes,
            key=self.key,
            paper=self.paper_codec,
            threads=self.encode_threads,
        )
