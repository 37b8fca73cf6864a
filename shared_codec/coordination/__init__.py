"""Coordination of refits, side by side: the coordinator (`coordinator`), the commit record
(`commit`), the client of the trainer job's owner service (`owners`) and the HTTP handle on a
``vllm serve`` engine (`engines`). Nothing here imports vLLM or Megatron."""
