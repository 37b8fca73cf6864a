"""dcr_tools: everything around DCR that is not the product.

The ``dcr`` command line (`cli`), the end-to-end demo (`demo`), the benchmarks (`bench`), the
tiny-model fixtures (`fixtures`), the reference Megatron trainers and RL trainer job
(`trainers`), and one set of process helpers (`procs`) used by the demo, the benchmarks and the
tests. The product packages (`shared_codec`, `vllm_dcr_plugin`, `megatron_dcr_hooks`) never
import this package (tests/unit/test_layering.py).
"""
