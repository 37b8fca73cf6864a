"""megatron_dcr_hooks: the owner side of DCR, running inside Megatron trainer processes.

Modules:
- ``cpu_compat``: the CPU layer that lets real megatron-core run on gloo/CPU (trainer processes
  only; never imported by a vLLM process).
- ``bridge_loader``: imports megatron-bridge's conversion modules without its package
  ``__init__`` files, with two fixes; returns the bridge's own mapping registry for a model type.
- ``model``: builds a GPTModel (local spec) for a Qwen3 / Qwen3-MoE HF config (tests, demo).
- ``conversion``: dense HF <-> Megatron conversion through the bridge registry.

Heavy imports (megatron.core, transformers) happen inside these modules, not here.
"""

__all__: list[str] = []
