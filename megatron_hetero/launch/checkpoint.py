"""What a Megatron-LM checkpoint folder holds, read without torch: the iteration, the format,
the arguments it was trained with, and, for ``torch_dist``, the global shape of every tensor
and where its bytes are.

A checkpoint folder (Megatron's ``--save``/``--load``) has ``latest_checkpointed_iteration.txt``
naming the last complete save and one ``iter_NNNNNNN`` folder per save. A ``torch_dist`` save
holds ``metadata.json`` (the format), ``common.pt`` (what every rank shares: ``args``,
``iteration``, the optimizer's content metadata; from megatron-core 0.19 the same, torch-saved,
is the object ``common_state`` inside the ``*.distcp`` files instead), ``.metadata`` (torch.distributed.checkpoint's
index: tensor shapes, and file, offset and length of each piece) and the ``*.distcp`` files. A
legacy ``torch`` save holds one ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank.

The two pickles are read by :class:`_Reader`, which builds no class it does not know: every
object of another class (a tensor, a dtype, an enum, torch's metadata classes) becomes an
:class:`_Opaque` holding its arguments and state, so nothing in a checkpoint can run code here.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Described, SchemaError
from ..plan import ModelSpec

__all__ = ["Checkpoint", "TensorIndex", "read_checkpoint", "FULLY_RESHARDABLE"]

TRACKER = "latest_checkpointed_iteration.txt"
FULLY_RESHARDABLE = frozenset({"fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor"})
"""Sharding types of distributed-optimizer state that Megatron loads under other TP and PP
sizes (``DistributedOptimizer.checkpoint_fully_reshardable_formats``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorIndex:
    """One tensor of a ``torch_dist`` save, from its ``.metadata``."""

    shape: tuple[int, ...]
    """Global shape (decoder layers stacked along a first dimension of ``num_layers``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """The last complete save of a Megatron-LM checkpoint folder."""

    folder: Path
    """The checkpoint folder (Megatron's ``--save``/``--load``)."""
    iteration_folder: Path
    """``iter_NNNNNNN`` (or ``release``) inside it, the save ``latest_checkpointed_iteration.txt``
    names."""
    iteration: int
    """Training iterations done (0 for a ``release`` save)."""
    format: str
    """``torch_dist`` (Megatron's default, reshardable) or ``torch`` (legacy, per rank)."""
    args: dict[str, Any] = field(repr=False)
    """Megatron's arguments of the run that saved it (``common.pt``'s ``args``); values of
    classes other than Python's plain types are opaque."""
    content_metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    """``common.pt``'s ``content_metadata`` (``distrib_optim_sharding_type``, ...)."""
    tensors: dict[str, TensorIndex] = field(default_factory=dict, repr=False)
    """Every tensor of a ``torch_dist`` save by key."""
    size_bytes: int = 0
    """Bytes of the files of this save."""

    @property
    def common_file(self) -> str:
        """Where ``args`` come from, for messages."""
        return str(self.iteration_folder / "common.pt")

    def arg(self, name: str) -> Any:
        """Megatron argument ``name``; a checkpoint without it is refused as another program's."""
        if name not in self.args:
            raise SchemaError(self.common_file, f"args.{name}", Described("nothing"),
                              "the arguments Megatron-LM's training saves with every checkpoint")
        return self.args[name]

    @property
    def precision(self) -> str:
        return "bf16" if self.args.get("bf16") else "fp16" if self.args.get("fp16") else "fp32"

    @property
    def optimizer_sharding(self) -> str | None:
        """The distributed optimizer's ``distrib_optim_sharding_type``; None without one."""
        if not self.args.get("use_distributed_optimizer"):
            return None
        return self.content_metadata.get("distrib_optim_sharding_type", "dp_zero_gather_scatter")

    def model(self, name: str) -> ModelSpec:
        """The model's shape from the saved arguments (the vocabulary: ``vocab_size`` when the
        run gave it, else the padded size Megatron built)."""
        a = self.arg
        heads = a("num_attention_heads")
        groups = a("num_query_groups") if self.args.get("group_query_attention") else heads
        vocab = self.args.get("vocab_size") or a("padded_vocab_size")
        try:
            return ModelSpec(
                name=name, num_layers=a("num_layers"), hidden_size=a("hidden_size"),
                ffn_hidden_size=a("ffn_hidden_size"), num_attention_heads=heads,
                num_query_groups=groups or heads, vocab_size=vocab, seq_length=a("seq_length"),
                swiglu=bool(a("swiglu")), normalization=a("normalization"),
                position_embedding_type=a("position_embedding_type"),
                untie_embeddings_and_output_weights=bool(a("untie_embeddings_and_output_weights")),
                add_bias_linear=bool(a("add_bias_linear")))
        except SchemaError as exc:
            raise SchemaError(self.common_file, f"args.{exc.path}", exc.found,
                              exc.expected) from None

    def padded_vocab_size(self, tp: int) -> int:
        """The embedding's rows a run with tensor-parallel size ``tp`` builds from this
        checkpoint's vocabulary (Megatron pads it to a multiple of ``make_vocab_size_divisible_by``
        x TP)."""
        unit = int(self.args.get("make_vocab_size_divisible_by") or 128) * tp
        vocab = self.args.get("vocab_size") or self.arg("padded_vocab_size")
        return -(-int(vocab) // unit) * unit


_POSITIVE, _FLAG, _TEXT = "a positive integer", "true or false", "a string"
SAVED_ARGS: dict[str, tuple[str, bool]] = {
    **{name: (_POSITIVE, True) for name in ("num_layers", "hidden_size", "ffn_hidden_size",
                                            "num_attention_heads", "seq_length",
                                            "global_batch_size")},
    **{name: (_POSITIVE, False) for name in ("num_query_groups", "vocab_size",
                                             "padded_vocab_size", "tensor_model_parallel_size",
                                             "pipeline_model_parallel_size",
                                             "make_vocab_size_divisible_by", "world_size")},
    **{name: (_FLAG, False) for name in ("swiglu", "group_query_attention", "bf16", "fp16",
                                         "untie_embeddings_and_output_weights", "add_bias_linear",
                                         "use_distributed_optimizer")},
    "normalization": (_TEXT, True), "position_embedding_type": (_TEXT, True),
    "hetero_plan": (_TEXT, False),
}
"""Every saved argument this tool reads, what it must be and whether it must be there; checked
once when the checkpoint is read, so that a damaged or foreign ``common.pt`` (an argument
missing, a string where Megatron saves a number) is one line naming ``args.NAME`` rather than
a traceback wherever the value is first used. An optional one may be absent or None."""

_TRACKER_DIGITS = 12
"""The most digits of an iteration in the tracker file (Megatron writes ``iter_%07d``)."""


def _check_saved(args: dict[str, Any], content: dict[str, Any], path: Path) -> None:
    for name, (kind, required) in SAVED_ARGS.items():
        value = args.get(name)
        if value is None:
            if required:
                raise SchemaError(str(path), f"args.{name}", Described("nothing"),
                                  f"{kind}, which Megatron-LM's training saves with every "
                                  "checkpoint (a checkpoint of another program?)")
            continue
        ok = (isinstance(value, bool) if kind == _FLAG else isinstance(value, str) if kind == _TEXT
              else isinstance(value, int) and not isinstance(value, bool) and value >= 1)
        if not ok:
            raise SchemaError(str(path), f"args.{name}", value,
                              f"{kind}, as Megatron-LM saves it (a damaged or foreign checkpoint?)")
    sharding = content.get("distrib_optim_sharding_type")
    if sharding is not None and not isinstance(sharding, str):
        raise SchemaError(str(path), "content_metadata.distrib_optim_sharding_type", sharding,
                          "the name of a sharding type, as Megatron-LM saves it")


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """The last complete save in ``folder``; a folder that is not a complete Megatron-LM
    checkpoint (no tracker file, a missing save, a missing or truncated file) is refused with
    the file and what was expected."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SchemaError(str(folder), "", Described("no such folder"),
                          "a Megatron-LM checkpoint folder (the run's --save)")
    tracker = folder / TRACKER
    if not tracker.is_file():
        raise SchemaError(str(tracker), "", Described("no such file"),
                          "the file Megatron-LM writes once a save is complete (a save that "
                          "never finished, or not a checkpoint folder)")
    text = tracker.read_text(errors="replace").strip()
    if text == "release":
        iteration, sub = 0, folder / "release"
    elif text.isascii() and text.isdigit() and len(text) <= _TRACKER_DIGITS:
        iteration, sub = int(text), folder / f"iter_{int(text):07d}"
    else:
        raise SchemaError(str(tracker), "", text, f"an iteration number (at most {_TRACKER_DIGITS} "
                          "ASCII digits) or 'release'")
    if not sub.is_dir():
        raise SchemaError(str(sub), "", Described("no such folder"),
                          f"the save of iteration {text} that {TRACKER} names")
    size = sum(p.stat().st_size for p in sub.rglob("*") if p.is_file())
    meta = sub / "metadata.json"
    if not meta.is_file():
        if any(sub.glob("mp_rank_*/model_optim_rng.pt")):  # not read: replan refuses it
            return Checkpoint(folder=folder, iteration_folder=sub, iteration=iteration,
                              format="torch", args={}, size_bytes=size)
        raise SchemaError(str(meta), "", Described("no such file"),
                          "the format file of a torch_dist save (a save cut short?)")
    try:
        backend = json.loads(meta.read_bytes()).get("sharded_backend")
    except (ValueError, AttributeError, RecursionError):
        raise SchemaError(str(meta), "", Described("not a JSON object"),
                          '{"sharded_backend": "torch_dist", ...} (a truncated file?)') from None
    if backend != "torch_dist":
        return Checkpoint(folder=folder, iteration_folder=sub, iteration=iteration,
                          format=str(backend), args={}, size_bytes=size)
    tensors = _check_index(sub)
    common = _common_state(sub)
    content = common.get("content_metadata") if isinstance(common, dict) else None
    content = content if isinstance(content, dict) else {}
    args = _args(common, sub / "common.pt")
    _check_saved(args, content, sub / "common.pt")
    return Checkpoint(folder=folder, iteration_folder=sub, iteration=iteration, format=backend,
                      args=args, content_metadata=content,
                      tensors=tensors, size_bytes=size)


_COMMON_STATE = "common_state/shard_0_1"
"""megatron-core 0.19's ``ShardedObject("common_state", None, (1,), (0,))`` in the index."""


def _common_state(sub: Path) -> Any:
    """``common.pt``'s object, or where there is none, that of ``common_state`` in the
    ``*.distcp`` file the index names (megatron-core 0.19 and later)."""
    if (sub / "common.pt").is_file():
        return _load_pickle(sub / "common.pt")
    index = _load_pickle(sub / ".metadata", zipped=False)
    for key, piece in index.state["storage_data"].items():
        if isinstance(key, _Opaque) and isinstance(key.state, dict) and \
                key.state.get("fqn") == _COMMON_STATE:
            info = piece.state
            with open(sub / info["relative_path"], "rb") as f:
                f.seek(int(info.get("offset") or 0))
                raw = f.read(int(info.get("length") or 0))
            saved = _load_pickle(sub / info["relative_path"], data=raw)
            return saved[0] if isinstance(saved, list) and saved else saved
    raise SchemaError(str(sub / "common.pt"), "", Described("no such file"),
                      "a file of a complete save (or, from megatron-core 0.19, the object "
                      f"{_COMMON_STATE} in its .metadata)")


def _args(common: Any, path: Path) -> dict[str, Any]:
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, _Opaque) or not isinstance(args.state, dict):
        raise SchemaError(str(path), "args", Described("nothing"),
                          "Megatron-LM's saved arguments (a checkpoint of another program?)")
    return dict(args.state)


def _check_index(sub: Path) -> dict[str, TensorIndex]:
    """The tensors of ``sub/.metadata``, after checking that every piece it lists lies inside
    a file that exists."""
    path = sub / ".metadata"
    index = _load_pickle(path, zipped=False)
    state = index.state if isinstance(index, _Opaque) else None
    shapes = state.get("state_dict_metadata") if isinstance(state, dict) else None
    pieces = state.get("storage_data") if isinstance(state, dict) else None
    if not isinstance(shapes, dict) or not isinstance(pieces, dict):
        raise SchemaError(str(path), "", Described("no tensor index"),
                          "torch.distributed.checkpoint's index of the save")
    need: dict[str, int] = {}
    for piece in pieces.values():
        info = piece.state if isinstance(piece, _Opaque) else None
        if not isinstance(info, dict) or not isinstance(info.get("relative_path"), str):
            raise SchemaError(str(path), "storage_data", Described("an entry without a file"),
                              "a file, offset and length for each piece")
        end = int(info.get("offset") or 0) + int(info.get("length") or 0)
        need[info["relative_path"]] = max(need.get(info["relative_path"], 0), end)
    for name, end in sorted(need.items()):
        file = sub / name
        if not file.is_file():
            raise SchemaError(str(file), "", Described("no such file"),
                              f"a file of the save that {path.name} lists")
        if file.stat().st_size < end:
            raise SchemaError(str(file), "", Described(f"{file.stat().st_size} bytes"),
                              f"at least {end} bytes, as {path.name} lists (a truncated file)")
    tensors = {}
    for key, meta in shapes.items():
        size = meta.state.get("size") if isinstance(meta, _Opaque) and isinstance(meta.state, dict) else None
        if isinstance(size, _Opaque) and size.args and isinstance(size.args[0], (tuple, list)):
            tensors[str(key)] = TensorIndex(shape=tuple(int(n) for n in size.args[0]))
    return tensors


class _Opaque:
    """An object of a class :class:`_Reader` does not build: its constructor arguments and
    pickled state, kept as plain data."""

    __slots__ = ("kind", "args", "state")

    def __init__(self, kind: str, args: tuple = ()):
        self.kind, self.args, self.state = kind, args, None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            merged = dict(state[0] or {})  # (__dict__, __slots__ values)
            merged.update(state[1] or {})
            state = merged
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.kind}>"


_PLAIN = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
          ("builtins", "slice"), ("builtins", "complex")}


