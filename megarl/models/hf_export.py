"""Export a run checkpoint as a Hugging Face checkpoint: safetensors shards, config and tokenizer.

    megarl export RUN_DIR/checkpoints/step_00000012 --out exported/ [--model-dir DIR] [--shard-size 5GB]

The checkpoint's trainer layout (`meta.json`: world_size, tp, pp, ep, expert_tp) is started again as world_size CPU
processes joined by gloo (no GPU needed, whatever machine trained it). Each builds its megatron-core
model stage, loads its shards of the model from megatron's distributed checkpoint (`model_optim/`, format v4;
for v1-v3 it maps its rank file into the stage, memory-mapped, no copy), and cuts it into HF
blocks through the table the importer reads (`megarl.models.hf_layout`), so export is the exact inverse
of import. Rank 0 writes: HF tensor after HF tensor, it receives each block from ONE rank holding it
(point-to-point), assembles the tensor, casts it to the dtype the run's model checkpoint stores it in, and
streams its bytes into the current safetensors shard (whose header is laid out in advance from the
shapes). No process materialises the model: rank 0 holds one HF tensor at a time, every rank holds its own
stage's shards only. Files go to `OUT.tmp`, renamed to `OUT` at the end.

The result: `config.json`, generation and tokenizer files copied from the run's model directory, and
`model.safetensors` or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megarl.checkpoint import MODEL_FORMATS, SHARDED_DIR, CheckpointError, open_checkpoint
from megarl.parallel.spawn import RankError, free_port, run_ranks
from megarl.sync.slices import HFSlice

DEFAULT_SHARD_SIZE = 5 * 10**9
# files of a model directory that travel with the weights (everything but the weights themselves)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
          "chat_template.json")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class ExportError(RuntimeError):
    """An export that cannot be done; the message names the problem and the fix."""


# ---- inputs: the checkpoint, the run's model, the output directory ---------------------------------------------
def read_checkpoint_meta(checkpoint_dir: Path) -> dict[str, Any]:
    """`meta.json` of a complete megarl checkpoint with every rank file present at its recorded size."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory; pass a checkpoint, e.g. RUN_DIR/checkpoints/step_00000012")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        candidates = [*path.glob("step_*"), *path.glob("checkpoints/step_*")]
        steps = sorted(p for p in candidates if (p / "meta.json").is_file())
        hint = f"; the newest complete one here is {steps[-1]}" if steps else ""
        if path.name.startswith(".step_") and path.name.endswith(".tmp"):
            hint = ": it is a save that never finished; export a complete step_XXXXXXXX directory" + hint
        raise ExportError(f"{path} is not a megarl checkpoint (no meta.json){hint}")
    try:  # complete, in megarl's format, every rank file at its recorded size
        meta = open_checkpoint(path, expected={}, formats=MODEL_FORMATS).meta
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    for key in ("world_size", "tp", "pp", "ep"):
        if not isinstance(meta.get(key), int):
            raise ExportError(f"{meta_file}: no trainer layout ({key!r} missing): not written by megarl's trainer")
    meta.setdefault("expert_tp", meta["tp"])  # written before trainer.expert_tp existed: megatron's default, tp
    return meta


def run_model_dir(checkpoint_dir: Path) -> Path:
    """The run's `model.hf_dir`, read from `config.yaml` of the run directory two levels above the checkpoint."""
    import yaml

    run_dir = Path(checkpoint_dir).resolve().parent.parent
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(f"{config} not found (the run directory of {checkpoint_dir}): pass the model the run "
                          "started from with --model-dir")
    hf_dir = ((yaml.safe_load(config.read_text()) or {}).get("model") or {}).get("hf_dir")
    if not hf_dir:
        raise ExportError(f"{config} has no model.hf_dir: pass --model-dir")
    return Path(hf_dir)


