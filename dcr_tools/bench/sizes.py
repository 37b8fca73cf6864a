"""Model sizes shared by the benchmarks.

`LARGE` is the scale run's Qwen3-shaped model (issue 18 item 6): ~1.34B parameters (hidden 2048,
24 layers, FFN 6144, 16 heads of 128 with 8 KV heads, untied vocabulary 32000; 2.7 GB BF16), the
same shape for `construct` (2-rank TP=2 GPTModel) and `apply` (one vLLM engine), so that the
per-GB costs of both sides compare with their medium runs.
"""

from __future__ import annotations

LARGE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
}
