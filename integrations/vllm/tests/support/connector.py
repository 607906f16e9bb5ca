"""A KV connector of the tests' own: vLLM's connector API, scheduler side, with transfers the
test starts and ends by hand. It says a store of a request's blocks is pending (kvwatch's
optional `kvwatch_transfer_pending`) while the test has marked one, and starts an async load
(WAITING_FOR_REMOTE_KVS) for a request whose `kv_transfer_params` ask for one. The worker
side is never built: the tests have no worker; they report a load's end through the model
output's `KVConnectorOutput`, as vLLM's workers do."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

REMOTE_LOAD_PARAM = "kvwatch_test_remote_tokens"


class PendingTransferConnector(KVConnectorBase_V1):
    """`pending_stores[request_id]` = what is in flight; a request whose kv_transfer_params
    carry REMOTE_LOAD_PARAM = n loads its first n tokens asynchronously."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending_stores: dict[str, str] = {}
        self.finished: list[str] = []

    # ---- kvwatch's optional question ----

    def kvwatch_transfer_pending(self, request: Request) -> str | None:
        return self.pending_stores.get(request.request_id)

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        remote = (request.kv_transfer_params or {}).get(REMOTE_LOAD_PARAM, 0)
        if remote and request.num_preemptions == 0:
            return int(remote) - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self.finished.append(request.request_id)
        return False, None

    # ---- worker side: never built in these tests ----

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the tests build no worker")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("the tests build no worker")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise NotImplementedError("the tests build no worker")

    def wait_for_save(self) -> None:
        raise NotImplementedError("the tests build no worker")