def check_model_dir(model_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The HF config of `model_dir`; refuses a directory whose config.json differs from the run's."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise ExportError(f"{config} not found: --model-dir must be the HF model the run started from")
    recorded = meta.get("model_config_sha256")
    if recorded and hashlib.sha256(config.read_bytes()).hexdigest() != recorded:
        raise ExportError(f"{config} is not the config.json the run trained (its sha256 differs from the one in "
                          "the checkpoint's meta.json): pass the run's own model directory with --model-dir")
    return json.loads(config.read_text())


def original_tensors(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """Name -> (safetensors dtype, shape) of every tensor of the model's own checkpoint (headers only),
    or None when the directory holds no safetensors."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    specs = {}
    for name in files:
        with safe_open(model_dir / name, "pt") as f:
            for key in f.keys():
                block = f.get_slice(key)
                specs[key] = (block.get_dtype(), tuple(block.get_shape()))
    return specs


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if m is None:
        raise ExportError(f"shard size {text!r}: use bytes or a size such as 5GB, 500MB, 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


# ---- the safetensors file, written tensor by tensor --------------------------------------------------------------
class SafetensorsStream:
    """A safetensors file whose header (names, dtypes, shapes, offsets) is written first; tensors are then
    appended one at a time, in the header's order (format: 8-byte little-endian header length, the JSON
    header padded with spaces to a multiple of 8, then the tensors' bytes back to back)."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]]) -> None:
        if sys.byteorder != "little":
            raise ExportError("safetensors stores little-endian data; export on a little-endian machine")
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = SAFETENSORS_DTYPES[dtype].itemsize * int(torch.Size(shape).numel())
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.header, self.pending = path, header, [name for name, _, _ in entries]
        self.file = path.open("wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.header[name]
        if not self.pending or self.pending[0] != name:
            raise RuntimeError(f"{self.path}: {name} written out of order (next: {self.pending[:1]})")
        if _DTYPE_NAMES[tensor.dtype] != entry["dtype"] or list(tensor.shape) != entry["shape"]:
            raise RuntimeError(f"{name}: {tensor.dtype} {tuple(tensor.shape)} does not match the header {entry}")
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.pending.pop(0)

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.path}: {len(self.pending)} tensors never written, e.g. {self.pending[0]}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _natural_key(name: str) -> list[Any]:
    """`model.layers.2.` before `model.layers.10.`: shards follow the model's layer order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_shards(tensors: list[tuple[str, str, tuple[int, ...]]], shard_size: int) -> list[list[tuple]]:
    """Consecutive groups of `(name, dtype, shape)` of at most `shard_size` bytes (a larger tensor gets a shard
    of its own), as `save_pretrained(max_shard_size=...)` splits."""
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in tensors:
        nbytes = SAFETENSORS_DTYPES[entry[1]].itemsize * int(torch.Size(entry[2]).numel())
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                     for i in range(1, count + 1)]


# ---- in every trainer rank ---------------------------------------------------------------------------------------
_TE_NORMS = {  # Transformer Engine spec (GPU) name -> local spec name of the same norm weight
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts\.)linear_fc([12])\.weight(\d+)")


def to_local_spec(state: dict[str, Any], local_keys: set[str]) -> dict[str, Any]:
    """A model state dict saved with either layer spec, named as the local spec that CPU export builds:
    Transformer Engine's fused-norm weights take the local norm names, TE's grouped experts
    (`mlp.experts.linear_fc1.weight{j}`, `TEGroupedMLP`) the local spec's `mlp.experts.local_experts.{j}.linear_fc1
    .weight` (the same tensor: one expert's shard), TE's `_extra_state` (FP8 metadata) is dropped. Names the local
    model has are kept as they are."""
    out = {}
    for key, value in state.items():
        if key in local_keys:
            out[key] = value
            continue
        if key.endswith("._extra_state"):
            continue
        grouped = _GROUPED_EXPERT.fullmatch(key)
        if grouped is not None:
            prefix, fc, j = grouped.groups()
            out[f"{prefix}local_experts.{j}.linear_fc{fc}.weight"] = value
            continue
        for te, local in _TE_NORMS.items():
            if key.endswith("." + te) and key.removesuffix(te) + local in local_keys:
                key = key.removesuffix(te) + local
                break
        out[key] = value
    return out


def _build(model_dir: Path, hf: dict[str, Any], tp: int, pp: int, ep: int, expert_tp: int,
           dtype: torch.dtype) -> torch.nn.Module:
    from megarl.models.qwen_provider import build_gpt_model

    try:
        return build_gpt_model(hf, tp=tp, pp=pp, ep=ep, params_dtype=dtype, expert_tp=expert_tp)
    except (ValueError, AssertionError) as err:
        raise ExportError(f"the model of {model_dir}/config.json cannot be built at the checkpoint's layout tp={tp} "
                          f"pp={pp} ep={ep} expert_tp={expert_tp} (wrong --model-dir?): {err}") from None


def _load_sharded_model(directory: Path, model_dir: Path, hf: dict[str, Any], tp: int, pp: int, ep: int,
                        expert_tp: int) -> torch.nn.Module:
    """Collective over the exporter's ranks: the model part of megatron's distributed checkpoint `directory`,
    saved on either layer spec (`megarl.models.spec_keys`: the 30B recipe's GPU job saves Transformer Engine's
    MoE norm names, export builds the local spec)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.models.spec_keys import load_across_specs

    precision = json.loads((directory.parent / "meta.json").read_text()).get("precision", "fp32")
    model = _build(model_dir, hf, tp, pp, ep, expert_tp, torch.bfloat16 if precision == "bf16" else torch.float32)
    try:
        state = load_across_specs({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(state["model"], strict=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - several kinds (torch's: a BaseException)
        raise ExportError(f"{directory} does not fit the model built from {model_dir}/config.json at tp={tp} "
                          f"pp={pp} ep={ep} (wrong --model-dir?): {type(err).__name__}: {err}") from None
    return model


def load_rank_model(checkpoint_dir: Path, rank: int, model_dir: Path, hf: dict[str, Any], tp: int, pp: int,
                    ep: int, expert_tp: int = 1) -> torch.nn.Module:
    """This rank's megatron model stage holding the checkpoint's model state (parallel groups initialised at the
    saving layout): from megatron's distributed checkpoint (`model_optim/`, format v4), or, for v1 to v3, the
    rank's own file, whose tensors the parameters become as memory-mapped views."""
    from megarl.models.qwen_provider import build_gpt_model

    sharded = Path(checkpoint_dir) / SHARDED_DIR
    if sharded.is_dir():
        return _load_sharded_model(sharded, model_dir, hf, tp, pp, ep, expert_tp)
    file = Path(checkpoint_dir) / f"rank_{rank:05d}.pt"
    state = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
    try:
        model_state = state["policy"]["model"]
    except (KeyError, TypeError):
        raise ExportError(f"{file} holds no policy model state (state['policy']['model']): not a megarl rank "
                          "file") from None
    dtype = next((v.dtype for v in model_state.values() if torch.is_tensor(v) and v.is_floating_point()),
                 torch.float32)
    try:
        model = build_gpt_model(hf, tp=tp, pp=pp, ep=ep, params_dtype=dtype, expert_tp=expert_tp)
    except (ValueError, AssertionError) as err:
        raise ExportError(f"the model of {model_dir}/config.json cannot be built at the checkpoint's layout tp={tp} "
                          f"pp={pp} ep={ep} expert_tp={expert_tp} (wrong --model-dir?): {err}") from None
    try:
        # assign: the parameters become the memory-mapped tensors of the rank file (no copy; pages are read when
        # a block is sent, so ranks that only hold replicas of other ranks' blocks read nothing)
        model.load_state_dict(to_local_spec(model_state, set(model.state_dict())), strict=True, assign=True)
    except RuntimeError as err:
        raise ExportError(f"{file} does not fit the model built from {model_dir}/config.json at tp={tp} pp={pp} "
                          f"ep={ep} (wrong --model-dir?): {err}") from None
    return model


def _assembly_plan(per_rank: list[tuple[str, list[HFSlice]]], specs: dict[str, tuple[str, tuple[int, ...]]] | None,
                   hf: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...], list[tuple[int, HFSlice]]]]:
    """`(name, dtype, shape, [(source rank, block), ...])` per HF tensor, in file order: one source per distinct
    block (the lowest rank holding it: rank 0 itself when it can); the blocks of a tensor must tile it exactly
    and the tensors must be the model checkpoint's own."""
    sources: dict[str, dict[HFSlice, int]] = {}
    for rank, (_, blocks) in enumerate(per_rank):
        for block in blocks:
            sources.setdefault(block.name, {}).setdefault(block, rank)
    if specs is None:  # no weights in the model directory: the dtype the config declares
        declared = hf.get("dtype") or hf.get("torch_dtype")
        dtype = _DTYPE_NAMES.get(getattr(torch, str(declared), None), _DTYPE_NAMES[torch.float32])
        specs = {name: (dtype, next(iter(b)).full_shape) for name, b in sources.items()}
    missing, extra = sorted(set(specs) - set(sources)), sorted(set(sources) - set(specs))
    if missing or extra:
        raise ExportError(f"the ranks' tensors differ from the model checkpoint's: missing {missing[:5]}, "
                          f"unexpected {extra[:5]} (wrong --model-dir?)")
    plan = []
    for name in sorted(specs, key=_natural_key):
        dtype, shape = specs[name]
        if dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"{name}: the model checkpoint stores it as {dtype}; export writes only "
                              f"{sorted(SAFETENSORS_DTYPES)}")
        blocks = sorted(sources[name].items(), key=lambda item: item[0].box)
        for block, _ in blocks:
            if block.full_shape != shape:
                raise ExportError(f"{name}: the ranks hold shape {block.full_shape}, the checkpoint {shape}")
        overlaps = [(a.box, b.box) for i, (a, _) in enumerate(blocks) for b, _ in blocks[i + 1:] if a.intersect(b)]
        covered = sum(block.numel for block, _ in blocks)
        if overlaps or covered != torch.Size(shape).numel():
            raise ExportError(f"{name}: the ranks' blocks do not tile the tensor ({covered} of "
                              f"{torch.Size(shape).numel()} elements, overlaps {overlaps[:2]})")
        plan.append((name, dtype, shape, [(rank, block) for block, rank in blocks]))
    return plan


def _write_rank0(plan, local: dict[HFSlice, torch.Tensor], rank_dtypes: list[str], out: Path,
                 shard_size: int) -> None:
    """Assemble each HF tensor from its blocks (received point-to-point) and stream it into its shard."""
    import torch.distributed as dist
    from tqdm import tqdm

    shards = plan_shards([(name, dtype, shape) for name, dtype, shape, _ in plan], shard_size)
    files = shard_names(len(shards))
    weight_map = {name: file for file, shard in zip(files, shards, strict=True) for name, _, _ in shard}
    plan_by_name = {name: (dtype, shape, blocks) for name, dtype, shape, blocks in plan}
    total = 0
    with tqdm(total=len(plan), desc="megarl export", unit="tensor", dynamic_ncols=True) as bar:
        for file, shard in zip(files, shards, strict=True):
            stream = SafetensorsStream(out / file, shard)
            for name, _, _ in shard:
                dtype, shape, blocks = plan_by_name[name]
                tensor = torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])
                for src, block in blocks:
                    if src == 0:
                        data = local[block]
                    else:
                        data = torch.empty(block.shape, dtype=getattr(torch, rank_dtypes[src]))
                        dist.recv(data, src=src)
                    tensor[tuple(slice(a, b) for a, b in block.box)] = data
                stream.write(name, tensor)
                total += tensor.numel() * tensor.element_size()
                bar.update()
            stream.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _export_rank(rank: int, world: int, layout: tuple[int, int, int, int], checkpoint_dir: str, model_dir: str,
                 out: str, shard_size: int, port: int) -> None:
    """One trainer rank of the export (spawned): load its shard, then send its blocks to rank 0 / write them."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no Apex / TE on CPU: expected
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.")
    from megarl.models.hf_slices import iter_local_hf_slices
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups

    apply_trainer_cpu_threads(0, world, 0)
    tp, pp, ep, expert_tp = layout
    init_trainer_groups(TrainerLayout(tp, pp, ep, expert_tp), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(model_dir)
        model = load_rank_model(Path(checkpoint_dir), rank, Path(model_dir), hf, tp, pp, ep, expert_tp)
        local = dict(iter_local_hf_slices(model, hf))  # views of the parameters, no copies
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object((dtype, list(local)), gathered if rank == 0 else None, dst=0)
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = _assembly_plan(gathered, original_tensors(Path(model_dir)), hf)
            except ExportError as err:
                box[0] = err
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], ExportError):
            raise box[0]
        if rank == 0:
            _write_rank0(box[0], local, [d for d, _ in gathered], Path(out), shard_size)
        else:
            for _, _, _, blocks in box[0]:
                for src, block in blocks:
                    if src == rank:
                        dist.send(local[block].contiguous(), dst=0)
        dist.barrier()
    finally:
        destroy_trainer_groups()


# ---- the whole export ----------------------------------------------------------------------------------------------
@contextmanager
def _cpu_only() -> Iterator[None]:
    """Processes spawned inside see no GPU: export runs on gloo and megatron's local spec on any machine."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _rank_error(err: RankError) -> ExportError:
    """An ExportError raised in a rank, as itself; any other failure as one naming the rank, with its traceback."""
    if err.exc_type == ExportError.__name__:
        return ExportError(err.message)
    return ExportError(f"{err}\n{err.traceback_text}".rstrip())


def export_checkpoint(checkpoint_dir: str | Path, model_dir: str | Path | None, out_dir: str | Path,
                      shard_size: int | str = DEFAULT_SHARD_SIZE, overwrite: bool = False) -> Path:
    """Write the HF checkpoint of run checkpoint `checkpoint_dir` to `out_dir` (see the module docstring).
    `model_dir`: the HF model the run started from (None: the run's `model.hf_dir`). Refuses a non-empty
    `out_dir` unless `overwrite`. Returns `out_dir`."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out_dir)
    meta = read_checkpoint_meta(checkpoint_dir)
    model_dir = Path(model_dir) if model_dir is not None else run_model_dir(checkpoint_dir)
    check_model_dir(model_dir, meta)
    shard_size = parse_size(shard_size)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} exists and is not empty: choose another --out, or pass --overwrite")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        layout = (meta["tp"], meta["pp"], meta["ep"], meta["expert_tp"])
        args = (meta["world_size"], layout, str(checkpoint_dir), str(model_dir), str(tmp), shard_size, free_port())
        with _cpu_only():
            try:
                run_ranks(_export_rank, meta["world_size"], *args, role="export")
            except RankError as err:
                raise _rank_error(err) from None
        for name in COPIED:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        old = out.with_name(out.name + ".old")
        if out.exists():  # empty, or --overwrite: moved aside, removed once the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---- command line ---------------------------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `megarl export CHECKPOINT_DIR --out DIR [--model-dir DIR] [--shard-size 5GB] [--overwrite]`."""
    p = subparsers.add_parser("export", help="write a run checkpoint as a Hugging Face checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", help="a checkpoint of a run, e.g. RUN_DIR/checkpoints/step_00000012")
    p.add_argument("--out", required=True, help="output directory (written as OUT.tmp, then renamed)")
    p.add_argument("--model-dir", default=None,
                   help="the HF model the run started from (default: model.hf_dir of the run's config.yaml, two "
                   "levels above the checkpoint)")
    p.add_argument("--shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        out = export_checkpoint(args.checkpoint_dir, args.model_dir, args.out, shard_size=args.shard_size,
                                overwrite=args.overwrite)
    except ExportError as err:
        print(f"megarl export: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0
