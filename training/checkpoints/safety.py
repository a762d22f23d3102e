"""No checkpoint runs code: every pickle in a checkpoint is read, without unpickling it, for the callables it names,
and refused unless each is one of those this project, accelerate, DeepSpeed and torch.distributed.checkpoint write
(`ALLOWED`), before anything loads it.

A pickle can name any callable, and an unpickler calls it: `torch.load(..., weights_only=False)` (DeepSpeed reads its
engine's files so, deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py) and `pickle.load` (torch's
FileSystemReader reads a torch.distributed.checkpoint folder's `.metadata` so) run whatever a swapped file asks.
Whoever can swap a file can rewrite the completion marker's sizes and checksums beside it, so the marker proves
nothing here. The check disassembles each pickle with the standard library's `pickletools.genops`, which decodes
opcodes and executes none, and collects every global a GLOBAL, INST or STACK_GLOBAL opcode names (a STACK_GLOBAL
whose module and name are not plain strings pushed before it is refused as unreadable). torch's zip checkpoints are
opened as zip files and their `data.pkl` read so; their tensors' bytes are not pickles.

The project's own loads then use torch's weights-only unpickler with the same allowlist (`load`), so that a global
the static reading missed still cannot run. `--trust_checkpoint` skips the check for a checkpoint its user trusts and
that needs more, saying so in one line.
"""

from __future__ import annotations

import io
import logging
import pickle
import pickletools
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger("shardgpt")

# Every global the checkpoints of this project's strategies hold, by who writes it and why: read from the checkpoints
# one process, DDP, FSDP2, FSDP1, ZeRO-1/2/3 (CPU and NVMe offload), a pipeline and the HF Trainer write, in fp32 and
# bf16 (tests/training/test_safety.py holds that every checkpoint the suite writes passes). A global is
# `module.qualname`, as the pickle names it. None of them runs anything but building the value it names.
ALLOWED = {
    # torch.save's own records (what torch's weights-only unpickler allows by default)
    "torch._utils._rebuild_tensor_v2": "torch.save: every tensor, rebuilt from its storage",
    "torch._tensor._rebuild_from_type_v2": "torch.save: a tensor whose class is recorded (ZeRO-3's partitions)",
    "torch.Tensor": "torch.save: the class such a tensor is rebuilt as",
    "torch._utils._rebuild_parameter": "torch.save: a Parameter (the HF Trainer's FSDP state)",
    "torch.FloatStorage": "torch.save: fp32 storages (weights, moments, steps)",
    "torch.BFloat16Storage": "torch.save: bf16 storages (DeepSpeed's bf16 module weights)",
    "torch.HalfStorage": "torch.save: fp16 storages (DeepSpeed's fp16 module weights)",
    "torch.LongStorage": "torch.save: int64 storages (steps and counters)",
    "torch.ByteStorage": "torch.save: uint8 storages (torch's CPU RNG state, in every random_states_<rank>.pkl)",
    "collections.OrderedDict": "torch.save: state dicts",
    "torch.Size": "a shape: DeepSpeed's partition records, DCP's index",
    "_codecs.encode": "pickle protocol 2's bytes (torch.save's protocol): NumPy's RNG state array",
    # accelerate's random_states_<rank>.pkl: Python's, NumPy's and torch's generators
    "numpy._core.multiarray._reconstruct": "accelerate: NumPy's RNG state, a uint32 array (NumPy 2)",
    "numpy.core.multiarray._reconstruct": "accelerate: NumPy's RNG state, a uint32 array (NumPy 1)",
    "numpy.ndarray": "accelerate: NumPy's RNG state's array",
    "numpy.dtype": "accelerate: NumPy's RNG state's dtype",
    "numpy.dtypes.UInt32DType": "accelerate: the class NumPy 2 builds that dtype as (torch's unpickler asks for it)",
    # torch.distributed.checkpoint's `.metadata` (FSDP2's and FSDP1's folders, a pipeline's): where each rank wrote what
    "torch.distributed.checkpoint.metadata.Metadata": "DCP: a folder's index",
    "torch.distributed.checkpoint.metadata.StorageMeta": "DCP: the writer's record",
    "torch.distributed.checkpoint.metadata.MetadataIndex": "DCP: an entry's name and offset",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata": "DCP: a tensor's shards",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata": "DCP: a non-tensor entry (the optimizer's groups)",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata": "DCP: a shard's offsets and sizes",
    "torch.distributed.checkpoint.metadata.TensorProperties": "DCP: a tensor's dtype and layout",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": "DCP: a tensor's memory format",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "DCP: an item's file, offset and length",
    "torch.serialization._get_layout": "DCP: a tensor's layout, by name",
    "torch.float32": "DCP: a tensor's dtype", "torch.bfloat16": "DCP: a tensor's dtype",
    "torch.float16": "DCP: a tensor's dtype", "torch.int64": "DCP: a tensor's dtype",
    "pathlib.PosixPath": "DCP: the folder it was written to (StorageMeta.checkpoint_id)",
    # DeepSpeed's engine files (mp_rank_*_model_states.pt, *_optim_states.pt)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "DeepSpeed: the static loss scaler it records in fp32 and bf16",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "DeepSpeed: fp16's loss scaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "DeepSpeed: the ZeRO stage the files were written under",
    "deepspeed.utils.tensor_fragment.fragment_address": "DeepSpeed ZeRO-1/2: where a parameter sits in a partition",
}  # fmt: skip


