"""A do-nothing vLLM KV connector that records what vLLM hands a connector (design notes only).

It loads and saves nothing: every hook writes one JSON line to the file named by
kv_connector_extra_config["probe_out"] (appended, one line per call kind and process), so
docs/vllm.md's "Connector design notes" rest on what vLLM 0.32.0 actually passes on this CPU
build. Run by scripts/probe/probe-connector.py. Not the kvtier connector.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class ProbeMetadata(KVConnectorMetadata):
    def __init__(self, summary: dict):
        self.summary = summary


def _tensor(t: torch.Tensor) -> dict:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_bytes": t.untyped_storage().nbytes(),
    }


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._out = extra["probe_out"]
        self._seen: set[str] = set()
        groups = []
        if kv_cache_config is not None:
            for g in kv_cache_config.kv_cache_groups:
                spec = g.kv_cache_spec
                groups.append(
                    {
                        "layers": len(g.layer_names),
                        "first_layer": g.layer_names[0],
                        "spec": type(spec).__name__,
                        "block_size": spec.block_size,
                        "num_kv_heads": getattr(spec, "num_kv_heads", None),
                        "head_size": getattr(spec, "head_size", None),
                        "dtype": str(getattr(spec, "dtype", None)),
                        "page_size_bytes": spec.page_size_bytes,
                    }
                )
        self._log(
            "init",
            {
                "role": role.name,
                "extra_config": extra,
                "kv_role": self._kv_transfer_config.kv_role,
                "cache_block_size": vllm_config.cache_config.block_size,
                "num_blocks": getattr(kv_cache_config, "num_blocks", None),
                "groups": groups,
                "model": vllm_config.model_config.model,
                "dtype": str(vllm_config.model_config.dtype),
                "tp_rank_world": [
                    vllm_config.parallel_config.rank,
                    vllm_config.parallel_config.world_size,
                ],
            },
        )

    def _log(self, kind: str, data: dict, once: bool = False) -> None:
        if once and kind in self._seen:
            return
        self._seen.add(kind)
        with open(self._out, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "hook": kind, **data}, default=str) + "\n")

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = list(kv_caches)
        first = kv_caches[names[0]]
        ptrs = sorted(t.data_ptr() for t in kv_caches.values())
        self._log(
            "register_kv_caches",
            {
                "n_layers": len(names),
                "names": names[:2] + names[-1:],
                "first": _tensor(first),
                "layer_ptr_gaps": sorted({b - a for a, b in itertools.pairwise(ptrs)})[:4],
            },
        )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._log(
            "start_load_kv",
            {
                "forward_context": type(forward_context).__name__,
                "kwargs": list(kwargs),
                "metadata": self._get_connector_metadata().summary,
            },
            once=True,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", {"layer_name": layer_name}, once=True)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        fields = {}
        for k in (
            "slot_mapping",
            "block_table",
            "seq_lens",
            "query_start_loc",
            "num_actual_tokens",
        ):
            v = getattr(attn_metadata, k, None)
            fields[k] = _tensor(v) if isinstance(v, torch.Tensor) else v
        self._log(
            "save_kv_layer",
            {
                "layer_name": layer_name,
                "kv_layer": _tensor(kv_layer),
                "attn_metadata": type(attn_metadata).__name__,
                "fields": fields,
                "kwargs": list(kwargs),
            },
            once=True,
        )

    def wait_for_save(self):
        self._log("wait_for_save", {}, once=True)

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._log(
            "get_num_new_matched_tokens",
            {
                "request_id": request.request_id,
                "cache_salt": request.cache_salt,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_computed_tokens": num_computed_tokens,
                "block_hashes": {
                    "n": len(request.block_hashes),
                    "type": type(request.block_hashes[0]).__name__
                    if request.block_hashes
                    else None,
                    "first": request.block_hashes[0].hex() if request.block_hashes else None,
                },
                "lora_request": request.lora_request,
                "kv_transfer_params": request.kv_transfer_params,
            },
        )
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._log(
            "update_state_after_alloc",
            {
                "request_id": request.request_id,
                "block_ids": blocks.get_block_ids(),
                "num_external_tokens": num_external_tokens,
            },
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        new = [
            {
                "req_id": r.req_id,
                "block_ids": r.block_ids,
                "num_computed_tokens": r.num_computed_tokens,
                "prompt_len": len(r.prompt_token_ids or []),
            }
            for r in scheduler_output.scheduled_new_reqs
        ]
        if new:
            self._log(
                "build_connector_meta",
                {
                    "scheduled_new_reqs": new,
                    "num_scheduled_tokens": scheduler_output.num_scheduled_tokens,
                },
            )
        return ProbeMetadata({"new_reqs": len(new)})

    def request_finished(self, request, block_ids: list[int]):
        self._log(
            "request_finished",
            {
                "request_id": request.request_id,
                "block_ids": block_ids,
                "num_computed_tokens": request.num_computed_tokens,
                "num_prompt_tokens": request.num_prompt_tokens,
            },
        )
        return False, None
