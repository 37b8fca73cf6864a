"""LoRA adapters refit by DCR on one real vLLM engine with LoRA enabled (run as a program; writes a
JSON report for tests/integration/vllm/test_adapters.py).

With ``--published`` the attempts come from a trainer's owner (test_lora_owner.py): v0 is loaded,
each later version fetched and committed, and compared with the dense load. Otherwise the
engine serves the tiny base model; adapter alias ``policy`` is dense-loaded at v0 through
``dcr_adapter_load`` and moved v0 -> v1 -> v2 -> v3 by delta attempts (``dcr_adapter_fetch``
into a candidate, ``dcr_adapter_commit``). Version 2's first attempt is foreign (a payload
naming a tensor the adapter does not have): its fetch fails, it is aborted, and its overwrite
retry commits. After every step the same greedy prompts run through the alias, and through the
trainer's own adapter directory of the same version loaded dense by vLLM under another name
(the oracle). Owners here are test-only (labelled): the real encoded delta between two adapter
versions, published through a real directory transport.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PROMPTS = [[11, 52, 93, 7, 301], [400, 12, 12, 88]]
ALIAS = "policy"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapters", required=True, help="JSON list of PEFT dirs v0..v3")
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--published",
        action="store_true",
        help="the store already holds attempt 0 of every version (a trainer's owner published "
        "them): load v0, then fetch and commit each version, nothing else",
    )
    args = ap.parse_args()
    adapters = json.loads(args.adapters)

    import numpy as np
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.format import PayloadMeta
    from shared_codec.peft import read_adapter
    from shared_codec.records import Kind, diff_tensors, make_item
    from shared_codec.transport.publish import publish_attempt
    from tests.integration.vllm._engine import start_llm
    from vllm_dcr_plugin.adapters import lora_id

    llm = start_llm(
        args.base, args.tp, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=8
    )
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    store = {"kind": "dir", "root": args.store}
    report: dict[str, Any] = {"steps": {}}

    def gen(lora: Any) -> list[list[int]]:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def rpc(method: str, *a: Any) -> dict[str, Any]:
        replies = llm.collective_rpc(method, args=a)
        report.setdefault("ranks", {})[method] = len(replies)
        assert len({json.dumps(r.get("version")) for r in replies}) == 1, replies
        return replies[0]

    alias = LoRARequest(ALIAS, 1, adapters[0])  # id and path: the engine core resolves them

    def step(name: str, version: int | None, **extra: Any) -> None:
        entry: dict[str, Any] = {"alias": gen(alias), **extra}
        if version is not None:  # the trainer's adapter of that version, loaded dense
            entry["dense"] = gen(LoRARequest(f"dense-{version}", 1000 + version, adapters[version]))
        entry["status"] = rpc("dcr_adapter_status")
        report["steps"][name] = entry

    def publish(
        version: int, attempt: int, *, overwrite: bool, foreign: bool = False, to: Any = None
    ) -> None:
        _, old = read_adapter(adapters[version - 1])
        _, new = read_adapter(adapters[version])
        kind = Kind.OVERWRITE if overwrite else Kind.XOR
        items = [diff_tensors(n, old[n], new[n], kind=kind, owner=0) for n in sorted(new)]
        if foreign:  # another adapter's tensor: the receiver refuses the payload
            name = "base_model.model.lm_head.lora_A.weight"
            one = np.ones(1, dtype=np.uint16)
            items.append(make_item(name, "bfloat16", (8, 4), 0, kind, np.zeros(1), one))
        meta = PayloadMeta(version=version, base_version=version - 1, attempt=attempt, owner=0,
                           sequence=0)  # fmt: skip
        config = BucketConfig(bucket_bytes=4096, threads=0)
        payloads = encode_items([i for i in items if i.count], meta, config)
        publish_attempt(to or store, version=version, attempt=attempt, base_version=version - 1,
                        payloads={0: payloads})  # fmt: skip

    report["base"] = gen(None)
    report["load"] = rpc("dcr_adapter_load", ALIAS, adapters[0], 0)
    step("v0", 0)
    if args.published:
        for v in range(1, len(adapters)):
            report[f"fetch{v}"] = rpc("dcr_adapter_fetch", ALIAS, store, v, 0, 60.0)
            report[f"commit{v}"] = rpc("dcr_adapter_commit", ALIAS, v)
            step(f"v{v}", v)
        report["ids"] = {str(v): lora_id(ALIAS, v) for v in range(len(adapters))}
        Path(args.out).write_text(json.dumps(report))
        return
    publish(1, 0, overwrite=False)
    report["fetch1"] = rpc("dcr_adapter_fetch", ALIAS, store, 1, 0, 60.0)
    step("candidate1", None)  # fetched, not committed: requests still run v0
    report["commit1"] = rpc("dcr_adapter_commit", ALIAS, 1)
    step("v1", 1)
    publish(2, 0, overwrite=False, foreign=True)
    report["fetch2_foreign"] = rpc("dcr_adapter_fetch", ALIAS, store, 2, 0, 60.0)
    report["abort2"] = rpc("dcr_adapter_abort", ALIAS, 0)
    step("failed2", None)
    publish(2, 1, overwrite=True)
    report["fetch2"] = rpc("dcr_adapter_fetch", ALIAS, store, 2, 1, 60.0)
    report["commit2"] = rpc("dcr_adapter_commit", ALIAS, 2)
    step("v2", 2)
    publish(3, 0, overwrite=False)
    report["fetch3"] = rpc("dcr_adapter_fetch", ALIAS, store, 3, 0, 60.0)
    report["commit3"] = rpc("dcr_adapter_commit", ALIAS, 3)
    step("v3", 3)
    report["ids"] = {str(v): lora_id(ALIAS, v) for v in range(4)}

    # the coordinator drives a second alias through the adapter channel: attempts, the commit
    # record, a failed attempt aborted and retried with overwrites
    from shared_codec.coordination.adapter_channel import AdapterChannel
    from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
    from shared_codec.coordination.engines import InProcessChannel
    from shared_codec.coordination.handle import EngineHandle
    from shared_codec.transport.spec import open_store
    from tests.integration.vllm._owners import CheckpointOwners

    class AdapterOwners(CheckpointOwners):
        """Test-only owners: the delta between two adapter versions; (2, 0) is foreign."""

        def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
            self.builds.append((version, attempt, retry))
            publish(version, attempt, overwrite=retry, foreign=(version, attempt) == (2, 0),
                    to=coord_store)  # fmt: skip
            return {"baseline_id": f"adapter-v{version - 1}"}

    coord_store = {"kind": "dir", "root": args.store + "-coordinated"}
    second = "policy-b"
    channel = AdapterChannel(InProcessChannel(llm, store=coord_store), second)
    handle = EngineHandle(
        "engine0", channel, tensors=[], checkpoint_for=lambda v: adapters[v], pipelined=False
    )
    handle.restore(0)
    owners = AdapterOwners([Path(a) for a in adapters], coord_store)
    coordinator = Coordinator(
        open_store(coord_store), owners, [handle], CoordinatorConfig(max_attempts=3),
        transport=coord_store,
    )  # fmt: skip
    coordinator.initialize()
    results = [coordinator.refit(), coordinator.refit()]
    report["coordinated"] = {
        "versions": [r.version for r in results],
        "retries": [r.retries for r in results],
        "builds": owners.builds,
        "failed": [a.failed for r in results for a in r.attempts if not a.ok],
        "digests": [r.record.digests.get("engine0") for r in results],
        "status": rpc("dcr_adapter_status"),
        "tokens": gen(LoRARequest(second, 1, adapters[0])),
        "dense": report["steps"]["v2"]["dense"],
    }
    report["list_loras"] = sorted(llm.llm_engine.list_loras())
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
