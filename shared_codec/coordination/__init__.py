"""Coordination of refits: the typed control-plane protocol (`protocol`, on `wire`), one engine
handle over channels (`handle`; the ``dcr_*`` RPC channel base `rpc_channel`; HTTP, Ray and
in-process channels in `engines`), the coordinator (`coordinator`), the commit record
(`commit`), retention (`retention`) and the client of the trainer job's owner service
(`owners`). Nothing here imports vLLM or Megatron."""