# Files a checkpoint holds that no resume unpickles, left out of the check (their globals are not checkpoint state).
NEVER_READ = {
    "training_args.bin": "the HF Trainer's TrainingArguments, pickled with accelerate's process state for people to "
    "read; neither the Trainer nor accelerate loads it on resume",
}

# The checkpoints this process was told to trust (--trust_checkpoint): their files load with the full unpickler.
TRUSTED: set[Path] = set()


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names a callable outside `ALLOWED`: it is not loaded."""

    same_on_every_rank = True  # every rank reads the same files before the process group: rank 0 reports for all


# ---------------------------------------------------------------------------------------------- reading a pickle


def pickle_globals(data: bytes) -> set[str]:
    """The globals a pickle names, read by `pickletools.genops` (which decodes and runs nothing). A STACK_GLOBAL
    whose module and name were not pushed as plain strings (or fetched from the memo as such) is `"?"`."""
    found, memo, pushed = set(), {}, []  # pushed: the last two values pushed, strings or None
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            found.add(arg.replace(" ", "."))
        elif name == "STACK_GLOBAL":
            module, qualname = pushed[-2:] if len(pushed) == 2 else (None, None)
            found.add(f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else "?")
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
            continue
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
            continue
        if name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif "UNICODE" in name or "STRING" in name:
            pushed.append(arg)
        elif op.stack_after:
            pushed.append(None)
        pushed = pushed[-2:]
    return found


class _Region(io.RawIOBase):
    """A byte range of an open file, seekable, as zipfile needs: one item of a torch.distributed.checkpoint shard."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos)
        return self.pos

    def readinto(self, buffer) -> int:
        self.f.seek(self.start + self.pos)
        data = self.f.read(max(0, min(len(buffer), self.length - self.pos)))
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def stream_globals(f) -> set[str] | None:
    """The globals of what `f` (a seekable binary file) holds: a torch.save zip's pickles (its tensors' bytes are
    not pickles), or a plain pickle; None when it holds no pickle (safetensors, JSON, raw tensor bytes)."""
    head = f.read(4)
    f.seek(0)
    if head.startswith(b"PK"):
        with zipfile.ZipFile(f) as archive:
            pickles = [n for n in archive.namelist() if n.endswith(".pkl")]
            return set().union(*(pickle_globals(archive.read(n)) for n in pickles)) if pickles else None
    if head[:1] == b"\x80":  # a pickle's PROTO opcode
        return pickle_globals(f.read())
    return None


class _Restricted(pickle.Unpickler):
    """The standard library's unpickler, allowed to resolve only `ALLOWED` globals ("Restricting Globals" in the
    pickle module's documentation): how a torch.distributed.checkpoint `.metadata` the static reading cleared is read
    for where its items lie."""

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


