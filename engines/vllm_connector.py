"""Engine-side piece for vLLM: a CPU-safe hidden-states connector (runs inside the vLLM server).

vLLM's `extract_hidden_states` speculative method caches the requested layers' states in a
KV-cache-like buffer, and `ExampleHiddenStatesConnector` copies each finished request's rows
out of it into `<shared_storage_path>/<request id>.safetensors` (`hidden_states [T, K, H]`,
`token_ids [T]`), behind an exclusive flock on `<file>.lock` that it releases once the file is
written. The stock connector stages that copy through a CUDA stream, a CUDA event and pinned
host memory; on vLLM's CPU build `pin_memory=True` raises and takes the engine down.

`HarvestHiddenStatesConnector` changes that step and the metadata: on a CPU buffer it copies the rows
synchronously (the copy has finished when the forward loop continues, so the buffer's blocks
can be freed safely) and hands the writer thread a completed stand-in event; everything else
(lock file protocol, file names, finished-request accounting) is vLLM's own code. On a GPU
buffer it defers to the stock implementation. Its files also record the crc32 of each tensor's
bytes (metadata `crc32`, JSON, as harvest.formats.crc writes it), which the worker's client checks
before it converts the file into harvest's dump. Harvest's generation requests (rids `hg-`, vLLM
request ids `cmpl-hg-...`: regeneration) get no file and no lock: the stock connector saves every
finished request, and nothing would ever read or delete those. Loaded by vLLM with
`"kv_connector": "HarvestHiddenStatesConnector", "kv_connector_module_path": "harvest.engines.vllm_connector"`
(see engines/vllm_launch.py), so this module must import with nothing but vLLM installed:
it imports nothing from harvest.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from functools import partial
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnectorMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput

CONNECTOR_NAME = "HarvestHiddenStatesConnector"
FORMAT = "harvest-vllm-1"
GENERATION_PREFIX = "cmpl-hg-"  # vLLM's id of a harvest generation request (harvest's `hg-` rids)


class CompletedEvent:
    """Stands in for a `torch.cuda.Event` whose work is already done (the copy was synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HarvestHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose device-to-host step also works on the CPU build, and
    whose files name the layer ids they hold (metadata `layer_ids`, in slot order), so the worker
    checks what the server captured instead of assuming it was launched with the run's flags, and
    the crc32 of each tensor (metadata `crc32`), so it checks the bytes too."""

    def _layer_ids(self) -> list[int]:
        hf = self._vllm_config.speculative_config.draft_model_config.hf_config
        return sorted(int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", []))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleHiddenStatesConnectorMetadata:
        """The stock metadata, less generation requests: with no file name recorded, the worker
        creates no lock and `request_finished` saves nothing (its never-scheduled path)."""
        meta = super().build_connector_meta(scheduler_output)
        for req_id in [r for r in meta.new_req_filenames if r.startswith(GENERATION_PREFIX)]:
            del meta.new_req_filenames[req_id]
            self._request_filenames.pop(req_id, None)
        return meta

    def _write_tensors(
        self,
        tensors: dict[str, torch.Tensor],
        event: torch.cuda.Event | CompletedEvent,
        filename: str,
        lock_fd: int | None,
    ) -> None:
        """The stock writer plus metadata (the stock one is a staticmethod; this bound method
        takes its place in the same `self._executor.submit(self._write_tensors, ...)` calls)."""
        meta = {"format": FORMAT, "layer_ids": json.dumps(self._layer_ids())}
        try:
            event.synchronize()
            tensors = {k: v.contiguous() for k, v in tensors.items()}
            meta["crc32"] = json.dumps(
                {k: zlib.crc32(v.reshape(-1).view(torch.uint8).numpy()) for k, v in sorted(tensors.items())},
                separators=(",", ":"),
            )
            save_file(tensors, filename, metadata=meta)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone(): the rows must survive the blocks being freed and reused by later requests.
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"a hidden-states write for request {pending.req_id} is already in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CompletedEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        return None