def _opaque_class(kind: str) -> type:
    """A stand-in for class or function ``kind``: calling or unpickling it makes an
    :class:`_Opaque`."""

    class Stand(_Opaque):
        __slots__ = ()

        def __new__(cls, *args, **kwargs):
            obj = object.__new__(cls)
            _Opaque.__init__(obj, kind, args)
            return obj

        def __init__(self, *args, **kwargs):
            pass

    Stand.__qualname__ = Stand.__name__ = kind
    return Stand


class _Reader(pickle.Unpickler):
    """Unpickles plain data; every other class or function becomes an :class:`_Opaque`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        return _opaque_class(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:  # a tensor's storage in torch's zip format
        return _Opaque("storage", (pid,))


def _load_pickle(path: Path, *, zipped: bool = True, data: bytes | None = None) -> Any:
    """The object pickled in ``path`` (torch's zip format: its ``data.pkl``); ``data``: that
    file's bytes, a piece of ``path``."""
    if data is None and not path.is_file():
        raise SchemaError(str(path), "", Described("no such file"), "a file of a complete save")
    try:
        if zipped:
            with zipfile.ZipFile(io.BytesIO(data) if data is not None else path) as z:
                names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
                if not names or z.testzip() is not None:
                    raise zipfile.BadZipFile
                raw = z.read(names[0])
        else:
            raw = path.read_bytes()
        return _Reader(io.BytesIO(raw)).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            IndexError, KeyError, AttributeError):
        raise SchemaError(str(path), "", Described(f"{path.stat().st_size} unreadable bytes"),
                          "a complete file written by torch (a truncated or damaged file)") from None