def findings(folder: Path, lenient: set[str] = frozenset()) -> Iterator[tuple[str, set[str] | None]]:
    """(what, its globals) for every pickle in a checkpoint: each file's, and, for a torch.distributed.checkpoint
    folder (FSDP2's, a pipeline's), its `.metadata`'s and then every item it lists in the `.distcp` shards (their
    tensors' torch.save records, their other entries' pickled values: DCP unpickles those with `weights_only=False`,
    torch/distributed/checkpoint/default_planner.py)."""
    for path in pickled_files(folder):
        if path.suffix == ".distcp":  # read through its folder's .metadata below
            continue
        with open(path, "rb") as f:
            try:
                found = stream_globals(f)
            except (ValueError, zipfile.BadZipFile, EOFError) as e:
                if path.name not in lenient:
                    raise
                logger.debug("%s: not a readable pickle (%s), left to its reader", path, e)
                continue
        yield str(path), found
        if path.name == ".metadata" and not (found or set()) - ALLOWED.keys():
            with open(path, "rb") as f:
                metadata = _Restricted(f).load()
            shards: dict[str, list] = {}
            for index, info in metadata.storage_data.items():
                if info.transform_descriptors:  # a transformed (compressed) item is not readable here
                    raise ValueError(f"{index.fqn} is stored transformed ({info.transform_descriptors})")
                shards.setdefault(info.relative_path, []).append((index.fqn, info.offset, info.length))
            for name, items in sorted(shards.items()):
                with open(path.parent / name, "rb") as f:
                    for fqn, offset, length in items:
                        item = io.BufferedReader(_Region(f, offset, length))
                        yield f"{path.parent / name} ({fqn})", stream_globals(item)


def pickled_files(folder: Path) -> Iterable[Path]:
    """The files of a checkpoint that may hold pickles (a file itself, or everything in a folder but its JSON,
    safetensors and text)."""
    folder = Path(folder)
    if folder.is_file():
        yield folder
        return
    skip = (".json", ".safetensors", ".txt", ".md", ".py", ".jinja", ".model")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if not path.name.endswith(skip) and path.name not in ("latest", "checkpoint_complete", *NEVER_READ):
            yield path


# ---------------------------------------------------------------------------------------------- the check


def check_checkpoint(
    folder: str | Path, trust: bool = False, what: str = "--resume_from_checkpoint", lenient: Iterable[str] = (),
    say: bool = True,
) -> None:  # fmt: skip
    """Refuse, in one line, a checkpoint folder (or file) any of whose pickles names a global outside `ALLOWED`, or
    that cannot be read as one (but the files named in `lenient`, which the caller reads itself); nothing is loaded
    and nothing saved is touched. `trust` (--trust_checkpoint) skips the check, saying so (if `say`), and lets the
    project's loads of its files use the full unpickler."""
    folder = Path(folder)
    if trust:
        if say:
            logger.warning("%s %s: not checked for code its pickles could run (--trust_checkpoint)", what, folder)
        TRUSTED.add(folder.resolve())
        return
    where, lenient = str(folder), set(lenient)
    try:
        for where, found in findings(folder, lenient):
            unknown = sorted((found or set()) - ALLOWED.keys())
            if unknown:
                raise UnsafeCheckpointError(
                    f"{what}: {where} names {unknown[0]}, which no checkpoint of this project holds: it could run "
                    "code when loaded, and nothing was loaded; delete the checkpoint, or pass --trust_checkpoint if "
                    "you wrote it and trust it"
                )
    except (ValueError, zipfile.BadZipFile, EOFError, OSError, pickle.UnpicklingError, AttributeError) as e:
        if isinstance(e, UnsafeCheckpointError):
            raise
        raise UnsafeCheckpointError(  # pickletools' errors are ValueErrors
            f"{what}: {where} cannot be read as a checkpoint's pickle ({type(e).__name__}: {e}); nothing was loaded: "
            "restore the file from a copy, or resume from another checkpoint"
        ) from None


def allowed_objects() -> list:
    """The allowed globals, as objects, for torch's weights-only unpickler (`torch.serialization.safe_globals`):
    what a check cleared loads with `weights_only=True`. Only those of modules this process has imported: a file
    that names another module's (DeepSpeed's, in its engine's files) is read by that library, which imports it."""
    import sys

    objects = []
    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        value = getattr(sys.modules.get(module), attr, None)
        if hasattr(value, "__qualname__"):  # a class or function: torch's unpickler knows dtypes and the like itself
            objects.append(value)
    return objects


def safe_load(path: str | Path, **kwargs):
    """`torch.load` with the weights-only unpickler, `ALLOWED` permitted: the project's own loads of checkpoint
    files; the full unpickler for a file of a checkpoint its user trusts (`TRUSTED`)."""
    import torch

    if any(parent in TRUSTED for parent in Path(path).resolve().parents):
        return torch.load(path, weights_only=False, **kwargs)
    with torch.serialization.safe_globals(allowed_objects()):
        return torch.load(path, weights_only=True, **kwargs)
